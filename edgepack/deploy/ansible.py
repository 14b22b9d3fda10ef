"""`edgepack fleet export-ansible`: the deploy as an Ansible playbook + inventory + the artifact, for teams
whose fleets already run on Ansible (and for `edgepack deploy --via ansible`, which runs it).

    DIR/ansible.cfg            host key checking on (known_hosts of the inventory), forks, plugins
    DIR/inventory.yml|.ini     group `edgepack` (the devices), one group per tag (tag_<name>)
    DIR/site.yml               the play (ansible_play.py), DIR/edgepack.yml its variables
    DIR/edgepack-step.sh       the on-device steps (ansible_step.py), POSIX shell only
    DIR/files/ARTIFACT         the artifact, and ARTIFACT.run: it as a self-unpacking script (no Python)
    DIR/filter_plugins/, DIR/callback_plugins/   the play's helpers and its one-line-per-device summary

No secret is written: devices authenticate with key files (their paths only) or the SSH agent.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ToolMissingError, UsageError
from .ansible_play import PLAYBOOK
from .ansible_step import extractor, step_script
from .artifact import ArtifactInfo
from .device import Device
from .probe import DEFAULT_DEST
from .ssh import DEFAULT_KNOWN_HOSTS

_PCT_RE = re.compile(r"^(\d{1,3})%$")


@dataclass(frozen=True)
class AnsibleOptions:
    canary: int = 1                  # devices in the first batch
    batch: str = "25%"               # size of the next batches (a count or a percentage)
    max_fail: int = 0                # percent of a batch that may fail before the roll-out stops
    inventory_format: str = "yaml"   # yaml | ini
    forks: int = 16                  # devices worked on at once within a batch (-j)
    dest: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    connect_timeout: float = 10.0
    selftest_timeout: float = 300.0
    lock_wait: float = 120.0
    lock_stale: float = 3600.0


@dataclass(frozen=True)
class Export:
    folder: Path
    playbook: Path
    inventory: Path
    config: Path
    batches: list[list[str]]
    plan: str


def serial(opts: AnsibleOptions) -> list:
    """Ansible's `serial`: the canary, then batches, then whatever is left."""
    batch = opts.batch.strip()
    if not (batch.isdigit() and int(batch) > 0) and not (_PCT_RE.match(batch) and 0 < int(batch[:-1]) <= 100):
        raise UsageError(f"--batch {opts.batch!r}: give a device count (5) or a percentage (25%)")
    if opts.canary < 1:
        raise UsageError("--canary must be at least 1")
    if not 0 <= opts.max_fail <= 100:
        raise UsageError("--max-fail is a percentage, 0-100")
    return [opts.canary, int(batch) if batch.isdigit() else batch, "100%"]


def batches(names: list[str], steps: list) -> list[list[str]]:
    """The batches Ansible makes of ``names`` with ``serial: steps`` (the last size repeats)."""
    out, i, k = [], 0, 0
    while i < len(names):
        s = steps[min(k, len(steps) - 1)]
        n = max(1, int(int(s[:-1]) / 100.0 * len(names))) if isinstance(s, str) else int(s)
        out.append(names[i:i + n])
        i, k = i + n, k + 1
    return out


def _dest(device: Device, opts: AnsibleOptions) -> str:
    return opts.dest or device.dest or DEFAULT_DEST


def _host_vars(device: Device, opts: AnsibleOptions) -> dict:
    known = os.path.abspath(os.path.expanduser(opts.known_hosts or device.known_hosts or DEFAULT_KNOWN_HOSTS))
    policy = "accept-new" if opts.accept_new_host_key else "yes"
    v = {"ansible_host": device.host, "ansible_port": device.port or 22}
    if device.user:
        v["ansible_user"] = device.user
    if device.keys:
        v["ansible_ssh_private_key_file"] = device.keys[0]
    extra = " ".join(f"-o IdentityFile={shlex.quote(k)}" for k in device.keys[1:])
    v["ansible_ssh_common_args"] = (f"-o UserKnownHostsFile={shlex.quote(known)} -o StrictHostKeyChecking={policy}"
                                    + (f" {extra}" if extra else ""))
    v["edgepack_dest"] = _dest(device, opts)
    return v


def _group(tag: str) -> str:
    return "tag_" + re.sub(r"[^A-Za-z0-9_]", "_", tag)


def _yaml_scalar(v) -> str:
    # JSON strings and numbers are valid YAML scalars: no YAML library needed, no quoting surprises
    return json.dumps(v)


def inventory_yaml(devices: list[Device], opts: AnsibleOptions) -> str:
    lines = ["# Written by `edgepack fleet export-ansible` from devices.toml", "all:", "  children:",
             "    edgepack:", "      hosts:"]
    for d in devices:
        lines.append(f"        {_yaml_scalar(d.name)}:")
        lines += [f"          {k}: {_yaml_scalar(v)}" for k, v in _host_vars(d, opts).items()]
    tags = sorted({t for d in devices for t in d.tags})
    for t in tags:
        lines += [f"    {_group(t)}:", "      hosts:"]
        lines += [f"        {_yaml_scalar(d.name)}: {{}}" for d in devices if t in d.tags]
    return "\n".join(lines) + "\n"


def inventory_ini(devices: list[Device], opts: AnsibleOptions) -> str:
    def val(v):
        return str(v) if isinstance(v, int) else shlex.quote(str(v))
    lines = ["# Written by `edgepack fleet export-ansible` from devices.toml", "[edgepack]"]
    for d in devices:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", d.name):
            raise UsageError(f"device name {d.name!r} cannot be written to an INI inventory",
                             hint="use --inventory-format yaml")
        lines.append(d.name + " " + " ".join(f"{k}={val(v)}" for k, v in _host_vars(d, opts).items()))
    for t in sorted({t for d in devices for t in d.tags}):
        lines += ["", f"[{_group(t)}]"] + [d.name for d in devices if t in d.tags]
    return "\n".join(lines) + "\n"


def _config(opts: AnsibleOptions, inventory: str) -> str:
    t = max(1, math.ceil(opts.connect_timeout))
    # StrictHostKeyChecking in ssh_args: ssh takes the first value it is given, and ssh_args come before
    # the `StrictHostKeyChecking=no` Ansible adds when host_key_checking is turned off (ansible-runner
    # turns it off unless told otherwise), so host keys stay checked whoever runs the playbook
    policy = "accept-new" if opts.accept_new_host_key else "yes"
    # ControlPersist: the steps of one device reuse one SSH connection; short, so nothing lingers long
    return f"""# Written by `edgepack fleet export-ansible`. Host keys are checked (known_hosts per host in the inventory).
[defaults]
inventory = {inventory}
forks = {opts.forks}
gathering = explicit
host_key_checking = True
retry_files_enabled = False
interpreter_python = auto_silent
timeout = {t}
callbacks_enabled = edgepack_summary
filter_plugins = ./filter_plugins
callback_plugins = ./callback_plugins

[ssh_connection]
ssh_args = -o StrictHostKeyChecking={policy} -o ControlMaster=auto -o ControlPersist=15s -o BatchMode=yes -o PasswordAuthentication=no -o ConnectTimeout={t}
pipelining = True
"""


def _vars(art: ArtifactInfo, opts: AnsibleOptions) -> str:
    v = {"edgepack_artifact": art.name, "edgepack_sha256": art.sha256, "edgepack_short": art.short,
         "edgepack_target": art.target, "edgepack_need_kb": (art.size + 64 * 1024) // 1024 + 1,
         "edgepack_selftest_timeout": int(math.ceil(opts.selftest_timeout)),
         "edgepack_lock_wait": int(math.ceil(opts.lock_wait)), "edgepack_lock_stale": int(opts.lock_stale)}
    return "# Written by `edgepack fleet export-ansible`\n" + "".join(f"{k}: {_yaml_scalar(x)}\n" for k, x in v.items())


def _plugin_source(name: str) -> str:
    # read, not imported: the callback plugin imports Ansible, which exporting does not need
    path = Path(__file__).with_name(name)
    if not path.is_file():
        raise ToolMissingError(f"{name} is not next to {Path(__file__).name} (a frozen edgepack without its "
                               "Ansible plugin sources)", hint="run export-ansible from an installed edgepack "
                               "(pip install -e .)")
    return path.read_text()


def plan_text(art: ArtifactInfo, devices: list[Device], bs: list[list[str]], opts: AnsibleOptions) -> str:
    lines = [f"Ansible roll-out of {art.name} ({art.target}, {art.short}) to {len(devices)} device(s), "
             f"{opts.forks} at once within a batch:"]
    for i, b in enumerate(bs, 1):
        lines.append(f"  batch {i}{' (canary)' if i == 1 else ''}: {', '.join(b)}")
    lines.append(f"  a batch where more than {opts.max_fail}% of the devices fail stops the roll-out: later "
                 "batches stay untouched")
    lines.append("  per device: probe, lock, upload to releases/.incoming-*, sha256 on the device, selftest "
                 "where it lies, atomic switch of current/previous; a failure is rolled back in `rescue`")
    lines.append("  devices without Python >= 3.8 (Android, old L4T) are found with `raw` and get only raw/script "
                 "modules (the upload is a self-unpacking script)")
    return "\n".join(lines)


def export(art: ArtifactInfo, devices: list[Device], folder: Path, opts: AnsibleOptions) -> Export:
    """Write the playbook, inventory, config and artifact into ``folder`` (created; files replaced)."""
    local = [d.name for d in devices if d.local]
    if local:
        raise UsageError(f"device {local[0]!r} is this machine: the Ansible path needs SSH devices",
                         hint="deploy to `local` without --via ansible")
    steps = serial(opts)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder", hint="pass -o NEW_FOLDER")
    for sub in ("files", "filter_plugins", "callback_plugins"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    inv_name = "inventory.ini" if opts.inventory_format == "ini" else "inventory.yml"
    inv_text = inventory_ini(devices, opts) if opts.inventory_format == "ini" else inventory_yaml(devices, opts)
    (folder / inv_name).write_text(inv_text)
    (folder / "ansible.cfg").write_text(_config(opts, inv_name))
    play = (PLAYBOOK.replace("@@NAME@@", art.name).replace("@@SHA@@", art.sha256)
            .replace("@@SERIAL@@", json.dumps(steps)).replace("@@MAXFAIL@@", str(opts.max_fail)))
    (folder / "site.yml").write_text(play)
    (folder / "edgepack.yml").write_text(_vars(art, opts))
    step = folder / "edgepack-step.sh"
    step.write_text(step_script(art))
    step.chmod(0o755)
    shutil.copyfile(art.path, folder / "files" / art.name)
    (folder / "files" / art.name).chmod(0o755)
    (folder / "files" / f"{art.name}.run").write_bytes(extractor(art))
    (folder / "filter_plugins" / "edgepack.py").write_text(_plugin_source("ansible_filters.py"))
    (folder / "callback_plugins" / "edgepack_summary.py").write_text(_plugin_source("ansible_summary.py"))
    bs = batches([d.name for d in devices], steps)
    plan = plan_text(art, devices, bs, opts)
    (folder / "PLAN.txt").write_text(plan + f"\n\nrun it: cd {shlex.quote(str(folder))} && ansible-playbook site.yml\n")
    return Export(folder=folder, playbook=folder / "site.yml", inventory=folder / inv_name,
                  config=folder / "ansible.cfg", batches=bs, plan=plan)
