#include "session.hpp"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "json.hpp"
#include "json_writer.hpp"
#include "module.hpp"
#include "tar_link.hpp"
#include "wire.hpp"
#include "workspace.hpp"

namespace tether {

namespace {

constexpr int kExitRunTimeout = 3;
// How often a running call's connection is looked at.
constexpr int kPeerCheckMs = 250;
// Growing `number` stops here even if a run is too fast to reach min_repeat_ms.
constexpr int64_t kMaxNumber = int64_t(1) << 30;

int g_control = -1;

void report_end(const std::string& error_class, std::string reason) {
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  std::string line = "end\t" + error_class + "\t" + reason + "\n";
  send_all(g_control, line.data(), line.size());
}

std::string fmt_g(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

// A failed call: the class named in remote/errors.py and the message.
struct Failure {
  std::string error_class, text;
};

// Heap memory for tensors, outputs and transfer chunks, aligned to a page:
// the kernel copies socket and file data with `rep movsb`, which on this
// AMD host ran at about two thirds of the speed into or out of a buffer 16
// bytes off a page boundary (where musl's malloc puts large blocks).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size) : size_(size) {
    if (posix_memalign(&data_, 4096, size ? size : 64) != 0) data_ = nullptr;
  }
  Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_) { o.data_ = nullptr; o.size_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~Buffer() { free(data_); }
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return size_; }
  bool ok() const { return data_ != nullptr; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

struct Tensor {
  TensorDesc desc;
  Buffer data;
};

// Bytes per element of the dtypes a tensor may hold (numbers only).
int itemsize(const std::string& dtype) {
  static const std::map<std::string, int> sizes = {
      {"bool", 1}, {"int8", 1}, {"uint8", 1}, {"int16", 2}, {"uint16", 2}, {"float16", 2},
      {"bfloat16", 2},
      // the low-bit types, one byte per element (crosscompile/lowbit.py)
      {"float8_e4m3fn", 1}, {"float8_e4m3fnuz", 1}, {"float8_e5m2", 1}, {"float8_e5m2fnuz", 1},
      {"float8_e8m0fnu", 1}, {"float4_e2m1fn", 1}, {"int4", 1}, {"uint4", 1}, {"int2", 1}, {"uint2", 1},
      {"int32", 4}, {"uint32", 4}, {"float32", 4}, {"int64", 8}, {"uint64", 8},
      {"float64", 8}, {"complex64", 8}, {"complex128", 16}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// A shape as Python prints a tuple: (1, 3) or (5,).
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

std::string name_list(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + quote(names[i]);
  return out + "]";
}

// Bytes of a tensor description, or -1 with *failure set.
int64_t tensor_bytes(const TensorDesc& desc, const std::string& name, Failure* failure) {
  int size = itemsize(desc.dtype);
  if (size == 0) {
    *failure = {"InvalidArgument", "tensor " + quote(name) + " has dtype " + quote(desc.dtype) +
                                       "; tensors hold numbers only (bool, int8-64, uint8-64, "
                                       "bfloat16, float16/32/64, float8, float4, int4, int2, "
                                       "complex)"};
    return -1;
  }
  int64_t count = 1;
  for (int64_t d : desc.shape) {
    if (d < 0) {
      std::string dims = "[";
      for (size_t i = 0; i < desc.shape.size(); ++i)
        dims += (i ? ", " : "") + std::to_string(desc.shape[i]);
      *failure = {"InvalidArgument", "tensor " + quote(name) + " has a negative dimension " +
                                         dims + "]"};
      return -1;
    }
    if (d && count > (int64_t(1) << 62) / d) {
      *failure = {"InvalidArgument", "tensor " + quote(name) + " of shape " +
                                         shape_text(desc.shape) + " is too large"};
      return -1;
    }
    count *= d;
  }
  return count * size;
}

int64_t peak_rss_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  int64_t kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "VmHWM:", 6) == 0) {
      kb = std::strtoll(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kb * 1024;  // the kernel counts in kB
}

// Ends the process when a module call outlives its timeout, or when the
// client closes the connection while the call runs: a session's calls are
// answered in order on one connection, so nothing else reads it meanwhile.
class Watchdog {
 public:
  explicit Watchdog(FrameConn* conn) : conn_(conn) {
    std::thread([this] { loop(); }).detach();
  }
  void arm(double timeout_s, const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    deadline_ms_ = timeout_s > 0 ? monotonic_ms() + static_cast<int64_t>(timeout_s * 1000) : INT64_MAX;
    timeout_s_ = timeout_s;
    what_ = what;
    ++generation_;
    cond_.notify_one();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    deadline_ms_ = 0;
  }

 private:
  void loop() {
    for (;;) {
      int64_t deadline;
      uint64_t generation;
      std::string what;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cond_.wait(lock, [this] { return deadline_ms_ != 0; });
        deadline = deadline_ms_;
        generation = generation_;
        what = what_;
      }
      int64_t left = deadline - monotonic_ms();
      if (left > 0) {
        if (peer_closed(left < kPeerCheckMs ? static_cast<int>(left) : kPeerCheckMs)) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (deadline_ms_ != 0 && generation_ == generation) {
            report_end("SessionEnded", "the client closed its connection during the " + what);
            _exit(0);
          }
        }
        continue;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (deadline_ms_ == 0 || generation_ != generation) continue;  // the call finished meanwhile
      std::string message =
          what + " did not finish within " + fmt_g(timeout_s_) +
          " s; the device stopped the module and ended the session. Give it more time "
          "(timeout=, or --timeout on the command line) or ask for fewer runs "
          "(number=/repeat=, --number/--repeat)";
      report_end("RunTimeout", message);
      timeval limit = {1, 0};
      setsockopt(conn_->fd(), SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
      conn_->send(error_frame("RunTimeout", message));
      _exit(kExitRunTimeout);
    }
  }

  bool peer_closed(int wait_ms) {
    pollfd p = {conn_->fd(), POLLIN, 0};
    if (::poll(&p, 1, wait_ms) <= 0) return false;
    char byte;
    ssize_t n = ::recv(conn_->fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) {
      ::poll(nullptr, 0, wait_ms);  // the client sent more; it is read after this call
      return false;
    }
    return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

  FrameConn* conn_;
  std::mutex mutex_;
  std::condition_variable cond_;
  int64_t deadline_ms_ = 0;
  uint64_t generation_ = 0;
  double timeout_s_ = 0;
  std::string what_;
};

// The summary statistics a benchmark reports, as numpy computes them.
double percentile(std::vector<double> sorted, double q) {
  double index = q / 100.0 * (sorted.size() - 1);
  size_t low = static_cast<size_t>(std::floor(index));
  size_t high = std::min(low + 1, sorted.size() - 1);
  return sorted[low] + (sorted[high] - sorted[low]) * (index - low);
}

std::string summary_json(const std::vector<double>& samples) {
  std::vector<double> sorted(samples);
  std::sort(sorted.begin(), sorted.end());
  double mean = 0;
  for (double s : samples) mean += s;
  mean /= samples.size();
  double var = 0;
  for (double s : samples) var += (s - mean) * (s - mean);
  var /= samples.size();
  return "\"mean\": " + json_number(mean) + ", \"median\": " + json_number(percentile(sorted, 50)) +
         ", \"std\": " + json_number(std::sqrt(var)) + ", \"min\": " + json_number(sorted.front()) +
         ", \"max\": " + json_number(sorted.back()) + ", \"p90\": " +
         json_number(percentile(sorted, 90)) + ", \"p99\": " + json_number(percentile(sorted, 99));
}

// A JSON value of the metadata written back: strings and (nested) lists of
// strings and numbers, as the steps' "fused", "inputs" and "outputs" hold.
std::string json_list(const JsonValue* v) {
  if (v == nullptr) return "[]";
  switch (v->kind) {
    case JsonValue::kString: return json_string(v->text);
    case JsonValue::kNumber: return v->integral ? std::to_string(v->integer) : json_number(v->number);
    case JsonValue::kArray: {
      std::string out = "[";
      for (size_t i = 0; i < v->items.size(); ++i) out += (i ? ", " : "") + json_list(&v->items[i]);
      return out + "]";
    }
    default: return "null";
  }
}

class SessionServer {
 public:
  explicit SessionServer(const SessionSettings& s)
      : settings_(s), conn_(s.conn_fd), workspace_(s.workspace), watchdog_(&conn_) {}

  [[noreturn]] void serve() {
    Frame header;
    if (settings_.idle_timeout_s > 0) {
      // The kernel's receive timeout, set once, bounds the wait for the next
      // request: no poll() before every read.
      timeval idle = {static_cast<time_t>(settings_.idle_timeout_s),
                      static_cast<suseconds_t>(std::fmod(settings_.idle_timeout_s, 1.0) * 1e6)};
      setsockopt(conn_.fd(), SOL_SOCKET, SO_RCVTIMEO, &idle, sizeof idle);
    }
    // The client's next call usually follows its answer within microseconds:
    // polling for it saves the wake-up of a process asleep in recv (and of
    // its idle virtual CPU), which costs more than the call (docs/sessions.md).
    conn_.set_poll_us(settings_.poll_us);
    for (;;) {
      ReadStatus status = conn_.read_header(&header);
      if (status == ReadStatus::kTimeout) {
        report_end("SessionEnded", "the client was idle for " + fmt_g(settings_.idle_timeout_s) + " s");
        _exit(0);
      }
      if (status != ReadStatus::kOk) break;
      if (header.op == "ping") {
        static const std::string ok = ok_frame_bytes();
        if (!conn_.send_raw(ok.data(), ok.size())) break;
      } else if (header.op == "close") {
        close_session();
      } else {
        dispatch(header);
      }
    }
    log_polling();
    conn_.close();
    report_end("SessionEnded", "the client closed its connection");
    _exit(0);
  }

 private:
  static std::string ok_frame_bytes() {
    Frame ok;
    ok.op = "ok";
    std::string head = ok.encode();
    std::string out(12, '\0');
    out[0] = static_cast<char>(head.size());
    return out + head;
  }

  void dispatch(const Frame& header) {
    Failure failure;
    bool done;
    const std::string& op = header.op;
    if (op == "upload") done = op_upload(header, &failure);
    else if (op == "download") done = op_download(header, &failure);
    else if (op == "list") done = op_list(&failure);
    else if (op == "remove") done = op_remove(header, &failure);
    else if (op == "put_tensor") done = op_put_tensor(header, &failure);
    else if (op == "get_tensor") done = op_get_tensor(header, &failure);
    else if (op == "free_tensor") done = op_free_tensor(header);
    else if (op == "load") done = op_load(header, &failure);
    else if (op == "run") done = op_run(header, &failure);
    else if (op == "benchmark") done = op_benchmark(header, &failure);
    else if (op == "profile") done = op_profile(header, &failure);
    else {
      failure = {"InvalidArgument", "unknown operation " + quote(op) +
                                        " on the data connection; client and server versions differ"};
      done = false;
    }
    if (!done && !failure.error_class.empty()) conn_.send(error_frame(failure.error_class, failure.text));
  }

  bool ok(const Frame& frame) {
    conn_.send(frame);
    return true;
  }

  // The connection is out of step: answer with an error and end the session.
  [[noreturn]] void drop(const std::string& error_class, const std::string& message) {
    conn_.send(error_frame(error_class, message));
    report_end(error_class, message);
    _exit(0);
  }

  // The client sent a body and an end frame this call will not read: read
  // them, so the next frame is read in step.
  void skip_transfer() {
    conn_.skip_body();
    Frame end;
    conn_.read_header(&end);
  }

  // ---------------------------------------------------------- session --
  // How the session's reads polled (docs/sessions.md, "Small calls"), for
  // the server's log.
  void log_polling() {
    const PollGate& g = conn_.poll_gate();
    char line[160];
    std::snprintf(line, sizeof line, "log\tpolling: %llu hits, %llu misses, %llu preempted, %llu skipped\n",
                  static_cast<unsigned long long>(g.hits), static_cast<unsigned long long>(g.misses),
                  static_cast<unsigned long long>(g.preempted), static_cast<unsigned long long>(g.skipped));
    send_all(settings_.control_fd, line, std::strlen(line));
  }

  [[noreturn]] void close_session() {
    // Answered once the server has given the board back, so it is free
    // again when the client's `with` block ends.
    log_polling();  // before the answer: the client's with block ends after it
    workspace_.remove_all();
    bool released = ask_server_close();
    if (released) {
      Frame ok;
      ok.op = "ok";
      conn_.send(ok);
    } else {
      conn_.send(error_frame("RemoteError", "the device server did not confirm the end of the session"));
    }
    conn_.close();
    _exit(0);
  }

  bool ask_server_close() {
    if (!send_all(settings_.control_fd, "close\n", 6)) return false;
    // The server answers "released" on the control socket; it is read here
    // (the lifeline thread only watches for the server's end).
    std::string buffered;
    int64_t deadline = monotonic_ms() + 60000;
    for (;;) {
      int64_t left = deadline - monotonic_ms();
      if (left <= 0) return false;
      pollfd p = {settings_.control_fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char data[256];
      ssize_t n = ::recv(settings_.control_fd, data, sizeof data, 0);
      if (n <= 0) return false;
      buffered.append(data, static_cast<size_t>(n));
      if (buffered.find("released\n") != std::string::npos) return true;
    }
  }

  bool check_size(const std::string& what, int64_t size, Failure* failure) {
    if (size <= settings_.max_bytes) return true;
    *failure = {"InvalidArgument", what + " is " + std::to_string(size) +
                                       " bytes; this device accepts at most " +
                                       std::to_string(settings_.max_bytes) +
                                       " (server option --max-upload-bytes)"};
    return false;
  }

  // ------------------------------------------------------------- files --
  bool op_upload(const Frame& header, Failure* failure) {
    const std::string& name = header.name;
    if (conn_.body_left() != header.size || conn_.body_left() > settings_.max_bytes) {
      // Reading past what was announced (or allowed) to stay in step is
      // what a hostile client wants: refuse, and end the connection.
      drop("InvalidArgument", "upload of " + quote(name) + " announces " + std::to_string(header.size) +
                                  " bytes and carries " + std::to_string(conn_.body_left()) +
                                  "; this device accepts at most " + std::to_string(settings_.max_bytes) +
                                  " (server option --max-upload-bytes)");
    }
    std::string error;
    std::string target = workspace_.path(name, &error);
    if (target.empty()) {
      skip_transfer();
      *failure = {"InvalidArgument", error};
      return false;
    }
    if (!make_parents(target)) {
      error = std::strerror(errno);
      skip_transfer();
      *failure = {"RemoteError", "upload failed on the device: cannot make the folders of " + quote(name) +
                                     ": " + error};
      return false;
    }
    // A name of its own: a file the session calls "x.part" is not touched.
    std::string partial = target + "." + std::to_string(getpid()) + "-" +
                          std::to_string(monotonic_ms()) + ".part";
    int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      skip_transfer();
      *failure = {"RemoteError", "upload of " + quote(name) + " failed on the device: " + std::strerror(errno)};
      return false;
    }
    Checksum checksum;
    Buffer chunk(static_cast<size_t>(std::min<int64_t>(kChunkBytes, std::max<int64_t>(conn_.body_left(), 1))));
    if (!chunk.ok()) {
      ::close(fd);
      ::unlink(partial.c_str());
      skip_transfer();
      *failure = {"RemoteError", "no memory to receive " + quote(name)};
      return false;
    }
    bool written = true;
    while (conn_.body_left()) {
      size_t n = static_cast<size_t>(std::min<int64_t>(chunk.size(), conn_.body_left()));
      if (!conn_.read_body(chunk.data(), n)) {
        ::close(fd);
        ::unlink(partial.c_str());
        end_connection();
      }
      checksum.update(chunk.data(), n);
      if (written && !write_all(fd, chunk.data(), n)) {
        written = false;
        error = std::strerror(errno);
      }
    }
    ::close(fd);
    Frame end;
    if (conn_.read_header(&end) != ReadStatus::kOk) {
      ::unlink(partial.c_str());
      end_connection();
    }
    if (!written) {
      ::unlink(partial.c_str());
      *failure = {"RemoteError", "upload of " + quote(name) + " could not be written on the device: " + error};
      return false;
    }
    if (end.op != "end") {
      ::unlink(partial.c_str());
      *failure = {"InvalidArgument", "upload of " + quote(name) + " was not finished properly"};
      return false;
    }
    std::string sum = checksum.text();
    if (end.checksum != sum) {
      ::unlink(partial.c_str());
      *failure = {"InvalidArgument", "upload of " + quote(name) + " is corrupt: " + sum +
                                         " on the device, " + end.checksum + " at the sender"};
      return false;
    }
    ::unlink(target.c_str());  // renaming over a file made ext4 flush it first (see worker.py)
    if (::rename(partial.c_str(), target.c_str()) != 0) {
      error = std::strerror(errno);
      ::unlink(partial.c_str());
      *failure = {"RemoteError", "upload of " + quote(name) + " could not be stored: " + error};
      return false;
    }
    Frame reply;
    reply.op = "ok";
    reply.name = name;
    reply.size = header.size;
    reply.checksum = sum;
    return ok(reply);
  }

  static bool write_all(int fd, const uint8_t* data, size_t size) {
    while (size) {
      ssize_t n = ::write(fd, data, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }

  [[noreturn]] void end_connection() {
    conn_.close();
    report_end("SessionEnded", "the client closed its connection");
    _exit(0);
  }

  bool op_download(const Frame& header, Failure* failure) {
    std::string error;
    std::string path = workspace_.existing(header.name, &error);
    if (path.empty()) {
      *failure = {"InvalidArgument", error};
      return false;
    }
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      if (fd >= 0) ::close(fd);
      *failure = {"RemoteError", "cannot read " + quote(header.name) + ": " + std::strerror(errno)};
      return false;
    }
    Frame reply;
    reply.op = "ok";
    reply.name = header.name;
    reply.size = st.st_size;
    conn_.send_prefix(reply, static_cast<uint64_t>(st.st_size));
    // The file's pages go to the socket with sendfile(2), where reading
    // them into a buffer and sending that copied each byte twice; the
    // checksum reads the same pages through a mapping of the chunk (one at
    // a time: mapped pages count as the process's memory).
    Checksum checksum;
    size_t size = static_cast<size_t>(st.st_size);
    for (size_t done = 0; done < size;) {
      size_t n = std::min(kChunkBytes, size - done);
      size_t sent = 0;
      struct stat now;
      void* mapped = ::fstat(fd, &now) == 0 && static_cast<size_t>(now.st_size) >= done + n
                         ? ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(done))
                         : MAP_FAILED;
      if (mapped != MAP_FAILED) {
        checksum.update(static_cast<const uint8_t*>(mapped), n);
        ::munmap(mapped, n);
        if (!conn_.send_file(fd, static_cast<int64_t>(done), n, &sent)) {
          ::close(fd);
          end_connection();
        }
      }
      if (sent < n) {
        // The file shrank under us; the client sees a short body and an error.
        ::close(fd);
        conn_.send(error_frame("RemoteError", header.name + " changed while it was being read"));
        return true;
      }
      done += n;
    }
    ::close(fd);
    Frame end;
    end.op = "end";
    end.checksum = checksum.text();
    return ok(end);
  }

  bool op_list(Failure*) {
    Frame reply;
    reply.op = "ok";
    for (const auto& name : workspace_.list()) {
      struct stat st;
      std::string unused;
      std::string path = workspace_.path(name, &unused);
      reply.files.push_back({name, ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0});
    }
    return ok(reply);
  }

  bool op_remove(const Frame& header, Failure* failure) {
    std::string error;
    std::string path = workspace_.existing(header.name, &error);
    if (path.empty()) {
      *failure = {"InvalidArgument", error};
      return false;
    }
    if (::unlink(path.c_str()) != 0) {
      *failure = {"RemoteError", "cannot remove " + quote(header.name) + ": " + std::strerror(errno)};
      return false;
    }
    Frame reply;
    reply.op = "ok";
    return ok(reply);
  }

  // ----------------------------------------------------------- tensors --
  bool op_put_tensor(const Frame& header, Failure* failure) {
    const std::string& name = header.name;
    int64_t bytes = -1;
    if (!check_size("tensor " + quote(name), conn_.body_left(), failure)) {
    } else if (header.tensors.size() != 1) {
      *failure = {"InvalidArgument", "put_tensor carries exactly one tensor"};
    } else if ((bytes = tensor_bytes(header.tensors[0], name, failure)) < 0) {
    } else if (bytes != conn_.body_left()) {
      *failure = {"InvalidArgument", "tensor " + quote(name) + " of shape " +
                                         shape_text(header.tensors[0].shape) + " " +
                                         header.tensors[0].dtype + " needs " + std::to_string(bytes) +
                                         " bytes, " + std::to_string(conn_.body_left()) + " were sent"};
      bytes = -1;
    }
    if (bytes < 0) {
      skip_transfer();  // keep the connection in step: the end frame follows
      return false;
    }
    Tensor tensor;
    tensor.desc = header.tensors[0];
    tensor.desc.name = name;
    // A tensor replaced by one of its size lends it its buffer: musl gives
    // large blocks back to the system when they are freed, so a new buffer
    // costs a page fault per page as the data arrives (64 MiB tensors came
    // in at about half the speed). If this transfer fails, both are gone.
    auto replaced = tensors_.find(name);
    if (replaced != tensors_.end() && replaced->second.data.size() == static_cast<size_t>(bytes)) {
      tensor.data = std::move(replaced->second.data);
      tensors_.erase(replaced);
    } else {
      tensor.data = Buffer(static_cast<size_t>(bytes));
    }
    if (!tensor.data.ok()) {
      skip_transfer();
      *failure = {"RemoteError", "no memory for tensor " + quote(name) + " of " + std::to_string(bytes) + " bytes"};
      return false;
    }
    Checksum checksum;
    for (int64_t done = 0; done < bytes;) {
      size_t n = static_cast<size_t>(std::min<int64_t>(kChunkBytes, bytes - done));
      if (!conn_.read_body(tensor.data.data() + done, n)) end_connection();
      checksum.update(tensor.data.data() + done, n);
      done += static_cast<int64_t>(n);
    }
    Frame end;
    if (conn_.read_header(&end) != ReadStatus::kOk) end_connection();
    std::string sum = checksum.text();
    if (end.checksum != sum) {
      *failure = {"InvalidArgument", "tensor " + quote(name) + " arrived corrupt: " + sum +
                                         ", sender " + end.checksum};
      return false;
    }
    tensors_[name] = std::move(tensor);
    Frame reply;
    reply.op = "ok";
    reply.name = name;
    reply.size = bytes;
    return ok(reply);
  }

  const Tensor* stored(const std::string& name, Failure* failure) {
    auto it = tensors_.find(name);
    if (it != tensors_.end()) return &it->second;
    std::string present;
    for (const auto& kv : tensors_) present += (present.empty() ? "" : ", ") + kv.first;
    *failure = {"InvalidArgument", "no tensor " + quote(name) +
                                       " on the board; upload it with upload_tensor first (present: " +
                                       (present.empty() ? "none" : present) + ")"};
    return nullptr;
  }

  bool op_get_tensor(const Frame& header, Failure* failure) {
    const Tensor* tensor = stored(header.name, failure);
    if (tensor == nullptr) return false;
    Frame reply;
    reply.op = "ok";
    reply.name = header.name;
    reply.tensors.push_back(tensor->desc);
    reply.tensors.back().name = header.name;
    conn_.send_prefix(reply, tensor->data.size());
    Checksum checksum;
    for (size_t done = 0; done < tensor->data.size();) {
      size_t n = std::min(kChunkBytes, tensor->data.size() - done);
      checksum.update(tensor->data.data() + done, n);  // while the chunk is still in the cache
      if (!conn_.send_raw(tensor->data.data() + done, n)) end_connection();
      done += n;
    }
    Frame end;
    end.op = "end";
    end.checksum = checksum.text();
    return ok(end);
  }

  bool op_free_tensor(const Frame& header) {
    tensors_.erase(header.name);
    Frame reply;
    reply.op = "ok";
    return ok(reply);
  }

  // ----------------------------------------------------------- modules --
  bool op_load(const Frame& header, Failure* failure) {
    const std::string& name = header.name;
    std::string error;
    std::string path = workspace_.existing(name, &error);
    if (path.empty()) {
      *failure = {"InvalidArgument", error};
      return false;
    }
    double start = monotonic_s();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tar") == 0) {
      path = link_module_tar(path, name, workspace_, settings_.cc, settings_.max_bytes, &error);
      if (path.empty()) {
        *failure = {"ModuleLoadError", error};
        return false;
      }
    }
    std::unique_ptr<Module> module = Module::load(path, 0, &error);
    if (!module) {
      // The loader names the absolute path; the client knows the file by its name.
      for (size_t at; (at = error.find(path)) != std::string::npos;) error.replace(at, path.size(), name);
      *failure = {"ModuleLoadError", error};
      return false;
    }
    double load_s = monotonic_s() - start;
    std::string id = name + "#" + std::to_string(modules_.size());
    Frame reply;
    reply.op = "ok";
    reply.name = id;
    reply.text = module->metadata_json();
    reply.seconds = load_s;
    modules_[id] = Loaded{std::move(module), load_s, path};
    return ok(reply);
  }

  struct Loaded {
    std::unique_ptr<Module> module;
    double load_s = 0;
    std::string path;
  };

  Loaded* loaded(const std::string& id, Failure* failure) {
    auto it = modules_.find(id);
    if (it != modules_.end()) return &it->second;
    *failure = {"InvalidArgument", "no module " + quote(id) + " loaded in this session; call load_module first"};
    return nullptr;
  }

  // The inputs of a run, benchmark or profile, in the module's order:
  // tensors in the frame's body, tensors left on the board (refs), and,
  // with `zeros`, zeros for any left out.
  // A dynamic module's input: its size on each dynamic axis within the
  // bounds and equal to the earlier inputs' (*size, -1 before the first),
  // the other dimensions as declared (minirt's check and texts).
  bool dynamic_shape(const Module& module, const TensorSpec& spec, const std::vector<int64_t>& shape,
                     int64_t* size, Failure* failure) {
    const std::string& dim = module.dynamic_name();
    std::string range = std::to_string(module.dynamic_min()) + ".." + std::to_string(module.dynamic_max());
    auto dynamic = [&](size_t axis) {
      return std::find(spec.dynamic_axes.begin(), spec.dynamic_axes.end(), static_cast<int64_t>(axis)) !=
             spec.dynamic_axes.end();
    };
    bool same_rest = shape.size() == spec.shape.size();
    for (size_t i = 0; same_rest && i < shape.size(); ++i) same_rest = dynamic(i) || shape[i] == spec.shape[i];
    if (!same_rest) {
      std::string expected = "(";
      for (size_t i = 0; i < spec.shape.size(); ++i) {
        expected += (i ? ", " : "") + (dynamic(i) ? dim + " " + range : std::to_string(spec.shape[i]));
      }
      *failure = {"InputError", "input " + quote(spec.name) + ": expected shape " + expected + "), got " +
                                    shape_text(shape)};
      return false;
    }
    for (int64_t axis : spec.dynamic_axes) {
      int64_t got = shape[static_cast<size_t>(axis)];
      std::string where = "input " + quote(spec.name) + ": " + dim + " (axis " + std::to_string(axis) + ") is " +
                          std::to_string(got);
      if (got < module.dynamic_min() || got > module.dynamic_max()) {
        *failure = {"InputError", where + ", outside this module's range " + range + "; run at most " +
                                      std::to_string(module.dynamic_max()) +
                                      " at a time, or rebuild the module with a wider dynamic range"};
        return false;
      }
      if (*size >= 0 && got != *size) {
        *failure = {"InputError", where + ", but an earlier one is " + std::to_string(*size) +
                                      "; every input needs the same " + dim};
        return false;
      }
      *size = got;
    }
    return true;
  }

  bool inputs(const Frame& header, const Module& module, bool zeros, std::vector<Tensor>* sent,
              std::vector<void*>* pointers, int64_t* size, Failure* failure) {
    for (const auto& desc : header.tensors) {
      int64_t bytes = tensor_bytes(desc, desc.name, failure);
      if (bytes < 0) return false;
      if (bytes > conn_.body_left()) {
        *failure = {"InvalidArgument", "tensor " + quote(desc.name) + " of shape " + shape_text(desc.shape) +
                                           " " + desc.dtype + " needs " + std::to_string(bytes) +
                                           " bytes, the frame has " + std::to_string(conn_.body_left()) + " left"};
        return false;
      }
      Tensor t;
      t.desc = desc;
      t.data = Buffer(static_cast<size_t>(bytes));
      if (!t.data.ok() || !conn_.read_body(t.data.data(), static_cast<size_t>(bytes))) end_connection();
      sent->push_back(std::move(t));
    }
    if (conn_.body_left()) {
      *failure = {"InvalidArgument", std::to_string(conn_.body_left()) + " bytes of tensor data left over after " +
                                         std::to_string(sent->size()) + " tensor(s)"};
      return false;
    }
    std::map<std::string, const Tensor*> given;
    for (const auto& t : *sent) given[t.desc.name] = &t;
    for (const auto& ref : header.refs) {
      const Tensor* t = stored(ref.second, failure);
      if (t == nullptr) return false;
      given[ref.first] = t;
    }
    std::vector<std::string> names, unknown, missing;
    for (const auto& spec : module.inputs()) names.push_back(spec.name);
    for (const auto& kv : given) {
      if (std::find(names.begin(), names.end(), kv.first) == names.end()) unknown.push_back(kv.first);
    }
    if (!unknown.empty()) {
      *failure = {"InputError", "unknown input name(s) " + name_list(unknown) +
                                    "; this module's inputs are " + name_list(names)};
      return false;
    }
    for (const auto& spec : module.inputs()) {
      auto it = given.find(spec.name);
      if (it == given.end()) {
        if (!zeros) {
          missing.push_back(spec.name);
          continue;
        }
        Tensor t;
        t.desc = {spec.name, spec.dtype, spec.shape};
        t.data = Buffer(static_cast<size_t>(spec.bytes()));
        std::memset(t.data.data(), 0, t.data.size());
        sent->push_back(std::move(t));
        pointers->push_back(sent->back().data.data());
        continue;
      }
      const TensorDesc& desc = it->second->desc;
      if (desc.dtype != spec.dtype) {
        *failure = {"InputError", "input " + quote(spec.name) + ": expected dtype " + spec.dtype + ", got " + desc.dtype};
        return false;
      }
      if (module.dynamic()) {
        if (!dynamic_shape(module, spec, desc.shape, size, failure)) return false;
      } else if (desc.shape != spec.shape) {
        *failure = {"InputError", "input " + quote(spec.name) + ": expected shape " + shape_text(spec.shape) +
                                      ", got " + shape_text(desc.shape)};
        return false;
      }
      pointers->push_back(it->second->data.data());
    }
    if (!missing.empty()) {
      *failure = {"InputError", "missing input(s) " + name_list(missing) + "; this module's inputs are " +
                                    name_list(names)};
      return false;
    }
    return true;
  }

  // What a run, benchmark or profile works on: the module, its inputs'
  // buffers and pointers, and the outputs'.
  struct Call {
    Loaded* entry = nullptr;
    std::vector<Tensor> sent;
    std::vector<void*> in, out;
    std::vector<Buffer> outputs;
    int64_t size = -1;  // a dynamic module's dimension size (Module::run)
  };

  // `sent` is reserved whole before any pointer into it is taken.
  bool prepare(const Frame& header, bool zeros, Call* call, Failure* failure) {
    call->entry = loaded(header.name, failure);
    if (call->entry == nullptr) return false;
    const Module& module = *call->entry->module;
    call->sent.reserve(header.tensors.size() + module.inputs().size());
    if (!inputs(header, module, zeros, &call->sent, &call->in, &call->size, failure)) return false;
    call->outputs.reserve(module.outputs().size());
    for (const auto& spec : module.outputs()) {
      TensorSpec actual = spec;
      actual.shape = spec.shape_at(call->size);
      call->outputs.emplace_back(static_cast<size_t>(actual.bytes()));
      call->out.push_back(call->outputs.back().data());
    }
    return true;
  }

  bool run_once(Module& module, std::vector<void*>& in, std::vector<void*>& out, Failure* failure,
                const std::string& what, int64_t size) {
    std::string error;
    if (module.run(in.data(), out.data(), &error, size) != 0) {
      *failure = {"RemoteError", what + " failed on the device: " + error};
      return false;
    }
    return true;
  }

  bool op_run(const Frame& header, Failure* failure) {
    Call call;
    if (!prepare(header, false, &call, failure)) return false;
    Loaded* entry = call.entry;
    std::vector<void*>& in = call.in;
    std::vector<void*>& out = call.out;
    Module& module = *entry->module;
    watchdog_.arm(header.timeout_s, "run of " + header.name);
    double start = monotonic_s();
    bool done = run_once(module, in, out, failure, "run", call.size);
    double run_s = monotonic_s() - start;
    watchdog_.disarm();
    if (!done) return false;
    Frame reply;
    reply.op = "ok";
    reply.seconds = run_s;
    std::vector<std::pair<const void*, size_t>> body;
    for (size_t i = 0; i < module.outputs().size(); ++i) {
      const TensorSpec& spec = module.outputs()[i];
      size_t bytes = 0;
      std::vector<int64_t> shape = module.cut_output(i, call.size, call.outputs[i].data(), &bytes);
      reply.tensors.push_back({spec.name, spec.dtype, shape});
      body.emplace_back(call.outputs[i].data(), bytes);
    }
    conn_.send(reply, body);
    return true;
  }

  bool op_benchmark(const Frame& header, Failure* failure) {
    Call call;
    if (!prepare(header, true, &call, failure)) return false;
    Loaded* entry = call.entry;
    std::vector<void*>& in = call.in;
    std::vector<void*>& out = call.out;
    int64_t number = header.number ? header.number : 10;
    int repeat = header.repeat ? header.repeat : 3;
    if (number < 1 || repeat < 1) {
      *failure = {"InvalidArgument", "number (" + std::to_string(number) + ") and repeat (" +
                                         std::to_string(repeat) + ") must be at least 1"};
      return false;
    }
    if (header.min_repeat_ms < 0 || header.cooldown_ms < 0) {
      *failure = {"InvalidArgument", "min_repeat_ms and cooldown_ms must not be negative"};
      return false;
    }
    Module& module = *entry->module;
    watchdog_.arm(header.timeout_s, "benchmark of " + header.name);
    std::vector<double> samples;
    bool done = time_runs(module, in, out, call.size, &number, repeat, header.min_repeat_ms,
                          header.cooldown_ms, &samples, failure);
    watchdog_.disarm();
    if (!done) return false;
    std::string text = "{\"samples\": [";
    for (size_t i = 0; i < samples.size(); ++i) text += (i ? ", " : "") + json_number(samples[i]);
    text += "], \"number\": " + std::to_string(number) + ", \"repeat\": " + std::to_string(samples.size()) +
            ", \"load_s\": " + json_number(entry->load_s) + ", \"peak_rss_bytes\": " +
            std::to_string(peak_rss_bytes()) + ", \"threads\": " + std::to_string(module.threads()) + ", " +
            summary_json(samples) + "}";
    Frame reply;
    reply.op = "ok";
    reply.text = text;
    return ok(reply);
  }

  // The timing loop of remote/server's benchmark (minirt/timing.py): one
  // warm-up run, `number` grown until a sample lasts min_repeat_ms, then
  // `repeat` samples of the mean of `number` runs.
  bool time_runs(Module& module, std::vector<void*>& in, std::vector<void*>& out, int64_t size, int64_t* number,
                 int repeat, double min_repeat_ms, double cooldown_ms, std::vector<double>* samples,
                 Failure* failure) {
    if (!run_once(module, in, out, failure, "benchmark", size)) return false;
    if (min_repeat_ms > 0) {
      while (*number < kMaxNumber) {
        double start = monotonic_s();
        for (int64_t i = 0; i < *number; ++i) {
          if (!run_once(module, in, out, failure, "benchmark", size)) return false;
        }
        double elapsed_ms = (monotonic_s() - start) * 1e3;
        if (elapsed_ms >= min_repeat_ms) break;
        // Aim a little past the target so one more round usually suffices.
        double scale = 1.2 * min_repeat_ms / std::max(elapsed_ms, 1e-3);
        *number = std::min(kMaxNumber, std::max(*number * 2, static_cast<int64_t>(std::ceil(*number * scale))));
      }
    }
    for (int i = 0; i < repeat; ++i) {
      if (cooldown_ms > 0 && i) {
        timespec pause = {static_cast<time_t>(cooldown_ms / 1e3),
                          static_cast<long>(std::fmod(cooldown_ms, 1e3) * 1e6)};
        nanosleep(&pause, nullptr);
      }
      double start = monotonic_s();
      for (int64_t k = 0; k < *number; ++k) {
        if (!run_once(module, in, out, failure, "benchmark", size)) return false;
      }
      samples->push_back((monotonic_s() - start) / *number);
    }
    return true;
  }

  bool op_profile(const Frame& header, Failure* failure) {
    Call call;
    if (!prepare(header, true, &call, failure)) return false;
    Loaded* entry = call.entry;
    std::vector<void*>& in = call.in;
    std::vector<void*>& out = call.out;
    Module& module = *entry->module;
    int number = header.number ? header.number : 10;
    if (!module.has_profiled()) {
      *failure = {"ModuleLoadError", header.name + " has no tether_run_profiled, so it cannot be profiled "
                                                   "per layer; rebuild it with this crosscompile"};
      return false;
    }
    if (call.size >= 0 && call.size != module.dynamic_max()) {
      *failure = {"InputError", "profiling runs this module at its upper bound " + module.dynamic_name() + " " +
                                    std::to_string(module.dynamic_max()) + "; pass inputs of that size (got " +
                                    std::to_string(call.size) + ")"};
      return false;
    }
    watchdog_.arm(header.timeout_s, "profile of " + header.name);
    double start = monotonic_s();
    std::vector<double> totals;
    bool done = true;
    for (int run = 0; run <= number && done; ++run) {  // run 0 warms caches and pages in the parameters
      std::vector<double> seconds;
      std::string error;
      if (module.run_profiled(in.data(), out.data(), &seconds, &error) != 0) {
        *failure = {"RemoteError", "profile failed on the device: " + error};
        done = false;
      } else if (run) {
        if (totals.empty()) totals.assign(seconds.size(), 0.0);
        for (size_t i = 0; i < seconds.size() && i < totals.size(); ++i) totals[i] += seconds[i];
      }
    }
    double elapsed = monotonic_s() - start;
    watchdog_.disarm();
    if (!done) return false;
    double whole = 0;
    for (double t : totals) whole += t;
    if (whole == 0) whole = 1;
    // Each step as the metadata describes it (docs/module-abi.md, "steps").
    JsonValue metadata;
    std::string unused;
    const JsonValue* steps = nullptr;
    if (parse_json(module.metadata_json(), &metadata, &unused)) steps = metadata.get("steps");
    bool described = steps != nullptr && steps->kind == JsonValue::kArray && steps->items.size() == totals.size();
    std::string rows = "[";
    for (size_t i = 0; i < totals.size(); ++i) {
      std::string op = "?", name = "step " + std::to_string(i), fused = "[]", ins = "[]", outs = "[]";
      if (described) {
        const JsonValue& step = steps->items[i];
        const JsonValue* v;
        op = (v = step.get("op")) && v->kind == JsonValue::kString ? v->text : "?";
        name = (v = step.get("name")) && v->kind == JsonValue::kString ? v->text : "";
        fused = json_list(step.get("fused"));
        ins = json_list(step.get("inputs"));
        outs = json_list(step.get("outputs"));
      }
      rows += (i ? ", " : "") + std::string("{\"op\": ") + json_string(op) + ", \"name\": " + json_string(name) +
              ", \"fused\": " + fused + ", \"inputs\": " + ins + ", \"outputs\": " + outs +
              ", \"mean_s\": " + json_number(totals[i] / number) + ", \"share\": " +
              json_number(totals[i] / whole) + "}";
    }
    Frame reply;
    reply.op = "ok";
    reply.seconds = elapsed;
    reply.text = "{\"rows\": " + rows + "], \"number\": " + std::to_string(number) + "}";
    return ok(reply);
  }

  SessionSettings settings_;
  FrameConn conn_;
  Workspace workspace_;
  Watchdog watchdog_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, Loaded> modules_;
};

// Ends the session with the server: the server holds the other end of the
// control socket for as long as it runs, so a hang-up means it is gone
// (even killed with SIGKILL), and nobody is left to end this session.
void follow_server(int control_fd, std::string workspace) {
  for (;;) {
    pollfd p = {control_fd, POLLRDHUP, 0};
    if (::poll(&p, 1, -1) < 0 && errno == EINTR) continue;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) break;
  }
  Workspace(workspace).remove_all();
  _exit(0);
}

}  // namespace

void serve_session(const SessionSettings& settings) {
  g_control = settings.control_fd;
  std::thread(follow_server, settings.control_fd, settings.workspace).detach();
  SessionServer server(settings);
  server.serve();
}

}  // namespace tether
