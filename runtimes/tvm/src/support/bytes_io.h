/* edgepack's own src/support/bytes_io.h: Streams over memory (TVM runtime sources include it). */
#ifndef EDGEPACK_TVM_SRC_SUPPORT_BYTES_IO_H_
#define EDGEPACK_TVM_SRC_SUPPORT_BYTES_IO_H_

#include <tvm/support/io.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

/*! \brief Appends everything written to a std::string. */
class BytesOutStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit BytesOutStream(std::string* out) : out_(out) {}
  size_t Read(void*, size_t) final { return 0; }
  size_t Write(const void* ptr, size_t size) final {
    out_->append(static_cast<const char*>(ptr), size);
    return size;
  }

 private:
  std::string* out_;
};

/*! \brief Reads from a byte range it does not own (the caller keeps it alive). */
class BytesInStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  BytesInStream(const void* data, size_t size) : data_(static_cast<const char*>(data)), size_(size) {}
  /*! \brief Any contiguous byte container: std::string, ffi::Bytes, ffi::String. */
  template <typename Container, typename = decltype(std::declval<const Container&>().data())>
  explicit BytesInStream(const Container& c)
      : data_(reinterpret_cast<const char*>(c.data())), size_(c.size()) {}
  size_t Read(void* ptr, size_t size) final {
    size_t n = std::min(size, size_ - pos_);
    if (n) std::memcpy(ptr, data_ + pos_, n);
    pos_ += n;
    return n;
  }
  size_t Write(const void*, size_t) final { return 0; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace support
}  // namespace tvm

#endif  // EDGEPACK_TVM_SRC_SUPPORT_BYTES_IO_H_
