"""No module uses a name it never defined or imported (pyflakes). Such a name fails only when its line
runs: a cache-hit stamp in edgepack/backends/ncnn/convert.py once raised NameError on every reused
conversion while every test that converted a model afresh passed."""
from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

REPO = Path(__file__).resolve().parents[2]


class _Collect(reporter.Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message):
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 (pyflakes' name)
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def test_no_undefined_names_in_the_package_bench_and_tests():
    collect = _Collect()
    files = [p for d in ("edgepack", "bench", "tests", ".ci") for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 100
    for path in files:
        api.checkPath(str(path), collect)
    assert not collect.found, "\n".join(collect.found)
