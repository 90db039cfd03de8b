// tether-server: the board server in C++ for boards without Python
// (docs/boards.md). It speaks board protocol v2 exactly as
// `python -m remote.server` does and takes the same options; every session
// runs in a process of its own, forked from this one.
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <netdb.h>
#include <string>
#include <thread>
#include <vector>

#include "devinfo.hpp"
#include "http2_refusal.hpp"
#include "sandbox.hpp"
#include "session.hpp"
#include "tracker_link.hpp"
#include "wire.hpp"
#include "workspace.hpp"

namespace tether {
namespace {

constexpr int kServerPort = 9090;
// Connections whose first frame is being served, at most (each in a thread).
// Every connection must send its first frame within kHelloDeadlineMs.
constexpr int kMaxPending = 64;
constexpr int kHelloDeadlineMs = 10000;
// Connections that have not yet sent their whole first frame, at most, in all
// and from one address; past either, the oldest is dropped: a client that
// means it sends its first frame at once, so an idle crowd cannot keep it out.
constexpr int kMaxWaiting = 1024;
constexpr int kMaxWaitingPerSource = 256;
constexpr size_t kFirstFrameBytes = 64 * 1024;
constexpr size_t kFrameHeaderBytes = 12;
// A connection with part of its first frame is looked at again this often.
constexpr int64_t kPartialRecheckMs = 50;
constexpr int kRegisterWaitMs = 5000;
// What a session's process printed, kept for its end reason.
constexpr size_t kOutputTailBytes = 16 * 1024;
// How often a session's watcher looks whether its process has ended, while
// processes the module started keep the process's control socket open.
constexpr int kExitCheckMs = 250;
// Ended sessions whose reason a client may still ask for.
constexpr size_t kEndedKept = 256;

struct Options {
  std::string host = "0.0.0.0";
  int port = kServerPort;
  std::string tracker, key, advertise, farm_secret, workspace_dir, cc = "cc";
  bool relay = false, advertise_given = false, allow_network = false, sandbox_enabled = true;
  // The layers in place, found out at start (plan_sandbox); the range of user
  // ids and the hidden files come from the options.
  Sandbox sandbox;
  StringPairs attributes;
  int max_sessions = 1;
  double idle_timeout_s = 300.0;
  int64_t max_upload_bytes = int64_t(1) << 30;
  // --session-limit NAME=NUMBER: resource limits on every session's processes.
  std::vector<std::pair<int, rlim_t>> session_limits;
  std::string session_limits_text;
  double session_queue_s = 0;
  int poll_us = 100;  // TETHER_POLL_US, as the Python side reads it
};

const char kUsage[] =
    "usage: tether-server [--host HOST] [--port PORT] [--tracker HOST:PORT] [--key KEY]\n"
    "                     [--advertise HOST[:PORT]] [--relay] [--farm-secret-file PATH]\n"
    "                     [--attr NAME=VALUE]... [--max-sessions N] [--idle-timeout SECONDS]\n"
    "                     [--max-upload-bytes N] [--session-queue SECONDS]\n"
    "                     [--workspace-dir DIR] [--cc CC] [--session-limit NAME=NUMBER]...\n"
    "                     [--allow-network] [--no-sandbox] [--session-uids FIRST-LAST] [--version]\n"
    "\n"
    "Run a Tether device server on this board (the native build: no Python needed).\n"
    "Environment: TETHER_TRACKER, TETHER_FARM_SECRET as defaults of --tracker, --farm-secret.\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "%stether-server: error: %s\n", kUsage, message.c_str());
  std::exit(2);
}

bool parse_number(const std::string& text, double* out) {
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return !text.empty() && end && *end == '\0';
}

Options parse_options(int argc, char** argv) {
  Options o;
  if (const char* t = ::getenv("TETHER_TRACKER")) o.tracker = t;
  if (char* s = ::getenv("TETHER_FARM_SECRET")) {
    o.farm_secret = s;
    // Blanked where it lies (the process's first environment, which forked
    // sessions' processes share and /proc/PID/environ shows), then dropped.
    std::memset(s, 'x', std::strlen(s));
    ::unsetenv("TETHER_FARM_SECRET");
  }
  if (const char* cc = ::getenv("CC")) o.cc = cc;
  if (const char* poll = ::getenv("TETHER_POLL_US")) {
    double us;
    if (!parse_number(poll, &us)) {
      usage_error(std::string("TETHER_POLL_US='") + poll + "' is not a number of microseconds; "
                  "unset it, or give e.g. 100 (0 turns polling off)");
    }
    o.poll_us = us < 0 ? 0 : static_cast<int>(us);
  }
  // With one core a poller would hold the CPU the client needs.
  if (::sysconf(_SC_NPROCESSORS_ONLN) < 2) o.poll_us = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    size_t eq = arg.find('=');
    bool inline_value = arg.compare(0, 2, "--") == 0 && eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) usage_error("argument " + arg + ": expected one argument");
      return argv[++i];
    };
    auto number = [&](double low) {
      std::string text = next();
      double v;
      if (!parse_number(text, &v) || v < low) usage_error("argument " + arg + ": invalid value '" + text + "'");
      return v;
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--version") {
      std::printf("tether-server %s (native, board protocol v%d)\n", kServerVersion, kProtocolVersion);
      std::exit(0);
    } else if (arg == "--host") o.host = next();
    else if (arg == "--port") o.port = static_cast<int>(number(0));
    else if (arg == "--tracker") o.tracker = next();
    else if (arg == "--key") o.key = next();
    else if (arg == "--advertise") { o.advertise = next(); o.advertise_given = true; }
    else if (arg == "--relay") o.relay = true;
    else if (arg == "--allow-network") o.allow_network = true;
    else if (arg == "--no-sandbox") o.sandbox_enabled = false;
    else if (arg == "--session-uids") {
      std::string error = parse_uid_range(next(), &o.sandbox);
      if (!error.empty()) usage_error(error);
    }
    else if (arg == "--farm-secret") {
      o.farm_secret = next();
      // Blank it where other processes of this user read the command line.
      if (!inline_value) std::memset(argv[i], 'x', std::strlen(argv[i]));
    } else if (arg == "--farm-secret-file") {
      std::string path = next();
      std::string refused = check_secret_file(path);
      if (!refused.empty()) {
        std::fprintf(stderr, "tether-server: error: %s\n", refused.c_str());
        std::exit(2);
      }
      // Covered in every session's mounts (confine_session).
      char absolute[4096];
      o.sandbox.hidden.push_back(::realpath(path.c_str(), absolute) ? absolute : path);
      FILE* f = std::fopen(path.c_str(), "r");
      if (f == nullptr) usage_error("--farm-secret-file " + path + ": cannot read it: " + std::strerror(errno));
      char line[4096] = "";
      if (std::fgets(line, sizeof line, f) == nullptr) line[0] = '\0';
      std::fclose(f);
      o.farm_secret = line;
      while (!o.farm_secret.empty() && (o.farm_secret.back() == '\n' || o.farm_secret.back() == '\r'))
        o.farm_secret.pop_back();
    }
    else if (arg == "--attr") {
      std::string text = next();
      size_t sep = text.find('=');
      if (sep == std::string::npos || sep == 0) usage_error("attribute '" + text + "' must look like name=value");
      o.attributes.emplace_back(text.substr(0, sep), text.substr(sep + 1));
    } else if (arg == "--max-sessions") o.max_sessions = static_cast<int>(number(1));
    else if (arg == "--idle-timeout") o.idle_timeout_s = number(0);
    else if (arg == "--max-upload-bytes") o.max_upload_bytes = static_cast<int64_t>(number(1));
    else if (arg == "--session-queue") o.session_queue_s = number(0);
    else if (arg == "--workspace-dir") o.workspace_dir = next();
    else if (arg == "--cc") o.cc = next();
    else if (arg == "--session-limit") {
      std::string text = next();
      static const std::pair<const char*, int> kinds[] = {
          {"as", RLIMIT_AS}, {"nproc", RLIMIT_NPROC}, {"fsize", RLIMIT_FSIZE}, {"cpu", RLIMIT_CPU}};
      size_t eq = text.find('=');
      std::string name = text.substr(0, eq), value = eq == std::string::npos ? "" : text.substr(eq + 1);
      int kind = -1;
      for (const auto& k : kinds) if (name == k.first) kind = k.second;
      bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
      if (kind < 0 || !digits) {
        usage_error("session limit '" + text + "' must be NAME=NUMBER with NAME one of as (bytes of address "
                    "space), nproc (processes of the session's user), fsize (bytes a file may grow to), "
                    "cpu (seconds of CPU time)");
      }
      o.session_limits.emplace_back(kind, static_cast<rlim_t>(std::strtoull(value.c_str(), nullptr, 10)));
      o.session_limits_text += (o.session_limits_text.empty() ? "" : ", ") + text;
    }
    else if (arg == "--tls-cert" || arg == "--tls-key" || arg == "--tls-ca") {
      usage_error(arg + ": this native server has no TLS library; use the Python server "
                        "(python -m remote.server) where sessions or the tracker link need TLS");
    } else {
      usage_error("unrecognized argument: " + std::string(argv[i]));
    }
  }
  if (!o.key.empty() && o.tracker.empty()) usage_error("--key needs --tracker HOST:PORT (or set TETHER_TRACKER)");
  if (o.key.empty()) o.tracker.clear();
  if (o.relay && o.tracker.empty()) usage_error("--relay needs a tracker to relay through (--tracker, --key)");
  return o;
}

std::string new_session_id() {
  static const char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::random_device random;
  std::string id;
  for (int i = 0; i < 22; ++i) id += kAlphabet[random() % 64];
  return id;
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    case SIGABRT: return "SIGABRT";
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGTRAP: return "SIGTRAP";
    default: return "signal " + std::to_string(sig);
  }
}

std::string fmt_g(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

// One session, as the server sees it: its process, why it ended, the tail of
// what it printed.
struct Session {
  std::string id, client, lease_token;
  double timeout_s = 0;
  int64_t opened_ms = 0;
  Workspace workspace;
  pid_t pid = 0;
  int control = -1;
  std::string stop_class, stop_reason, own_class, own_reason, tail;
  bool gone = false, reported = false;
};

class DeviceService {
 public:
  DeviceService(const Options& options, DeviceInfo info) : options_(options), info_(std::move(info)) {}

  void attach(TrackerLink* link) { link_ = link; }
  const DeviceInfo* info() const { return &info_; }

  std::vector<std::string> live_tokens() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> tokens;
    for (const auto& kv : sessions_) if (!kv.second->lease_token.empty()) tokens.push_back(kv.second->lease_token);
    return tokens;
  }

  void start_expiry() {
    std::thread([this] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        std::vector<std::pair<std::string, double>> late;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          int64_t now = monotonic_ms();
          for (const auto& kv : sessions_) {
            const Session& s = *kv.second;
            if (s.timeout_s > 0 && now - s.opened_ms > s.timeout_s * 1000) late.emplace_back(s.id, s.timeout_s);
          }
        }
        for (const auto& s : late)
          end(s.first, "its session timeout of " + fmt_g(s.second) + " s was reached", "SessionEnded", true);
      }
    }).detach();
  }

  void stop_all() {
    std::vector<std::string> ids;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (const auto& kv : sessions_) ids.push_back(kv.first);
      slot_free_.notify_all();
    }
    for (const auto& id : ids) end(id, "server stopping", "SessionEnded", true);
  }

  // A new connection: its first frame decides what it is.
  void handle(int fd, const std::string& peer, int64_t deadline_ms) {
    FrameConn conn(fd);
    Frame first;
    ReadStatus status = conn.read_header(&first, deadline_ms, 64 * 1024);
    bool handed_over = false;
    if (status == ReadStatus::kOk) {
      if (first.version != kProtocolVersion) {
        std::string named = first.version ? "protocol v" + std::to_string(first.version)
                                          : "an older protocol (v1)";
        conn.send(error_frame("ConnectionFailed", "this peer speaks Tether board protocol v" +
                                                      std::to_string(kProtocolVersion) + " and the client " +
                                                      named + "; run the same Tether version on both ends"));
      } else if (first.op == "open") {
        handed_over = open(&conn, first, peer);
      } else if (first.op == "status") {
        conn.send(status_of(first.name));
      } else if (first.op == "close") {
        // From a new connection, when the session's own is busy or stuck;
        // the unguessable session id is what entitles the caller.
        end(first.name, "closed by the client", "SessionEnded", true);
        Frame ok;
        ok.op = "ok";
        conn.send(ok);
      } else if (first.op == "info") {
        Frame ok;
        ok.op = "ok";
        ok.info = &info_;
        conn.send(ok);
      } else {
        conn.send(error_frame("InvalidArgument", "a connection must begin with open, status, close or info, not " +
                                                     quote(first.op)));
      }
    } else if (status == ReadStatus::kNotFrames && conn.seen().compare(0, 4, "PRI ") == 0) {
      refuse_grpc(fd, conn.unread(), "this board speaks Tether board protocol v2 and this client protocol v1 "
                                     "(gRPC); update Tether on this computer");
    } else if (status != ReadStatus::kClosed) {
      log_line("connection from %s dropped before a session", peer.c_str());
    }
    if (!handed_over) conn.close();
  }

 private:
  bool open(FrameConn* conn, const Frame& request, const std::string& peer) {
    if (conn->buffered()) {
      conn->send(error_frame("InvalidArgument", "send nothing after open before its answer"));
      return false;
    }
    if (link_ != nullptr) {
      if (request.token.empty()) {
        conn->send(error_frame("AuthenticationError",
                               "this device is behind a tracker: request it through the tracker "
                               "(rpc.connect_tracker(...).request(key)) instead of connecting directly"));
        return false;
      }
      LinkError error;
      if (!link_->redeem(request.token, &error)) {
        conn->send(error_frame(error.error_class, error.text));
        return false;
      }
    }
    std::shared_ptr<Session> session;
    std::string refused;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto deadline = std::chrono::steady_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(options_.session_queue_s * 1000));
      while (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
        if (stopping_ || slot_free_.wait_until(lock, deadline) == std::cv_status::timeout) {
          if (static_cast<int>(sessions_.size()) < options_.max_sessions && !stopping_) break;
          std::string waited = options_.session_queue_s > 0 ? " after waiting " + fmt_g(options_.session_queue_s) + " s" : "";
          refused = "device busy: " + std::to_string(sessions_.size()) + " session(s) open, at most " +
                    std::to_string(options_.max_sessions) + waited +
                    "; try again later or use a tracker to queue (server options --max-sessions, --session-queue)";
          break;
        }
      }
      if (refused.empty()) {
        session = std::make_shared<Session>();
        session->id = new_session_id();
        session->client = request.client.empty() ? peer : request.client;
        session->lease_token = request.token;
        session->timeout_s = request.session_timeout_s;
        session->opened_ms = monotonic_ms();
        sessions_[session->id] = session;
      }
    }
    if (!refused.empty()) {
      conn->send(error_frame("DeviceBusy", refused));
      if (link_ != nullptr) {
        LinkError ignored;
        link_->release(request.token, &ignored);
      }
      return false;
    }
    std::string error;
    session->workspace = Workspace::make(options_.workspace_dir, &error);
    if (session->workspace.root().empty() || !spawn(session, conn->fd(), &error)) {
      end(session->id, "its process could not start: " + error, "RemoteError", false);
      conn->send(error_frame("RemoteError", "the session could not start on the device: " + error));
      return false;
    }
    // Logged before the answer: once the client hears "ok", the log says so.
    log_line("session %.8s opened by %s", session->id.c_str(), session->client.c_str());
    Frame ok;
    ok.op = "ok";
    ok.name = session->id;
    ok.info = &info_;
    ok.size = options_.max_upload_bytes;
    conn->send(ok);
    ::close(conn->fd());  // the session's process has its own copy
    return true;
  }

  // Forks the session's process; it serves `conn_fd` from then on.
  bool spawn(const std::shared_ptr<Session>& session, int conn_fd, std::string* error) {
    int control[2], output[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, control) != 0) {
      *error = std::strerror(errno);
      return false;
    }
    if (::pipe2(output, O_CLOEXEC) != 0) {
      *error = std::strerror(errno);
      ::close(control[0]);
      ::close(control[1]);
      return false;
    }
    SessionSettings settings;
    settings.conn_fd = conn_fd;
    settings.control_fd = control[1];
    settings.workspace = session->workspace.root();
    settings.max_bytes = options_.max_upload_bytes;
    settings.idle_timeout_s = options_.idle_timeout_s;
    settings.poll_us = options_.poll_us;
    settings.cc = options_.cc;
    std::unique_lock<std::mutex> forking(processes_mutex_);
    uid_t uid = take_uid();
    pid_t pid = ::fork();
    if (pid < 0) {
      *error = std::string("fork failed: ") + std::strerror(errno);
      for (int fd : {control[0], control[1], output[0], output[1]}) ::close(fd);
      return false;
    }
    if (pid == 0) {
      ::setpgid(0, 0);  // the session's processes are one group, ended together
      sigset_t all;
      sigemptyset(&all);
      ::sigprocmask(SIG_SETMASK, &all, nullptr);
      // The server's memory is hidden from its user's other processes (see
      // main); the session's process holds none of it that matters, once
      // its copy of the options is gone.
      ::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
      const Sandbox& sandbox = options_.sandbox;
      bool relay = sandbox.has("pids");
      pid_t server = ::getppid();
      std::string why = enter_namespaces(sandbox, !relay);
      if (why.empty() && relay) {
        // The session runs in pid 1 of the namespace: when it ends, the
        // kernel kills every process left in it. This process stays
        // outside (in the server's mounts too), the one the server sees,
        // and ends as it did.
        pid_t inner = ::fork();
        if (inner < 0) why = std::string("fork failed: ") + std::strerror(errno);
        if (inner > 0) {
          close_other_fds({0, 1, 2});
          end_as(inner, server, settings.workspace);
        }
        if (inner == 0) {
          // Pid 1 of a namespace ignores the signals it sends itself, so the
          // session runs in pid 2: a fault that an emulator (qemu-user)
          // delivers with kill(), or a module's raise(), ends it as on any
          // process. Pid 1 only waits for it and ends with its end.
          pid_t session_pid = ::fork();
          if (session_pid < 0) why = std::string("fork failed: ") + std::strerror(errno);
          if (session_pid > 0) {
            close_other_fds({});
            reap_as_init(session_pid);
          }
        }
        if (inner == 0 && why.empty() && sandbox.has("files")) why = enter_mount_namespace();
      }
      if (why.empty()) {
        ::dup2(output[1], 2);  // a failure below is in the session's end reason
        why = confine_session(sandbox, settings.workspace, uid, &settings.workspace);
      }
      if (!why.empty()) {
        std::fprintf(stderr, "the session's sandbox could not be set up: %s\n", why.c_str());
        _exit(1);
      }
      if (::chdir(settings.workspace.c_str()) != 0) {
      }
      for (const auto& limit : options_.session_limits) {
        rlimit value = {limit.second, limit.second};
        ::setrlimit(limit.first, &value);
      }
      std::string& secret = const_cast<std::string&>(options_.farm_secret);
      std::fill(secret.begin(), secret.end(), '\0');
      if (link_ != nullptr) link_->forget_secrets();
      // The child keeps only its connection, its control socket and its
      // output: a copy of another session's connection held here would keep
      // that connection open after its own process ended.
      ::dup2(output[1], 1);
      ::dup2(output[1], 2);
      close_other_fds({0, 1, 2, conn_fd, control[1]});
      ::signal(SIGINT, SIG_IGN);  // Ctrl-C on the server's terminal is the server's
      serve_session(settings);
    }
    session_pids_.insert(pid);
    session_uids_[pid] = uid;
    forking.unlock();
    ::close(control[1]);
    ::close(output[1]);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      session->pid = pid;
      session->control = control[0];
    }
    std::thread([this, session, control_fd = control[0], output_fd = output[0]] {
      watch(session, control_fd, output_fd);
    }).detach();
    return true;
  }

  // What a session started ends with it: its process group, and those that
  // left it (a new session, a double fork) and so came to this server, a
  // subreaper, once their parents ended.
  void end_processes_of(pid_t leader) {
    ::kill(-leader, SIGKILL);
    std::lock_guard<std::mutex> lock(processes_mutex_);
    session_pids_.erase(leader);
    session_uids_.erase(leader);
    for (pid_t pid : own_children()) {
      if (session_pids_.count(pid)) continue;
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
  }

  // A user id of --session-uids no live session has, taken in turn through
  // the range from a random start: an id comes back only after the whole
  // range, so what a session left in a world-writable folder is not the next
  // one's. Called with processes_mutex_ held.
  uid_t take_uid() {
    const Sandbox& sandbox = options_.sandbox;
    if (next_uid_ == 0) next_uid_ = 1 + std::random_device()() % sandbox.uid_count;
    std::set<uid_t> live;
    for (const auto& kv : session_uids_) live.insert(kv.second);
    for (uid_t i = 0; i < sandbox.uid_count; ++i) {
      uid_t uid = sandbox.uid_first + (next_uid_++ % sandbox.uid_count);
      if (!live.count(uid)) return uid;
    }
    return sandbox.uid_first;  // more live sessions than ids: never with the default range
  }

  // Waits for `pid` and ends the way it ended (the same exit code or signal).
  // When `server` has gone meanwhile, removes the session's workspace, which
  // the session saw only as its /tmp.
  [[noreturn]] static void end_as(pid_t pid, pid_t server, const std::string& workspace) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (::getppid() != server) Workspace(workspace).remove_all();
    int signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) > 128) signal = WEXITSTATUS(status) - 128;  // reap_as_init's
    if (signal != 0) {
      rlimit none = {0, 0};
      ::setrlimit(RLIMIT_CORE, &none);
      ::signal(signal, SIG_DFL);
      ::kill(::getpid(), signal);
    }
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
  }

  // Pid 1 of a session's PID namespace: reaps what is orphaned in it until
  // `session` ends, then exits with its exit code, or 128 + its signal
  // (which end_as, outside, turns back into that signal). Its exit ends
  // every process left in the namespace.
  [[noreturn]] static void reap_as_init(pid_t session) {
    int status = 0;
    for (;;) {
      pid_t done = ::waitpid(-1, &status, 0);
      if (done == session) break;
      if (done < 0 && errno != EINTR) _exit(1);
    }
    _exit(WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WIFEXITED(status) ? WEXITSTATUS(status) : 1);
  }

  static bool has_exited(pid_t pid) {
    siginfo_t info;
    info.si_pid = 0;
    return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           info.si_pid == pid;
  }

  static std::vector<pid_t> own_children() {
    std::vector<pid_t> pids;
    DIR* dir = ::opendir("/proc/self/task");
    if (dir == nullptr) return pids;
    while (dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
      std::string path = std::string("/proc/self/task/") + entry->d_name + "/children";
      FILE* f = std::fopen(path.c_str(), "r");
      if (f == nullptr) continue;
      long pid;
      while (std::fscanf(f, "%ld", &pid) == 1) pids.push_back(static_cast<pid_t>(pid));
      std::fclose(f);
    }
    ::closedir(dir);
    return pids;
  }

  static void close_other_fds(std::initializer_list<int> keep) {
    DIR* dir = ::opendir("/proc/self/fd");
    std::vector<int> open_fds;
    if (dir != nullptr) {
      while (dirent* entry = ::readdir(dir)) {
        if (entry->d_name[0] >= '0' && entry->d_name[0] <= '9') open_fds.push_back(std::atoi(entry->d_name));
      }
      ::closedir(dir);
    } else {
      for (int fd = 3; fd < 4096; ++fd) open_fds.push_back(fd);
    }
    for (int fd : open_fds) {
      bool kept = false;
      for (int k : keep) kept = kept || k == fd;
      if (!kept) ::close(fd);
    }
  }

  // Follows one session's process: its messages, its output, its end.
  void watch(std::shared_ptr<Session> session, int control_fd, int output_fd) {
    std::string lines;
    bool control_open = true, output_open = true;
    while (control_open || output_open) {
      pollfd fds[2] = {{control_open ? control_fd : -1, POLLIN, 0}, {output_open ? output_fd : -1, POLLIN, 0}};
      // Once the process has closed its control socket, its output gets a
      // moment to drain (a grandchild could hold the pipe). Processes a module
      // started hold copies of both: the process's own end is looked for too.
      int ready = ::poll(fds, 2, control_open ? kExitCheckMs : 2000);
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0 && (!control_open || has_exited(session->pid))) break;
      char data[65536];
      if (fds[0].revents) {
        ssize_t n = ::recv(control_fd, data, sizeof data, 0);
        if (n <= 0) {
          control_open = false;
        } else {
          lines.append(data, static_cast<size_t>(n));
          for (size_t nl; (nl = lines.find('\n')) != std::string::npos;) {
            std::string line = lines.substr(0, nl);
            lines.erase(0, nl + 1);
            message(session, line);
          }
        }
      }
      if (fds[1].revents) {
        ssize_t n = ::read(output_fd, data, sizeof data);
        if (n <= 0) {
          output_open = false;
        } else {
          std::lock_guard<std::mutex> lock(mutex_);
          session->tail.append(data, static_cast<size_t>(n));
          if (session->tail.size() > kOutputTailBytes) session->tail.erase(0, session->tail.size() - kOutputTailBytes);
        }
      }
    }
    ::close(output_fd);
    int status = 0;
    while (::waitpid(session->pid, &status, 0) < 0 && errno == EINTR) {
    }
    end_processes_of(session->pid);
    std::string error_class, reason;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      session->gone = true;
      describe(*session, status, &error_class, &reason);
      ::close(control_fd);
      session->control = -1;
      // A thread that stopped this process waits for it to be gone before it
      // frees the board; it must not wait out its whole limit.
      changed_.notify_all();
    }
    end(session->id, reason, error_class, false);
    std::lock_guard<std::mutex> lock(mutex_);
    session->reported = true;
    changed_.notify_all();
  }

  void message(const std::shared_ptr<Session>& session, const std::string& line) {
    if (line.compare(0, 4, "end\t") == 0) {
      size_t tab = line.find('\t', 4);
      std::lock_guard<std::mutex> lock(mutex_);
      if (session->own_class.empty()) {
        session->own_class = line.substr(4, tab == std::string::npos ? std::string::npos : tab - 4);
        session->own_reason = tab == std::string::npos ? "" : line.substr(tab + 1);
      }
    } else if (line.compare(0, 4, "log\t") == 0) {
      log_line("session %.8s %s", session->id.c_str(), line.c_str() + 4);
    } else if (line == "close") {
      end(session->id, "closed by the client", "SessionEnded", false);
      send_all(session->control, "released\n", 9);
    }
  }

  static void describe(const Session& s, int status, std::string* error_class, std::string* reason) {
    if (!s.stop_class.empty()) {
      *error_class = s.stop_class;
      *reason = s.stop_reason;
      return;
    }
    if (!s.own_class.empty()) {
      *error_class = s.own_class;
      *reason = s.own_reason;
      return;
    }
    std::string note;
    std::string text = s.tail;
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (!text.empty()) {
      std::vector<std::string> lines;
      size_t start = 0;
      while (start <= text.size()) {
        size_t nl = text.find('\n', start);
        if (nl == std::string::npos) nl = text.size();
        std::string line = text.substr(start, nl - start);
        if (line.size() > 300) line = line.substr(line.size() - 300);
        lines.push_back(line);
        start = nl + 1;
      }
      size_t first = lines.size() > 5 ? lines.size() - 5 : 0;
      note = "; its last output: ";
      for (size_t i = first; i < lines.size(); ++i) note += (i > first ? " | " : "") + lines[i];
    }
    if (WIFSIGNALED(status)) {
      *error_class = "ModuleCrashed";
      *reason = "the process running this session's modules was killed by " + signal_name(WTERMSIG(status)) +
                "; a module it ran crashed (or it ran out of memory)" + note;
    } else {
      *error_class = "SessionEnded";
      *reason = "the process running this session's modules exited with code " +
                std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + note;
    }
  }

 public:
  // Ends a session (idempotent): its process is stopped when `stop_process`,
  // its folder removed and its lease given back; returns once that is done,
  // whichever thread does it.
  void end(const std::string& id, const std::string& why, const std::string& error_class, bool stop_process) {
    std::shared_ptr<Session> session;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto it = sessions_.find(id);
      if (it == sessions_.end()) {
        changed_.wait_for(lock, std::chrono::seconds(30), [&] { return !ending_.count(id); });
        return;
      }
      session = it->second;
      sessions_.erase(it);
      ending_.insert(id);
      ended_[id] = {error_class, why};
      ended_order_.push_back(id);
      while (ended_order_.size() > kEndedKept) {
        ended_.erase(ended_order_.front());
        ended_order_.pop_front();
      }
      if (stop_process && session->pid && !session->gone) {
        if (session->stop_class.empty()) {
          session->stop_class = error_class;
          session->stop_reason = why;
        }
        ::kill(-session->pid, SIGKILL);
        ::kill(session->pid, SIGKILL);
        changed_.wait_for(lock, std::chrono::seconds(10), [&] { return session->gone; });
      }
    }
    session->workspace.remove_all();
    log_line("session %.8s of %s ended: %s", session->id.c_str(), session->client.c_str(), why.c_str());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot_free_.notify_all();
    }
    if (!session->lease_token.empty() && link_ != nullptr) {
      LinkError error;
      if (!link_->release(session->lease_token, &error))
        log_line("could not return the lease to the tracker: %s", error.text.c_str());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    ending_.erase(id);
    changed_.notify_all();
  }

 private:
  Frame status_of(const std::string& id) {
    Frame reply;
    reply.op = "ok";
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = sessions_.find(id);
    if (it != sessions_.end()) {
      // A client asks when its connection broke: give a dying process a
      // moment to be reaped so the answer says why.
      std::shared_ptr<Session> session = it->second;
      if (!changed_.wait_for(lock, std::chrono::seconds(3), [&] { return session->reported; })) {
        reply.open = true;
        return reply;
      }
    }
    auto ended = ended_.find(id);
    if (ended == ended_.end()) {
      reply.open = sessions_.count(id) != 0;
      reply.text = "unknown session";
      reply.error = "SessionError";
      return reply;
    }
    reply.error = ended->second.first;
    reply.text = ended->second.second;
    return reply;
  }

  const Options& options_;
  DeviceInfo info_;
  TrackerLink* link_ = nullptr;
  std::mutex mutex_;
  // Held while a session's process is forked and while strays are ended, so
  // that a process just forked is never taken for a stray.
  std::mutex processes_mutex_;
  std::set<pid_t> session_pids_;
  std::map<pid_t, uid_t> session_uids_;
  uid_t next_uid_ = 0;
  std::condition_variable slot_free_, changed_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::map<std::string, std::pair<std::string, std::string>> ended_;
  std::deque<std::string> ended_order_;
  std::set<std::string> ending_;
  bool stopping_ = false;
};

int listen_on(const std::string& host, int port, int* bound_port) {
  bool v6 = host.find(':') != std::string::npos;
  int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_storage addr = {};
  socklen_t len;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET6, host.c_str(), &a->sin6_addr) != 1) return -1;
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    if (::inet_pton(AF_INET, host.c_str(), &a->sin_addr) != 1) return -1;
    len = sizeof *a;
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, 128) != 0) {
    ::close(fd);
    return -1;
  }
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                         : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

// The local address this machine would use to reach `host` (no packet is sent).
std::string local_address_towards(const std::string& tracker) {
  std::string host = tracker.substr(0, tracker.rfind(':'));
  addrinfo hints = {};
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  std::string result = "127.0.0.1";
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) == 0) {
    int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
      sockaddr_in local = {};
      socklen_t len = sizeof local;
      char text[INET_ADDRSTRLEN];
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
          ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text))
        result = text;
    }
    if (fd >= 0) ::close(fd);
    ::freeaddrinfo(found);
  }
  return result;
}

// Whether a whole first frame waits in ``fd`` (looked at, not read); true too
// for what is not a first frame at all, or a connection that ended: the
// service answers those at once.
bool first_frame_arrived(int fd) {
  static std::vector<unsigned char> head(kFrameHeaderBytes + kFirstFrameBytes);
  ssize_t n = ::recv(fd, head.data(), head.size(), MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  if (n < static_cast<ssize_t>(kFrameHeaderBytes)) return n == 0;
  uint64_t head_len = 0, body_len = 0;
  for (int i = 3; i >= 0; --i) head_len = head_len << 8 | head[i];
  for (int i = 11; i >= 4; --i) body_len = body_len << 8 | head[i];
  if (head_len > kFirstFrameBytes || body_len != 0) return true;
  return static_cast<uint64_t>(n) >= kFrameHeaderBytes + head_len;
}

struct Opening {
  int fd;
  std::string where, source;
  int64_t deadline_ms, recheck_ms;
};

// Accepts connections and waits for each one's first frame in one poll set,
// costing a descriptor and no thread; only a connection whose first frame has
// arrived whole gets a thread of its own (kMaxPending at once). See
// kMaxWaiting for the caps and why the oldest is dropped.
void accept_loop(int listener, DeviceService* service, std::atomic<int>* pending) {
  std::deque<Opening> waiting;  // in order of arrival, so of deadline too
  std::map<std::string, int> per_source;
  std::vector<pollfd> fds;
  auto forget = [&](std::deque<Opening>::iterator it, bool close_it) {
    if (--per_source[it->source] == 0) per_source.erase(it->source);
    if (close_it) ::close(it->fd);
    return waiting.erase(it);
  };
  for (;;) {
    int64_t now = monotonic_ms();
    while (!waiting.empty() && waiting.front().deadline_ms <= now) forget(waiting.begin(), true);
    int64_t timeout = 500;
    if (!waiting.empty()) timeout = std::min(timeout, waiting.front().deadline_ms - now);
    fds.assign(1, pollfd{listener, POLLIN, 0});
    for (const Opening& o : waiting) {
      bool later = o.recheck_ms > now;
      if (later) timeout = std::min(timeout, o.recheck_ms - now);
      fds.push_back(pollfd{later ? -1 : o.fd, POLLIN, 0});
    }
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(timeout, 0)));
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents & (POLLNVAL | POLLERR)) return;  // the listener was closed: the server stops
    size_t i = 1;
    for (auto it = waiting.begin(); it != waiting.end(); ++i) {
      if (fds[i].fd < 0 || !fds[i].revents) {
        ++it;
        continue;
      }
      if (!first_frame_arrived(it->fd) || pending->load() >= kMaxPending) {
        // Part of a frame keeps it readable: polling it again at once would spin.
        it->recheck_ms = monotonic_ms() + kPartialRecheckMs;
        ++it;
        continue;
      }
      int fd = it->fd;
      std::string where = it->where;
      int64_t deadline = it->deadline_ms;
      it = forget(it, false);
      ++*pending;
      std::thread([service, pending, fd, where, deadline] {
        service->handle(fd, where, deadline);
        --*pending;
      }).detach();
    }
    if (!(fds[0].revents & POLLIN)) continue;
    sockaddr_storage peer = {};
    socklen_t len = sizeof peer;
    int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EBADF || errno == EINVAL) return;
      continue;
    }
    char text[INET6_ADDRSTRLEN] = "?";
    int peer_port = 0;
    if (peer.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&peer);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      peer_port = ntohs(a->sin6_port);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&peer);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      peer_port = ntohs(a->sin_port);
    }
    std::string source = text;
    if (per_source[source] >= kMaxWaitingPerSource) {
      log_line("dropped the oldest of %d connections from %s still opening", kMaxWaitingPerSource, text);
      for (auto it = waiting.begin(); it != waiting.end(); ++it) {
        if (it->source == source) {
          forget(it, true);
          break;
        }
      }
    } else if (static_cast<int>(waiting.size()) >= kMaxWaiting) {
      log_line("dropped the oldest of %d connections still opening", kMaxWaiting);
      forget(waiting.begin(), true);
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ++per_source[source];
    waiting.push_back(Opening{fd, source + ":" + std::to_string(peer_port), source,
                              monotonic_ms() + kHelloDeadlineMs, 0});
  }
}

}  // namespace
}  // namespace tether

int main(int argc, char** argv) {
  using namespace tether;
  Options options = parse_options(argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  // Processes whose parents end come to this server, not to init, so that
  // none of a session's outlives it (DeviceService::end_processes_of).
  ::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  // Its memory and /proc files (environment, open files) readable by root
  // only, not by the modules its sessions run as the same user.
  ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  log_line("sandbox: %s", options.session_limits.empty()
                              ? "no --session-limit: a session may use all of the board's memory, disk and CPU "
                                "until its timeouts end it"
                              : options.session_limits_text.c_str());
  // Every thread inherits this mask, so SIGINT/SIGTERM reach sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &stop_signals, nullptr);

  int port = 0;
  int listener = listen_on(options.host, options.port, &port);
  if (listener < 0) {
    std::fprintf(stderr, "tether-server: cannot listen on %s:%d: %s\n", options.host.c_str(), options.port,
                 std::strerror(errno));
    return 1;
  }
  // Before any thread starts: the probes fork.
  plan_sandbox(&options.sandbox, options.sandbox_enabled, options.allow_network);
  std::string level = options.sandbox.level();
  log_line("sandbox: sessions are isolated by %s", level.c_str());
  for (const auto& missing : options.sandbox.missing) log_line("sandbox: %s", missing.c_str());
  DeviceInfo info = collect_device_info(options.attributes);
  // How far sessions are isolated: the server's to say, not the operator's.
  for (auto& kv : info.attributes) {
    if (kv.first == "isolation") kv.second = level;
  }
  DeviceService service(options, std::move(info));
  service.start_expiry();
  std::unique_ptr<TrackerLink> link;
  if (!options.tracker.empty()) {
    std::string advertise = options.advertise;
    if (options.relay) {
      advertise.clear();
    } else if (!options.advertise_given) {
      std::string local = options.host != "0.0.0.0" && options.host != "::" && !options.host.empty()
                              ? options.host : local_address_towards(options.tracker);
      advertise = local + ":" + std::to_string(port);
    } else if (advertise.find(':') == std::string::npos) {
      advertise += ":" + std::to_string(port);
    }
    link.reset(new TrackerLink(
        options.tracker, options.key, advertise, service.info(), options.farm_secret,
        [&service, tracker = options.tracker](int fd) {
          service.handle(fd, "relay via " + tracker, monotonic_ms() + kHelloDeadlineMs);
        },
        [&service] { return service.live_tokens(); }));
    service.attach(link.get());
    link->start();
  }

  std::atomic<int> pending(0);
  std::thread([&] { accept_loop(listener, &service, &pending); }).detach();

  std::string where = "standalone";
  if (link) {
    if (link->wait_registered(kRegisterWaitMs)) {
      where = "registered with " + options.tracker + " as " + options.key;
    } else {
      std::string error = link->last_error();
      where = "not yet registered with " + options.tracker + ": " + (error.empty() ? "no answer" : error) +
              "; retrying in the background";
    }
  }
  std::printf("tether device server listening on %s:%d (%s)\n", options.host.c_str(), port, where.c_str());
  std::fflush(stdout);

  int sig = 0;
  ::sigwait(&stop_signals, &sig);
  ::shutdown(listener, SHUT_RDWR);
  ::close(listener);
  if (link) link->stop();
  service.stop_all();
  return 0;
}
