#include "string_printf.hpp"

#include <cstdarg>
#include <cstdio>

namespace tether {

std::string string_printf(const char* fmt, ...) {
  va_list args, again;
  va_start(args, fmt);
  va_copy(again, args);
  int n = vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) vsnprintf(&out[0], out.size() + 1, fmt, again);
  va_end(again);
  return out;
}

}  // namespace tether
