"""A real OCI registry for tests and benchmarks: Debian's docker-registry on 127.0.0.1:<free port>, with
its own config file and storage folder (the system service is never used), optionally with htpasswd auth."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """docker-registry serving one folder on 127.0.0.1:<free port>; never the system service."""

    def __init__(self, root: Path, htpasswd: Path | None = None):
        exe = shutil.which("docker-registry")
        assert exe, "docker-registry is not installed: run .ci/deps-oci.sh"
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        auth = f"auth:\n  htpasswd:\n    realm: edgepack-test\n    path: {htpasswd}\n" if htpasswd else ""
        cfg = root / "config.yml"
        cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
                       f"http:\n  addr: {self.host}\n{auth}")
        self.log = open(root / "registry.log", "w")
        self.proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                return
            except urllib.error.HTTPError:   # 401 with auth: it answers
                return
            except OSError:
                assert self.proc.poll() is None, (root / "registry.log").read_text()
                time.sleep(0.1)
        raise AssertionError("docker-registry did not start within 20 s")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
