"""The exact-text edits edgepack makes to the pinned ncnn source refuse a source they do not fit."""
from __future__ import annotations

import pytest

from edgepack.backends.ncnn.lstm_patch import _EDITS as LSTM_EDITS
from edgepack.backends.ncnn.source_patch import apply_edits
from edgepack.errors import BuildError


def test_edit_applies_when_the_text_occurs_as_often_as_expected(tmp_path):
    f = tmp_path / "a.cpp"
    f.write_text("x = 1;\ny = 1;\n")
    apply_edits(f, (("the ones", " = 1;", " = 2;", 2),), "some_patch.py")
    assert f.read_text() == "x = 2;\ny = 2;\n"


@pytest.mark.parametrize("text", ["x = 1;\n", "x = 1;\ny = 1;\nz = 1;\n"])
def test_edit_refuses_a_changed_source_and_leaves_it_alone(tmp_path, text):
    f = tmp_path / "a.cpp"
    f.write_text(text)
    with pytest.raises(BuildError) as exc:
        apply_edits(f, (("the ones", " = 1;", " = 2;", 2),), "some_patch.py")
    assert "expected 2 copy(ies) of the ones" in exc.value.message and str(f) in exc.value.message
    assert "update edgepack/backends/ncnn/some_patch.py" in exc.value.hint
    assert f.read_text() == text


def test_lstm_edits_replace_every_bias_load_of_the_step_loop():
    # each step must start from the precomputed input gates: no step may still load the bias itself
    new_text = "".join(new for _, _, new, _ in LSTM_EDITS)
    assert "_mm256_loadu_ps(bias_c_IFOG)" not in new_text and "_mm_loadu_ps(bias_c_IFOG)" not in new_text
    olds = [old for _, old, _, _ in LSTM_EDITS]
    assert "            __m256 _IFOG = _mm256_loadu_ps(bias_c_IFOG);\n" in olds
    assert "            __m128 _IFOG = _mm_loadu_ps(bias_c_IFOG);\n" in olds


def test_the_cache_key_follows_the_text_of_the_edits_not_only_their_version():
    # a patch edited without a version bump once reused the library built from the old text
    from edgepack.backends.ncnn.source_patch import _EDITS, PATCH_KEY, PATCH_VERSION, edits_digest
    assert PATCH_KEY == f"{PATCH_VERSION}-{edits_digest(_EDITS)}"
    what, old, new, count = _EDITS[0]
    changed = ((what, old, new.replace("200000L", "100000L"), count),) + tuple(_EDITS[1:])
    assert new != changed[0][2] and edits_digest(changed) != edits_digest(_EDITS)
    assert edits_digest(_EDITS, LSTM_EDITS) != edits_digest(_EDITS)


def test_exact_division_edits_leave_no_reciprocal_prone_division():
    # every division the functors do is under EP_EXACT_DIV and on the operator (an intrinsic's own
    # body is compiled under -ffast-math, out of the pragma's reach); aarch64 vectors too
    from edgepack.backends.ncnn.exact_div_patch import _ARM_EDITS, _GENERIC_EDITS, _X86_EDITS
    x86_new = "".join(new for _, _, new, _ in _X86_EDITS)
    assert "_div_ps" not in x86_new
    assert x86_new.count("EP_EXACT_DIV\n        return x / y;") == 4
    assert x86_new.count("EP_EXACT_DIV\n        return y / x;") == 4
    assert "".join(new for _, _, new, _ in _GENERIC_EDITS).count("EP_EXACT_DIV\n        return") == 2
    arm_new = "".join(new for _, _, new, _ in _ARM_EDITS)
    assert "vdivq_f32" not in arm_new and arm_new.count("ep_exact_div(x, y), ep_exact_div(x, y)") == 1
    assert 'float_control(precise, on)' in x86_new


def test_every_arch_keys_the_exact_division_and_the_load_reuse():
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.exact_div_patch import EXACT_DIV_PATCH_KEY
    from edgepack.backends.ncnn.load_reuse_patch import LOAD_REUSE_PATCH_KEY
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    for name in ("x86_64", "arm64"):
        patches = {key_name: key for key_name, key, _ in library._arch_patches(matrix.get(name))}
        assert patches["exact_div_patch"] == EXACT_DIV_PATCH_KEY, name
        assert patches["load_reuse_patch"] == LOAD_REUSE_PATCH_KEY, name  # the runtime calls ep_ncnn_load_reuse
        assert "shared_weights_patch" in patches, name   # x86 and Arm each key their own edits


def test_the_shared_kernel_table_has_no_start_up_constructor():
    # innerproduct_x86.cpp is also compiled as its AVX-512 build; a namespace-scope object with a
    # constructor runs that build's code at start-up on every CPU (it trapped under qemu's Nehalem)
    from edgepack.backends.ncnn.shared_weights_patch import _TABLE
    top_level = [line for line in _TABLE.splitlines() if line.startswith("static ")]
    assert top_level and all(line.rstrip().endswith(")") for line in top_level), top_level
    assert "    static std::vector<EpSharedKernel> table;" in _TABLE and "    static Mutex lock;" in _TABLE


def test_load_reuse_changes_nothing_unless_a_load_is_in_progress():
    # fastMalloc/fastFree are inline in every ncnn file: with the flag off they must be ncnn's own calls
    from edgepack.backends.ncnn.load_reuse_patch import _FREE_NEW, _HEADER_DECLS, _MALLOC_NEW, _SOURCE_DEFS
    assert "#define EP_REUSE_MIN ((size_t)1 << 20)" in _HEADER_DECLS  # one threshold, the header's
    assert "if (g_ep_load_reuse && size >= EP_REUSE_MIN" in _MALLOC_NEW and "EP_REUSE_MIN (" not in _SOURCE_DEFS
    assert "if (!g_ep_load_reuse || !ep_reuse_keep(ptr))\n            free(ptr);" in _FREE_NEW
    # kept blocks are freed when the load ends, and the slots are built on first use (no start-up code)
    assert "    static EpReuseSlots s;" in _SOURCE_DEFS and "ncnn::ep_reuse_drain(s);" in _SOURCE_DEFS
    assert not [line for line in _SOURCE_DEFS.splitlines() if line.startswith("static ") and line.endswith(";")]


def test_fp16_weights_patch_is_x86_only_and_applies_after_the_edits_it_extends():
    # its modelbin edit extends load_reuse_patch's read buffer, its InnerProduct edits the shared-kernel
    # code of shared_weights_patch: applied before them, its anchors would not exist
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.fp16_weights_patch import FP16_WEIGHTS_PATCH_KEY, _MB_WIDEN_NEW, _IP_LOAD_NEW
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    x86 = [name for name, _, _ in library._arch_patches(matrix.get("x86_64"))]
    assert x86.index("fp16_weights_patch") > max(x86.index("load_reuse_patch"), x86.index("shared_weights_patch"))
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["fp16_weights_patch"] == FP16_WEIGHTS_PATCH_KEY
    assert "fp16_weights_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    # the read buffer is handed over only when InnerProduct_x86 asks; int8-scaled layers load as before
    assert "if (d->ep_keep_fp16)" in _MB_WIDEN_NEW and "Mat::from_float16(&float16_weights[0], w);" in _MB_WIDEN_NEW
    assert "if (int8_scale_term)\n        return InnerProduct::load_model(mb);" in _IP_LOAD_NEW
    # Gemm: only a large, transposed, unquantised constant B is kept in fp16 (the layout pnnx writes)
    from edgepack.backends.ncnn.fp16_weights_patch import _GEMM_LOAD_NEW, _GEMM_PACK_NEW
    assert "if (constantB != 1 || transB != 1 || weight_block_quantize || quantize_term" in _GEMM_LOAD_NEW
    assert "#define EP_GEMM_KEEP_FP16_MIN (1 << 19)" in _GEMM_LOAD_NEW
    assert "ep_widen_fp16_block(B_data, K, j, max_jj, k, max_kk, block);" in _GEMM_PACK_NEW


def test_int8_gemm_patch_is_x86_only_and_comes_after_the_fp16_weights():
    # its packing reads B as fp16_weights_patch leaves it (fp16 or fp32), so it must apply after it
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.int8_gemm_patch import INT8_GEMM_PATCH_KEY, MARK_KEY, _KERNEL, _PACK_NEW
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    x86 = dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))
    assert list(x86).index("int8_gemm_patch") > list(x86).index("fp16_weights_patch")
    assert x86["int8_gemm_patch"] == INT8_GEMM_PATCH_KEY
    assert "int8_gemm_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    # taken only where the sums cannot overflow int32 and the CPU can run vpmaddwd, and only when marked
    assert "constantK <= 32768" in _PACK_NEW and "cpu_support_x86_avx2()" in _PACK_NEW and "ep_mark == 1" in _PACK_NEW
    assert "if (!(v >= -255.f && v <= 255.f) || v != (float)(int)v)\n                return 0;" in _KERNEL
    # both passes (the range on VNNI CPUs, then the packing) go through the one block packer
    assert _PACK_NEW.count("ep_pack_block(B_data, N, K, K2, nb, ") == 2
    assert MARK_KEY not in range(0, 23) and MARK_KEY < 30   # Gemm reads keys 0-22; 30-31 are the Layer's


def test_dw_block_patch_keys_each_arch_on_its_own_loops_and_sums_each_pixel_in_ncnn_order():
    from edgepack.backends.ncnn import dw_block_patch as dw, library
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["dw_block_patch"] == dw.DW_BLOCK_PATCH_KEY
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("arm64")))["dw_block_patch"] == dw.DW_BLOCK_ARM_PATCH_KEY
    assert dw.DW_BLOCK_PATCH_KEY != dw.DW_BLOCK_ARM_PATCH_KEY
    for text, lanes, madd in ((dw._PACK16_NEW, 16, "_mm512_fmadd_ps"), (dw._PACK8_NEW, 8, "_mm256_comp_fmadd_ps"),
                              (dw._PACK4_NEW, 4, "_mm_add_ps(_mm_mul_ps"), (dw._ARM_FP32_NEW, 4, "vmlaq_f32"),
                              (dw._ARM_FP16S_NEW, 4, "vfmaq_f32"), (dw._ARM_FP16SA8_NEW, 8, "vfmaq_f16"),
                              (dw._ARM_FP16SA4_NEW, 4, "vfma_f16")):
        # every sum starts from the bias and takes the taps in order, one multiply-add each
        for s in range(8):
            assert f"_s{s} = {madd}(" in text
            assert f"(p + sstep * {s})" in text and f"_s{s} = _b;" in text
        assert "for (int k = 0; k < maxk; k++)" in text and "for (; j + 7 < outw; j += 8)" in text
        assert "for (; j + 3 < outw; j += 4)" in text and f"kptr + k * {lanes}" in text
        assert text.count("for (; j < outw; j++)") == 1    # the pixels left take ncnn's loop
    assert dw._PACK4_NEW.count("activation_sse(") == 12      # the 4-lane loop's fused activation, on all 8 + 4 sums
    assert "outptr += 8 * 16;" in dw._PACK16_NEW and "outptr += 4 * 16;" in dw._PACK16_NEW
    assert dw._ARM_FP16SA8_NEW.count("activation_ps_f16(") == 12 and dw._ARM_FP32_NEW.count("activation_ps(") == 12


def test_gelu_erf_coefficients_hold_erf_to_fp32_rounding():
    # the rational erf of gelu_erf_patch.py, checked against math.erf: in exact arithmetic, and
    # evaluated in fp32 as the kernel does (Horner, then one division), over the whole clamp range
    import math

    import numpy as np

    from edgepack.backends.ncnn.gelu_erf_patch import ERF_P, ERF_Q
    y = np.linspace(-4.0, 4.0, 80001)
    want = np.array([math.erf(v) for v in y])
    t = y * y
    exact = y * np.polyval(ERF_P[::-1], t) / np.polyval(ERF_Q[::-1], t)
    assert float(np.abs(exact - want).max()) < 5e-8                # half a unit in the last place of 1
    y32, t32 = y.astype(np.float32), (y * y).astype(np.float32)
    p, q = np.float32(ERF_P[-1]), np.float32(ERF_Q[-1])
    for c in ERF_P[-2::-1]:
        p = p * t32 + np.float32(c)
    for c in ERF_Q[-2::-1]:
        q = q * t32 + np.float32(c)
    got = (y32 * p / q).astype(np.float64)
    assert float(np.abs(got - want).max()) < 6e-7                 # a few units in the last place of 1
    assert math.erf(4.0) > 1 - 2 ** -24 * 0.5                      # past the clamp, erf rounds to 1 in fp32


def test_gelu_erf_patch_is_x86_only_and_replaces_every_vector_erf():
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.gelu_erf_patch import _EDITS, GELU_ERF_PATCH_KEY
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["gelu_erf_patch"] == GELU_ERF_PATCH_KEY
    assert "gelu_erf_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    helpers = _EDITS[0][2]
    assert helpers.count("static NCNN_FORCEINLINE") == 3
    for name in ("ep_erf_ps", "ep_erf256_ps", "ep_erf512_ps"):
        assert f" {name}(" in helpers
        assert any(new.endswith(f"= {name}(") for _, _, new, _ in _EDITS[1:])
    assert helpers.count("_div_ps(") == 3 and not any(f"{e}(" in helpers for e in ("exp_ps", "exp256_ps", "exp512_ps"))


def test_gemm_pair_patch_is_x86_only_and_sums_each_output_as_ncnn_does():
    from edgepack.backends.ncnn import gemm_pair_patch as gp, library
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["gemm_pair_patch"] == \
        gp.GEMM_PAIR_PATCH_KEY
    assert "gemm_pair_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    text = gp._LOOP_NEW
    assert text.startswith(gp._LOOP_OLD.split("\n")[0]) and text.endswith(gp._LOOP_OLD.split("\n", 1)[1])
    for c in range(6):
        # one FMA per k for each output, onto its start: zero or the bias, else the tile's partial sum
        assert text.count(f"_s0{c} = _mm256_comp_fmadd_ps(_pA0, _pB, _s0{c});") == 1
        assert text.count(f"_s1{c} = _mm256_comp_fmadd_ps(_pA1, _pB, _s1{c});") == 1
        assert f"_s0{c} = _c0;" in text and f"_s1{c} = _c1;" in text
        assert f"_s1{c} = _mm256_load_ps(outptr_next + 8 * (h + {c}));" in text
    assert text.count("_mm256_comp_fmadd_ps(") == 12 and "[" not in text.split("for (int kk")[1].split("pA += 8")[0].replace(
        "pBh[", "")  # named registers in the inner loop, no arrays
    # the panel below skips exactly the blocks summed with it
    assert "jj = ep_blocks * 12;" in text and "outptr += ep_blocks * 96;" in text and "pB += ep_blocks * 12 * max_kk;" in text


def test_gemm_pair16_patch_is_x86_only_after_the_avx2_pairs_and_covers_each_column_once():
    from edgepack.backends.ncnn import gemm_pair16_patch as gp, library
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    names = [n for n, _, _ in library._arch_patches(matrix.get("x86_64"))]
    assert names.index("gemm_pair16_patch") == names.index("gemm_pair_patch") + 1  # its anchors hold that one's text
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["gemm_pair16_patch"] == \
        gp.GEMM_PAIR16_PATCH_KEY
    assert "gemm_pair16_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    # a 48-column span: four 12-column groups, each first column at its block's offset
    span = [line.strip() for line in gp._HELPERS_NEW.split("jj + 47 < n16; jj += 48)")[1].split("}")[0].splitlines()
            if "EP_PAIR16_BLOCK(" in line]
    cols = []
    for line in span:
        nc, offset, col = (part.strip() for part in line.split("(", 1)[1].rstrip(");").split(",", 2))
        start = sum(int(n) for n in col.replace("jj", "").split("+") if n.strip())  # "jj + 12": 12 on
        assert start % 16 == int(offset)
        cols += range(start, start + int(nc))
    assert cols == list(range(48))
    # one FMA per k for each output, onto its start (zero, the bias, or the tile's partial sum), in k order
    kernel = gp._HELPERS_NEW.split("void ep_pair16_block(")[1]
    assert kernel.count("_mm512_fmadd_ps(") == 2 and "s0[c] = k != 0 ? _mm512_load_ps(sum0 + 16 * c) : colC ?" in kernel
    # the panel below skips exactly the columns summed with it, in both GEMMs
    for text in (gp._LOOP_NEW, gp._WG_PANEL_NEW, gp._GEMM_LOOP_NEW):
        assert "jj = ep_n16;" in text and "pB += ep_n16 * max_kk;" in text and "outptr += ep_n16 * 16;" in text


def test_int8_gemv_patch_is_x86_only_after_the_kernels_it_shares_and_marks_only_centred_inputs():
    # it reads weights as fp16_weights_patch leaves them and shares through shared_weights_patch's table
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.int8_gemv_patch import INT8_GEMV_PATCH_KEY, MARK_KEY, _CODE, mark_integer_gemvs
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    x86 = list(dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64"))).items())
    names = [n for n, _ in x86]
    assert names.index("int8_gemv_patch") > max(names.index("fp16_weights_patch"), names.index("shared_weights_patch"))
    assert dict(x86)["int8_gemv_patch"] == INT8_GEMV_PATCH_KEY
    assert "int8_gemv_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    # int8 weights only (the range first: no int conversion of a float past int's), VNNI or AVX2 CPUs,
    # no bias; the AVX2 kernel in every AVX build, the VNNI one only in the AVX-512 build
    assert "if (!(v >= -128.f && v <= 127.f) || v != (float)(int)v)" in _CODE
    assert "cpu_support_x86_avx512_vnni() ? 2 : cpu_support_x86_avx2() ? 1 : 0" in _CODE
    assert "if (!isa || bias_term || activation_type || int8_scale_term || num_output % 16)" in _CODE
    assert _CODE.index("#if __AVX__") < _CODE.index("#if __AVX512F__") < _CODE.index("ep_gemv_block_avx2")
    assert MARK_KEY not in range(0, 19) and MARK_KEY < 30   # InnerProduct reads 0-18; 30-31 are the Layer's
    param = ("7767517\n6 8\nInput in0 0 1 in0\n"
             "EpDynQuant dq 1 3 in0 c s z\n"
             "Split sp 1 2 c c0 c1\n"
             "Reshape r 1 1 c0 c2 0=512\n"
             "InnerProduct ip 1 1 c2 y 0=2048 1=0 2=1048576\n"
             "InnerProduct other 1 1 c1 y2 0=2048 1=0 2=1048576\n")
    text, n = mark_integer_gemvs(param)
    lines = {line.split()[1]: line for line in text.splitlines()[2:]}
    assert n == 1 and lines["ip"].endswith(f"{MARK_KEY}=1") and f"{MARK_KEY}=" not in lines["other"]
    assert mark_integer_gemvs(param.replace("EpDynQuant", "Quantize")) == (param.replace("EpDynQuant", "Quantize"), 0)


def test_flush_denormals_patch_is_x86_only_and_hands_the_bits_to_workers():
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.flush_denormals_patch import _FILE_EDITS, FLUSH_DENORMALS_PATCH_KEY
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    x86 = dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))
    assert x86["flush_denormals_patch"] == FLUSH_DENORMALS_PATCH_KEY
    assert "flush_denormals_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    edits = dict(_FILE_EDITS)
    # all three SSE3 guards of cpu.cpp (the include, get and set), and both forks of simpleomp
    assert [e[3] for e in edits["src/cpu.cpp"]] == [3]
    omp = {e[0]: e for e in edits["src/simpleomp.cpp"]}
    assert omp["forks record them"][3] == 2 and "_mm_getcsr() & EP_CSR_DAZ_FTZ" in omp["forks record them"][2]
    assert "_mm_setcsr(" in omp["workers take them"][2]


def test_binaryop_inplace_patch_keys_each_arch_and_checks_who_holds_the_input():
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.binaryop_inplace_patch import (_FILE_EDITS, BINARYOP_INPLACE_ARM_PATCH_KEY,
                                                               BINARYOP_INPLACE_PATCH_KEY)
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    x86 = [name for name, _, _ in library._arch_patches(matrix.get("x86_64"))]
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("x86_64")))["binaryop_inplace_patch"] == \
        BINARYOP_INPLACE_PATCH_KEY
    # after thread_split_patch, which edits the same file's loops
    assert x86.index("binaryop_inplace_patch") > x86.index("thread_split_patch")
    assert dict((n, k) for n, k, _ in library._arch_patches(matrix.get("arm64")))["binaryop_inplace_patch"] == \
        BINARYOP_INPLACE_ARM_PATCH_KEY
    (path, edits), = _FILE_EDITS
    top = {e[0]: e for e in edits}["the output over a dying input"][2]
    # light mode only, one or two holders only, and never memory without a count
    assert "opt.lightmode && (ep_refs == 1 || ep_refs == 2)" in top and "A.refcount ? *A.refcount : 0" in edits[0][2]
