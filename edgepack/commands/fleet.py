"""`edgepack fleet export-ansible`, and the Ansible options of `edgepack deploy` (`--via ansible`)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .ansible_opts import ansible_options, rollout_options
from .common import out_console
from .deploy import _INVENTORY_HELP, _setup, device_options


@click.group()
def fleet():
    """Fleets on existing engines: write the deploy as an Ansible playbook."""


@fleet.command("export-ansible", epilog=_INVENTORY_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@device_options
@rollout_options
@click.option("--out", "-o", "out", type=click.Path(path_type=Path), required=True,
              help="Folder to write the playbook, inventory, ansible.cfg and the artifact into.")
@click.option("--inventory-format", type=click.Choice(["yaml", "ini"]), default="yaml", show_default=True,
              help="Format of the Ansible inventory written.")
@click.pass_context
def export_ansible(ctx, artifact, out, **kw):
    """Write ARTIFACT's deploy as an Ansible playbook + inventory for teams that run Ansible themselves.

    The play does what `edgepack deploy` does on each device (fit check, lock, upload, sha256 on the
    device, selftest before the switch, atomic switch, rollback in `rescue`), in canary batches with a
    failure threshold, and ends with one result line per device. Host keys are checked against the
    inventory's known_hosts. Devices without Python >= 3.8 get only raw/script modules.

    \b
    Examples:
      edgepack fleet export-ansible dist/tiny_cnn-jetson-orin -I devices.toml --tag jetson -o rollout/
      cd rollout && ansible-playbook site.yml
      edgepack fleet export-ansible dist/m-arm64 -I devices.toml --tag line-1 --canary 2 --batch 10 \\
          --max-fail 5 --inventory-format ini -o rollout/
    """
    from ..deploy import ansible
    from ..deploy.artifact import inspect_artifact
    art = inspect_artifact(artifact)
    devices, opts = _setup(ctx, kw)
    ex = ansible.export(art, devices, out, ansible_options(kw, opts))
    if kw["as_json"]:
        click.echo(json.dumps({"folder": str(ex.folder), "playbook": str(ex.playbook), "inventory": str(ex.inventory),
                               "batches": ex.batches, "artifact": {"name": art.name, "sha256": art.sha256}}, indent=1))
        return
    out_console.print(ex.plan, soft_wrap=True, highlight=False)
    out_console.print(f"written: {ex.folder}/ (site.yml, {ex.inventory.name}, ansible.cfg, files/)\n"
                      f"run it:  cd {ex.folder} && ansible-playbook site.yml", soft_wrap=True, highlight=False)


COMMANDS = (fleet,)
