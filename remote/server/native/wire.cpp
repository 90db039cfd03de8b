#include "wire.hpp"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace tether {

namespace {

enum WireType { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

class Writer {
 public:
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out.push_back(static_cast<char>(v));
  }
  void tag(int field, WireType type) { varint((static_cast<uint64_t>(field) << 3) | type); }
  void string(int field, const std::string& s) {
    if (s.empty()) return;
    tag(field, kBytes);
    varint(s.size());
    out += s;
  }
  void repeated_string(int field, const std::string& s) {  // empty elements are kept
    tag(field, kBytes);
    varint(s.size());
    out += s;
  }
  void int64(int field, int64_t v) {
    if (v == 0) return;
    tag(field, kVarint);
    varint(static_cast<uint64_t>(v));  // negative int32/int64 take ten bytes, as protobuf's
  }
  void boolean(int field, bool v) {
    if (!v) return;
    tag(field, kVarint);
    varint(1);
  }
  void float64(int field, double v) {
    if (v == 0) return;
    tag(field, kFixed64);
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(bits >> (8 * i)));
  }
  void message(int field, const std::string& encoded) {
    tag(field, kBytes);
    varint(encoded.size());
    out += encoded;
  }
  void pairs(int field, const StringPairs& entries) {
    for (const auto& kv : entries) {
      Writer entry;
      entry.string(1, kv.first);
      entry.string(2, kv.second);
      message(field, entry.out);
    }
  }
  std::string out;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  bool done() const { return p_ >= end_; }
  bool varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) return false;
      uint8_t byte = *p_++;
      *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  }
  bool tag(int* field, int* type) {
    uint64_t v;
    if (!varint(&v)) return false;
    *field = static_cast<int>(v >> 3);
    *type = static_cast<int>(v & 7);
    return *field > 0;
  }
  bool bytes(const uint8_t** data, size_t* size) {
    uint64_t n;
    if (!varint(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
    *data = p_;
    *size = static_cast<size_t>(n);
    p_ += n;
    return true;
  }
  bool string(std::string* s) {
    const uint8_t* data;
    size_t size;
    if (!bytes(&data, &size)) return false;
    s->assign(reinterpret_cast<const char*>(data), size);
    return true;
  }
  bool float64(double* v) {
    if (end_ - p_ < 8) return false;
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits |= static_cast<uint64_t>(p_[i]) << (8 * i);
    std::memcpy(v, &bits, 8);
    p_ += 8;
    return true;
  }
  bool skip(int type) {
    uint64_t v;
    const uint8_t* data;
    size_t size;
    switch (type) {
      case kVarint: return varint(&v);
      case kFixed64: if (end_ - p_ < 8) return false; p_ += 8; return true;
      case kBytes: return bytes(&data, &size);
      case kFixed32: if (end_ - p_ < 4) return false; p_ += 4; return true;
      default: return false;  // groups are not used by the protocol
    }
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

std::string encode_info(const DeviceInfo& info) {
  Writer w;
  w.string(1, info.triple);
  w.string(2, info.machine);
  w.string(3, info.cpu_model);
  for (const auto& f : info.cpu_features) w.repeated_string(4, f);
  w.int64(5, info.cores);
  w.int64(6, info.memory_bytes);
  w.string(7, info.os);
  w.pairs(12, info.attributes);
  w.string(13, info.server_version);
  w.string(14, info.emulated);
  return w.out;
}

std::string encode_tensor(const TensorDesc& t) {
  Writer w;
  w.string(1, t.name);
  w.string(2, t.dtype);
  if (!t.shape.empty()) {
    Writer packed;
    for (int64_t d : t.shape) packed.varint(static_cast<uint64_t>(d));
    w.message(3, packed.out);
  }
  return w.out;
}

bool decode_tensor(const uint8_t* data, size_t size, TensorDesc* t) {
  Reader r(data, size);
  while (!r.done()) {
    int field, type;
    if (!r.tag(&field, &type)) return false;
    if (field == 1 && type == kBytes) {
      if (!r.string(&t->name)) return false;
    } else if (field == 2 && type == kBytes) {
      if (!r.string(&t->dtype)) return false;
    } else if (field == 3 && type == kBytes) {  // packed, as proto3 writes it
      const uint8_t* p;
      size_t n;
      if (!r.bytes(&p, &n)) return false;
      Reader packed(p, n);
      while (!packed.done()) {
        uint64_t v;
        if (!packed.varint(&v)) return false;
        t->shape.push_back(static_cast<int64_t>(v));
      }
    } else if (field == 3 && type == kVarint) {
      uint64_t v;
      if (!r.varint(&v)) return false;
      t->shape.push_back(static_cast<int64_t>(v));
    } else if (!r.skip(type)) {
      return false;
    }
  }
  return true;
}

bool decode_pair(const uint8_t* data, size_t size, std::pair<std::string, std::string>* kv) {
  Reader r(data, size);
  while (!r.done()) {
    int field, type;
    if (!r.tag(&field, &type)) return false;
    if (field == 1 && type == kBytes) {
      if (!r.string(&kv->first)) return false;
    } else if (field == 2 && type == kBytes) {
      if (!r.string(&kv->second)) return false;
    } else if (!r.skip(type)) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string Frame::encode() const {
  Writer w;
  w.string(1, op);
  w.string(2, name);
  w.int64(3, size);
  for (const auto& t : tensors) w.message(4, encode_tensor(t));
  w.pairs(5, refs);
  w.string(6, checksum);
  w.float64(7, seconds);
  w.string(8, text);
  w.string(9, error);
  w.float64(10, timeout_s);
  w.string(11, token);
  w.int64(13, number);
  w.int64(14, repeat);
  w.float64(15, min_repeat_ms);
  w.float64(16, cooldown_ms);
  w.int64(17, version);
  w.int64(18, id);
  w.string(19, client);
  w.float64(20, session_timeout_s);
  if (info != nullptr) w.message(21, encode_info(*info));
  for (const auto& f : files) {
    Writer entry;
    entry.string(1, f.name);
    entry.int64(2, f.size);
    w.message(22, entry.out);
  }
  w.string(23, key);
  w.string(24, address);
  w.string(25, device_id);
  for (const auto& t : live_tokens) w.repeated_string(26, t);
  w.string(27, farm_secret);
  w.boolean(28, relay);
  w.boolean(29, open);
  return w.out;
}

bool Frame::decode(const uint8_t* data, size_t length) {
  Reader r(data, length);
  while (!r.done()) {
    int field, type;
    if (!r.tag(&field, &type)) return false;
    uint64_t v = 0;
    bool ok = true;
    if (type == kBytes) {
      switch (field) {
        case 1: ok = r.string(&op); break;
        case 2: ok = r.string(&name); break;
        case 4: {
          const uint8_t* p;
          size_t n;
          tensors.emplace_back();
          ok = r.bytes(&p, &n) && decode_tensor(p, n, &tensors.back());
          break;
        }
        case 5: {
          const uint8_t* p;
          size_t n;
          refs.emplace_back();
          ok = r.bytes(&p, &n) && decode_pair(p, n, &refs.back());
          break;
        }
        case 6: ok = r.string(&checksum); break;
        case 8: ok = r.string(&text); break;
        case 9: ok = r.string(&error); break;
        case 11: ok = r.string(&token); break;
        case 19: ok = r.string(&client); break;
        case 23: ok = r.string(&key); break;
        case 24: ok = r.string(&address); break;
        case 25: ok = r.string(&device_id); break;
        case 26: live_tokens.emplace_back(); ok = r.string(&live_tokens.back()); break;
        case 27: ok = r.string(&farm_secret); break;
        default: ok = r.skip(type);
      }
    } else if (type == kFixed64) {
      double d = 0;
      ok = r.float64(&d);
      switch (field) {
        case 7: seconds = d; break;
        case 10: timeout_s = d; break;
        case 15: min_repeat_ms = d; break;
        case 16: cooldown_ms = d; break;
        case 20: session_timeout_s = d; break;
        default: break;
      }
    } else if (type == kVarint) {
      ok = r.varint(&v);
      switch (field) {
        case 3: size = static_cast<int64_t>(v); break;
        case 13: number = static_cast<int32_t>(v); break;
        case 14: repeat = static_cast<int32_t>(v); break;
        case 17: version = static_cast<int32_t>(v); break;
        case 18: id = static_cast<int64_t>(v); break;
        case 28: relay = v != 0; break;
        case 29: open = v != 0; break;
        default: break;
      }
    } else {
      ok = r.skip(type);
    }
    if (!ok) return false;
  }
  return true;
}

Frame error_frame(const std::string& error_class, const std::string& text) {
  Frame f;
  f.op = "error";
  f.error = error_class;
  f.text = text;
  return f;
}

// ------------------------------------------------------------- checksum --

namespace {
uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
}  // namespace

void Checksum::update(const uint8_t* data, size_t size) {
  length_ += size;
  while (size) {
    size_t n = size < kChunkBytes - block_fill_ ? size : kChunkBytes - block_fill_;
    add(data, n);
    block_fill_ += n;
    data += n;
    size -= n;
    if (block_fill_ == kChunkBytes) {
      close_block(&a_, &b_);
      block_sum_ = 0;
      block_fill_ = 0;
    }
  }
}

void Checksum::add(const uint8_t* data, size_t size) {
  if (tail_size_) {
    while (tail_size_ < 8 && size) {
      tail_[tail_size_++] = *data++;
      --size;
    }
    if (tail_size_ < 8) return;
    uint64_t word = load_le64(tail_);
    block_sum_ += word;
    x_ ^= word;
    tail_size_ = 0;
  }
  size_t whole = size & ~static_cast<size_t>(7);
  uint64_t sum = 0, x = 0;
  for (size_t i = 0; i < whole; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);  // every board this serves is little-endian
    sum += word;
    x ^= word;
  }
  block_sum_ += sum;
  x_ ^= x;
  for (size_t i = whole; i < size; ++i) tail_[tail_size_++] = data[i];
}

void Checksum::close_block(uint64_t* a, uint64_t* b) const {
  uint64_t word = 0;
  if (tail_size_) {
    uint8_t padded[8] = {};
    std::memcpy(padded, tail_, tail_size_);
    word = load_le64(padded);
  }
  // The block's words, then this block added to the running A and B.
  uint64_t new_a = a_ + block_sum_ + word;
  *b = b_ + new_a;
  *a = new_a;
}

std::string Checksum::text() const {
  uint64_t a = a_, b = b_, x = x_;
  if (block_fill_) close_block(&a, &b);
  if (tail_size_) {
    uint8_t padded[8] = {};
    std::memcpy(padded, tail_, tail_size_);
    x ^= load_le64(padded);
  }
  char out[96];
  std::snprintf(out, sizeof out, "fsum64:%016llx%016llx%016llx:%llu",
                static_cast<unsigned long long>(a), static_cast<unsigned long long>(b),
                static_cast<unsigned long long>(x), static_cast<unsigned long long>(length_));
  return out;
}

// ---------------------------------------------------------------- frames --

int64_t monotonic_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int64_t monotonic_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

bool send_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

namespace {
constexpr size_t kReadBuffer = 64 * 1024;
constexpr size_t kPrefixBytes = 12;

void put_prefix(uint8_t* out, uint32_t head, uint64_t body) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(head >> (8 * i));
  for (int i = 0; i < 8; ++i) out[4 + i] = static_cast<uint8_t>(body >> (8 * i));
}

bool send_iov(int fd, iovec* iov, int count) {
  while (count) {
    msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = count < IOV_MAX ? count : IOV_MAX;  // the kernel takes at most IOV_MAX at once
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t sent = static_cast<size_t>(n);
    while (count && sent >= iov->iov_len) {
      sent -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + sent;
      iov->iov_len -= sent;
    }
  }
  return true;
}
}  // namespace

FrameConn::FrameConn(int fd) : fd_(fd), buffer_(kReadBuffer) {}

bool FrameConn::fill(size_t count, int64_t deadline_ms, ReadStatus* status) {
  if (end_ - start_ >= count) return true;
  if (start_) {
    std::memmove(buffer_.data(), buffer_.data() + start_, end_ - start_);
    end_ -= start_;
    start_ = 0;
  }
  if (buffer_.size() < count) buffer_.resize(count);
  bool polling = poll_us_ > 0 && !deadline_ms;
  // Poll only while frames come back to back (docs/sessions.md, "Small
  // calls"): once one takes longer than the window, block at once until
  // they do again, so an idle or slow peer costs no CPU.
  if (polling && back_to_back_ && gate_.take_turn()) {
    int64_t until = 0, last = 0;
    bool preempted = false;
    PollGate::Outcome outcome = PollGate::kHit;
    while (end_ < count) {
      ssize_t n = ::recv(fd_, buffer_.data() + end_, buffer_.size() - end_, MSG_DONTWAIT);
      if (n > 0) {
        end_ += static_cast<size_t>(n);
        continue;
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;  // the read below says why
      // No sched_yield between tries: on a busy machine it handed the core
      // to another program for a time slice (docs/sessions.md).
      int64_t now = monotonic_us();
      if (!until) {
        until = now + poll_us_;
      } else if (now - last > poll_us_ / 4) {
        preempted = true;  // a try takes well under a microsecond: the core was lost
      }
      last = now;
      if (now > until) {
        outcome = PollGate::kMiss;
        break;
      }
    }
    gate_.record(preempted ? PollGate::kPreempted : outcome);
  }
  int64_t blocked_at = polling && end_ < count ? monotonic_us() : 0;
  if (blocked_at) back_to_back_ = false;
  while (end_ < count) {
    if (deadline_ms) {
      int64_t left = deadline_ms - monotonic_ms();
      pollfd p = {fd_, POLLIN, 0};
      int ready = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        *status = ReadStatus::kTimeout;
        return false;
      }
    }
    ssize_t n = ::recv(fd_, buffer_.data() + end_, buffer_.size() - end_, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      *status = ReadStatus::kTimeout;
      return false;
    }
    if (n <= 0) {
      *status = n == 0 ? ReadStatus::kClosed : ReadStatus::kError;
      return false;
    }
    end_ += static_cast<size_t>(n);
  }
  if (blocked_at && monotonic_us() - blocked_at <= poll_us_) back_to_back_ = true;
  return true;
}

ReadStatus FrameConn::read_header(Frame* frame, int64_t deadline_ms, size_t max_header) {
  if (body_left_ && !skip_body()) return ReadStatus::kClosed;
  ReadStatus status = ReadStatus::kOk;
  if (!fill(kPrefixBytes, deadline_ms, &status)) return status;
  const uint8_t* p = buffer_.data() + start_;
  uint32_t head = 0;
  uint64_t body = 0;
  for (int i = 3; i >= 0; --i) head = (head << 8) | p[i];
  for (int i = 7; i >= 0; --i) body = (body << 8) | p[4 + i];
  if (head > max_header || body > (1ull << 62)) {
    seen_.assign(reinterpret_cast<const char*>(p), end_ - start_ < 64 ? end_ - start_ : 64);
    return ReadStatus::kNotFrames;
  }
  if (!fill(kPrefixBytes + head, deadline_ms, &status)) return status;
  p = buffer_.data() + start_;
  *frame = Frame();
  if (!frame->decode(p + kPrefixBytes, head)) {
    seen_.assign(reinterpret_cast<const char*>(p), end_ - start_ < 64 ? end_ - start_ : 64);
    return ReadStatus::kNotFrames;
  }
  start_ += kPrefixBytes + head;
  if (buffer_.size() > 4 * kReadBuffer && end_ == start_) {
    buffer_.assign(kReadBuffer, 0);  // a huge header's buffer is not kept
    start_ = end_ = 0;
  }
  body_left_ = static_cast<int64_t>(body);
  return ReadStatus::kOk;
}

bool FrameConn::read_into(uint8_t* out, size_t size) {
  size_t buffered = end_ - start_;
  if (buffered) {
    size_t n = buffered < size ? buffered : size;
    std::memcpy(out, buffer_.data() + start_, n);
    start_ += n;
    out += n;
    size -= n;
  }
  while (size) {
    ssize_t n = ::recv(fd_, out, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool FrameConn::read_body(void* buffer, size_t size) {
  if (static_cast<int64_t>(size) > body_left_) return false;
  if (!read_into(static_cast<uint8_t*>(buffer), size)) return false;
  body_left_ -= static_cast<int64_t>(size);
  return true;
}

bool FrameConn::skip_body() {
  std::vector<uint8_t> scratch(body_left_ < static_cast<int64_t>(kChunkBytes)
                                   ? static_cast<size_t>(body_left_) : kChunkBytes);
  while (body_left_) {
    size_t n = body_left_ < static_cast<int64_t>(scratch.size())
                   ? static_cast<size_t>(body_left_) : scratch.size();
    if (!read_body(scratch.data(), n)) return false;
  }
  return true;
}

bool FrameConn::send(const Frame& frame) { return send(frame, {}); }

bool FrameConn::send(const Frame& frame,
                     const std::vector<std::pair<const void*, size_t>>& body) {
  std::string head = frame.encode();
  uint64_t total = 0;
  for (const auto& piece : body) total += piece.second;
  uint8_t prefix[kPrefixBytes];
  put_prefix(prefix, static_cast<uint32_t>(head.size()), total);
  std::vector<iovec> iov;
  iov.push_back({prefix, kPrefixBytes});
  iov.push_back({const_cast<char*>(head.data()), head.size()});
  for (const auto& piece : body) {
    if (piece.second) iov.push_back({const_cast<void*>(piece.first), piece.second});
  }
  // One sendmsg for the prefix, the header and every piece of the body (a
  // run's outputs are a handful of buffers): no copy, one system call when
  // the socket takes it all.
  return send_iov(fd_, iov.data(), static_cast<int>(iov.size()));
}

bool FrameConn::send_prefix(const Frame& frame, uint64_t body_size) {
  std::string head = frame.encode();
  uint8_t prefix[kPrefixBytes];
  put_prefix(prefix, static_cast<uint32_t>(head.size()), body_size);
  iovec iov[2] = {{prefix, kPrefixBytes}, {const_cast<char*>(head.data()), head.size()}};
  return send_iov(fd_, iov, 2);
}

bool FrameConn::send_raw(const void* data, size_t size) { return send_all(fd_, data, size); }

bool FrameConn::send_file(int fd, int64_t offset, size_t count, size_t* sent) {
  off_t position = static_cast<off_t>(offset);
  *sent = 0;
  while (*sent < count) {
    ssize_t n = ::sendfile(fd_, fd, &position, count - *sent);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) break;
    *sent += static_cast<size_t>(n);
  }
  return true;
}

void FrameConn::close() {
  if (fd_ >= 0) {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace tether
