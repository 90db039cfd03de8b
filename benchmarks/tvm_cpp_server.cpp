// Apache TVM's RPC server with no Python in it, as the peer of Tether's native
// board server in benchmarks/bench_transfer.py.
//
// The apache-tvm wheel ships libtvm_runtime.so but not the `tvm_rpc` program
// (apps/cpp_rpc). This stands in for it: it answers TVM's connection
// handshake as tvm/rpc/server.py does, forks one process per session (as
// that server does) and hands the socket to the runtime's own
// `tvm::runtime::RPCServerLoop(int)`, the loop `python -m tvm.exec.rpc_server`
// also runs each session in. The two functions the benchmark's sessions call
// that the Python server registers in Python are registered here in C++:
// "tvm.rpc.server.workpath" (upload and download ask it where a file lives)
// and "rpc.test.addone" (the small call). So every byte and every call of a
// session is handled by C++ code.
//
//   g++ -std=c++17 -O2 tvm_cpp_server.cpp -I<tvm_ffi>/include -I<tvm>/include \
//       -L<tvm>/lib -ltvm_runtime -L<tvm_ffi>/lib -ltvm_ffi -o tvm-cpp-server
//   tvm-cpp-server --host 127.0.0.1 --port 0    # prints "listening on HOST:PORT"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

namespace tvm {
namespace runtime {
void RPCServerLoop(int sockfd);  // exported by libtvm_runtime.so (rpc_socket_impl.cc)
}  // namespace runtime
}  // namespace tvm

namespace {

// tvm/rpc/base.py
constexpr int32_t kRpcMagic = 0xff271;
constexpr int32_t kRpcCodeSuccess = kRpcMagic;
constexpr int32_t kRpcCodeMismatch = kRpcMagic + 2;

std::string g_workdir;

bool recv_all(int fd, void* out, size_t size) {
  char* p = static_cast<char*>(out);
  while (size) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool send_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// The handshake of tvm/rpc/server.py's _accept_conn for a server without a
// tracker: magic, then "client:<key> [options]", answered with success and
// "server:<key>". The key is empty, as the Python server's default.
bool handshake(int fd) {
  int32_t magic = 0, length = 0;
  if (!recv_all(fd, &magic, 4) || magic != kRpcMagic) return false;
  if (!recv_all(fd, &length, 4) || length < 0 || length > 4096) return false;
  std::string key(static_cast<size_t>(length), '\0');
  if (!recv_all(fd, &key[0], key.size())) return false;
  std::string first = key.substr(0, key.find(' '));
  if (first != "client:") {
    int32_t code = kRpcCodeMismatch;
    send_all(fd, &code, 4);
    return false;
  }
  const std::string server_key = "server:";
  int32_t code = kRpcCodeSuccess, server_length = static_cast<int32_t>(server_key.size());
  return send_all(fd, &code, 4) && send_all(fd, &server_length, 4) &&
         send_all(fd, server_key.data(), server_key.size());
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm.rpc.server.workpath",
           [](tvm::ffi::String name) { return tvm::ffi::String(g_workdir + "/" + std::string(name)); })
      .def("rpc.test.addone", [](int64_t x) { return x + 1; });
}

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  int port = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--host") == 0) host = argv[i + 1];
    else if (std::strcmp(argv[i], "--port") == 0) port = std::atoi(argv[i + 1]);
  }
  char folder[] = "/tmp/tvm-cpp-server-XXXXXX";
  if (::mkdtemp(folder) == nullptr) return 1;
  g_workdir = folder;
  ::signal(SIGCHLD, SIG_DFL);
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1 ||
      ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener, 16) != 0) {
    std::perror("tvm-cpp-server: listen");
    return 1;
  }
  socklen_t size = sizeof addr;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &size);
  std::printf("listening on %s:%d\n", host.c_str(), ntohs(addr.sin_port));
  std::fflush(stdout);
  for (;;) {
    int fd = ::accept(listener, nullptr, nullptr);
    if (fd < 0) continue;
    // As TVM's Python server: one session at a time, each in its own process.
    if (handshake(fd)) {
      // Nagle off, so that no small call waits on it: TVM's best case.
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      pid_t pid = ::fork();
      if (pid == 0) {
        ::close(listener);
        tvm::runtime::RPCServerLoop(fd);
        ::_exit(0);
      }
      if (pid > 0) ::waitpid(pid, nullptr, 0);
    }
    ::close(fd);
  }
}
