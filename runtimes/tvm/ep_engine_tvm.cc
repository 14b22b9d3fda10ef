/* The TVM engine behind ep_engine_*: the model compiled by apache-tvm (relax, system library)
 * is linked in as lib0.o (kernels) + devc.o (VM bytecode and weights), both registering
 * themselves at start-up; this file loads the VM executable from the system library and runs
 * its "main" function.
 *
 * Options from the spec: tvm.entry (function name, default "main"), tvm.outputs (number of
 * outputs the VM returns, as a check). Threads: TVM's own thread pool, sized through
 * TVM_NUM_THREADS before the pool starts (a user's TVM_NUM_THREADS wins).
 */
/* musl defines no __MUSL__, so tvm-ffi cannot detect endianness alone (as in runtime_lib.DEFINES). */
#ifndef TVM_FFI_CMAKE_LITTLE_ENDIAN
#define TVM_FFI_CMAKE_LITTLE_ENDIAN 1
#endif

#include "ep_runtime.h"

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/runtime/memory/memory_manager.h>
#include <tvm/runtime/tensor.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

struct ep_engine {
    const ep_model_spec *spec;
    ffi::Optional<ffi::Module> vm;   // (Module has no empty state of its own)
    ffi::Optional<ffi::Function> entry;
};

extern "C" const char *ep_engine_describe(void) { return "tvm 0.27 relax VM (system library)"; }

namespace {

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

}  // namespace

extern "C" int ep_engine_open(const ep_model_spec *spec, int threads, ep_engine **out, ep_status *st) {
    *out = nullptr;
    if (threads > 0 && std::getenv("TVM_NUM_THREADS") == nullptr) {
        char buf[16];
        snprintf(buf, sizeof buf, "%d", threads);
        setenv("TVM_NUM_THREADS", buf, 1);
    }
    ep_engine *e = new (std::nothrow) ep_engine();
    if (!e) return ep_fail(st, EP_ERR_NOMEM, "out of memory");
    e->spec = spec;
    try {
        ffi::Module syslib = ffi::Function::GetGlobalRequired("ffi.SystemLib")().cast<ffi::Module>();
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

extern "C" int ep_engine_run(ep_engine *e, const ep_tensor *inputs, ep_tensor *outputs, ep_status *st) {
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
            std::vector<int64_t> shape(inputs[i].shape, inputs[i].shape + inputs[i].ndim);
            Tensor t = Tensor::Empty(ffi::Shape(shape), dt, cpu);
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

extern "C" void ep_engine_close(ep_engine *e) { delete e; }
