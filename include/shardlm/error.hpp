// error.hpp — the one error type of shardlm and the check macros.
//
// Owns: shardlm::Error, fmt(), SHARDLM_CHECK / SHARDLM_FAIL. Knows nothing about
// MPI, CUDA or files; the per-library check macros (MPI_CHECK, H5_CHECK,
// CUDA_CHECK, NCCL_CHECK) live beside the code that calls those libraries and
// throw this type, so one handler in main() turns any failure into one message
// and an MPI_Abort.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

namespace shardlm {

// A failure with a sentence for the user: what was wrong, where, what to do.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// printf-style formatting into a std::string (g++ 12 has no std::format).
template <class... Args>
std::string fmt(const char* format, Args&&... args) {
  int n = std::snprintf(nullptr, 0, format, args...);
  if (n < 0) return format;
  std::string out(static_cast<size_t>(n), '\0');
  std::snprintf(out.data(), out.size() + 1, format, args...);
  return out;
}
inline std::string fmt(const char* format) { return format; }

}  // namespace shardlm

// Throw shardlm::Error with a formatted message when `cond` is false.
#define SHARDLM_CHECK(cond, ...)                                   \
  do {                                                             \
    if (!(cond)) throw ::shardlm::Error(::shardlm::fmt(__VA_ARGS__)); \
  } while (0)

#define SHARDLM_FAIL(...) throw ::shardlm::Error(::shardlm::fmt(__VA_ARGS__))
