// The session sandbox (remote/server/isolation.py, Sandbox, enter_namespaces,
// confine_session): the layers this board can give its sessions, found out
// at start, and their set-up in a session's process.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace tether {

// The layers, in the order the attribute "isolation" names them (see
// isolation.py's LAYERS for what each stops).
extern const char* const kSandboxLayers[6];
constexpr const char* kDefaultSessionUids = "200000-265535";

struct Sandbox {
  std::vector<std::string> layers = {"processes"};
  std::vector<std::string> missing;  // one line each for the start-up log
  std::vector<std::string> hidden;   // files no session may read
  uid_t uid_first = 200000, uid_count = 65536;
  bool has(const char* layer) const;
  std::string level() const;  // "processes,pids,...", in kSandboxLayers' order
};

// "" and the range set, else what is wrong with `text` (FIRST-LAST).
std::string parse_uid_range(const std::string& text, Sandbox* sandbox);
// Probes each layer in a child process (call before any thread starts);
// a layer that fails is left out and named in `missing`. Exits with a
// message when a user of this board has an id of the range.
void plan_sandbox(Sandbox* sandbox, bool enabled, bool allow_network);
// In a session's process, single-threaded: its namespaces (the mount
// namespace too when `mounts`). "" once done.
std::string enter_namespaces(const Sandbox& sandbox, bool mounts = true);
// Its own mount namespace, whose mounts stay in it. "" once done.
std::string enter_mount_namespace();
// In a session's process once it knows its workspace: the workspace becomes
// its /tmp, the others and the hidden files are covered, and it takes the
// user `uid` for good. "" once done (*root: the workspace as it sees it).
std::string confine_session(const Sandbox& sandbox, const std::string& workspace, uid_t uid,
                            std::string* root);
// "" when only this process's user may read the secret file at `path`.
std::string check_secret_file(const std::string& path);

}  // namespace tether
