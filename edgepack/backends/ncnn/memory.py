"""`--memory lean`: Winograd only where its transformed kernels are small (issue 10 item 5).

ncnn's x86 and Arm 3x3 stride-1 convolutions run as Winograd F(6,3)/F(4,3) and keep the transformed
kernels, 64/9 or 36/9 times the layer's fp32 weights, for the life of the net. On nudenet_320n
(YOLOv8n-class) that is 27.7 MB of kernels for 12 MB of fp32 weights, the largest share of the
artifact's peak RSS. The layers with the largest kernels are the deep ones (many channels, small
feature maps), where Winograd also gains the least; ncnn's per-layer feature mask (param key 31,
bit 6) turns Winograd off for one layer, which then runs as im2col + sgemm on its plain weights.

On x86 the bit also hands a layer to the direct kernel (direct_conv_patch.py) wherever that kernel
can run it (3x3 at stride 1 or 2, 1x1 and 2x2 at stride 1, output channels a multiple of 8), whatever the
break-even: it needs no transformed kernel and no im2col or GEMM workspace, and keeps its weights as
fp16 when they convert exactly (as pnnx stores them). nudenet_320n: peak RSS 0.96 of the model's
need (2.09 before; `fast` 2.55), for 12% of speed on 1 thread and none on 2 (docs/backends.md, Memory).

(A Gemm whose large constant B was stored in fp16 keeps its packed tiles in fp16 in both modes:
gemm_fp16_b_patch.py; lean had marked Gemms for it with featmask bit 9 until it cost no speed.)

The .param is the build's own pnnx output; this only sets featmask bits (`31=`) on chosen lines.
"""
from __future__ import annotations

from pathlib import Path

MODES = ("fast", "lean")
NO_WINOGRAD = 1 << 6          # ncnn get_masked_option: featmask bit 6 masks use_winograd_convolution
INTEGER_SUMS = 1 << 8         # edgepack's own: sums integers, may take Winograd F(2,3) (integer_winograd_patch.py, x86)
KERNEL_LIMIT = 1 << 20        # bytes of transformed kernel above which a layer runs without Winograd


def _geometry(fields: dict[str, str]) -> dict[str, int]:
    """A Convolution line's numbers, with ncnn's defaults (Convolution::load_param): output channels,
    kernel, dilation and stride per axis, weight count, dynamic weights and int8 flags."""
    def num(key: str, default: int) -> int:
        return int(fields.get(key, default))
    kw, dw, sw = num("1", 1), num("2", 1), num("3", 1)
    return {"cout": num("0", 0), "kw": kw, "kh": num("11", kw), "dw": dw, "dh": num("12", dw), "sw": sw,
            "sh": num("13", sw), "wsize": num("6", 0), "dynamic": num("19", 0), "int8": num("8", 0)}


def winograd_bytes(fields: dict[str, str]) -> tuple[int, int]:
    """(bytes of the Winograd kernel ncnn would keep for this Convolution, 0 where it uses none;
    bytes of its plain fp32 weights).
    pnnx writes no shape hints, so ncnn takes its dynamic-shape choice: F(6,3) when both channel
    counts are <= 32, F(4,3) otherwise (convolution_x86.cpp / convolution_arm.cpp, create_pipeline)."""
    g = _geometry(fields)
    cout, wsize = g["cout"], g["wsize"]
    if g["dynamic"] or cout <= 0 or (g["kw"], g["kh"], g["dw"], g["dh"], g["sw"], g["sh"]) != (3, 3, 1, 1, 1, 1):
        return 0, wsize * 4
    cin = wsize // 9 // cout
    if cin <= 8 and cout <= 8:
        return 0, wsize * 4
    tiles = 64 if cin <= 32 and cout <= 32 else 36
    return cin * cout * tiles * 4, wsize * 4


def direct_kernel_takes(fields: dict[str, str]) -> bool:
    """Whether the x86 direct kernel (direct_conv_patch.py, `ep_c3_wanted`) runs this Convolution in
    lean mode: fp32 weights in the file, dilation 1, equal strides, output channels a multiple of 8,
    3x3 at stride 1 or 2, or 1x1 or 2x2 at stride 1."""
    g = _geometry(fields)
    kw, kh, sw = g["kw"], g["kh"], g["sw"]
    if g["dynamic"] or g["int8"] or g["cout"] <= 0 or g["cout"] % 8 or (g["dw"], g["dh"]) != (1, 1) or sw != g["sh"]:
        return False
    return (kw, kh) == (3, 3) and sw in (1, 2) or kw == kh and kw <= 2 and sw == 1


def lean_param(text: str, limit: int = KERNEL_LIMIT, direct: bool = False,
               integer: bool = False) -> tuple[str, list[str], int]:
    """(param text with Winograd masked on layers whose kernel exceeds `limit`, and with `direct` (x86)
    on every layer the direct kernel takes; the masked convolutions' names; bytes of Winograd kernel
    saved). `integer`:
    the masked layers are also marked INTEGER_SUMS; otherwise a masked layer loses that mark (lean
    mode's mask is for memory, and F(2,3) keeps a transformed kernel too)."""
    out, masked, saved = [], [], 0
    for line in text.splitlines():
        t = line.split()
        if len(t) > 4 and t[0] == "Convolution" and t[2].isdigit() and t[3].isdigit():
            head = 4 + int(t[2]) + int(t[3])
            fields = dict(kv.split("=", 1) for kv in t[head:] if "=" in kv and not kv.startswith("-"))
            mask = int(fields.get("31", 0))
            size, plain = winograd_bytes(fields)
            if size > limit or direct and direct_kernel_takes(fields):
                mask |= NO_WINOGRAD
                line = _with_featmask(t, head, mask | INTEGER_SUMS if integer else mask & ~INTEGER_SUMS)
                masked.append(t[1])
                saved += size - plain if size else 0
        out.append(line)
    return "\n".join(out) + "\n", masked, saved


def _with_featmask(t: list[str], head: int, mask: int) -> str:
    """A .param line (its tokens; its fields start at ``head``) with its featmask (key 31) set to ``mask``."""
    rest = [kv for kv in t[head:] if not kv.startswith("31=")]
    return " ".join(t[:head] + rest + [f"31={mask}"])


def integer_convolutions(text: str) -> str:
    """The param text with every Convolution marked as summing integers: Winograd masked (bit 6) and
    INTEGER_SUMS. For graphs whose convolutions sum integers (lowered dynamic int8, QLinearConv), which
    im2col + sgemm and the direct kernel add exactly, as onnxruntime's ConvInteger does; Winograd
    F(6,3)/F(4,3)'s transforms are fractions, and their rounding flipped enough later roundings to move
    ddddocr_old_int8 by 1.3% (0.27% without). F(2,3)'s keep integer sums exact: on x86 the patched
    convolution takes it for INTEGER_SUMS layers (integer_winograd_patch.py); Arm keeps bit 6."""
    return lean_param(text, limit=-1, integer=True)[0]


def apply_memory_mode(engine, mode: str, workdir: Path, arch: str):
    """The engine build for `--memory MODE`: unchanged for `fast` and for anything but a whole-graph
    NCNN build (a partitioned build keeps ncnn's defaults); for `lean`, its .param with Winograd
    masked where the kernel is large (and, on x86_64, where the direct kernel takes the layer), and
    what was masked in the manifest."""
    import dataclasses
    if mode not in MODES:
        raise ValueError(f"memory mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "fast" or engine.backend != "ncnn" or engine.segments:
        return engine
    direct = arch == "x86_64"  # the direct kernel is an x86 patch
    text, masked, saved = lean_param(Path(engine.model_blobs[0]).read_text(), KERNEL_LIMIT, direct)
    workdir.mkdir(parents=True, exist_ok=True)
    param = workdir / "model.lean.param"
    param.write_text(text)
    return dataclasses.replace(
        engine, model_blobs=(param, *engine.model_blobs[1:]),
        manifest={**engine.manifest, "memory": mode, "winograd_masked_layers": masked,
                  "winograd_kernel_bytes_saved": saved,
                  "lean_direct_kernel": direct})
