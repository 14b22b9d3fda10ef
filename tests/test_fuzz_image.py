"""The artifact's image path (our strict PNG/JPEG/PNM checks, then Debian's stb_image) survives
mutated images under AddressSanitizer + UBSan, for a bounded ~25 s."""
from __future__ import annotations

import io
import subprocess
from pathlib import Path

import numpy as np

from fuzz_targets import build_fuzzer, sanitizer_findings, write_seeds


def image_seeds(d: Path) -> list[Path]:
    """Small valid images of every accepted kind, plus the exact inputs of issue #11."""
    from PIL import Image
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
    return write_seeds(d, out.items())


def test_image_checks_and_decoder_survive_fuzzing_under_asan(tmp_path):
    exe = build_fuzzer("image", tmp_path)
    seeds = image_seeds(tmp_path / "seeds")
    (tmp_path / "crashes").mkdir()
    proc = subprocess.run([str(exe), "25s", *map(str, seeds)], capture_output=True, text=True, timeout=300,
                          env={"EP_FUZZ_CRASH_DIR": str(tmp_path / "crashes"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not sanitizer_findings(proc.stderr), proc.stderr[-3000:]
    fuzzed = int(proc.stdout.split("fuzzed ")[1].split()[0])
    decoded = int(proc.stdout.split("decoded ")[1].split(",")[0])
    assert fuzzed >= 5000, proc.stdout  # it really ran (tens of thousands a second on an idle core)
    assert decoded >= 2 * 10, proc.stdout  # every valid seed decodes (1 and 3 channels), and mutants too
    assert not list((tmp_path / "crashes").iterdir())
