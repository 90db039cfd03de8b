#include "tar_link.hpp"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace tether {

namespace {

constexpr size_t kBlock = 512;
constexpr int kLinkTimeoutMs = 300 * 1000;

// Where the compiler lives on PATH, or "".
std::string which(const std::string& program) {
  if (program.find('/') != std::string::npos) return ::access(program.c_str(), X_OK) == 0 ? program : "";
  const char* path = ::getenv("PATH");
  std::string folders = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= folders.size()) {
    size_t end = folders.find(':', start);
    if (end == std::string::npos) end = folders.size();
    std::string candidate = folders.substr(start, end - start) + "/" + program;
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

int64_t octal(const char* field, size_t size) {
  int64_t v = 0;
  for (size_t i = 0; i < size && field[i]; ++i) {
    if (field[i] == ' ') continue;
    if (field[i] < '0' || field[i] > '7') return -1;
    v = v * 8 + (field[i] - '0');
  }
  return v;
}

bool read_exact(int fd, void* out, size_t size) {
  char* p = static_cast<char*>(out);
  while (size) {
    ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// e_machine of this build's own code.
int own_machine() {
#if defined(__aarch64__)
  return 183;
#elif defined(__arm__)
  return 40;
#elif defined(__x86_64__)
  return 62;
#else
  return 0;
#endif
}

void remove_folder(const std::string& folder, const std::vector<std::string>& files) {
  for (const auto& f : files) ::unlink(f.c_str());
  ::rmdir(folder.c_str());
}

}  // namespace

std::string link_module_tar(const std::string& tar_path, const std::string& name,
                            const Workspace& workspace, const std::string& cc, int64_t max_bytes,
                            std::string* error) {
  std::string compiler = which(cc);
  if (compiler.empty()) {
    *error = name + " holds object files that must be linked on the board, but the C compiler '" + cc +
             "' is not on this board's PATH; install one (e.g. apt install gcc) or upload a linked "
             "module (.so from export_library)";
    return "";
  }
  int fd = ::open(tar_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *error = "cannot read " + name + ": " + std::strerror(errno);
    return "";
  }
  unsigned char magic[6] = {};
  ssize_t got = ::read(fd, magic, sizeof magic);
  static const char* const kCompressed[] = {"\x1f\x8b", "BZh", "\xfd" "7zXZ", "\x28\xb5\x2f\xfd"};
  for (const char* m : kCompressed) {
    if (got >= static_cast<ssize_t>(std::strlen(m)) && std::memcmp(magic, m, std::strlen(m)) == 0) {
      ::close(fd);
      *error = name + " is a compressed archive; the board takes uncompressed .tar files only "
                      "(export_library writes one)";
      return "";
    }
  }
  ::lseek(fd, 0, SEEK_SET);
  std::string folder = workspace.root() + "/.link-XXXXXX";
  std::vector<char> pattern(folder.begin(), folder.end());
  pattern.push_back('\0');
  if (::mkdtemp(pattern.data()) == nullptr) {
    ::close(fd);
    *error = "cannot unpack " + name + ": " + std::strerror(errno);
    return "";
  }
  folder = pattern.data();
  std::vector<std::string> objects;
  int64_t unpacked = 0;
  char header[kBlock];
  std::vector<char> chunk(1 << 20);
  for (bool first = true;; first = false) {
    if (!read_exact(fd, header, kBlock)) {  // the end of the archive, unless nothing came before
      if (first) *error = name + " is not a readable tar archive: it is shorter than one tar header";
      break;
    }
    bool zero = true;
    for (char c : header) zero = zero && c == 0;
    if (zero) break;
    int64_t size = octal(header + 124, 12);
    if (size < 0 || std::memcmp(header + 257, "ustar", 5) != 0) {
      *error = name + " is not a readable tar archive";
      break;
    }
    char type = header[156];
    std::string member(header, strnlen(header, 100));
    std::string base = member.substr(member.rfind('/') == std::string::npos ? 0 : member.rfind('/') + 1);
    bool regular = type == '0' || type == '\0';
    bool skip = type == '5' || type == 'x' || type == 'g' || (regular && (base.size() < 3 ||
                base.compare(base.size() - 2, 2, ".o") != 0));
    if (!regular && !skip) {
      *error = name + ": member '" + member + "' is not a regular file; a module archive holds only "
                      ".o files and metadata.json";
      break;
    }
    int64_t padded = (size + kBlock - 1) / kBlock * kBlock;
    if (skip) {
      if (::lseek(fd, padded, SEEK_CUR) < 0) break;
      continue;
    }
    unpacked += size;
    if (unpacked > max_bytes) {
      *error = name + " unpacks to more than " + std::to_string(max_bytes) +
               " bytes, this device's limit for a session's files (server option --max-upload-bytes)";
      break;
    }
    std::string target = folder + "/" + base;
    int out = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (out < 0) {
      *error = errno == EEXIST ? name + ": two members are named '" + base + "'"
                               : "cannot unpack " + name + ": " + std::strerror(errno);
      break;
    }
    objects.push_back(target);
    int64_t left = size;
    bool ok = true;
    while (left && ok) {
      size_t n = static_cast<size_t>(left < static_cast<int64_t>(chunk.size()) ? left : chunk.size());
      ok = read_exact(fd, chunk.data(), n) && ::write(out, chunk.data(), n) == static_cast<ssize_t>(n);
      left -= static_cast<int64_t>(n);
    }
    ::close(out);
    if (!ok || ::lseek(fd, padded - size, SEEK_CUR) < 0) {
      *error = name + " is not a readable tar archive: " + base + " is cut short";
      break;
    }
    unsigned char ident[20] = {};
    int check = ::open(target.c_str(), O_RDONLY | O_CLOEXEC);
    bool elf = check >= 0 && read_exact(check, ident, sizeof ident) && std::memcmp(ident, "\x7f" "ELF", 4) == 0;
    if (check >= 0) ::close(check);
    if (!elf) {
      *error = name + ": " + base + " is not an ELF object file";
      break;
    }
    int machine = ident[18] | (ident[19] << 8);
    if (own_machine() && machine != own_machine()) {
      *error = name + ": " + base + " is code for another machine (e_machine " + std::to_string(machine) +
               "); build it for this board's target";
      break;
    }
  }
  ::close(fd);
  if (error->empty() && objects.empty()) *error = name + " holds no .o files to link";
  if (!error->empty()) {
    remove_folder(folder, objects);
    return "";
  }
  std::string stem = name.substr(0, name.size() - 4);
  std::string output = workspace.path(stem + ".so", error);
  if (output.empty()) {
    remove_folder(folder, objects);
    return "";
  }
  // No C library and no start files: this server loads modules itself and
  // takes them only as the module ABI has them (no DT_NEEDED, no DT_INIT).
  std::vector<std::string> args = {compiler, "-shared", "-nostdlib", "-o", output};
  args.insert(args.end(), objects.begin(), objects.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(&a[0]);
  argv.push_back(nullptr);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    *error = std::string("cannot start the linker: ") + std::strerror(errno);
    remove_folder(folder, objects);
    return "";
  }
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipe_fds[1], 1);
    ::dup2(pipe_fds[1], 2);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(pipe_fds[1]);
  std::string log;
  int64_t deadline = kLinkTimeoutMs;
  char buffer[4096];
  for (;;) {
    pollfd p = {pipe_fds[0], POLLIN, 0};
    int ready = ::poll(&p, 1, 1000);
    if (ready == 0 && (deadline -= 1000) <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    if (ready <= 0) continue;
    ssize_t n = ::read(pipe_fds[0], buffer, sizeof buffer);
    if (n <= 0) break;
    log.append(buffer, static_cast<size_t>(n));
  }
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  remove_folder(folder, objects);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    if (log.size() > 2000) log = log.substr(log.size() - 2000);
    *error = "linking " + name + " with " + cc + " failed (exit " +
             std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + "): " + log;
    return "";
  }
  return output;
}

}  // namespace tether
