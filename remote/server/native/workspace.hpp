// A session's folder on the board; every name a client sends is checked here
// (the same rules as remote/server/workspace.py).
#pragma once

#include <string>
#include <vector>

namespace tether {

class Workspace {
 public:
  // Makes a fresh folder under `parent` (empty: $TMPDIR, else /tmp, else
  // /data/local/tmp as on Android); empty root() and *error on failure.
  static Workspace make(const std::string& parent, std::string* error);
  explicit Workspace(std::string root = "") : root_(std::move(root)) {}
  const std::string& root() const { return root_; }
  // The absolute path of `name` inside the workspace, or "" with *error set.
  std::string path(const std::string& name, std::string* error) const;
  // The path of an existing regular file, or "" with *error set.
  std::string existing(const std::string& name, std::string* error) const;
  // Names of the regular files inside, sorted (symlinks leading out are left out).
  std::vector<std::string> list() const;
  void remove_all() const;

 private:
  std::string root_;
};

// Makes every missing folder of `path`'s parent.
bool make_parents(const std::string& path);
std::string quote(const std::string& text);  // Python's repr() of a str, for messages

}  // namespace tether
