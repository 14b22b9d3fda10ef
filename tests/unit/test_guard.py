"""The unit tier's guard itself: it must really refuse processes and connections.
(AssertionError is an AssertionError; matched by its message.)"""
import os
import socket
import subprocess

import pytest



def test_subprocess_is_refused():
    with pytest.raises(AssertionError, match="start a process"):
        subprocess.run(["true"])


def test_os_system_is_refused():
    with pytest.raises(AssertionError):
        os.system("true")


def test_network_is_refused():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(AssertionError, match="network"):
            s.connect(("127.0.0.1", 9))
    finally:
        s.close()
    with pytest.raises(AssertionError):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
