#include "sandbox.hpp"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace tether {

const char* const kSandboxLayers[6] = {"processes", "pids", "proc", "files", "user", "no-network"};
// World-writable folders besides /tmp that sessions would otherwise share
// (isolation.py's SHARED_FOLDERS).
const char* const kSharedFolders[2] = {"/dev/shm", "/var/tmp"};

bool Sandbox::has(const char* layer) const {
  for (const auto& l : layers) if (l == layer) return true;
  return false;
}

std::string Sandbox::level() const {
  std::string text;
  for (const char* layer : kSandboxLayers) {
    if (has(layer)) text += (text.empty() ? "" : ",") + std::string(layer);
  }
  return text;
}

namespace {

std::string failed(const char* what) { return std::string(what) + " (" + std::strerror(errno) + ")"; }

bool write_file(const char* path, const std::string& text) {
  int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  bool ok = fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  if (fd >= 0) ::close(fd);
  return ok;
}

// Whether the folder of workspaces may be covered: not when it holds this
// server's executable, which a session's process is.
bool may_cover(const std::string& folder) {
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return false;
  std::string path(exe, static_cast<size_t>(n));
  return path.compare(0, folder.size() + 1, folder + "/") != 0;
}

// What the session's process keeps of a user namespace's capabilities: none.
void drop_capabilities() {
  struct { uint32_t version; int pid; } header = {0x20080522, 0};
  uint32_t data[6] = {0, 0, 0, 0, 0, 0};
  ::syscall(SYS_capset, &header, data);
}

// Tries `layers` in a child process as a session would: "" when they work.
std::string probe(const Sandbox& plan, const std::vector<std::string>& layers) {
  Sandbox trial = plan;
  trial.layers = layers;
  trial.hidden.clear();
  char folder[] = "/tmp/tether-probe-XXXXXX";
  if (::mkdtemp(folder) == nullptr) return failed("cannot make a folder to try it in");
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return failed("cannot try it");
  pid_t pid = ::fork();
  if (pid == 0) {
    // As a session's process is: the server's own setting (0) would leave
    // /proc/self/uid_map to root.
    ::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    std::string why = enter_namespaces(trial), root;
    if (why.empty() && trial.has("pids")) {
      // The session's process is in its PID namespace: so is the process
      // that tries the rest.
      pid_t inner = ::fork();
      if (inner > 0) {
        while (::waitpid(inner, nullptr, 0) < 0 && errno == EINTR) {
        }
        _exit(0);
      }
      if (inner < 0 || ::getpid() != 1) why = "a process in a new PID namespace is not its pid 1";
    }
    if (why.empty()) why = confine_session(trial, folder, trial.uid_first, &root);
    ssize_t ignored = ::write(out[1], why.data(), why.size());
    (void)ignored;
    _exit(0);
  }
  ::close(out[1]);
  std::string why;
  char data[512];
  for (ssize_t n; (n = ::read(out[0], data, sizeof data)) > 0;) why.append(data, static_cast<size_t>(n));
  ::close(out[0]);
  while (pid > 0 && ::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  ::rmdir(folder);
  if (pid < 0) return failed("cannot try it: fork failed");
  return why;
}

}  // namespace

std::string parse_uid_range(const std::string& text, Sandbox* sandbox) {
  size_t dash = text.find('-');
  std::string first = text.substr(0, dash), last = dash == std::string::npos ? "" : text.substr(dash + 1);
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() < 11 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  unsigned long long a = digits(first) ? std::strtoull(first.c_str(), nullptr, 10) : 0;
  unsigned long long b = digits(last) ? std::strtoull(last.c_str(), nullptr, 10) : 0;
  if (a == 0 || b < a || b >= 0xFFFFFFFFull) {
    return "--session-uids '" + text + "' must be FIRST-LAST, two user ids above 0, e.g. " +
           kDefaultSessionUids;
  }
  sandbox->uid_first = static_cast<uid_t>(a);
  sandbox->uid_count = static_cast<uid_t>(b - a + 1);
  return "";
}

void plan_sandbox(Sandbox* sandbox, bool enabled, bool allow_network) {
  if (!enabled) {
    sandbox->missing.push_back("no namespaces and no per-session user (--no-sandbox): a module sees this "
                               "board's files, processes and network as this server's user");
    return;
  }
  std::vector<std::string> wanted = {"pids", "files", "proc"};
  if (::geteuid() == 0) {
    ::setpwent();
    while (passwd* entry = ::getpwent()) {
      if (entry->pw_uid >= sandbox->uid_first && entry->pw_uid - sandbox->uid_first < sandbox->uid_count) {
        std::fprintf(stderr, "tether-server: user %s has uid %u, inside --session-uids %u-%u: give a range "
                     "of ids no user has\n", entry->pw_name, static_cast<unsigned>(entry->pw_uid),
                     static_cast<unsigned>(sandbox->uid_first),
                     static_cast<unsigned>(sandbox->uid_first + sandbox->uid_count - 1));
        std::exit(2);
      }
    }
    ::endpwent();
    wanted.push_back("user");
  } else {
    sandbox->missing.push_back("no per-session user: this server does not run as root, so modules run as its "
                               "user and read what it can outside the files covered for them");
  }
  if (allow_network) {
    sandbox->missing.push_back("sessions may use the network (--allow-network)");
  } else {
    wanted.push_back("no-network");
  }
  if (probe(*sandbox, wanted).empty()) {  // all at once, as on most boards: one child tried
    sandbox->layers.insert(sandbox->layers.end(), wanted.begin(), wanted.end());
    return;
  }
  for (const auto& layer : wanted) {
    std::vector<std::string> alone = {layer};
    if (layer == "user" && sandbox->has("files")) alone.push_back("files");
    if (layer == "proc") alone = {"pids", "files", "proc"};
    std::string why = probe(*sandbox, alone);
    if (why.empty()) {
      sandbox->layers.push_back(layer);
      continue;
    }
    const char* what = layer == "pids" ? "no PID namespace: processes a module starts outlive a server killed with SIGKILL"
                       : layer == "files" ? "no mount namespace: a module sees the other sessions' workspaces (to "
                                            "their modes) and the secret file, and shares /tmp, /dev/shm and /var/tmp"
                       : layer == "proc" ? "no /proc of its own: a module sees every process of the board in /proc, "
                                           "their command lines, and (as the server's user) their environments"
                       : layer == "user" ? "no per-session user: this root cannot take the ids of --session-uids (in a "
                                            "container, map them into its user namespace)"
                                         : "no network namespace: a module opens connections from the board";
    sandbox->missing.push_back(std::string(what) + " (" + why + ")");
  }
  // Each works alone; together they must too (one unshare does them all).
  std::string why = sandbox->layers.size() > 1 ? probe(*sandbox, sandbox->layers) : "";
  if (!why.empty()) {
    sandbox->missing.push_back("the namespaces fail together (" + why + "): sessions keep to their processes only");
    sandbox->layers = {"processes"};
  }
}

std::string enter_namespaces(const Sandbox& sandbox, bool mounts) {
  int flags = 0;
  if (sandbox.has("pids")) flags |= CLONE_NEWPID;
  if (sandbox.has("files") && mounts) flags |= CLONE_NEWNS;
  if (sandbox.has("no-network")) flags |= CLONE_NEWNET;
  if (flags == 0) return "";
  uid_t uid = ::geteuid();
  gid_t gid = ::getegid();
  if (uid != 0) flags |= CLONE_NEWUSER;
  if (::unshare(flags) != 0) return failed("this kernel refuses the namespaces here");
  if (flags & CLONE_NEWUSER) {
    if (!write_file("/proc/self/setgroups", "deny") ||
        !write_file("/proc/self/uid_map", std::to_string(uid) + " " + std::to_string(uid) + " 1") ||
        !write_file("/proc/self/gid_map", std::to_string(gid) + " " + std::to_string(gid) + " 1")) {
      return failed("cannot map this user in a user namespace");
    }
  }
  if ((flags & CLONE_NEWNS) && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return failed("cannot keep this session's mounts to itself");
  }
  return "";
}

std::string enter_mount_namespace() {
  if (::unshare(CLONE_NEWNS) != 0) return failed("this kernel refuses a mount namespace here");
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return failed("cannot keep this session's mounts to itself");
  }
  return "";
}

std::string confine_session(const Sandbox& sandbox, const std::string& workspace, uid_t uid,
                            std::string* root) {
  bool user = sandbox.has("user");
  *root = workspace;
  if ((user && ::chown(workspace.c_str(), uid, uid) != 0) || ::chmod(workspace.c_str(), 0700) != 0) {
    return failed("cannot give the session its workspace");
  }
  if (sandbox.has("files")) {
    // A bind fails where the file is already out of sight.
    for (const auto& path : sandbox.hidden) ::mount("/dev/null", path.c_str(), nullptr, MS_BIND, nullptr);
    if (::mount(workspace.c_str(), "/tmp", nullptr, MS_BIND, nullptr) != 0) {
      return failed("cannot make the session's workspace its /tmp");
    }
    std::string parent = workspace.substr(0, workspace.rfind('/'));
    if (parent != "/tmp" && parent.compare(0, 5, "/tmp/") != 0 && !parent.empty() && may_cover(parent)) {
      ::mount("tmpfs", parent.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555");
    }
    for (const char* folder : kSharedFolders) {
      struct stat info;
      if (::stat(folder, &info) != 0 || !S_ISDIR(info.st_mode) || !may_cover(folder)) continue;
      if (::mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") != 0) {
        return failed((std::string("cannot give the session a ") + folder + " of its own").c_str());
      }
    }
    // Mounted by a process of the session's PID namespace, /proc shows that
    // namespace's processes only.
    if (sandbox.has("proc") && ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
      return failed("cannot give the session a /proc of its own");
    }
    *root = "/tmp";
  }
  if (user) {
    if (::setgroups(0, nullptr) != 0 || ::setresgid(uid, uid, uid) != 0 || ::setresuid(uid, uid, uid) != 0) {
      return failed("cannot take the session's user");
    }
    // A change of user makes the process undumpable: its /proc files
    // would be root's, not its own user's.
    ::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
  } else {
    drop_capabilities();
  }
  // No set-user-id program gives a module back what it has left.
  ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
  // The process outside the namespace that waits for this one: if it is
  // killed, this one goes too, and with it the namespace (set after the
  // change of user, which clears it).
  if (sandbox.has("pids")) ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  return "";
}

std::string check_secret_file(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return "--farm-secret-file " + path + ": cannot read it: " + std::strerror(errno);
  if (info.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 0777));
    return "--farm-secret-file " + path + " may be read by others (mode " + mode +
           "); make it this user's alone: chmod 600 " + path;
  }
  if (info.st_uid != ::geteuid()) {
    return "--farm-secret-file " + path + " belongs to uid " + std::to_string(info.st_uid) +
           ", not to this server's user (uid " + std::to_string(::geteuid()) +
           "): chown it to that user, then chmod 600 " + path;
  }
  return "";
}

}  // namespace tether
