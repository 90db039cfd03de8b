#include "tracker_link.hpp"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

namespace tether {

namespace {
constexpr int kCallTimeoutMs = 5000;
constexpr int kConnectTimeoutMs = 5000;
constexpr double kMaxBackoffS = 5.0;
constexpr int kTrackerPort = 9190;
}  // namespace

void log_line(const char* format, ...) {
  char stamp[32];
  time_t now = ::time(nullptr);
  tm local;
  ::localtime_r(&now, &local);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &local);
  char text[2048];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  std::fprintf(stderr, "%s tether.server %s\n", stamp, text);
  std::fflush(stderr);
}

int dial(const std::string& address, int default_port, int timeout_ms, std::string* error) {
  std::string host = address;
  std::string port = std::to_string(default_port);
  size_t colon = address.rfind(':');
  if (!address.empty() && address[0] == '[') {  // [v6]:port
    size_t close = address.find(']');
    host = address.substr(1, close - 1);
    if (close + 1 < address.size() && address[close + 1] == ':') port = address.substr(close + 2);
  } else if (colon != std::string::npos && address.find(':') == colon) {
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  addrinfo hints = {};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    *error = "cannot resolve " + host + ": " + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  *error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc2 = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc2 != 0 && errno == EINPROGRESS) {
      pollfd p = {fd, POLLOUT, 0};
      if (::poll(&p, 1, timeout_ms) == 1) {
        int soerr = 0;
        socklen_t len = sizeof soerr;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        rc2 = soerr ? -1 : 0;
        errno = soerr;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc2 == 0) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      break;
    }
    *error = errno == ECONNREFUSED ? "connection refused (is the tracker running, and is the address right?)"
                                   : std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(found);
  return fd;
}

TrackerLink::TrackerLink(std::string tracker, std::string key, std::string address,
                         const DeviceInfo* info, std::string farm_secret,
                         std::function<void(int)> on_relay,
                         std::function<std::vector<std::string>()> live_tokens)
    : tracker_(std::move(tracker)), key_(std::move(key)), address_(std::move(address)),
      farm_secret_(std::move(farm_secret)), info_(info), on_relay_(std::move(on_relay)),
      live_tokens_(std::move(live_tokens)) {}

void TrackerLink::start() {
  std::thread([this] { run(); }).detach();
}

void TrackerLink::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stopping_ = true;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  changed_.notify_all();
  log_line("lease stats: redeemed=%d overlaps=%d", redeemed_, overlaps_);
}

bool TrackerLink::wait_registered(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  return changed_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return registered_; });
}

std::string TrackerLink::last_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

void TrackerLink::run() {
  double backoff = 0.2;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    std::string failure;
    double interval = connect_and_register();
    if (interval > 0) {
      backoff = 0.2;
      serve(interval);
    } else if (interval < -1) {
      backoff = kMaxBackoffS;  // refused: asking again at once would be refused again
    }
    int fd;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      registered_ = false;
      fd = fd_;
      fd_ = -1;
      failure = last_error_;
    }
    if (fd >= 0) ::close(fd);
    fail_calls();
    if (interval == 0 || interval < -1) {
      log_line("tracker %s: %s; trying again in %.1f s", tracker_.c_str(), failure.c_str(), backoff);
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (changed_.wait_for(lock, std::chrono::milliseconds(static_cast<int>(backoff * 1000)),
                          [this] { return stopping_; }))
      return;
    backoff = backoff * 2 < kMaxBackoffS ? backoff * 2 : kMaxBackoffS;
  }
}

// The ping interval the tracker asked for; 0 on a failure to connect, -2
// when the tracker refused this board.
double TrackerLink::connect_and_register() {
  std::string error;
  int fd = dial(tracker_, kTrackerPort, kConnectTimeoutMs, &error);
  if (fd < 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    last_error_ = error;
    return 0;
  }
  std::vector<std::string> live = live_tokens_();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fd_ = fd;
    live.insert(live.end(), live_.begin(), live_.end());
  }
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  Frame reg;
  reg.op = "register";
  reg.version = kProtocolVersion;
  reg.key = key_;
  reg.address = address_;
  reg.info = info_;
  reg.device_id = device_id_;
  reg.token = credential_;
  reg.farm_secret = farm_secret_;
  reg.live_tokens = live;
  reg.relay = address_.empty();
  FrameConn conn(fd);
  Frame reply;
  ReadStatus status = ReadStatus::kError;
  if (send(reg)) status = conn.read_header(&reply, monotonic_ms() + kCallTimeoutMs);
  std::lock_guard<std::mutex> lock(mutex_);
  if (status != ReadStatus::kOk) {
    if (status == ReadStatus::kNotFrames) {
      last_error_ = tracker_ + " answered in HTTP/2: it is a protocol v1 tracker (gRPC only); run the "
                               "same Tether version on the tracker and the boards";
    } else if (status == ReadStatus::kTimeout) {
      last_error_ = "the tracker did not answer the registration within 5 s";
    } else {
      last_error_ = "the tracker closed the link";
    }
    return 0;
  }
  if (reply.op == "error") {
    last_error_ = reply.text;
    if (reply.error == "AuthenticationError") {
      log_line("tracker %s refused this board: %s", tracker_.c_str(), reply.text.c_str());
      if (!device_id_.empty()) {
        // Its id is not (or no longer) this board's to take: join as a new
        // board rather than be refused for good.
        device_id_.clear();
        credential_.clear();
        return 0;
      }
      return -2;
    }
    return 0;
  }
  bool again = !device_id_.empty();
  device_id_ = reply.name;
  credential_ = reply.token;
  last_error_.clear();
  std::string how = address_.empty() ? " through its relay" : ", address " + address_;
  log_line("registered%s with tracker %s as %s (key %s%s)", again ? " again" : "", tracker_.c_str(),
           device_id_.c_str(), key_.c_str(), how.c_str());
  registered_ = true;
  changed_.notify_all();
  return reply.seconds > 0 ? reply.seconds : 1.0;
}

// Reads the tracker's frames; pings whenever it has been quiet for `interval_s`.
void TrackerLink::serve(double interval_s) {
  int fd;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fd = fd_;
  }
  FrameConn conn(fd);
  int64_t interval_ms = static_cast<int64_t>(interval_s * 1000);
  int64_t last_heard = monotonic_ms();
  Frame ping;
  ping.op = "ping";
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    Frame frame;
    ReadStatus status = conn.read_header(&frame, monotonic_ms() + interval_ms);
    if (status == ReadStatus::kTimeout) {
      if (monotonic_ms() - last_heard > 3 * interval_ms + kCallTimeoutMs) {
        std::lock_guard<std::mutex> lock(mutex_);
        last_error_ = "the tracker stopped answering";
        return;
      }
      if (!send(ping)) {
        std::lock_guard<std::mutex> lock(mutex_);
        last_error_ = "the tracker closed the link";
        return;
      }
      continue;
    }
    if (status != ReadStatus::kOk) {
      std::lock_guard<std::mutex> lock(mutex_);
      last_error_ = "the tracker closed the link";
      return;
    }
    last_heard = monotonic_ms();
    if (frame.op == "relay") {
      std::string relay_id = frame.name;
      std::thread([this, relay_id] { relay(relay_id); }).detach();
    } else if (frame.id) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (waiting_.count(frame.id)) {
        replies_[frame.id] = frame;
        changed_.notify_all();
      }
    }
  }
}

bool TrackerLink::send(const Frame& frame) {
  int fd;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fd = fd_;
  }
  if (fd < 0) return false;
  std::lock_guard<std::mutex> lock(send_mutex_);
  FrameConn conn(fd);
  return conn.send(frame);
}

void TrackerLink::fail_calls() {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.clear();
  changed_.notify_all();
}

bool TrackerLink::call(Frame frame, Frame* reply, LinkError* error) {
  int64_t id;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!changed_.wait_for(lock, std::chrono::milliseconds(kCallTimeoutMs), [this] { return registered_; })) {
      *error = {"ConnectionFailed", "this board is not registered with tracker " + tracker_ + " (" +
                                        (last_error_.empty() ? "connecting" : last_error_) +
                                        "); try again shortly"};
      return false;
    }
    id = next_id_++;
    waiting_.insert(id);
  }
  frame.id = id;
  if (!send(frame)) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(id);
    *error = {"ConnectionFailed", "tracker " + tracker_ + ": the link is down"};
    return false;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  bool answered = changed_.wait_for(lock, std::chrono::milliseconds(kCallTimeoutMs), [&] {
    return replies_.count(id) || !waiting_.count(id);
  });
  waiting_.erase(id);
  auto it = replies_.find(id);
  if (!answered || it == replies_.end()) {
    *error = {"ConnectionFailed", "tracker " + tracker_ + " did not answer " + frame.op + " within 5 s"};
    return false;
  }
  *reply = it->second;
  replies_.erase(it);
  if (reply->op == "error") {
    *error = {reply->error.empty() ? "RemoteError" : reply->error, reply->text};
    return false;
  }
  return true;
}

bool TrackerLink::redeem(const std::string& token, LinkError* error) {
  Frame frame, reply;
  frame.op = "redeem";
  frame.token = token;
  if (!call(frame, &reply, error)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  ++redeemed_;
  if (!live_.empty()) {
    ++overlaps_;
    log_line("lease redeemed while %zu other(s) were live", live_.size());
  }
  live_.insert(token);
  return true;
}

bool TrackerLink::release(const std::string& token, LinkError* error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(token);
  }
  Frame frame, reply;
  frame.op = "release";
  frame.token = token;
  return call(frame, &reply, error);
}

// Dials the tracker for a client it is relaying, and serves that connection.
void TrackerLink::relay(std::string relay_id) {
  std::string error;
  int fd = dial(tracker_, kTrackerPort, kConnectTimeoutMs, &error);
  if (fd < 0) {
    log_line("could not connect back to tracker %s for a relayed session: %s", tracker_.c_str(), error.c_str());
    return;
  }
  Frame hello;
  hello.op = "relay";
  hello.version = kProtocolVersion;
  hello.name = relay_id;
  hello.device_id = device_id_;
  hello.farm_secret = farm_secret_;
  FrameConn conn(fd);
  if (!conn.send(hello)) {
    ::close(fd);
    return;
  }
  on_relay_(fd);
}

void TrackerLink::forget_secrets() {
  for (std::string* secret : {&farm_secret_, &credential_}) {
    std::fill(secret->begin(), secret->end(), '\0');
    secret->clear();
  }
}

}  // namespace tether
