/* The TVM engine (ep_engine_ops_tvm, see ep_engine_table.h): the model compiled by apache-tvm
 * (relax, system library) is linked in as lib0.o (kernels) + devc.o (VM bytecode and weights),
 * both registering themselves at start-up; this file loads the VM executable from the system
 * library and runs its "main" function.
 *
 * Options from the spec: tvm.entry (function name, default "main"), tvm.outputs (number of
 * outputs the VM returns, as a check). Threads: TVM's own thread pool, sized through
 * TVM_NUM_THREADS before the pool starts (a user's TVM_NUM_THREADS wins). Its idle workers yield
 * SPIN_YIELDS times (~0.5 ms at ~0.5 us a sched_yield) before sleeping, not TVM's 300000 (~170 ms):
 * a worker spinning that long holds a core the ncnn segments of a split artifact want, and the
 * process's exit waits for it (a pure-TVM oww_melspectrogram's `selftest --threads 2`: 0.20 s wall,
 * 0.00 s with 1000). Steady-state latency is the same (0.23-0.26 ms at 2 threads either way). A
 * user's TVM_THREAD_POOL_SPIN_COUNT wins.
 *
 * ISA levels (x86_64): tvm.isa lists extra copies of the kernels, best first, as
 * "x86-64-v4=edgepack_v4_;x86-64-v3=edgepack_v3_" (level=system-lib prefix); tvm.isa_base names
 * the level of the unprefixed kernels. The first level this CPU has (CPUID + the OS saving the
 * vector state) is used; tvm-ffi's SystemLib(prefix) finds the bytecode/weights and any kernel
 * the level lacks under the plain name. EDGEPACK_TVM_ISA=<level> forces a level (refused when the
 * CPU lacks it), EDGEPACK_TVM_ISA=auto only reports the choice; both print it on stderr.
 *
 * tvm.prefix: the system-lib prefix of this model's kernels and bytecode (a partitioned artifact
 * holds several TVM segments; all but the first are compiled with their own prefix, no ISA copies).
 */
/* musl defines no __MUSL__, so tvm-ffi cannot detect endianness alone (as in runtime_lib.DEFINES). */
#ifndef TVM_FFI_CMAKE_LITTLE_ENDIAN
#define TVM_FFI_CMAKE_LITTLE_ENDIAN 1
#endif

#include "ep_engine_table.h"

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/runtime/memory/memory_manager.h>
#include <tvm/runtime/tensor.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

static const char SPIN_YIELDS[] = "1000";  /* TVM_THREAD_POOL_SPIN_COUNT unless the user set one (above) */

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

struct tvm_engine {
    const ep_model_spec *spec;
    ffi::Optional<ffi::Module> vm;   // (Module has no empty state of its own)
    ffi::Optional<ffi::Function> entry;
    // The input tensors, made at the first run and refilled whole at every run after it: a fresh
    // one per run was a fresh mmap of every input above the allocator's threshold, page-faulted in
    // and unmapped again (a 320 KB Where ran 0.15-0.22 ms, 5% of it in the kernel). Runs on one
    // engine never overlap (serve holds its engine lock), so one set per engine is enough.
    std::vector<ffi::Optional<Tensor>> inputs;
};

static char g_describe[160] = "tvm 0.27 relax VM (system library)";

namespace {

const char *tvm_describe(void) { return g_describe; }

/* Whether this CPU runs code compiled for an x86-64 micro-architecture level (the psABI's
 * x86-64-v2/v3/v4 feature lists). Unknown names are "no". */
bool cpu_has_level(const std::string &level) {
#if defined(__x86_64__)
    if (level == "x86-64") return true;
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    const unsigned c1 = c;
    unsigned ext_c = 0;
    if (__get_cpuid(0x80000001, &a, &b, &c, &d)) ext_c = c;
    // SSE3, SSSE3, CX16, SSE4.1, SSE4.2, POPCNT; LAHF/SAHF
    const bool v2 = (c1 & 1u) && (c1 & (1u << 9)) && (c1 & (1u << 13)) && (c1 & (1u << 19)) && (c1 & (1u << 20)) &&
                    (c1 & (1u << 23)) && (ext_c & 1u);
    if (level == "x86-64-v2") return v2;
    if (!v2 || !(c1 & (1u << 27))) return false;  // OSXSAVE: xgetbv is usable
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    unsigned b7 = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) b7 = b;
    // AVX, FMA, F16C, MOVBE; AVX2, BMI1, BMI2; LZCNT; the OS saves XMM+YMM state
    const bool v3 = (c1 & (1u << 28)) && (c1 & (1u << 12)) && (c1 & (1u << 29)) && (c1 & (1u << 22)) &&
                    (b7 & (1u << 5)) && (b7 & (1u << 3)) && (b7 & (1u << 8)) && (ext_c & (1u << 5)) &&
                    (xlo & 0x6u) == 0x6u;
    if (level == "x86-64-v3") return v3;
    // AVX512F, DQ, CD, BW, VL; the OS saves opmask + ZMM state
    const bool v4 = v3 && (b7 & (1u << 16)) && (b7 & (1u << 17)) && (b7 & (1u << 28)) && (b7 & (1u << 30)) &&
                    (b7 & (1u << 31)) && (xlo & 0xe0u) == 0xe0u;
    if (level == "x86-64-v4") return v4;
    return false;
#else
    (void)level;
    return false;
#endif
}

/* The system-lib prefix to load (and the level's name into *level), per tvm.isa; -1 on a
 * forced level this CPU or artifact cannot run. */
int pick_isa(const ep_model_spec *spec, std::string *prefix, std::string *level, ep_status *st) {
    const std::string list = ep_option_get(spec, "tvm.isa", "");
    const std::string base = ep_option_get(spec, "tvm.isa_base", "");
    const char *env = std::getenv("EDGEPACK_TVM_ISA");
    const std::string forced = env && std::strcmp(env, "auto") != 0 ? env : "";
    *prefix = ep_option_get(spec, "tvm.prefix", "");
    *level = base;
    bool found = !forced.empty() && forced == base;
    size_t pos = 0;
    while (pos < list.size()) {
        size_t end = list.find(';', pos);
        if (end == std::string::npos) end = list.size();
        std::string item = list.substr(pos, end - pos);
        pos = end + 1;
        size_t eq = item.find('=');
        if (eq == std::string::npos) continue;
        std::string lv = item.substr(0, eq), px = item.substr(eq + 1);
        if (!forced.empty() ? forced == lv : cpu_has_level(lv)) {
            if (!forced.empty() && !cpu_has_level(lv))
                return ep_fail(st, EP_ERR_USAGE, "EDGEPACK_TVM_ISA=%s: this CPU lacks that instruction set",
                               forced.c_str());
            *prefix = px;
            *level = lv;
            found = true;
            break;
        }
    }
    if (!forced.empty() && !found)
        return ep_fail(st, EP_ERR_USAGE, "EDGEPACK_TVM_ISA=%s: the artifact has kernels for %s%s%s only",
                       forced.c_str(), base.empty() ? "one level" : base.c_str(), list.empty() ? "" : " and ",
                       list.c_str());
    if (env) std::fprintf(stderr, "tvm: kernels for %s\n", level->empty() ? "the build's CPU" : level->c_str());
    if (!level->empty())
        std::snprintf(g_describe, sizeof g_describe, "tvm 0.27 relax VM (system library), kernels for %s",
                      level->c_str());
    return EP_OK;
}

bool to_dl(ep_dtype t, DLDataType *out) {
    switch (t) {
    case EP_F32: *out = DLDataType{kDLFloat, 32, 1}; return true;
    case EP_F64: *out = DLDataType{kDLFloat, 64, 1}; return true;
    case EP_F16: *out = DLDataType{kDLFloat, 16, 1}; return true;
    case EP_I32: *out = DLDataType{kDLInt, 32, 1}; return true;
    case EP_I64: *out = DLDataType{kDLInt, 64, 1}; return true;
    case EP_I8: *out = DLDataType{kDLInt, 8, 1}; return true;
    case EP_U8: *out = DLDataType{kDLUInt, 8, 1}; return true;
    case EP_BOOL: *out = DLDataType{kDLBool, 8, 1}; return true;
    default: return false;
    }
}

bool same_dtype(DLDataType a, DLDataType b) {
    // TVM stores ONNX bool as uint1 or bool8 depending on the op; both are one byte per element.
    auto canon = [](DLDataType d) {
        if (d.code == kDLBool || (d.code == kDLUInt && d.bits == 1)) return DLDataType{kDLBool, 8, d.lanes};
        return d;
    };
    DLDataType x = canon(a), y = canon(b);
    return x.code == y.code && x.bits == y.bits && x.lanes == y.lanes;
}

std::string first_line(const std::string &s) {
    size_t nl = s.find('\n');
    std::string line = nl == std::string::npos ? s : s.substr(0, nl);
    return line.size() > 400 ? line.substr(0, 400) : line;
}

int fail_from(ep_status *st, int code, const char *what, const std::exception &e) {
    std::string msg;
    if (auto *err = dynamic_cast<const ffi::Error *>(&e)) {
        msg = std::string(err->kind()) + ": " + std::string(err->message());
    } else {
        msg = e.what();
    }
    return ep_fail(st, code, "%s: %s", what, first_line(msg).c_str());
}

/* Whether a kept input tensor has this input's dtype, shape and byte count (so a copy fills it whole). */
bool fits(const ffi::Optional<Tensor> &kept, const ep_tensor &in, DLDataType dt) {
    if (!kept.has_value()) return false;
    const Tensor &t = kept.value();
    if (!same_dtype(t->dtype, dt) || t->ndim != in.ndim) return false;
    int64_t count = 1;
    for (int d = 0; d < in.ndim; d++) {
        if (t->shape[d] != in.shape[d]) return false;
        count *= in.shape[d];
    }
    return static_cast<size_t>(count) * ((dt.bits * dt.lanes + 7) / 8) == in.nbytes;
}

int copy_output(const ffi::Any &value, int index, const ep_model_spec *spec, ep_tensor *out, ep_status *st) {
    auto opt = value.as<Tensor>();
    if (!opt.has_value()) {
        return ep_fail(st, EP_ERR_MODEL, "output %d (%s): the model returned a %s, not a tensor", index,
                       spec->outputs[index].name, value.GetTypeKey().c_str());
    }
    Tensor t = opt.value();
    DLDataType want;
    if (!to_dl(out->dtype, &want) || !same_dtype(t->dtype, want)) {
        return ep_fail(st, EP_ERR_MODEL, "output %s: the model returned dtype code %d bits %d, the spec says %s",
                       spec->outputs[index].name, t->dtype.code, t->dtype.bits, ep_dtype_name(out->dtype));
    }
    int64_t count = 1;
    for (int i = 0; i < t->ndim; i++) count *= t->shape[i];
    if (count != ep_shape_count(out->shape, out->ndim)) {
        return ep_fail(st, EP_ERR_MODEL, "output %s: the model returned %lld values, the spec promises %lld",
                       spec->outputs[index].name, (long long)count,
                       (long long)ep_shape_count(out->shape, out->ndim));
    }
    Tensor::CopyToBytes(t.operator->(), out->data, out->nbytes);
    return EP_OK;
}

int tvm_open(const ep_model_spec *spec, int threads, void **out, ep_status *st) {
    *out = nullptr;
    if (int rc = ep_spec_check(spec, st)) return rc;
    if (threads > 0 && std::getenv("TVM_NUM_THREADS") == nullptr) {
        char buf[16];
        snprintf(buf, sizeof buf, "%d", threads);
        setenv("TVM_NUM_THREADS", buf, 1);
    }
    setenv("TVM_THREAD_POOL_SPIN_COUNT", SPIN_YIELDS, 0);  /* read once, when the pool starts */
    tvm_engine *e = new (std::nothrow) tvm_engine();
    if (!e) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    e->spec = spec;
    std::string prefix, level;
    if (int rc = pick_isa(spec, &prefix, &level, st)) {
        delete e;
        return rc;
    }
    try {
        e->inputs.resize(spec->n_inputs);  // filled at the first run (tvm_run)
        ffi::Module syslib = ffi::Function::GetGlobalRequired("ffi.SystemLib")(ffi::String(prefix)).cast<ffi::Module>();
        auto load = syslib->GetFunction("vm_load_executable", false);
        if (!load.has_value()) {
            delete e;
            return ep_fail(st, EP_ERR_MODEL, "the artifact holds no TVM VM executable (devc.o not linked?)");
        }
        // The system library's root module is the VM executable (with the kernels imported).
        e->vm = load.value()().cast<ffi::Module>();
        ffi::Module vm = e->vm.value();
        auto init = vm->GetFunction("vm_initialization", false);
        if (!init.has_value()) {
            delete e;
            return ep_fail(st, EP_ERR_MODEL, "the embedded TVM module is not a relax VM");
        }
        const int cpu = static_cast<int>(kDLCPU);
        const int pooled = static_cast<int>(tvm::runtime::memory::AllocatorType::kPooled);
        init.value()(cpu, 0, pooled, cpu, 0, pooled);
        const char *entry = ep_option_get(spec, "tvm.entry", "main");
        auto fn = vm->GetFunction(entry, false);
        if (!fn.has_value()) {
            delete e;
            return ep_fail(st, EP_ERR_MODEL, "the TVM VM has no function %s", entry);
        }
        e->entry = fn.value();
    } catch (const std::exception &ex) {
        delete e;
        return fail_from(st, EP_ERR_MODEL, "loading the TVM model failed", ex);
    }
    *out = e;
    return EP_OK;
}

int tvm_run(void *handle, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st) {
    tvm_engine *e = static_cast<tvm_engine *>(handle);
    const ep_model_spec *spec = e->spec;
    try {
        std::vector<ffi::Any> args;
        args.reserve(spec->n_inputs);
        const DLDevice cpu{kDLCPU, 0};
        for (int i = 0; i < spec->n_inputs; i++) {
            DLDataType dt;
            if (!to_dl(inputs[i].dtype, &dt))
                return ep_fail(st, EP_ERR_INPUT, "input %s: dtype %s is not supported by the TVM engine",
                               spec->inputs[i].name, ep_dtype_name(inputs[i].dtype));
            /* ids that index a tensor: TVM's take/gather read where they say (index_bounds.py) */
            int bad = ep_check_ids(&spec->inputs[i], &inputs[i], ep_option_ids(spec, "tvm.in_ids", i), st);
            if (bad) return bad;
            if (!fits(e->inputs[i], inputs[i], dt)) {
                std::vector<int64_t> shape(inputs[i].shape, inputs[i].shape + inputs[i].ndim);
                e->inputs[i] = Tensor::Empty(ffi::Shape(shape), dt, cpu);
            }
            Tensor t = e->inputs[i].value();
            Tensor::CopyFromBytes(t.operator->(), inputs[i].data, inputs[i].nbytes);
            args.emplace_back(std::move(t));
        }
        std::vector<ffi::AnyView> views(args.begin(), args.end());
        ffi::Any result;
        e->entry.value().CallPacked(views.data(), static_cast<int32_t>(views.size()), &result);
        if (auto arr = result.as<ffi::Array<ffi::Any>>()) {
            if (static_cast<int>(arr.value().size()) != spec->n_outputs)
                return ep_fail(st, EP_ERR_MODEL, "the model returned %d outputs, the spec has %d",
                               static_cast<int>(arr.value().size()), spec->n_outputs);
            for (int i = 0; i < spec->n_outputs; i++) {
                int rc = copy_output(arr.value()[i], i, spec, &outputs[i], st);
                if (rc) return rc;
            }
            return EP_OK;
        }
        if (spec->n_outputs != 1)
            return ep_fail(st, EP_ERR_MODEL, "the model returned one tensor, the spec has %d outputs", spec->n_outputs);
        return copy_output(result, 0, spec, &outputs[0], st);
    } catch (const std::exception &ex) {
        return fail_from(st, EP_ERR_MODEL, "running the TVM model failed", ex);
    }
}

void tvm_close(void *handle) { delete static_cast<tvm_engine *>(handle); }

}  // namespace

extern "C" const ep_engine_ops ep_engine_ops_tvm = {"tvm", tvm_open, tvm_run, tvm_close, tvm_describe};
