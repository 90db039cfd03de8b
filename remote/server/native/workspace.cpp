#include "workspace.hpp"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace tether {

namespace {
// Longer or deeper names are refused before the file system sees them.
constexpr size_t kMaxNameChars = 1024;
constexpr size_t kMaxNameDepth = 32;

std::string real_path(const std::string& path) {
  char out[PATH_MAX];
  return ::realpath(path.c_str(), out) ? std::string(out) : std::string();
}

bool inside(const std::string& real, const std::string& root) {
  return real == root || (real.size() > root.size() && real.compare(0, root.size(), root) == 0 &&
                          real[root.size()] == '/');
}

std::vector<std::string> split(const std::string& name) {
  std::vector<std::string> parts;
  std::string part;
  for (char c : name) {
    if (c == '/' || c == '\\') {
      parts.push_back(part);
      part.clear();
    } else {
      part.push_back(c);
    }
  }
  parts.push_back(part);
  return parts;
}

void walk(const std::string& root, const std::string& folder, const std::string& prefix,
          std::vector<std::string>* names, int depth) {
  if (depth > 64) return;
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = ::readdir(dir)) {
    std::string base = entry->d_name;
    if (base == "." || base == "..") continue;
    std::string full = folder + "/" + base;
    struct stat st;
    if (::lstat(full.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      walk(root, full, prefix + base + "/", names, depth + 1);
      continue;
    }
    std::string real = real_path(full);
    if (!real.empty() && inside(real, root) && real != root && ::stat(real.c_str(), &st) == 0 &&
        S_ISREG(st.st_mode)) {
      names->push_back(prefix + base);
    }
  }
  ::closedir(dir);
}

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* dir = ::opendir(path.c_str())) {
      while (dirent* entry = ::readdir(dir)) {
        if (std::strcmp(entry->d_name, ".") && std::strcmp(entry->d_name, ".."))
          remove_tree(path + "/" + entry->d_name);
      }
      ::closedir(dir);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}
}  // namespace

std::string quote(const std::string& text) {
  // As Python's repr() writes a str: single quotes unless the text holds one.
  bool single = text.find('\'') == std::string::npos || text.find('"') != std::string::npos;
  char q = single ? '\'' : '"';
  std::string out(1, q);
  for (unsigned char c : text) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out += '\\'; out += q; }
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + q;
}

Workspace Workspace::make(const std::string& parent, std::string* error) {
  std::string base = parent;
  if (base.empty()) {
    const char* tmp = ::getenv("TMPDIR");
    struct stat st;
    if (tmp && *tmp) base = tmp;
    else if (::stat("/tmp", &st) == 0 && S_ISDIR(st.st_mode)) base = "/tmp";
    else base = "/data/local/tmp";
  }
  std::string pattern = base + "/tether-session-XXXXXX";
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (::mkdtemp(buffer.data()) == nullptr) {
    *error = "cannot make a session folder in " + base + ": " + std::strerror(errno) +
             " (server option --workspace-dir names another)";
    return Workspace();
  }
  return Workspace(real_path(buffer.data()));
}

std::string Workspace::path(const std::string& name, std::string* error) const {
  std::vector<std::string> parts = split(name);
  if (name.size() > kMaxNameChars || parts.size() > kMaxNameDepth) {
    *error = "file name of " + std::to_string(name.size()) + " characters and " +
             std::to_string(parts.size()) + " folders is too long: at most " +
             std::to_string(kMaxNameChars) + " characters and " + std::to_string(kMaxNameDepth) +
             " folders deep";
    return "";
  }
  bool bad = name.empty() || name[0] == '/' || name.find('\0') != std::string::npos;
  for (const auto& p : parts) bad = bad || p.empty() || p == "." || p == "..";
  if (bad) {
    *error = "file name " + quote(name) + " is not allowed: use a plain relative name inside "
             "the session workspace (no absolute path, no '..')";
    return "";
  }
  std::string full = root_;
  for (const auto& p : parts) {
    full += "/" + p;
    // A symlink planted inside the folder must not lead out of it.
    struct stat st;
    if (::lstat(full.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      std::string real = real_path(full);
      if (real.empty() || !inside(real, root_)) {
        *error = "file name " + quote(name) + " leads outside the session workspace";
        return "";
      }
    }
  }
  return full;
}

std::string Workspace::existing(const std::string& name, std::string* error) const {
  std::string full = path(name, error);
  if (full.empty()) return "";
  struct stat st;
  if (::stat(full.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::string present;
    for (const auto& n : list()) present += (present.empty() ? "" : ", ") + n;
    *error = "no file " + quote(name) + " in the session workspace; upload it first (present: " +
             (present.empty() ? "nothing" : present) + ")";
    return "";
  }
  return full;
}

std::vector<std::string> Workspace::list() const {
  std::vector<std::string> names;
  walk(root_, root_, "", &names, 0);
  std::sort(names.begin(), names.end());
  return names;
}

void Workspace::remove_all() const {
  if (!root_.empty()) remove_tree(root_);
}

bool make_parents(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return true;
  std::string folder = path.substr(0, slash);
  struct stat st;
  if (::stat(folder.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
  if (!make_parents(folder)) return false;
  return ::mkdir(folder.c_str(), 0755) == 0 || errno == EEXIST;
}

}  // namespace tether
