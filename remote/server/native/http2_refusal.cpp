#include "http2_refusal.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstdio>

#include "wire.hpp"

namespace tether {

namespace {

const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
constexpr int kHeaders = 0x1, kSettings = 0x4, kGoaway = 0x7;
constexpr int kEndStream = 0x1, kEndHeaders = 0x4, kAck = 0x1;
constexpr int kFailedPrecondition = 9;
constexpr int kLingerMs = 5000;

std::string frame(int kind, int flags, uint32_t stream, const std::string& payload = "") {
  std::string out;
  uint32_t n = static_cast<uint32_t>(payload.size());
  out += static_cast<char>(n >> 16);
  out += static_cast<char>(n >> 8);
  out += static_cast<char>(n);
  out += static_cast<char>(kind);
  out += static_cast<char>(flags);
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>(stream >> shift);
  return out + payload;
}

// An HPACK integer with a 7-bit prefix (RFC 7541, 5.1).
std::string integer(size_t value) {
  std::string out;
  if (value < 127) return std::string(1, static_cast<char>(value));
  out += static_cast<char>(127);
  value -= 127;
  while (value >= 128) {
    out += static_cast<char>(value % 128 + 128);
    value /= 128;
  }
  return out + static_cast<char>(value);
}

// A header field as a literal without indexing, new name (RFC 7541, 6.2.2).
std::string literal(const std::string& name, const std::string& value) {
  return std::string(1, '\0') + integer(name.size()) + name + integer(value.size()) + value;
}

std::string error_headers(int status, const std::string& message) {
  std::string text;
  for (unsigned char c : message) {
    if (c >= 0x20 && c < 0x7f && c != '%') {
      text += static_cast<char>(c);
    } else {
      char escaped[4];
      std::snprintf(escaped, sizeof escaped, "%%%02X", c);
      text += escaped;
    }
  }
  return "\x88" + literal("content-type", "application/grpc") +  // :status 200 is index 8
         literal("grpc-status", std::to_string(status)) + literal("grpc-message", text);
}

}  // namespace

void refuse_grpc(int fd, std::string buffer, const std::string& message) {
  int64_t deadline = monotonic_ms() + kLingerMs;
  auto need = [&](size_t count) {
    while (buffer.size() < count) {
      int64_t left = deadline - monotonic_ms();
      pollfd p = {fd, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      char data[65536];
      ssize_t n = ::recv(fd, data, sizeof data, 0);
      if (n <= 0) return false;
      buffer.append(data, static_cast<size_t>(n));
    }
    return true;
  };
  const size_t preface = sizeof kPreface - 1;
  if (!need(preface) || buffer.compare(0, preface, kPreface) != 0) return;
  buffer.erase(0, preface);
  std::string settings = frame(kSettings, 0, 0);
  send_all(fd, settings.data(), settings.size());
  std::string block = error_headers(kFailedPrecondition, message);
  uint32_t answered = 0;
  while (need(9)) {
    auto byte = [&](size_t i) { return static_cast<uint8_t>(buffer[i]); };
    size_t length = (byte(0) << 16) | (byte(1) << 8) | byte(2);
    int kind = byte(3), flags = byte(4);
    uint32_t stream = ((byte(5) << 24) | (byte(6) << 16) | (byte(7) << 8) | byte(8)) & 0x7fffffff;
    if (!need(9 + length)) break;
    buffer.erase(0, 9 + length);
    std::string reply;
    if (kind == kSettings && !(flags & kAck)) {
      reply = frame(kSettings, kAck, 0);
    } else if (kind == kHeaders && stream) {
      reply = frame(kHeaders, kEndStream | kEndHeaders, stream, block);
      answered = stream;
    }
    if (!reply.empty()) send_all(fd, reply.data(), reply.size());
  }
  std::string goaway(8, '\0');
  for (int i = 0; i < 4; ++i) goaway[i] = static_cast<char>(answered >> (24 - 8 * i));
  std::string last = frame(kGoaway, 0, 0, goaway);
  send_all(fd, last.data(), last.size());
}

}  // namespace tether
