"""The connector interface on this machine (device `local`): no SSH, same layout and checks."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from .connector import CommandTimeout, Connector, Progress, RunResult


class LocalConnector(Connector):
    def run(self, command: str, timeout: float) -> RunResult:
        t0 = time.monotonic()
        try:
            p = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, errors="replace",
                               timeout=timeout, stdin=subprocess.DEVNULL, cwd=os.path.expanduser("~"))
        except subprocess.TimeoutExpired:
            raise CommandTimeout(f"local: command timed out after {timeout:.0f} s") from None
        return RunResult(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)

    def put(self, local: Path, remote: str, progress: Progress | None = None) -> None:
        total, sent = os.path.getsize(local), 0
        with open(local, "rb") as src, open(remote, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                dst.write(block)
                sent += len(block)
                if progress:
                    progress(sent, total)

    def write_bytes(self, data: bytes, remote: str) -> None:
        Path(remote).write_bytes(data)

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        os.mkdir(remote, mode)

    def chmod(self, remote: str, mode: int) -> None:
        os.chmod(remote, mode)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def symlink(self, target: str, link: str) -> None:
        os.symlink(target, link)

    def read_bytes(self, remote: str, limit: int = 65536) -> bytes:
        with open(remote, "rb") as fh:
            return fh.read(limit)

    def remove(self, remote: str) -> None:
        os.unlink(remote)

    def rmdir(self, remote: str) -> None:
        os.rmdir(remote)

    def close(self) -> None:
        pass

