/* edgepack's own minimal tvm/support/io.h: the byte stream the TVM runtime (de)serialises with.
 *
 * Written for edgepack (the apache-tvm wheel ships the runtime sources without this header).
 * Format: little-endian, fixed-width scalars written as their bytes; containers as a uint64
 * element count followed by the elements (see serializer.h).
 */
#ifndef EDGEPACK_TVM_SUPPORT_IO_H_
#define EDGEPACK_TVM_SUPPORT_IO_H_

#include <cstddef>
#include <cstdint>

namespace tvm {
namespace support {

template <typename T>
struct Serializer;

class Stream {
 public:
  virtual ~Stream() = default;
  /*! \brief Read up to size bytes; returns the number read (0 at the end). */
  virtual size_t Read(void* ptr, size_t size) = 0;
  /*! \brief Write size bytes; returns the number written. */
  virtual size_t Write(const void* ptr, size_t size) = 0;

  template <typename T>
  void Write(const T& value) {
    Serializer<T>::Write(this, value);
  }
  template <typename T>
  bool Read(T* out) {
    return Serializer<T>::Read(this, out);
  }
  template <typename T>
  void WriteArray(const T* data, size_t n) {
    for (size_t i = 0; i < n; ++i) Serializer<T>::Write(this, data[i]);
  }
  template <typename T>
  bool ReadArray(T* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      if (!Serializer<T>::Read(this, data + i)) return false;
    }
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#include <tvm/support/serializer.h>

#endif  // EDGEPACK_TVM_SUPPORT_IO_H_
