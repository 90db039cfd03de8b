// printf into a std::string, for error messages (the server avoids iostream
// to stay small).
//
//   std::string message = tether::string_printf("%s is truncated: %llu bytes", path, size);
#pragma once

#include <string>

namespace tether {

std::string string_printf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace tether
