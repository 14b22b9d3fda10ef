"""The SSH connector (paramiko): host keys verified against known_hosts, keys from files or the agent.

No password is ever accepted or sent: public-key authentication only, so nothing secret can reach argv,
the environment or a log.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from ..errors import DeployError, UsageError
from .connector import (CommandTimeout, ConnectionLost, Connector, HostKeyRefused, Progress, RunResult,
                        Unreachable)
from .device import Device

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
# paramiko logs transport-thread failures (with tracebacks) through `logging`; without a handler Python
# would print them on stderr. The errors reach the user as one line per device instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
# accept-new appends to known_hosts from several worker threads: one writer at a time.
_KNOWN_HOSTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class SSHOptions:
    known_hosts: str | None = None     # None: the inventory's, else ~/.ssh/known_hosts
    accept_new_host_key: bool = False  # like OpenSSH StrictHostKeyChecking=accept-new
    connect_timeout: float = 10.0      # TCP connect, banner and authentication, each


def fingerprint(key: paramiko.PKey) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def host_id(host: str, port: int) -> str:
    """How known_hosts names the host: bare for port 22, [host]:port otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


class _UnknownHostKey(paramiko.MissingHostKeyPolicy):
    """Refuse an unknown host key (the default) or add it (--accept-new-host-key). A *changed* key is
    refused by paramiko itself (BadHostKeyException) whatever the policy, like OpenSSH's accept-new."""

    def __init__(self, known_hosts: Path, accept_new: bool, device: Device):
        self.known_hosts, self.accept_new, self.device = known_hosts, accept_new, device

    def missing_host_key(self, client, hostname, key):
        if not self.accept_new:
            raise HostKeyRefused(
                f"{self.device.name}: host key of {hostname} is not in {self.known_hosts} "
                f"({key.get_name()} {fingerprint(key)})",
                hint=f"check the fingerprint on the device (ssh-keygen -lf /etc/ssh/ssh_host_{_short(key)}_key.pub), "
                     "then rerun with --accept-new-host-key to trust it, or add it to known_hosts yourself")
        with _KNOWN_HOSTS_LOCK:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.known_hosts, "a") as fh:
                fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _short(key: paramiko.PKey) -> str:
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(key.get_name(), "ecdsa")


def resolve_known_hosts(opts: SSHOptions, device: Device) -> Path:
    return Path(os.path.expanduser(opts.known_hosts or device.known_hosts or DEFAULT_KNOWN_HOSTS))


# AES-GCM first: with the CTR ciphers paramiko checks every received packet's HMAC in Python (a
# byte-by-byte constant-time compare); GCM authenticates in C. Measured on the lab: client CPU per 2 MB
# upload 25 -> 17 ms, which adds up when one process (one GIL) drives dozens of devices.
_CIPHERS_FIRST = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _transport(sock, **kw) -> paramiko.Transport:
    t = paramiko.Transport(sock, **kw)
    sec = t.get_security_options()
    sec.ciphers = tuple(c for c in _CIPHERS_FIRST if c in sec.ciphers) + \
        tuple(c for c in sec.ciphers if c not in _CIPHERS_FIRST)
    return t


def connect(device: Device, opts: SSHOptions) -> "SSHConnector":
    known_hosts = resolve_known_hosts(opts, device)
    for key in device.keys:
        if not os.path.isfile(key):
            raise UsageError(f"{device.name}: key file {key} does not exist",
                             hint="fix `key` in the inventory or IdentityFile in ~/.ssh/config")
    client = paramiko.SSHClient()
    if known_hosts.is_file():
        try:
            client.load_host_keys(str(known_hosts))
        except (OSError, paramiko.SSHException) as exc:
            raise UsageError(f"cannot read known_hosts {known_hosts}: {exc}") from None
    client.set_missing_host_key_policy(_UnknownHostKey(known_hosts, opts.accept_new_host_key, device))
    user = device.user or _local_user()
    t = opts.connect_timeout
    try:  # our own TCP connect: refused / no route / timeout each get a plain message
        sock = socket.create_connection((device.host, device.port or 22), timeout=t)
    except (socket.timeout, TimeoutError):
        client.close()
        raise Unreachable(f"{device.name}: {device.address} timed out after {t:g} s (no TCP answer)",
                          hint="check the address and that the device is powered and on the network") from None
    except OSError as exc:
        client.close()
        raise Unreachable(f"{device.name}: cannot reach {device.address}: {_reason(exc)}",
                          hint="check the address, the port and that sshd runs on the device") from None
    try:
        client.connect(device.host, port=device.port or 22, username=user, key_filename=list(device.keys) or None,
                       allow_agent=True, look_for_keys=not device.keys, timeout=t, banner_timeout=t,
                       auth_timeout=t, channel_timeout=t, password=None, sock=sock,
                       transport_factory=_transport)
    except HostKeyRefused:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        hid = host_id(device.host, device.port or 22)
        raise HostKeyRefused(
            f"{device.name}: host key of {hid} CHANGED: it offered {exc.key.get_name()} {fingerprint(exc.key)}, "
            f"{known_hosts} has {fingerprint(exc.expected_key)}; someone may be intercepting the connection",
            hint=f"if the device was re-imaged, verify its new key, then remove the old one: "
                 f"ssh-keygen -f {known_hosts} -R '{hid}'") from None
    except (paramiko.AuthenticationException, paramiko.SSHException) as exc:
        if not isinstance(exc, paramiko.AuthenticationException) and "No authentication methods" not in str(exc):
            _unreachable(client, sock, device, exc, t)
        client.close()
        how = f"key {', '.join(device.keys)}" if device.keys else "the SSH agent and ~/.ssh/id_* keys"
        if not isinstance(exc, paramiko.AuthenticationException):
            raise DeployError(f"{device.name}: no SSH key to offer {user}@{device.host} (no agent, no ~/.ssh/id_* key)",
                              hint="set `key` in the inventory, IdentityFile in ~/.ssh/config, or ssh-add it") from None
        raise DeployError(f"{device.name}: {user}@{device.host} refused {how}",
                          hint=f"install the public key on the device (ssh-copy-id -p {device.port or 22} "
                               f"{user}@{device.host}) or set `key` in the inventory") from None
    except (OSError, EOFError) as exc:
        _unreachable(client, sock, device, exc, t)
    transport = client.get_transport()
    transport.set_keepalive(5)  # notice a dead peer instead of hanging on it
    return SSHConnector(device, client)


def _unreachable(client, sock, device: Device, exc: BaseException, t: float):
    """Raise Unreachable for a connection that failed below authentication."""
    client.close()
    sock.close()
    text = str(exc)
    if isinstance(exc, (socket.timeout, TimeoutError)) or "banner" in text or "No existing session" in text:
        # paramiko's transport thread died waiting for the server's greeting
        raise Unreachable(f"{device.name}: {device.address} accepted TCP but sent no SSH greeting within "
                          f"{t:g} s (timed out)", hint="is sshd running on that port, and is the device "
                          "overloaded? raise --connect-timeout for slow links") from None
    raise Unreachable(f"{device.name}: SSH with {device.address} failed: {_reason(exc)}",
                      hint="check the address, the port and that sshd runs on the device") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _local_user() -> str:
    import getpass
    return getpass.getuser()


# how long output may still arrive after the command's exit-status when EOF has not come yet
_OUTPUT_GRACE_S = 5.0


class SSHConnector(Connector):
    def __init__(self, device: Device, client: paramiko.SSHClient):
        self.device, self.client = device, client
        self._sftp: paramiko.SFTPClient | None = None

    def _lost(self, exc: BaseException, doing: str) -> ConnectionLost:
        return ConnectionLost(f"{self.device.name}: connection lost while {doing}: {_reason(exc)}",
                              hint="the previous version is still installed; rerun the deploy when the device is back")

    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = self.client.open_sftp()
            except (OSError, EOFError, paramiko.SSHException) as exc:
                raise self._lost(exc, "opening SFTP") from None
        return self._sftp

    def run(self, command: str, timeout: float) -> RunResult:
        t0 = time.monotonic()
        deadline = t0 + timeout
        try:
            chan = self.client.get_transport().open_session(timeout=timeout)
            chan.exec_command(command)
            out, err = bytearray(), bytearray()
            # Sleep in select() until the channel has data or closes, instead of polling: with dozens of
            # devices at once, 5 ms polling loops in every thread fought over the GIL (and the CPU the
            # devices' own sshd needs on a small machine).
            fd = chan.fileno()
            exited_at = None
            while True:  # bounded by `deadline`
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                # Done at EOF, not at exit-status: sshd sends exit-status when the shell exits and reads
                # what is still in the pipe afterwards, so output can follow it. A child that outlives
                # the shell and keeps the pipe open gets a short grace, not the whole timeout.
                if chan.closed or (chan.eof_received and chan.exit_status_ready()):
                    break
                now = time.monotonic()
                if chan.exit_status_ready():
                    exited_at = exited_at or now
                    if now - exited_at > _OUTPUT_GRACE_S:
                        break
                left = deadline - now
                if left <= 0:
                    chan.close()
                    raise CommandTimeout(f"{self.device.name}: command timed out after {timeout:.0f} s")
                select.select([fd], [], [], min(left, 0.5))
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            rc = chan.recv_exit_status() if chan.exit_status_ready() else -1
            chan.close()
        except CommandTimeout:
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise self._lost(exc, "running a command") from None
        if rc == -1 and not self.client.get_transport().is_active():
            raise self._lost(EOFError("session closed"), "running a command")
        return RunResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - t0)

    def _alive(self) -> bool:
        t = self.client.get_transport()
        return t is not None and t.is_active()

    def _sftp_call(self, doing: str, fn, *args):
        try:
            return fn(*args)
        except (EOFError, paramiko.SSHException) as exc:
            raise self._lost(exc, doing) from None
        except OSError as exc:
            if self._alive():
                raise  # a file error on a healthy session (ENOENT, no space, ...): the engine reports it
            raise self._lost(exc, doing) from None

    def put(self, local: Path, remote: str, progress: Progress | None = None) -> None:
        self._sftp_call("uploading", self.sftp().put, str(local), remote, progress, True)

    def write_bytes(self, data: bytes, remote: str) -> None:
        def write():
            with self.sftp().open(remote, "wb") as fh:
                fh.write(data)
        self._sftp_call("writing", write)

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        self._sftp_call("creating a folder", self.sftp().mkdir, remote, mode)

    def chmod(self, remote: str, mode: int) -> None:
        self._sftp_call("changing a mode", self.sftp().chmod, remote, mode)

    def rename(self, src: str, dst: str) -> None:
        self._sftp_call("renaming", self.sftp().posix_rename, src, dst)

    def symlink(self, target: str, link: str) -> None:
        self._sftp_call("linking", self.sftp().symlink, target, link)

    def read_bytes(self, remote: str, limit: int = 65536) -> bytes:
        def read():
            with self.sftp().open(remote, "rb") as fh:
                return fh.read(limit)
        return self._sftp_call("reading", read)

    def remove(self, remote: str) -> None:
        self._sftp_call("removing a file", self.sftp().remove, remote)

    def rmdir(self, remote: str) -> None:
        self._sftp_call("removing a folder", self.sftp().rmdir, remote)

    def close(self) -> None:
        try:
            if self._sftp is not None:
                self._sftp.close()
        except Exception:
            pass
        self.client.close()
