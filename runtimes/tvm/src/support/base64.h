/* edgepack's own src/support/base64.h: base64 Streams, built on tvm-ffi's Base64Encode/Decode.
 *
 * The output stream collects the raw bytes and encodes them on Finish(); the input stream
 * decodes the whole underlying stream on InitPosition(). Used only for tensors embedded in
 * JSON, never on an artifact's hot path.
 */
#ifndef EDGEPACK_TVM_SRC_SUPPORT_BASE64_H_
#define EDGEPACK_TVM_SRC_SUPPORT_BASE64_H_

#include <tvm/ffi/extra/base64.h>
#include <tvm/support/io.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

class Base64OutStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit Base64OutStream(Stream* out) : out_(out) {}
  size_t Read(void*, size_t) final { return 0; }
  size_t Write(const void* ptr, size_t size) final {
    raw_.append(static_cast<const char*>(ptr), size);
    return size;
  }
  /*! \brief Encode what was written and pass it on. */
  void Finish() {
    TVMFFIByteArray bytes{raw_.data(), raw_.size()};
    ffi::String text = ffi::Base64Encode(bytes);
    if (text.size()) out_->Write(text.data(), text.size());
    raw_.clear();
  }

 private:
  Stream* out_;
  std::string raw_;
};

class Base64InStream : public Stream {
 public:
  using Stream::Read;
  using Stream::Write;
  explicit Base64InStream(Stream* in) : in_(in) {}
  /*! \brief Read and decode the whole input (leading/trailing whitespace ignored). */
  void InitPosition() {
    std::string text;
    char buf[4096];
    for (size_t n; (n = in_->Read(buf, sizeof buf)) > 0;) text.append(buf, n);
    text.erase(std::remove_if(text.begin(), text.end(),
                              [](unsigned char c) { return std::isspace(c) != 0; }),
               text.end());
    TVMFFIByteArray bytes{text.data(), text.size()};
    ffi::Bytes raw = ffi::Base64Decode(bytes);
    decoded_.assign(raw.data(), raw.size());
    pos_ = 0;
  }
  size_t Read(void* ptr, size_t size) final {
    size_t n = std::min(size, decoded_.size() - pos_);
    if (n) std::memcpy(ptr, decoded_.data() + pos_, n);
    pos_ += n;
    return n;
  }
  size_t Write(const void*, size_t) final { return 0; }

 private:
  Stream* in_;
  std::string decoded_;
  size_t pos_ = 0;
};

}  // namespace support
}  // namespace tvm

#endif  // EDGEPACK_TVM_SRC_SUPPORT_BASE64_H_
