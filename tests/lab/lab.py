"""The device lab: each simulated device is a real OpenSSH sshd, on its own 127.0.0.x loopback address,
in its own user+mount namespace (device.sh), with generated host and client keys.

Kinds of device:
  x86_64  - the host's userland, a private (empty) binfmt_misc, a private home folder
  arm64   - the same, with qemu-aarch64 registered in its private binfmt_misc: aarch64 executables run
  jetson  - sshd chroots into an overlay of a Debian 11 arm64 root filesystem (glibc 2.31); its shell
            is aarch64 (under qemu via binfmt), so `uname -m` says aarch64, as on an L4T r35 Jetson

Every packet stays on loopback; every wait is bounded in count and time.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import rootfs

HERE = Path(__file__).resolve().parent
# binfmt_misc magic/mask of a little-endian 64-bit ELF executable for EM_AARCH64 (183 = 0xb7)
AARCH64_MAGIC = r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
AARCH64_MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
KINDS = ("x86_64", "arm64", "jetson")


def _tool(name: str, *extra_dirs: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *extra_dirs]))
    if not found:
        raise RuntimeError(f"{name} not found: run .ci/deps-deploy.sh (it installs the device lab's tools)")
    return found


def keygen(path: Path, comment: str) -> str:
    """A fresh ed25519 key pair without passphrase; returns the public key line."""
    subprocess.run([_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, timeout=30, stdin=subprocess.DEVNULL)
    return path.with_suffix(".pub").read_text().strip()


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in task.read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    seen, todo = [], [pid]
    for _ in range(10000):  # bounded walk of the process tree
        if not todo:
            break
        for c in _children(todo.pop()):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def _kill(pids: list[int], sig=signal.SIGKILL) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


@dataclass
class Device:
    lab: "Lab"
    name: str
    kind: str
    addr: str
    dir: Path
    tmpfs_size: str | None = None
    tags: tuple[str, ...] = ()
    port: int = 0
    proc: subprocess.Popen | None = None
    host_pub: str = ""
    extra_sshd: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        return f"root@{self.addr}:{self.port}"

    @property
    def target(self) -> str:
        return "x86_64" if self.kind == "x86_64" else "arm64"

    @property
    def dest(self) -> str:
        """Where the tests deploy: inside the small tmpfs on the disk-full device."""
        if self.kind == "jetson":
            return "/opt/edgepack" if not self.tmpfs_size else "/opt/small/edgepack"
        return str(self.home / ("small/edgepack" if self.tmpfs_size else "edgepack"))

    @property
    def home(self) -> Path:
        """The device's home folder as this machine sees it (bind-mounted over $HOME inside)."""
        return self.dir / "home"

    @property
    def remote_home(self) -> str:
        return "/root" if self.kind == "jetson" else os.path.expanduser("~")

    @property
    def log(self) -> Path:
        return self.dir / "sshd.log"

    def _config(self) -> Path:
        lines = [f"ListenAddress {self.addr}:{self.port}", f"HostKey {self.dir / 'host_key'}",
                 f"AuthorizedKeysFile {self.lab.client_key.with_suffix('.pub')}", "PidFile none",
                 "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                 "StrictModes no", "PermitRootLogin prohibit-password", "UseDNS no",
                 "Subsystem sftp internal-sftp", "MaxStartups 64:30:128", "MaxSessions 32",
                 "LogLevel INFO", "ClientAliveInterval 0"]
        if self.kind == "jetson":
            lines.append(f"ChrootDirectory {self.lab.chroot_mnt}/root")
        lines += list(self.extra_sshd)
        cfg = self.dir / "sshd_config"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg

    def start(self, timeout: float = 15.0) -> "Device":
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": os.path.expanduser("~"),
               "LAB_SSHD": _tool("sshd", "/usr/sbin", "/sbin")}
        if self.kind != "jetson":
            self.home.mkdir(parents=True, exist_ok=True)
            env["LAB_HOME"] = str(self.home)
            if self.tmpfs_size:
                env.update(LAB_TMPFS_DIR=str(self.home / "small"), LAB_TMPFS_SIZE=self.tmpfs_size)
        if self.kind == "arm64":
            env.update(LAB_QEMU=_tool("qemu-aarch64"), LAB_QEMU_MAGIC=AARCH64_MAGIC + ":" + AARCH64_MASK)
        if self.kind == "jetson":
            env.update(LAB_QEMU=str(rootfs.qemu_aarch64_static()),
                       LAB_QEMU_MAGIC=AARCH64_MAGIC + ":" + AARCH64_MASK,
                       LAB_ROOTFS=str(rootfs.arm64_rootfs()), LAB_CHROOT_MNT=str(self.lab.chroot_mnt))
            if self.tmpfs_size:
                env.update(LAB_CHROOT_TMPFS_DIR="/opt/small", LAB_TMPFS_SIZE=self.tmpfs_size)
        env.update(self.env)
        last = ""
        for attempt in range(5):  # a port taken between free_port() and sshd's bind: pick another
            # a restarted device keeps its port when it can, so known_hosts still names it
            self.port = self.port if (self.port and attempt == 0) else free_port(self.addr)
            env["LAB_CONFIG"] = str(self._config())
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [_tool("unshare"), "--user", "--mount", "--propagation", "private", "sh", str(HERE / "device.sh")],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            self._map_ids()
            if self._wait_listening(timeout):
                return self
            last = self.log.read_text(errors="replace")[-2000:]
            self.stop()
            if "Address already in use" not in last:
                break
        raise RuntimeError(f"device {self.name} did not start; sshd log:\n{last}")

    def _map_ids(self, timeout: float = 5.0) -> None:
        # util-linux's --map-users needs newuidmap; we are root outside, so write an identity map ourselves
        # (sshd's privilege separation switches to the unprivileged `sshd` user, which must be mapped).
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if os.readlink(f"/proc/{self.proc.pid}/ns/user") != own:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None:
                return
            time.sleep(0.005)
        else:
            raise RuntimeError(f"device {self.name}: namespace never appeared")
        for f in ("uid_map", "gid_map"):
            Path(f"/proc/{self.proc.pid}/{f}").write_text("0 0 4294967295\n")

    def _wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if "Server listening" in self.log.read_text(errors="replace"):
                return True
            time.sleep(0.02)
        return False

    def kill_connections(self) -> None:
        """Cut every SSH connection of this device (its per-connection sshd processes); keep listening."""
        if self.proc:
            _kill(descendants(self.proc.pid))

    def stop(self) -> None:
        if self.proc is None:
            return
        pids = descendants(self.proc.pid)
        _kill([self.proc.pid] + pids, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill([self.proc.pid])
            self.proc.wait(timeout=5)
        _kill(descendants(self.proc.pid) + pids)
        self.proc = None

    def new_host_key(self) -> None:
        """Replace the host key (as a re-imaged device would); restart to take effect."""
        for p in (self.dir / "host_key", self.dir / "host_key.pub"):
            p.unlink(missing_ok=True)
        self.host_pub = keygen(self.dir / "host_key", f"{self.name}-host")

    def known_hosts_line(self) -> str:
        keytype, b64 = self.host_pub.split()[:2]
        return f"[{self.addr}]:{self.port} {keytype} {b64}"

    def inventory_toml(self) -> str:
        tags = ", ".join(f'"{t}"' for t in (self.kind, *self.tags))
        return (f'[devices.{self.name}]\nhost = "{self.addr}"\nport = {self.port}\nuser = "root"\n'
                f'key = "{self.lab.client_key}"\ntarget = "{self.target}"\ndest = "{self.dest}"\n'
                f'tags = [{tags}]\n')


def _address_range() -> tuple[int, int]:
    """The last octets this test process may give devices: 11..249, split between pytest-xdist workers
    so that two workers never put devices on one 127.0.0.x address."""
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    size = (249 - 11 + 1) // count
    return 11 + index * size, 11 + (index + 1) * size - 1


class Lab:
    """A set of devices sharing one client key and one known_hosts file, all torn down by close()."""

    _first_addr, _last_addr = _address_range()
    _next_addr = _first_addr

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.client_key = self.root / "client_key"
        keygen(self.client_key, "edgepack-lab-client")
        self.known_hosts = self.root / "known_hosts"
        self.known_hosts.write_text("")
        self.devices: dict[str, Device] = {}
        self._chroot_mnt: Path | None = None

    @property
    def chroot_mnt(self) -> Path:
        # Same path for every jetson device: each mounts its own tmpfs+overlay there, in its own namespace.
        if self._chroot_mnt is None:
            self._chroot_mnt = rootfs.cache_dir() / "mnt"
            self._chroot_mnt.mkdir(mode=0o755, exist_ok=True)
        return self._chroot_mnt

    def add(self, name: str, kind: str = "x86_64", *, tmpfs_size: str | None = None, tags=(),
            trust: bool = True, start: bool = True) -> Device:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        if Lab._next_addr > Lab._last_addr:
            Lab._next_addr = Lab._first_addr
        addr = f"127.0.0.{Lab._next_addr}"
        Lab._next_addr += 1
        d = Device(self, name, kind, addr, self.root / name, tmpfs_size=tmpfs_size, tags=tuple(tags))
        d.dir.mkdir(parents=True, exist_ok=True)
        d.host_pub = keygen(d.dir / "host_key", f"{name}-host")
        self.devices[name] = d
        if start:
            d.start()
            if trust:
                self.trust(d)
        return d

    def trust(self, d: Device) -> None:
        with open(self.known_hosts, "a") as fh:
            fh.write(d.known_hosts_line() + "\n")

    def write_inventory(self, devices=None, path: Path | None = None) -> Path:
        path = path or self.root / "devices.toml"
        devs = devices if devices is not None else list(self.devices.values())
        path.write_text(f'known_hosts = "{self.known_hosts}"\n\n' + "\n".join(d.inventory_toml() for d in devs))
        return path

    def close(self) -> None:
        for d in list(self.devices.values()):
            d.stop()


def silent_server(addr: str = "127.0.0.250"):
    """A TCP listener that accepts and never speaks: an SSH client waiting for its banner must time out."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((addr, 0))
    s.listen(8)
    return s
