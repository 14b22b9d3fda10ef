"""Options of the Ansible path shared by `edgepack deploy --via ansible` and `edgepack fleet export-ansible`
(no import of .deploy at load time: deploy.py imports this module)."""
from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import click

from .common import err_console


def rollout_options(fn):
    """Canary batches and the failure threshold (the Ansible path's `serial` and `max_fail_percentage`)."""
    opts = [
        click.option("--canary", type=click.IntRange(1, 100000), default=1, show_default=True,
                     help="Ansible: devices in the first batch."),
        click.option("--batch", default="25%", show_default=True, metavar="N|P%",
                     help="Ansible: size of each later batch, a count or a percentage of the devices."),
        click.option("--max-fail", type=click.IntRange(0, 100), default=0, show_default=True,
                     help="Ansible: percent of a batch that may fail before the roll-out stops (later "
                          "batches stay untouched)."),
    ]
    return functools.reduce(lambda f, o: o(f), reversed(opts), fn)


def via_option(fn):
    return click.option("--via", type=click.Choice(["ssh", "ansible"]), default="ssh", show_default=True,
                        help="ssh: edgepack's own SSH client (paramiko), -j devices at once; ansible: write a "
                             "playbook and run it with ansible-runner (canary batches, failure threshold).")(fn)


def ansible_options(kw, opts):
    from ..deploy.ansible import AnsibleOptions
    return AnsibleOptions(canary=kw["canary"], batch=kw["batch"], max_fail=kw["max_fail"],
                          inventory_format=kw.get("inventory_format") or "yaml", forks=opts.parallel,
                          dest=opts.dest, known_hosts=opts.ssh.known_hosts,
                          accept_new_host_key=opts.ssh.accept_new_host_key,
                          connect_timeout=opts.ssh.connect_timeout, selftest_timeout=opts.selftest_timeout,
                          lock_wait=opts.lock_wait, lock_stale=opts.lock_stale)


def deploy_via_ansible(ctx, artifact: Path, kw) -> None:
    """`edgepack deploy --via ansible`: export into a temporary folder, run it, report like deploy."""
    from ..deploy import ansible, ansible_run
    from ..deploy.artifact import inspect_artifact
    from ..errors import UsageError
    from ..oci.ref import looks_like_reference
    from .deploy import _live, _report, _setup
    if not artifact.exists() and looks_like_reference(str(artifact)):
        raise UsageError(f"--via ansible deploys a local artifact, not {artifact}",
                         hint=f"fetch it first: edgepack pull {artifact} --platform linux/ARCH")
    art = inspect_artifact(artifact)
    devices, opts = _setup(ctx, kw)
    aopts = ansible_options(kw, opts)
    folder = Path(tempfile.mkdtemp(prefix="edgepack-playbook-"))
    try:
        ex = ansible.export(art, devices, folder, aopts)
        err_console.print(f"[dim]{ex.plan}[/dim]", soft_wrap=True, highlight=False)
        results = ansible_run.run(ex, art, devices, aopts, on_result=_live, keep=bool(ctx.obj and ctx.obj.debug))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _report("deploy", results, "deploy", kw["as_json"],
            f"edgepack deploy {art.name} ({art.target}, {art.short}) via ansible",
            {"via": "ansible", "artifact": {"path": str(art.path), "sha256": art.sha256, "target": art.target,
                                            "arch": art.arch}})
