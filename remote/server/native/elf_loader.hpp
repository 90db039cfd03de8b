// Loading a module's ELF shared object without dlopen: a static executable
// has no dynamic loader, so the server maps and relocates modules itself.
// What it accepts and refuses is written down in docs/module-abi.md
// ("Loading without dlopen").
//
//   std::string error;
//   auto so = tether::SharedObject::load("net.so", &error);
//   if (!so) fprintf(stderr, "%s\n", error.c_str());
//   auto run = reinterpret_cast<int32_t (*)(void*const*, void*const*, void*)>(so->function("tether_run"));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tether {

class SharedObject {
 public:
  // Maps the shared object at `path`, applies its relocations and protects
  // its segments. Returns nullptr with *error naming the file, what is wrong
  // and what to do.
  static std::unique_ptr<SharedObject> load(const std::string& path, std::string* error);
  ~SharedObject();  // unmaps the image
  SharedObject(const SharedObject&) = delete;
  SharedObject& operator=(const SharedObject&) = delete;

  // The address of the exported function `name`, or nullptr when the object
  // defines no such symbol inside an executable segment.
  void* function(const char* name) const;
  // How many bytes from `address` to the end of the readable segment that
  // holds it (0 when none does): how far a string the module returns may run.
  size_t readable_bytes(const void* address) const;
  const std::string& path() const { return path_; }

 private:
  struct Segment {
    uintptr_t start, end;  // loaded addresses, [start, end)
    int prot;
  };
  SharedObject() = default;

  std::string path_;
  uint8_t* image_ = nullptr;
  size_t image_bytes_ = 0;
  std::vector<Segment> segments_;
  std::vector<std::pair<std::string, uintptr_t>> exports_;
  friend class ElfImageBuilder;
};

}  // namespace tether
