/* edgepack's own tvm/support/cuda/nvtx.h: edgepack artifacts are CPU-only, so NVTX profiling
 * ranges compile to nothing. */
#ifndef EDGEPACK_TVM_SUPPORT_CUDA_NVTX_H_
#define EDGEPACK_TVM_SUPPORT_CUDA_NVTX_H_

#include <string>

namespace tvm {
namespace support {

class NVTXScopedRange {
 public:
  explicit NVTXScopedRange(const char*) {}
  explicit NVTXScopedRange(const std::string&) {}
  NVTXScopedRange(const NVTXScopedRange&) = delete;
  NVTXScopedRange& operator=(const NVTXScopedRange&) = delete;
};

}  // namespace support
}  // namespace tvm

#define TVM_NVTX_FUNC_SCOPE()

#endif  // EDGEPACK_TVM_SUPPORT_CUDA_NVTX_H_
