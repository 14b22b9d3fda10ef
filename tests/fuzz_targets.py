"""The fuzz targets of tests/fuzz/: how each is built under AddressSanitizer + UBSan, and how a run
is judged. Shared by the test_fuzz_*.py tests (bounded runs) and bench/fuzz_long.py (long runs)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from edgepack.bundle import STB_INCLUDE_DIR
from edgepack.resources import runtimes_dir

FUZZ = Path(__file__).parent / "fuzz"
COMMON = runtimes_dir() / "common"

# name -> (runtime sources under runtimes/common, extra include folders); the driver is FUZZ/<name>_fuzz.c
TARGETS: dict[str, tuple[tuple[str, ...], tuple[Path, ...]]] = {
    "image": (("ep_image.c", "ep_util.c"), (STB_INCLUDE_DIR,)),
    "http": (("ep_http.c", "ep_json.c", "ep_csv.c", "ep_util.c"), ()),
    "npy": (("ep_npy.c", "ep_util.c"), ()),
    "detect": (("ep_detect.c", "ep_util.c"), ()),
    # no libncnn: the options parser is apart from the engine so that it can be fuzzed alone
    "ncnn_options": (("ep_util.c",), (runtimes_dir() / "ncnn",)),
}


def host_cc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise AssertionError("a host C compiler is needed (apt-get install gcc)")
    return cc


def build_fuzzer(name: str, out_dir: Path) -> Path:
    """Compile FUZZ/<name>_fuzz.c with the runtime sources it exercises, sanitizers on, any
    sanitizer report fatal (so a finding is a non-zero exit)."""
    sources, includes = TARGETS[name]
    if name == "image" and not (STB_INCLUDE_DIR / "stb_image.h").is_file():
        raise AssertionError("stb_image.h is missing: apt-get install libstb-dev")
    exe = Path(out_dir) / f"{name}_fuzz"
    subprocess.run([host_cc(), "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    f"-I{COMMON}", f"-I{FUZZ}", *(f"-I{d}" for d in includes), str(FUZZ / f"{name}_fuzz.c"),
                    *(str(COMMON / s) for s in sources), "-lm", "-o", str(exe)], check=True)
    return exe


def write_seeds(d: Path, items) -> list[Path]:
    """(file name, bytes) pairs written under d; their paths."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in items:
        (d / name).write_bytes(data)
        paths.append(d / name)
    return paths


def sanitizer_findings(stderr: str) -> bool:
    return "ERROR: AddressSanitizer" in stderr or "runtime error" in stderr


def run_fuzzer(exe: Path, budget: str, seeds, timeout: float = 600, env: dict | None = None) -> str:
    """Run a fuzzer on its seeds for `budget` (mutants per seed, or '25s'); assert it ended cleanly
    with no sanitizer report; return what it printed."""
    proc = subprocess.run([str(exe), budget, *map(str, seeds)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not sanitizer_findings(proc.stderr), proc.stderr[-3000:]
    return proc.stdout
