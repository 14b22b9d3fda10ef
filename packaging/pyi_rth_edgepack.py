"""PyInstaller run-time hook for the frozen edgepack (runs before edgepack is imported).

The one-file bootloader points LD_LIBRARY_PATH at its extraction folder so the bundled Python finds
its own libraries. edgepack's children (zig, cmake, ninja, qemu-aarch64, llvm-strip, pnnx, the built
artifacts) are host programs and must see the host's libraries, so the original value is restored
for them; the already-running interpreter keeps what it loaded.
"""
import os

_orig = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
if _orig is None:
    os.environ.pop("LD_LIBRARY_PATH", None)
else:
    os.environ["LD_LIBRARY_PATH"] = _orig
