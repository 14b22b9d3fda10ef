"""`edgepack deploy`, `devices`, `rollback` and `smoke`: artifacts onto devices over SSH."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from .ansible_opts import deploy_via_ansible, rollout_options, via_option
from .common import err_console, out_console
from ..errors import DeployError, UsageError
from ..tables import print_table

_INVENTORY_HELP = """Devices: --device NAME (from --inventory or ~/.ssh/config), user@host[:port], or `local`;
--tag TAG selects every inventory device with that tag. Host keys are checked against known_hosts."""


def device_options(fn):
    """The options every device command shares."""
    opts = [
        click.option("--device", "-d", "device_specs", multiple=True, metavar="NAME|user@host[:port]",
                     help="Device to act on; repeat or comma-separate."),
        click.option("--tag", "tags", multiple=True, help="Every inventory device carrying this tag."),
        click.option("--inventory", "-I", type=click.Path(path_type=Path),
                     help="devices.toml (name, host, port, user, key, target, dest, tags)."),
        click.option("--dest", help="Install folder on the devices (default: inventory `dest`, else ~/edgepack)."),
        # 16: on the lab, 32 devices deploy in 5.4 s with -j 16 against 9.8 s with -j 4 (one device: 1.1 s)
        click.option("--jobs", "--parallel", "-j", "parallel", type=click.IntRange(1, 256), default=16,
                     show_default=True, help="Devices worked on at once (-j means jobs in every command)."),
        click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout."),
        click.option("--known-hosts", type=click.Path(path_type=Path),
                     help="known_hosts file (default: the inventory's, else ~/.ssh/known_hosts)."),
        click.option("--accept-new-host-key", is_flag=True,
                     help="Trust and record the key of a host not yet in known_hosts (a changed key is "
                          "still refused), like OpenSSH's accept-new."),
        click.option("--ssh-config", type=click.Path(path_type=Path), default=Path("~/.ssh/config"),
                     show_default=True, help="OpenSSH client config for Host aliases."),
        click.option("--connect-timeout", type=click.FloatRange(0.1, 600), default=10.0, show_default=True,
                     help="Seconds to wait for a device to answer."),
        click.option("--selftest-timeout", type=click.FloatRange(1, 86400), default=300.0, show_default=True,
                     help="Seconds the selftest/bench may run on a device."),
        click.option("--lock-wait", type=click.FloatRange(0, 86400), default=120.0, show_default=True,
                     help="deploy/rollback: seconds to wait while another edgepack run holds the device's "
                          "lock (DEST/.edgepack-lock) before giving up."),
    ]
    return functools.reduce(lambda f, o: o(f), reversed(opts), fn)


def _setup(ctx, kw) -> tuple[list, object]:
    from ..deploy.engine import Options
    from ..deploy.inventory import load_inventory, select_devices
    from ..deploy.ssh import SSHOptions
    inv = load_inventory(kw["inventory"]) if kw["inventory"] else None
    ssh_config = Path(kw["ssh_config"]).expanduser() if kw["ssh_config"] else None
    devices = select_devices(list(kw["device_specs"]), list(kw["tags"]), inv, ssh_config)
    opts = Options(ssh=SSHOptions(known_hosts=str(kw["known_hosts"]) if kw["known_hosts"] else None,
                                  accept_new_host_key=kw["accept_new_host_key"],
                                  connect_timeout=kw["connect_timeout"]),
                   dest=kw["dest"], parallel=kw["parallel"], selftest_timeout=kw["selftest_timeout"],
                   lock_wait=kw["lock_wait"],
                   debug=bool(ctx.obj and ctx.obj.debug))
    return devices, opts


def _report(command: str, results, kind: str, as_json: bool, title: str, extra: dict | None = None) -> None:
    from ..deploy.results import table_rows
    if as_json:
        click.echo(json.dumps({"command": command, **(extra or {}), "ok": all(r.ok for r in results),
                               "results": [r.to_json() for r in results]}, indent=1))
    else:
        print_table(out_console, title, *table_rows(results, kind))
        for r in results:
            if not r.ok and r.hint:
                err_console.print(f"[yellow]hint[/yellow] {r.device}: {r.hint}", soft_wrap=True)
    bad = [r for r in results if not r.ok]
    if bad:
        names = ", ".join(f"{r.device} ({r.status})" for r in bad)
        raise DeployError(f"{command}: {len(bad)} of {len(results)} device(s) did not succeed: {names}",
                          hint="see the table above; each failed device kept its previous version"
                          if command == "deploy" else None)


def _live(result) -> None:
    err_console.print(f"[dim]{result.device}: {result.status} ({result.seconds:.1f} s)[/dim]")


@click.command(epilog=_INVENTORY_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@device_options
@click.option("--fail-fast", is_flag=True, help="Start no further device after the first failure.")
@click.option("--insecure-registry", "insecure", is_flag=True,
              help="ARTIFACT is REGISTRY/REPO:TAG on a plain-HTTP registry (see `edgepack push --help`).")
@click.option("--pull-on-device", is_flag=True,
              help="ARTIFACT is REGISTRY/REPO:TAG: each device fetches its entry itself (curl/wget), "
                   "instead of this machine uploading it over SSH.")
@via_option
@rollout_options
@click.pass_context
def deploy(ctx, artifact, fail_fast, insecure, pull_on_device, **kw):
    """Push ARTIFACT to devices: verify, install atomically, selftest on the device, roll back on failure.

    ARTIFACT may be REGISTRY/REPO:TAG (pushed with `edgepack push`): each device gets the entry of its
    inventory target or of its architecture, pulled once here and checked by digest.

    \b
    Examples:
      edgepack deploy dist/model-jetson-orin -I devices.toml --tag jetson -j 8
      edgepack deploy dist/model-x86_64 -d edge@192.0.2.10:2222 --json
    """
    if kw.pop("via") == "ansible":
        if fail_fast:
            # ansible-playbook has no "start no further host" switch; its batches stop on --max-fail instead
            raise UsageError("--fail-fast applies to --via ssh only",
                             hint="with --via ansible, --max-fail 0 (the default) stops the roll-out after the "
                                  "batch where a device failed; --canary 1 makes that first batch one device")
        return deploy_via_ansible(ctx, artifact, kw)
    from ..oci.ref import looks_like_reference
    if not artifact.exists() and looks_like_reference(str(artifact)):
        return _deploy_from_registry(ctx, str(artifact), fail_fast, insecure, pull_on_device, kw)
    from ..deploy.artifact import inspect_artifact
    from ..deploy.engine import deploy_one, run_all
    art = inspect_artifact(artifact)
    devices, opts = _setup(ctx, kw)

    def one(dev):
        res = deploy_one(dev, art, opts)
        _live(res)
        return res

    results = run_all(devices, one, opts.parallel, fail_fast)
    _report("deploy", results, "deploy", kw["as_json"], f"edgepack deploy {art.name} ({art.target}, {art.short})",
            {"artifact": {"path": str(art.path), "sha256": art.sha256, "target": art.target, "arch": art.arch}})


def _deploy_from_registry(ctx, reference: str, fail_fast: bool, insecure: bool, pull_on_device: bool, kw) -> None:
    from ..deploy.engine import run_all
    from ..deploy.registry import deploy_one_from, open_source
    source = open_source(reference, insecure)  # bad reference / credentials: one error before any device
    devices, opts = _setup(ctx, kw)

    def one(dev):
        res = deploy_one_from(dev, source, opts, pull_on_device)
        _live(res)
        return res

    results = run_all(devices, one, opts.parallel, fail_fast)
    _report("deploy", results, "deploy", kw["as_json"], f"edgepack deploy {source.ref}",
            {"reference": str(source.ref), "digest": source.index_digest})


@click.group()
def devices():
    """Inspect devices (reachability, architecture, glibc, free disk)."""


@devices.command("check", epilog=_INVENTORY_HELP)
@device_options
@click.pass_context
def devices_check(ctx, **kw):
    """Connect to each device: reachable, arch, glibc, free disk at dest, installed version."""
    from ..deploy.engine import check_one, run_all
    devs, opts = _setup(ctx, kw)
    results = run_all(devs, lambda d: check_one(d, opts), opts.parallel)
    _report("devices check", results, "check", kw["as_json"], "edgepack devices check")


@devices.command("list")
@click.option("--inventory", "-I", type=click.Path(path_type=Path), required=True,
              help="devices.toml (name, host, port, user, key, target, dest, tags).")
@click.option("--json", "as_json", is_flag=True, help="Print the devices as JSON on stdout.")
def devices_list(inventory, as_json):
    """Print the devices of an inventory (no connection is made)."""
    from ..deploy.inventory import load_inventory
    inv = load_inventory(inventory)
    rows = [{"name": d.name, "address": d.address, "target": d.target, "dest": d.dest, "tags": list(d.tags)}
            for d in inv.devices.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    print_table(out_console, f"devices in {inventory}", ["name", "address", "target", "dest", "tags"],
                [[r["name"], r["address"], r["target"] or "-", r["dest"] or "-", ",".join(r["tags"])] for r in rows])


@click.command(epilog=_INVENTORY_HELP)
@device_options
@click.pass_context
def rollback(ctx, **kw):
    """Switch each device back to its previous version (again: forward), then selftest it."""
    from ..deploy.engine import rollback_one, run_all
    devs, opts = _setup(ctx, kw)
    results = run_all(devs, lambda d: rollback_one(d, opts), opts.parallel)
    _report("rollback", results, "rollback", kw["as_json"], "edgepack rollback")


@click.command(epilog=_INVENTORY_HELP)
@device_options
@click.option("--bench", is_flag=True, help="Also run the artifact's benchmark on the device.")
@click.pass_context
def smoke(ctx, bench, **kw):
    """Re-run the installed artifact's selftest (and --bench) on each device."""
    from ..deploy.engine import run_all, smoke_one
    devs, opts = _setup(ctx, kw)
    results = run_all(devs, lambda d: smoke_one(d, opts, bench), opts.parallel)
    _report("smoke", results, "smoke", kw["as_json"], "edgepack smoke" + (" --bench" if bench else ""))


COMMANDS = (deploy, devices, rollback, smoke)
