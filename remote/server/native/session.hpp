// The process that serves one session (forked by the server for each one):
// files, tensors left on the board, loaded modules, runs, timing and
// profiles, on the session's own connection (docs/sessions.md).
#pragma once

#include <cstdint>
#include <string>

namespace tether {

struct SessionSettings {
  int conn_fd = -1;      // the client's connection
  int control_fd = -1;   // to the server: "end\t<class>\t<reason>", "close"; back: "released"
  std::string workspace;
  int64_t max_bytes = 0;
  double idle_timeout_s = 0;
  int poll_us = 0;       // how long to poll for the next request before sleeping
  std::string cc;        // links uploaded .tar modules
};

// Serves the session until it ends; never returns (the process exits).
[[noreturn]] void serve_session(const SessionSettings& settings);

}  // namespace tether
