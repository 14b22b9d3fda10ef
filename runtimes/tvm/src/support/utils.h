/* edgepack's own src/support/utils.h: the few string helpers the TVM runtime sources use. */
#ifndef EDGEPACK_TVM_SRC_SUPPORT_UTILS_H_
#define EDGEPACK_TVM_SRC_SUPPORT_UTILS_H_

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace tvm {
namespace support {

/*! \brief True when s is a non-empty run of decimal digits. */
inline bool IsNumber(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

inline std::vector<std::string> Split(const std::string& s, char delim) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, delim)) out.push_back(item);
  return out;
}

inline bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

inline bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/*! \brief Integer value of an environment variable, or fallback when unset or empty. */
template <typename T>
inline T GetEnv(const char* name, T fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  std::istringstream in(v);
  T out = fallback;
  in >> out;
  return out;
}

}  // namespace support
}  // namespace tvm

#endif  // EDGEPACK_TVM_SRC_SUPPORT_UTILS_H_
