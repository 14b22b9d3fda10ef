"""The artifact's image path (our strict PNG/JPEG/PNM checks, then Debian's stb_image) survives
mutated images under AddressSanitizer + UBSan, for a bounded ~25 s."""
from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np

from edgepack.bundle import STB_INCLUDE_DIR
from edgepack.resources import runtimes_dir

FUZZ = Path(__file__).parent / "fuzz"


def build_image_fuzzer(out: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a host C compiler is needed (apt-get install gcc)"
    assert (STB_INCLUDE_DIR / "stb_image.h").is_file(), "apt-get install libstb-dev"
    common = runtimes_dir() / "common"
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{common}",
                    f"-I{STB_INCLUDE_DIR}", str(FUZZ / "image_fuzz.c"), str(common / "ep_image.c"),
                    str(common / "ep_util.c"), "-lm", "-o", str(out)], check=True)
    return out


def image_seeds(d: Path) -> list[Path]:
    """Small valid images of every accepted kind, plus the exact inputs of issue #11."""
    from PIL import Image
    d.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(1).integers(0, 256, (12, 16, 3)).astype(np.uint8)
    out = {}

    def save(name, im, fmt, **kw):
        b = io.BytesIO()
        im.save(b, format=fmt, **kw)
        out[name] = b.getvalue()

    save("rgb.png", Image.fromarray(img), "PNG")
    save("grey.png", Image.fromarray(img[..., 0]), "PNG")
    save("palette.png", Image.fromarray(img).convert("P"), "PNG")
    save("rgba_interlaced.png", Image.fromarray(img).convert("RGBA"), "PNG", interlace=1)
    save("baseline.jpg", Image.fromarray(img), "JPEG", quality=90)
    save("progressive.jpg", Image.fromarray(img), "JPEG", quality=80, progressive=True)
    save("grey.jpg", Image.fromarray(img[..., 0]), "JPEG", quality=90)
    save("subsampled.jpg", Image.fromarray(np.repeat(np.repeat(img, 2, 0), 2, 1)), "JPEG", quality=70,
         subsampling=2)
    out["rgb.ppm"] = b"P6\n# a comment\n16 12\n255\n" + img.tobytes()
    out["grey.pgm"] = b"P5 16 12 255\n" + img[..., 0].tobytes()
    out["issue11-16bit.pgm"] = b"P5\n2048 2048\n65535\n"
    out["issue11-header-only.ppm"] = b"P6\n64 64\n255\n"
    paths = []
    for name, data in out.items():
        (d / name).write_bytes(data)
        paths.append(d / name)
    return paths


def test_image_checks_and_decoder_survive_fuzzing_under_asan(tmp_path):
    exe = build_image_fuzzer(tmp_path / "image_fuzz")
    seeds = image_seeds(tmp_path / "seeds")
    (tmp_path / "crashes").mkdir()
    proc = subprocess.run([str(exe), "25s", *map(str, seeds)], capture_output=True, text=True, timeout=300,
                          env={"EP_FUZZ_CRASH_DIR": str(tmp_path / "crashes"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
    fuzzed = int(proc.stdout.split("fuzzed ")[1].split()[0])
    decoded = int(proc.stdout.split("decoded ")[1].split(",")[0])
    assert fuzzed >= 5000, proc.stdout  # it really ran (tens of thousands a second on an idle core)
    assert decoded >= 2 * 10, proc.stdout  # every valid seed decodes (1 and 3 channels), and mutants too
    assert not list((tmp_path / "crashes").iterdir())
