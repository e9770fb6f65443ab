// The one shim function that must throw a C++ exception: `aoti_torch_check`.
// libtorch's throws c10::Error; the generated code runs every kernel and
// wrapper call inside the container's try block, which turns any exception into
// AOTI_RUNTIME_FAILURE for the caller. Rust cannot raise a C++ exception, so the
// Rust `aoti_torch_check` (src/check.rs) calls this when the check failed.
#include <cstdint>
#include <stdexcept>
#include <string>

extern "C" [[noreturn]] void tcg_shim_check_fail(const char* func, const char* file, uint32_t line,
                                                 const char* msg) {
  std::string what = "check failed";
  if (msg != nullptr && *msg != '\0') {
    what += ": ";
    what += msg;
  }
  what += " (";
  what += func != nullptr ? func : "?";
  what += " at ";
  what += file != nullptr ? file : "?";
  what += ":";
  what += std::to_string(line);
  what += ")";
  throw std::runtime_error(what);
}
