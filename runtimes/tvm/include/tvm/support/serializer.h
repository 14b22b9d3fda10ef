/* edgepack's own minimal tvm/support/serializer.h: Serializer<T> for the types the TVM runtime
 * stores in executables and parameter blobs.
 *
 *  - trivially copyable values (integers, floats, enums, DLDataType, DLDevice): their bytes;
 *  - std::string, ffi::String: uint64 length, then the bytes;
 *  - std::vector, ffi::Array: uint64 count, then each element;
 *  - std::pair: first, then second; std::map / std::unordered_map: uint64 count, then pairs.
 * Only little-endian hosts are supported (every edgepack target is little-endian).
 */
#ifndef EDGEPACK_TVM_SUPPORT_SERIALIZER_H_
#define EDGEPACK_TVM_SUPPORT_SERIALIZER_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/string.h>
#include <tvm/support/io.h>

#include <map>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "edgepack's TVM runtime serializer supports little-endian targets only"
#endif

namespace tvm {
namespace support {

namespace detail {
inline void WriteCount(Stream* s, size_t n) {
  uint64_t v = static_cast<uint64_t>(n);
  s->Write(&v, sizeof(v));
}
inline bool ReadCount(Stream* s, uint64_t* n) { return s->Read(n, sizeof(*n)) == sizeof(*n); }
inline bool ReadBytes(Stream* s, void* dst, size_t n) { return n == 0 || s->Read(dst, n) == n; }
}  // namespace detail

/*! \brief Plain values: their bytes. Other types need a specialisation. */
template <typename T>
struct Serializer {
  static constexpr bool enabled = std::is_trivially_copyable<T>::value;
  static void Write(Stream* s, const T& v) {
    static_assert(std::is_trivially_copyable<T>::value, "no Serializer for this type");
    s->Write(&v, sizeof(T));
  }
  static bool Read(Stream* s, T* v) {
    static_assert(std::is_trivially_copyable<T>::value, "no Serializer for this type");
    return s->Read(v, sizeof(T)) == sizeof(T);
  }
};

template <>
struct Serializer<std::string> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const std::string& v) {
    detail::WriteCount(s, v.size());
    if (!v.empty()) s->Write(v.data(), v.size());
  }
  static bool Read(Stream* s, std::string* v) {
    uint64_t n;
    if (!detail::ReadCount(s, &n)) return false;
    v->resize(static_cast<size_t>(n));
    return detail::ReadBytes(s, v->empty() ? nullptr : &(*v)[0], v->size());
  }
};

template <>
struct Serializer<ffi::String> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const ffi::String& v) {
    detail::WriteCount(s, v.size());
    if (v.size()) s->Write(v.data(), v.size());
  }
  static bool Read(Stream* s, ffi::String* v) {
    std::string tmp;
    if (!Serializer<std::string>::Read(s, &tmp)) return false;
    *v = ffi::String(std::move(tmp));
    return true;
  }
};

template <typename A, typename B>
struct Serializer<std::pair<A, B>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const std::pair<A, B>& v) {
    Serializer<A>::Write(s, v.first);
    Serializer<B>::Write(s, v.second);
  }
  static bool Read(Stream* s, std::pair<A, B>* v) {
    return Serializer<A>::Read(s, &v->first) && Serializer<B>::Read(s, &v->second);
  }
};

template <typename T, typename Alloc>
struct Serializer<std::vector<T, Alloc>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const std::vector<T, Alloc>& v) {
    detail::WriteCount(s, v.size());
    if constexpr (std::is_trivially_copyable<T>::value) {
      if (!v.empty()) s->Write(v.data(), v.size() * sizeof(T));
    } else {
      for (const T& x : v) Serializer<T>::Write(s, x);
    }
  }
  static bool Read(Stream* s, std::vector<T, Alloc>* v) {
    uint64_t n;
    if (!detail::ReadCount(s, &n)) return false;
    v->resize(static_cast<size_t>(n));
    if constexpr (std::is_trivially_copyable<T>::value) {
      return detail::ReadBytes(s, v->data(), v->size() * sizeof(T));
    } else {
      for (T& x : *v) {
        if (!Serializer<T>::Read(s, &x)) return false;
      }
      return true;
    }
  }
};

template <typename T>
struct Serializer<ffi::Array<T>> {
  static constexpr bool enabled = true;
  static void Write(Stream* s, const ffi::Array<T>& v) {
    detail::WriteCount(s, v.size());
    for (const T& x : v) Serializer<T>::Write(s, x);
  }
  static bool Read(Stream* s, ffi::Array<T>* v) {
    uint64_t n;
    if (!detail::ReadCount(s, &n)) return false;
    ffi::Array<T> out;
    out.reserve(static_cast<int64_t>(n));
    for (uint64_t i = 0; i < n; ++i) {
      T x;
      if (!Serializer<T>::Read(s, &x)) return false;
      out.push_back(std::move(x));
    }
    *v = std::move(out);
    return true;
  }
};

namespace detail {
template <typename M>
struct MapSerializer {
  static void Write(Stream* s, const M& m) {
    WriteCount(s, m.size());
    for (const auto& kv : m) {
      Serializer<typename M::key_type>::Write(s, kv.first);
      Serializer<typename M::mapped_type>::Write(s, kv.second);
    }
  }
  static bool Read(Stream* s, M* m) {
    uint64_t n;
    if (!ReadCount(s, &n)) return false;
    m->clear();
    for (uint64_t i = 0; i < n; ++i) {
      typename M::key_type k;
      typename M::mapped_type v;
      if (!Serializer<typename M::key_type>::Read(s, &k)) return false;
      if (!Serializer<typename M::mapped_type>::Read(s, &v)) return false;
      m->emplace(std::move(k), std::move(v));
    }
    return true;
  }
};
}  // namespace detail

template <typename K, typename V, typename C, typename A>
struct Serializer<std::map<K, V, C, A>> : detail::MapSerializer<std::map<K, V, C, A>> {
  static constexpr bool enabled = true;
};
template <typename K, typename V, typename H, typename E, typename A>
struct Serializer<std::unordered_map<K, V, H, E, A>>
    : detail::MapSerializer<std::unordered_map<K, V, H, E, A>> {
  static constexpr bool enabled = true;
};

}  // namespace support
}  // namespace tvm

#endif  // EDGEPACK_TVM_SUPPORT_SERIALIZER_H_
