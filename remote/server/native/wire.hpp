// Board protocol v2 on the wire (docs/protocol.md): the DataFrame message and
// the few messages inside it, encoded and decoded by hand, and frames on a
// socket. A board needs no protobuf library: the messages are written from
// the field numbers of remote/proto/tether_v1.proto.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tether {

constexpr int32_t kProtocolVersion = 2;
// 1 MiB chunks, as the Python side uses: the checksum's block size too.
constexpr size_t kChunkBytes = 1 << 20;

using StringPairs = std::vector<std::pair<std::string, std::string>>;

struct TensorDesc {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

struct FileEntry {
  std::string name;
  int64_t size = 0;
};

struct DeviceInfo {
  std::string triple, machine, cpu_model;
  std::vector<std::string> cpu_features;
  int32_t cores = 0;
  int64_t memory_bytes = 0;
  std::string os, server_version, emulated;
  StringPairs attributes;
};

// tether.v1.DataFrame; fields the native server never reads or writes are
// skipped when decoding.
struct Frame {
  std::string op, name;
  int64_t size = 0;
  std::vector<TensorDesc> tensors;
  StringPairs refs;
  std::string checksum;
  double seconds = 0;
  std::string text, error;
  double timeout_s = 0;
  std::string token;
  int32_t number = 0, repeat = 0;
  double min_repeat_ms = 0, cooldown_ms = 0;
  int32_t version = 0;
  int64_t id = 0;
  std::string client;
  double session_timeout_s = 0;
  const DeviceInfo* info = nullptr;  // written only
  std::vector<FileEntry> files;
  std::string key, address, device_id;
  std::vector<std::string> live_tokens;
  std::string farm_secret;
  bool relay = false, open = false;

  std::string encode() const;
  bool decode(const uint8_t* data, size_t length);
};

Frame error_frame(const std::string& error_class, const std::string& text);

// The "fsum64" checksum of a transfer (remote/proto/frames.py, Checksum):
// Fletcher-style sums of little-endian 64-bit words over 1 MiB blocks.
class Checksum {
 public:
  void update(const uint8_t* data, size_t size);
  std::string text() const;

 private:
  void add(const uint8_t* data, size_t size);
  void close_block(uint64_t* a, uint64_t* b) const;
  uint64_t a_ = 0, b_ = 0, x_ = 0, block_sum_ = 0;
  size_t block_fill_ = 0;
  uint8_t tail_[8] = {};
  size_t tail_size_ = 0;
  uint64_t length_ = 0;
};

// Why a read failed.
enum class ReadStatus { kOk, kClosed, kTimeout, kNotFrames, kError };

// Whether a reader's next wait polls before it blocks, from how its recent
// polls went (remote/proto/frames.py's PollGate, docs/sessions.md "Small
// calls"): after a poll that ran out (miss) or lost the core (preempted),
// the next `pause_left` waits block at once; each bad poll in a row doubles
// the pause, up to kMaxPause waits; a hit resets it.
struct PollGate {
  enum Outcome { kHit, kMiss, kPreempted };
  static constexpr int kMaxPause = 64;
  int pause_left = 0;
  int next_pause = 1;
  uint64_t hits = 0, misses = 0, preempted = 0, skipped = 0;
  bool polling() const { return pause_left == 0; }
  // Before a wait that would poll: false when it must block at once.
  bool take_turn() {
    if (!pause_left) return true;
    --pause_left;
    ++skipped;
    return false;
  }
  void record(Outcome outcome) {
    if (outcome == kHit) {
      ++hits;
      next_pause = 1;
      return;
    }
    ++(outcome == kMiss ? misses : preempted);
    pause_left = next_pause;
    next_pause = next_pause * 2 < kMaxPause ? next_pause * 2 : kMaxPause;
  }
};

// A connected socket that speaks frames.
class FrameConn {
 public:
  explicit FrameConn(int fd);
  int fd() const { return fd_; }
  // A read with no deadline first polls for up to `us` microseconds (a
  // non-blocking recv again and again), then sleeps.
  void set_poll_us(int us) { poll_us_ = us; }
  const PollGate& poll_gate() const { return gate_; }
  // Reads the next frame's header (skipping what is left of the last body).
  // deadline_ms: absolute CLOCK_MONOTONIC milliseconds, or 0 for none.
  ReadStatus read_header(Frame* frame, int64_t deadline_ms = 0, size_t max_header = 16u << 20);
  int64_t body_left() const { return body_left_; }
  bool read_body(void* buffer, size_t size);
  bool skip_body();
  // Bytes received and not yet read (a client that sent ahead of an answer).
  size_t buffered() const { return end_ - start_; }
  // The first bytes of what was not a frame (to tell an HTTP/2 peer).
  const std::string& seen() const { return seen_; }
  // Every byte received and not yet read as frames.
  std::string unread() const {
    return std::string(reinterpret_cast<const char*>(buffer_.data()) + start_, end_ - start_);
  }

  bool send(const Frame& frame);
  bool send(const Frame& frame, const std::vector<std::pair<const void*, size_t>>& body);
  // A frame whose body the caller sends with send_raw.
  bool send_prefix(const Frame& frame, uint64_t body_size);
  bool send_raw(const void* data, size_t size);
  // Sends `count` bytes of file `fd` from `offset` with sendfile(2); *sent
  // says how many went (fewer when the file ended first). False: the
  // connection failed.
  bool send_file(int fd, int64_t offset, size_t count, size_t* sent);
  void close();

 private:
  bool fill(size_t count, int64_t deadline_ms, ReadStatus* status);
  bool read_into(uint8_t* out, size_t size);
  int fd_;
  std::vector<uint8_t> buffer_;
  size_t start_ = 0, end_ = 0;
  int64_t body_left_ = 0;
  int poll_us_ = 0;
  bool back_to_back_ = true;  // the last frame came within the polling window
  PollGate gate_;
  std::string seen_;
};

int64_t monotonic_ms();
int64_t monotonic_us();
double monotonic_s();
bool send_all(int fd, const void* data, size_t size);

}  // namespace tether
