#include "devinfo.hpp"

#include <stdlib.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>

namespace tether {

namespace {

std::string read_file(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return "";
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) text.append(buffer, n);
  std::fclose(f);
  return text;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_android() {
  struct stat st;
  return ::getenv("ANDROID_ROOT") != nullptr || ::stat("/system/build.prop", &st) == 0;
}

// The triple modules for this board are built for (LLVM's normalised form).
std::string triple_for(const std::string& machine) {
  bool arm64 = machine == "aarch64" || machine == "arm64";
  if (is_android()) return arm64 ? "aarch64-unknown-linux-android" : "armv7-unknown-linux-androideabi";
  if (machine == "x86_64" || machine == "amd64") return "x86_64-unknown-linux-gnu";
  if (arm64) {
#if defined(__arm__)
    // A 32-bit userland on a 64-bit kernel (32-bit Raspberry Pi OS on a Pi 4).
    return "armv7l-unknown-linux-gnueabihf";
#else
    return "aarch64-unknown-linux-gnu";
#endif
  }
  if (machine == "armv7l" || machine == "armv8l") return "armv7l-unknown-linux-gnueabihf";
  if (machine == "armv6l") return "armv6l-unknown-linux-gnueabihf";
  return machine + "-unknown-linux-gnu";
}

std::string os_name() {
  std::string text = read_file("/etc/os-release");
  size_t at = text.find("PRETTY_NAME=");
  if (at != std::string::npos) {
    std::string value = text.substr(at + 12, text.find('\n', at) - at - 12);
    value = trim(value);
    if (value.size() >= 2 && (value[0] == '"' || value[0] == '\'')) value = value.substr(1, value.size() - 2);
    return value;
  }
  std::string build = read_file("/system/build.prop");
  at = build.find("ro.build.version.release=");
  if (at != std::string::npos) {
    return "Android " + trim(build.substr(at + 25, build.find('\n', at) - at - 25));
  }
  utsname u;
  return ::uname(&u) == 0 ? std::string(u.sysname) + " " + u.release : "Linux";
}

}  // namespace

DeviceInfo collect_device_info(const StringPairs& attributes) {
  DeviceInfo info;
  utsname u;
  std::string machine = ::uname(&u) == 0 ? u.machine : "";
#if defined(__arm__)
  if (machine == "aarch64" || machine == "arm64") machine = "armv8l";  // as a 32-bit process sees it
#endif
  info.machine = machine;
  info.triple = triple_for(u.machine);
  std::string part;
  std::string cpuinfo = read_file("/proc/cpuinfo");
  size_t start = 0;
  while (start < cpuinfo.size()) {
    size_t end = cpuinfo.find('\n', start);
    if (end == std::string::npos) end = cpuinfo.size();
    std::string line = cpuinfo.substr(start, end - start);
    start = end + 1;
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = lower(trim(line.substr(0, colon)));
    std::string value = trim(line.substr(colon + 1));
    bool digits = !value.empty();
    for (char c : value) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    if ((name == "model name" || name == "hardware" || name == "cpu model" || name == "processor") &&
        info.cpu_model.empty() && !digits) {
      info.cpu_model = value;
    } else if ((name == "flags" || name == "features") && info.cpu_features.empty()) {
      size_t a = 0;
      while (a < value.size()) {
        size_t b = value.find(' ', a);
        if (b == std::string::npos) b = value.size();
        if (b > a) info.cpu_features.push_back(value.substr(a, b - a));
        a = b + 1;
      }
    } else if (name == "cpu part" && part.empty()) {
      part = value;  // ARM cores: which core (0xd08 is a Cortex-A72)
    }
  }
  if (info.cpu_model.empty()) info.cpu_model = machine;
  long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  info.cores = cores > 0 ? static_cast<int32_t>(cores) : 1;
  std::string meminfo = read_file("/proc/meminfo");
  size_t at = meminfo.find("MemTotal:");
  if (at != std::string::npos) info.memory_bytes = std::strtoll(meminfo.c_str() + at + 9, nullptr, 10) * 1024;
  info.os = os_name();
  info.server_version = kServerVersion;
  const char* emulated = ::getenv("TETHER_EMULATED");
  info.emulated = emulated ? emulated : "";
  info.attributes = attributes;
  auto has = [&](const char* key) {
    for (const auto& kv : info.attributes) if (kv.first == key) return true;
    return false;
  };
  if (!part.empty() && (machine.compare(0, 3, "arm") == 0 || machine.compare(0, 5, "aarch") == 0) &&
      !has("cpu_part")) {
    info.attributes.emplace_back("cpu_part", part);
  }
  // What a session is kept from (remote/server/isolation.py, ISOLATION_LEVEL):
  // the server's to say, not the operator's.
  for (auto it = info.attributes.begin(); it != info.attributes.end();) {
    it = it->first == "isolation" ? info.attributes.erase(it) : it + 1;
  }
  info.attributes.emplace_back("isolation", "processes");
  return info;
}

}  // namespace tether
