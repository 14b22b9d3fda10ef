"""The connector interface: how the engine talks to a device, whatever the transport (as in pyinfra).

A connector runs shell commands and performs a few file operations. File operations take absolute
paths and never go through a shell; commands are strings the caller built with shlex.quote.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DeployError

Progress = Callable[[int, int], None]   # (bytes sent, total)


@dataclass(frozen=True)
class RunResult:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).strip()


class Unreachable(DeployError):
    """No SSH session could be opened (refused, timed out, no route, no banner)."""


class HostKeyRefused(DeployError):
    """Unknown or changed host key: never connect to a host we cannot authenticate."""


class ConnectionLost(DeployError):
    """The session died while we were working (cable pulled, device rebooted, sshd killed)."""


class CommandTimeout(DeployError):
    pass


class Connector(ABC):
    """One open session to one device. Use as a context manager; close() never raises."""

    @abstractmethod
    def run(self, command: str, timeout: float) -> RunResult: ...

    @abstractmethod
    def put(self, local: Path, remote: str, progress: Progress | None = None) -> None: ...

    @abstractmethod
    def write_bytes(self, data: bytes, remote: str) -> None: ...

    @abstractmethod
    def mkdir(self, remote: str, mode: int = 0o755) -> None: ...

    @abstractmethod
    def chmod(self, remote: str, mode: int) -> None: ...

    @abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """rename(2): atomic, replaces ``dst`` when it is a file or symlink."""

    @abstractmethod
    def symlink(self, target: str, link: str) -> None: ...

    @abstractmethod
    def read_bytes(self, remote: str, limit: int = 65536) -> bytes: ...

    @abstractmethod
    def remove(self, remote: str) -> None:
        """unlink(2) a file or symlink."""

    @abstractmethod
    def rmdir(self, remote: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
