"""The unit tier: pure Python, no compiler, qemu, sshd, TVM or network. It runs in well under a minute
(`python3 -m pytest -q tests/unit`). An autouse fixture turns any attempt to start a process or open a
network connection into a test failure, so a slow or environment-dependent test cannot creep in."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ helpers (models.py)


class ForbiddenInUnitTier(AssertionError):
    pass


def _refuse(what):
    def refuse(*args, **kwargs):
        raise ForbiddenInUnitTier(f"the unit tier may not {what}: move this test to the integration tier")
    return refuse


@pytest.fixture(autouse=True)
def no_processes_or_network(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
    for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp", "execvpe"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse("start a process"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("open a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("open a network connection"))
    monkeypatch.setattr(socket, "create_connection", _refuse("open a network connection"))
    monkeypatch.setattr(socket, "getaddrinfo", _refuse("resolve a host name"))
    yield
