// The board's link to its tracker (docs/protocol.md, "A board's link to its
// tracker"; remote/server/registration.py is the same in Python): register,
// ping, redeem and release leases, and dial back for relayed clients.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "wire.hpp"

namespace tether {

// A request on the link that failed: the error class and message.
struct LinkError {
  std::string error_class, text;
};

class TrackerLink {
 public:
  TrackerLink(std::string tracker, std::string key, std::string address, const DeviceInfo* info,
              std::string farm_secret, std::function<void(int)> on_relay,
              std::function<std::vector<std::string>()> live_tokens);
  void start();
  void stop();  // logs the lease counts
  bool wait_registered(int timeout_ms);
  std::string last_error();
  // Whether the tracker accepts `token` as a live lease on this board.
  bool redeem(const std::string& token, LinkError* error);
  bool release(const std::string& token, LinkError* error);
  // In a session's forked process, where a module runs: overwrite the farm
  // secret and the board's credential in this copy of the server's memory.
  void forget_secrets();

 private:
  void run();
  double connect_and_register();
  void serve(double interval_s);
  bool send(const Frame& frame);
  bool call(Frame frame, Frame* reply, LinkError* error);
  void relay(std::string relay_id);
  void fail_calls();

  std::string tracker_, key_, address_, farm_secret_;
  const DeviceInfo* info_;
  std::function<void(int)> on_relay_;
  std::function<std::vector<std::string>()> live_tokens_;
  std::string device_id_, credential_;

  std::mutex mutex_;
  std::condition_variable changed_;
  bool registered_ = false, stopping_ = false;
  std::string last_error_;
  int fd_ = -1;
  int64_t next_id_ = 1;
  std::map<int64_t, Frame> replies_;
  std::set<int64_t> waiting_;
  std::mutex send_mutex_;
  int redeemed_ = 0, overlaps_ = 0;
  std::set<std::string> live_;
};

// A connected TCP socket to HOST:PORT (port `default_port` when absent), or -1
// with *error set.
int dial(const std::string& address, int default_port, int timeout_ms, std::string* error);
void log_line(const char* format, ...);

}  // namespace tether
