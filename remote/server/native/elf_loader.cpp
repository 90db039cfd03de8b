#include "elf_loader.hpp"

#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "string_printf.hpp"

// The running build decides which modules it can load: its own machine and
// class. A module holds code for one instruction set, and this process can
// only jump into code of its own.
#if defined(__x86_64__)
#define TETHER_MACHINE EM_X86_64
#define TETHER_MACHINE_NAME "x86_64"
#elif defined(__aarch64__)
#define TETHER_MACHINE EM_AARCH64
#define TETHER_MACHINE_NAME "aarch64"
#elif defined(__arm__)
#define TETHER_MACHINE EM_ARM
#define TETHER_MACHINE_NAME "arm"
#else
#error "the native board server is built for x86_64, aarch64 and 32-bit ARM only"
#endif

#if UINTPTR_MAX == 0xffffffffu
#define TETHER_ELF_CLASS ELFCLASS32
#define TETHER_ELF_BITS 32
typedef Elf32_Ehdr Ehdr;
typedef Elf32_Phdr Phdr;
typedef Elf32_Dyn Dyn;
typedef Elf32_Sym Sym;
typedef Elf32_Rel Rel;
typedef Elf32_Rela Rela;
#define TETHER_R_TYPE ELF32_R_TYPE
#define TETHER_R_SYM ELF32_R_SYM
#else
#define TETHER_ELF_CLASS ELFCLASS64
#define TETHER_ELF_BITS 64
typedef Elf64_Ehdr Ehdr;
typedef Elf64_Phdr Phdr;
typedef Elf64_Dyn Dyn;
typedef Elf64_Sym Sym;
typedef Elf64_Rel Rel;
typedef Elf64_Rela Rela;
#define TETHER_R_TYPE ELF64_R_TYPE
#define TETHER_R_SYM ELF64_R_SYM
#endif

// The ARM run-time ABI helpers LLVM calls on 32-bit ARM for what the
// instruction set lacks (int64 to float conversion, 64-bit division) and
// under Android's names for memcpy/memset. They come from compiler-rt, which
// every build of this server links, and use the base (soft-float) calling
// convention whatever the float ABI of the caller.
#if defined(__arm__)
#define TETHER_ARM_HELPERS(X)                                                                  \
  X(__aeabi_memcpy) X(__aeabi_memcpy4) X(__aeabi_memcpy8) X(__aeabi_memmove)                   \
  X(__aeabi_memmove4) X(__aeabi_memmove8) X(__aeabi_memset) X(__aeabi_memset4)                 \
  X(__aeabi_memset8) X(__aeabi_memclr) X(__aeabi_memclr4) X(__aeabi_memclr8) X(__aeabi_idiv)   \
  X(__aeabi_uidiv) X(__aeabi_idivmod) X(__aeabi_uidivmod) X(__aeabi_ldivmod)                   \
  X(__aeabi_uldivmod) X(__aeabi_llsl) X(__aeabi_llsr) X(__aeabi_lasr) X(__aeabi_lmul)          \
  X(__aeabi_l2f) X(__aeabi_ul2f) X(__aeabi_l2d) X(__aeabi_ul2d) X(__aeabi_f2lz)                \
  X(__aeabi_f2ulz) X(__aeabi_d2lz) X(__aeabi_d2ulz)
// Declared only to take their addresses; the module calls them.
#define TETHER_DECLARE_HELPER(name) extern "C" void name(void);
TETHER_ARM_HELPERS(TETHER_DECLARE_HELPER)
#endif

namespace tether {

namespace {

// Relocation kinds, per machine. Modules from crosscompile only carry
// JUMP_SLOT entries (the GOT slots of memcpy/memset/...); RELATIVE,
// GLOB_DAT and the absolute word are what LLD writes for any pointer stored
// in data, so they are applied too.
#if defined(__x86_64__)
constexpr uint32_t kRelNone = R_X86_64_NONE, kRelRelative = R_X86_64_RELATIVE,
                   kRelGlobDat = R_X86_64_GLOB_DAT, kRelJumpSlot = R_X86_64_JUMP_SLOT,
                   kRelAbsolute = R_X86_64_64;
#elif defined(__aarch64__)
constexpr uint32_t kRelNone = R_AARCH64_NONE, kRelRelative = R_AARCH64_RELATIVE,
                   kRelGlobDat = R_AARCH64_GLOB_DAT, kRelJumpSlot = R_AARCH64_JUMP_SLOT,
                   kRelAbsolute = R_AARCH64_ABS64;
#else
constexpr uint32_t kRelNone = R_ARM_NONE, kRelRelative = R_ARM_RELATIVE,
                   kRelGlobDat = R_ARM_GLOB_DAT, kRelJumpSlot = R_ARM_JUMP_SLOT,
                   kRelAbsolute = R_ARM_ABS32;
#endif

// Bit 0 of a 32-bit ARM function's address selects Thumb code; the code
// itself starts at the even address.
#if defined(__arm__)
constexpr uint64_t kCodeAddressMask = ~uint64_t{1};
#else
constexpr uint64_t kCodeAddressMask = ~uint64_t{0};
#endif

// Dynamic tags that musl's <elf.h> may lack.
constexpr int64_t kTagRelr = 36;                 // DT_RELR
constexpr int64_t kTagAndroidRel = 0x6000000f;   // DT_ANDROID_REL
constexpr int64_t kTagAndroidRela = 0x60000011;  // DT_ANDROID_RELA

// At most this many program headers: modules have fewer than ten, and a
// larger count is a corrupt header rather than a real file.
constexpr unsigned kMaxProgramHeaders = 256;

// The largest address range a module's segments may span. Real modules
// hold their parameters, so they are as large as the model; 2 GiB is more
// than a board's memory, and refusing larger spans keeps a corrupt size
// from reserving a terabyte.
constexpr uint64_t kMaxSpanBytes = uint64_t{2} << 30;

struct Import {
  const char* name;
  uintptr_t address;
};

std::vector<Import> imports() {
  typedef void* (*Copy)(void*, const void*, size_t);
  typedef void* (*Fill)(void*, int, size_t);
  std::vector<Import> table = {
      {"memcpy", reinterpret_cast<uintptr_t>(static_cast<Copy>(&memcpy))},
      {"memset", reinterpret_cast<uintptr_t>(static_cast<Fill>(&memset))},
      {"memmove", reinterpret_cast<uintptr_t>(static_cast<Copy>(&memmove))},
  };
#if defined(__arm__)
#define TETHER_HELPER_ENTRY(name) table.push_back({#name, reinterpret_cast<uintptr_t>(&name)});
  TETHER_ARM_HELPERS(TETHER_HELPER_ENTRY)
#endif
  return table;
}

const char* machine_name(unsigned machine) {
  switch (machine) {
    case EM_X86_64: return "x86_64";
    case EM_AARCH64: return "aarch64";
    case EM_ARM: return "arm";
    case EM_386: return "x86";
    case EM_RISCV: return "riscv";
    case EM_MIPS: return "mips";
    case EM_PPC: return "ppc";
    case EM_PPC64: return "ppc64";
    case EM_S390: return "s390x";
    default: return nullptr;
  }
}

bool read_at(int fd, uint64_t offset, void* out, size_t size) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (size > 0) {
    ssize_t n = pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = 0;  // the file ended early
    if (n <= 0) return false;
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A name from the file, fit for a message: a corrupt file's bytes need not
// be text, and the message travels in a protobuf string (UTF-8 only).
std::string printable(const char* name) {
  std::string out;
  for (const char* p = name; *p; ++p) {
    if (p - name == 80) {
      out += "...";
      break;
    }
    unsigned char c = static_cast<unsigned char>(*p);
    out += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : string_printf("\\x%02x", c);
  }
  return out;
}

int segment_prot(uint32_t flags) {
  return ((flags & PF_R) ? PROT_READ : 0) | ((flags & PF_W) ? PROT_WRITE : 0) |
         ((flags & PF_X) ? PROT_EXEC : 0);
}

class File {
 public:
  explicit File(int fd) : fd_(fd) {}
  ~File() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

// The steps of one load; on failure *error_ says why, and the half-built
// SharedObject's destructor unmaps what was mapped.
class ElfImageBuilder {
 public:
  ElfImageBuilder(SharedObject* so, std::string* error) : so_(so), error_(error), path_(so->path_) {}

  bool build() {
    int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cannot_read();
    File file(fd);
    struct stat st;
    if (fstat(fd, &st) != 0) return cannot_read();
    file_bytes_ = static_cast<uint64_t>(st.st_size);
    return read_headers(fd) && map(fd) && read_dynamic() && read_symbols() && relocate() && protect();
  }

 private:
  bool fail(const std::string& message) {
    *error_ = message;
    return false;
  }

  bool cannot_read() {
    const char* why = errno ? strerror(errno) : "the file ended early";
    return fail(string_printf("cannot read %s: %s", path_.c_str(), why));
  }

  bool refuse(const std::string& what) {
    return fail(path_ + " " + what + "; rebuild it with crosscompile for this board's target");
  }

  // What a board's `cc -shared` adds to an object tar's module: the C
  // library and its start-up files.
  bool refuse_board_link(const std::string& what) {
    return fail(path_ + " " + what + "; rebuild it with crosscompile's export_library(), or link an "
                "object tar with `cc -shared -nostdlib -o net.so *.o`");
  }

  bool truncated(uint64_t need) {
    return fail(string_printf("%s is truncated: its headers describe %llu bytes, the file has %llu; "
                              "upload it again (or rebuild it)",
                              path_.c_str(), static_cast<unsigned long long>(need),
                              static_cast<unsigned long long>(file_bytes_)));
  }

  bool read_headers(int fd) {
    unsigned char ident[EI_NIDENT + 4] = {0};
    size_t got = file_bytes_ < sizeof ident ? static_cast<size_t>(file_bytes_) : sizeof ident;
    if (!read_at(fd, 0, ident, got)) return cannot_read();
    if (got < EI_NIDENT + 4 || memcmp(ident, ELFMAG, SELFMAG) != 0 ||
        (ident[EI_CLASS] != ELFCLASS32 && ident[EI_CLASS] != ELFCLASS64)) {
      return fail(path_ + " is not an ELF shared object; expected a module written by crosscompile's "
                          "export_library()");
    }
    if (ident[EI_DATA] != ELFDATA2LSB) {
      return fail(path_ + " is a big-endian ELF file, but this server runs little-endian code; "
                          "rebuild it for this board's target");
    }
    unsigned machine = ident[18] | (ident[19] << 8);
    int bits = ident[EI_CLASS] == ELFCLASS32 ? 32 : 64;
    if (machine != TETHER_MACHINE || ident[EI_CLASS] != TETHER_ELF_CLASS) {
      const char* name = machine_name(machine);
      std::string module_machine = name ? name : string_printf("e_machine %u", machine);
      return fail(string_printf("%s is a %d-bit %s module, but this server runs %d-bit %s code; "
                                "rebuild it for this board's target",
                                path_.c_str(), bits, module_machine.c_str(), TETHER_ELF_BITS,
                                TETHER_MACHINE_NAME));
    }
    if (file_bytes_ < sizeof(Ehdr)) return truncated(sizeof(Ehdr));
    if (!read_at(fd, 0, &header_, sizeof header_)) return cannot_read();
    if (header_.e_type != ET_DYN) {
      return fail(string_printf("%s is not an ELF shared object (e_type %u); expected a module written "
                                "by crosscompile's export_library()",
                                path_.c_str(), header_.e_type));
    }
    if (header_.e_phentsize != sizeof(Phdr) || header_.e_phnum == 0 ||
        header_.e_phnum > kMaxProgramHeaders) {
      return refuse(string_printf("has unreadable program headers (%u of %u bytes)", header_.e_phnum,
                                  header_.e_phentsize));
    }
    // Everything the headers promise must be in the file: a cut upload is
    // refused here rather than loaded with zeros where code should be.
    uint64_t need = static_cast<uint64_t>(header_.e_phoff) + uint64_t{header_.e_phnum} * sizeof(Phdr);
    if (header_.e_shoff != 0) {
      need = std::max<uint64_t>(need, static_cast<uint64_t>(header_.e_shoff) +
                                          uint64_t{header_.e_shnum} * header_.e_shentsize);
    }
    if (need > file_bytes_) return truncated(need);
    phdrs_.resize(header_.e_phnum);
    if (!read_at(fd, header_.e_phoff, phdrs_.data(), phdrs_.size() * sizeof(Phdr))) return cannot_read();
    for (const Phdr& ph : phdrs_) {
      if (ph.p_type == PT_LOAD) {
        uint64_t end = static_cast<uint64_t>(ph.p_offset) + ph.p_filesz;
        if (end < ph.p_offset) return refuse("has a segment whose size overflows");
        need = std::max(need, end);
      }
    }
    if (need > file_bytes_) return truncated(need);
    return true;
  }

  bool map(int fd) {
    uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    uintptr_t low = UINTPTR_MAX, high = 0, align = page;
    for (const Phdr& ph : phdrs_) {
      if (ph.p_type == PT_TLS) return refuse("uses thread-local storage (PT_TLS), which modules do not");
      if (ph.p_type == PT_INTERP) return refuse("is a program (it has PT_INTERP), not a module");
      if (ph.p_type != PT_LOAD || ph.p_memsz == 0) continue;
      uintptr_t end = ph.p_vaddr + ph.p_memsz;
      if (ph.p_filesz > ph.p_memsz || end < ph.p_vaddr || end > UINTPTR_MAX - page) {
        return refuse("has a loadable segment with inconsistent sizes");
      }
      low = std::min<uintptr_t>(low, ph.p_vaddr & ~(page - 1));
      high = std::max<uintptr_t>(high, (end + page - 1) & ~(page - 1));
      // Segments keep their alignment (LLD aligns them to 64 KiB on ARM);
      // larger values than that are not real.
      if (ph.p_align > align && ph.p_align <= 65536 && (ph.p_align & (ph.p_align - 1)) == 0) {
        align = ph.p_align;
      }
      loads_.push_back(&ph);
    }
    if (loads_.empty()) return refuse("has no loadable segment");
    size_t span = high - low;
    if (uint64_t{span} > kMaxSpanBytes) {
      return refuse(string_printf("has loadable segments spanning %llu bytes, more than a module can",
                                  static_cast<unsigned long long>(span)));
    }
    // One reservation for the whole span keeps the segments at their
    // distances from each other, as the code's PC-relative addressing needs.
    size_t reserve = span + align - page;
    void* region = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
      return fail(string_printf("cannot load %s: reserving %zu bytes for it failed: %s", path_.c_str(), span,
                                strerror(errno)));
    }
    uintptr_t start = reinterpret_cast<uintptr_t>(region);
    uintptr_t aligned = (start + align - 1) & ~(align - 1);
    if (aligned > start) munmap(region, aligned - start);
    if (aligned + span < start + reserve) {
      munmap(reinterpret_cast<void*>(aligned + span), start + reserve - aligned - span);
    }
    so_->image_ = reinterpret_cast<uint8_t*>(aligned);
    so_->image_bytes_ = span;
    bias_ = aligned - low;
    page_ = page;
    // The file's bytes are copied rather than mapped: a module replaced on
    // disk while loaded (a new upload under the same name) must not change
    // or cut the code that runs.
    for (const Phdr* ph : loads_) {
      void* to = reinterpret_cast<void*>(bias_ + ph->p_vaddr);
      if (ph->p_filesz && !read_at(fd, ph->p_offset, to, ph->p_filesz)) return cannot_read();
      so_->segments_.push_back({bias_ + ph->p_vaddr, bias_ + ph->p_vaddr + ph->p_memsz,
                                segment_prot(ph->p_flags)});
    }
    return true;
  }

  // The loaded address of [vaddr, vaddr + size) if it lies inside one
  // loadable segment, else nullptr: every table the dynamic section points
  // to is checked before it is read.
  uint8_t* at(uint64_t vaddr, uint64_t size) const {
    for (const Phdr* ph : loads_) {
      if (vaddr >= ph->p_vaddr && size <= ph->p_memsz && vaddr - ph->p_vaddr <= ph->p_memsz - size) {
        return reinterpret_cast<uint8_t*>(bias_ + static_cast<uintptr_t>(vaddr));
      }
    }
    return nullptr;
  }

  bool read_dynamic() {
    const Phdr* dynamic = nullptr;
    for (const Phdr& ph : phdrs_) {
      if (ph.p_type == PT_DYNAMIC) dynamic = &ph;
    }
    if (!dynamic) return refuse("has no dynamic section (PT_DYNAMIC)");
    const Dyn* entries = reinterpret_cast<const Dyn*>(at(dynamic->p_vaddr, dynamic->p_memsz));
    if (!entries) return refuse("has its dynamic section outside its loadable segments");
    size_t count = dynamic->p_memsz / sizeof(Dyn);
    std::vector<uint64_t> needed;
    std::string forbidden;  // why the first entry a module must not have is refused
    auto forbid = [&forbidden](const std::string& why) {
      if (forbidden.empty()) forbidden = why;
    };
    for (size_t i = 0; i < count && entries[i].d_tag != DT_NULL; ++i) {
      int64_t tag = entries[i].d_tag;
      uint64_t value = entries[i].d_un.d_val;
      switch (tag) {
        case DT_NEEDED: needed.push_back(value); break;
        case DT_STRTAB: strtab_ = value; break;
        case DT_STRSZ: strsz_ = value; break;
        case DT_SYMTAB: symtab_ = value; break;
        case DT_SYMENT: syment_ = value; break;
        case DT_HASH: hash_ = value; break;
        case DT_GNU_HASH: gnu_hash_ = value; break;
        case DT_RELA: rela_ = value; break;
        case DT_RELASZ: relasz_ = value; break;
        case DT_RELAENT: relaent_ = value; break;
        case DT_REL: rel_ = value; break;
        case DT_RELSZ: relsz_ = value; break;
        case DT_RELENT: relent_ = value; break;
        case DT_JMPREL: jmprel_ = value; break;
        case DT_PLTRELSZ: pltrelsz_ = value; break;
        case DT_PLTREL: pltrel_ = value; break;
        // A module keeps no state that needs setting up: crosscompile's
        // modules have no constructors, and running foreign start-up code
        // (a libc's crt files) without that libc would crash.
        case DT_INIT:
          forbid("has an initialisation function (DT_INIT), which modules do not");
          break;
        case DT_INIT_ARRAY:
          forbid("has initialisation functions (DT_INIT_ARRAY), which modules do not");
          break;
        case DT_PREINIT_ARRAY:
          forbid("has initialisation functions (DT_PREINIT_ARRAY), which modules do not");
          break;
        case DT_FINI:
          forbid("has a finalisation function (DT_FINI), which modules do not");
          break;
        case DT_FINI_ARRAY:
          forbid("has finalisation functions (DT_FINI_ARRAY), which modules do not");
          break;
        case DT_TEXTREL:
          forbid("relocates its code (DT_TEXTREL); it was not built position-independent");
          break;
        case DT_VERNEED:
          forbid("requires symbol versions (DT_VERNEED), which modules do not");
          break;
        case kTagRelr:
        case kTagAndroidRel:
        case kTagAndroidRela:
          forbid(string_printf("has packed relocations (dynamic tag 0x%llx), which this loader does "
                               "not read", static_cast<unsigned long long>(tag)));
          break;
        default: break;  // DT_SONAME, DT_FLAGS, DT_PLTGOT, ...: nothing to do
      }
    }
    if (!strtab_ || !symtab_) return refuse("has no dynamic symbol table (DT_SYMTAB/DT_STRTAB)");
    strings_ = reinterpret_cast<const char*>(at(strtab_, strsz_));
    if (!strings_ || strsz_ == 0 || strings_[strsz_ - 1] != '\0') {
      return refuse("has its string table outside its loadable segments");
    }
    if (syment_ && syment_ != sizeof(Sym)) return refuse("has symbol table entries of an unknown size");
    if (!needed.empty()) {
      std::string names;
      for (uint64_t offset : needed) {
        names += names.empty() ? "" : ", ";
        names += offset < strsz_ ? printable(strings_ + offset) : "?";
      }
      const char* libraries = needed.size() > 1 ? "libraries " : "library ";
      return refuse_board_link("needs the shared " + (libraries + names) +
                               " (DT_NEEDED), but a module must need none: this server has no dynamic loader");
    }
    if (!forbidden.empty()) return refuse_board_link(forbidden);
    return true;
  }

  const char* symbol_name(const Sym& sym) const {
    return sym.st_name < strsz_ ? strings_ + sym.st_name : nullptr;
  }

  // The number of dynamic symbols: DT_HASH says it; from DT_GNU_HASH it is
  // one past the highest index a hash chain reaches.
  bool count_symbols() {
    if (hash_) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(at(hash_, 8));
      if (!words) return refuse("has its hash table outside its loadable segments");
      nsyms_ = words[1];
      return true;
    }
    if (!gnu_hash_) {
      return refuse("has neither DT_HASH nor DT_GNU_HASH, so its symbols cannot be counted");
    }
    const uint32_t* head = reinterpret_cast<const uint32_t*>(at(gnu_hash_, 16));
    if (!head) return refuse("has its hash table outside its loadable segments");
    uint32_t nbuckets = head[0], symoffset = head[1], bloom_words = head[2];
    uint64_t buckets_at = gnu_hash_ + 16 + uint64_t{bloom_words} * sizeof(uintptr_t);
    const uint32_t* buckets = reinterpret_cast<const uint32_t*>(at(buckets_at, uint64_t{nbuckets} * 4));
    if (!buckets) return refuse("has its hash table outside its loadable segments");
    uint32_t last = 0;
    for (uint32_t i = 0; i < nbuckets; ++i) last = std::max(last, buckets[i]);
    if (last < symoffset) {
      nsyms_ = symoffset;
      return true;
    }
    uint64_t chains_at = buckets_at + uint64_t{nbuckets} * 4;
    for (uint32_t i = last;; ++i) {
      const uint32_t* chain = reinterpret_cast<const uint32_t*>(at(chains_at + uint64_t{i - symoffset} * 4, 4));
      if (!chain) return refuse("has a hash chain that runs outside its loadable segments");
      if (*chain & 1) {
        nsyms_ = uint64_t{i} + 1;
        return true;
      }
    }
  }

  bool read_symbols() {
    if (!count_symbols()) return false;
    syms_ = reinterpret_cast<const Sym*>(at(symtab_, nsyms_ * sizeof(Sym)));
    if (!syms_ || nsyms_ > (uint64_t{1} << 24)) {
      return refuse("has its symbol table outside its loadable segments");
    }
    std::vector<Import> table = imports();
    std::vector<std::string> missing;
    values_.assign(nsyms_, 0);
    for (uint64_t i = 1; i < nsyms_; ++i) {
      const Sym& sym = syms_[i];
      const char* name = symbol_name(sym);
      if (!name) {
        return refuse(string_printf("has symbol %llu named outside its string table",
                                    static_cast<unsigned long long>(i)));
      }
      if (sym.st_shndx == SHN_UNDEF) {
        if (!*name) continue;
        bool found = false;
        for (const Import& import : table) {
          if (strcmp(import.name, name) == 0) {
            values_[i] = import.address;
            found = true;
          }
        }
        if (!found) missing.push_back(printable(name));
        continue;
      }
      values_[i] = sym.st_shndx == SHN_ABS ? sym.st_value : bias_ + sym.st_value;
      unsigned bind = ELF64_ST_BIND(sym.st_info);  // same encoding in both classes
      if (*name && (bind == STB_GLOBAL || bind == STB_WEAK) && sym.st_shndx != SHN_ABS) {
        if (!at(sym.st_value & kCodeAddressMask, 1)) {
          return refuse(string_printf("exports %s at 0x%llx, outside its loadable segments",
                                      printable(name).c_str(), static_cast<unsigned long long>(sym.st_value)));
        }
        so_->exports_.emplace_back(name, static_cast<uintptr_t>(values_[i]));
      }
    }
    if (!missing.empty()) {
      std::string names;
      for (const std::string& name : missing) names += (names.empty() ? "" : ", ") + name;
      return fail(path_ + " needs symbol" + (missing.size() > 1 ? "s " : " ") + names +
                  ", which this server does not provide (a module may import only memcpy, memset "
                  "and memmove" +
#if defined(__arm__)
                  ", and on 32-bit ARM the run-time ABI helpers __aeabi_*" +
#endif
                  std::string("); rebuild it with crosscompile"));
    }
    return true;
  }

  template <typename Entry>
  bool apply_table(uint64_t vaddr, uint64_t bytes, uint64_t entry_bytes, bool with_addend) {
    if (!vaddr || !bytes) return true;
    if (entry_bytes && entry_bytes != sizeof(Entry)) {
      return refuse("has relocation entries of an unknown size");
    }
    const Entry* entries = reinterpret_cast<const Entry*>(at(vaddr, bytes));
    if (!entries) return refuse("has a relocation table outside its loadable segments");
    for (uint64_t i = 0; i < bytes / sizeof(Entry); ++i) {
      const Entry& r = entries[i];
      uint32_t type = TETHER_R_TYPE(r.r_info);
      uint64_t sym = TETHER_R_SYM(r.r_info);
      if (type == kRelNone) continue;
      uintptr_t* where = reinterpret_cast<uintptr_t*>(at(r.r_offset, sizeof(uintptr_t)));
      if (!where) {
        return refuse(string_printf("has a relocation at 0x%llx, outside its loadable segments",
                                    static_cast<unsigned long long>(r.r_offset)));
      }
      if (sym >= nsyms_) {
        return refuse(string_printf("has a relocation of symbol %llu, past its symbol table",
                                    static_cast<unsigned long long>(sym)));
      }
      uintptr_t addend = with_addend ? static_cast<uintptr_t>(addend_of(r)) : *where;
      if (type == kRelRelative) {
        *where = bias_ + addend;
      } else if (type == kRelGlobDat || type == kRelJumpSlot) {
        // The slot gets the symbol's address; REL tables (ARM) hold a lazy
        // binding stub's address there, not an addend.
        *where = values_[sym] + (with_addend ? addend : 0);
      } else if (type == kRelAbsolute) {
        *where = values_[sym] + addend;
      } else {
        return fail(string_printf("%s has a relocation of type %u (at 0x%llx), which this server's loader "
                                  "does not apply (it applies types %u, %u, %u and %u); rebuild it with "
                                  "crosscompile for this board's target",
                                  path_.c_str(), type, static_cast<unsigned long long>(r.r_offset),
                                  kRelRelative, kRelGlobDat, kRelJumpSlot, kRelAbsolute));
      }
    }
    return true;
  }

  static int64_t addend_of(const Rela& r) { return r.r_addend; }
  static int64_t addend_of(const Rel&) { return 0; }

  bool relocate() {
    bool plt_rela = pltrel_ == DT_RELA;
    if (jmprel_ && pltrel_ != DT_RELA && pltrel_ != DT_REL) return refuse("has an unknown DT_PLTREL");
    return apply_table<Rela>(rela_, relasz_, relaent_, true) &&
           apply_table<Rel>(rel_, relsz_, relent_, false) &&
           (plt_rela ? apply_table<Rela>(jmprel_, pltrelsz_, 0, true)
                     : apply_table<Rel>(jmprel_, pltrelsz_, 0, false));
  }

  bool protect() {
    for (const SharedObject::Segment& s : so_->segments_) {
      if (s.prot & PROT_EXEC) {
        // ARM fetches instructions through a cache the copy did not go through.
        __builtin___clear_cache(reinterpret_cast<char*>(s.start), reinterpret_cast<char*>(s.end));
      }
    }
    // Pages of no segment (the gaps LLD leaves between them) become
    // inaccessible; a page two segments share gets both protections.
    uintptr_t image = reinterpret_cast<uintptr_t>(so_->image_);
    size_t pages = so_->image_bytes_ / page_;
    std::vector<int> prot(pages, PROT_NONE);
    for (const SharedObject::Segment& s : so_->segments_) {
      uintptr_t first = (s.start - image) / page_, end = (s.end - image + page_ - 1) / page_;
      for (uintptr_t p = first; p < end; ++p) prot[p] |= s.prot;
    }
    for (const Phdr& ph : phdrs_) {
      if (ph.p_type != PT_GNU_RELRO) continue;
      if (!at(ph.p_vaddr, ph.p_memsz)) return refuse("has its RELRO range outside its loadable segments");
      // Read-only once relocated, as ld.so does: whole pages inside the range.
      uintptr_t first = (bias_ + ph.p_vaddr - image) / page_;
      uintptr_t last = (bias_ + ph.p_vaddr + ph.p_memsz - image) / page_;
      for (uintptr_t p = first; p < last && p < pages; ++p) prot[p] &= ~PROT_WRITE;
    }
    for (size_t p = 0; p < pages;) {
      size_t q = p;
      while (q < pages && prot[q] == prot[p]) ++q;
      if (mprotect(so_->image_ + p * page_, (q - p) * page_, prot[p]) != 0) {
        return fail(string_printf("cannot load %s: protecting its segments failed: %s", path_.c_str(),
                                  strerror(errno)));
      }
      p = q;
    }
    return true;
  }

  SharedObject* so_;
  std::string* error_;
  const std::string& path_;
  uint64_t file_bytes_ = 0;
  Ehdr header_ = {};
  std::vector<Phdr> phdrs_;
  std::vector<const Phdr*> loads_;
  uintptr_t bias_ = 0, page_ = 4096;
  uint64_t strtab_ = 0, strsz_ = 0, symtab_ = 0, syment_ = 0, hash_ = 0, gnu_hash_ = 0;
  uint64_t rela_ = 0, relasz_ = 0, relaent_ = 0, rel_ = 0, relsz_ = 0, relent_ = 0;
  uint64_t jmprel_ = 0, pltrelsz_ = 0, pltrel_ = 0;
  const char* strings_ = nullptr;
  const Sym* syms_ = nullptr;
  uint64_t nsyms_ = 0;
  std::vector<uintptr_t> values_;
};

std::unique_ptr<SharedObject> SharedObject::load(const std::string& path, std::string* error) {
  std::unique_ptr<SharedObject> so(new SharedObject());
  so->path_ = path;
  ElfImageBuilder builder(so.get(), error);
  if (!builder.build()) return nullptr;
  return so;
}

SharedObject::~SharedObject() {
  if (image_) munmap(image_, image_bytes_);
}

void* SharedObject::function(const char* name) const {
  for (const auto& entry : exports_) {
    if (entry.first != name) continue;
    uintptr_t code = static_cast<uintptr_t>(entry.second & kCodeAddressMask);
    for (const Segment& s : segments_) {
      if ((s.prot & PROT_EXEC) && code >= s.start && code < s.end) return reinterpret_cast<void*>(entry.second);
    }
  }
  return nullptr;
}

size_t SharedObject::readable_bytes(const void* address) const {
  uintptr_t a = reinterpret_cast<uintptr_t>(address);
  for (const Segment& s : segments_) {
    if ((s.prot & PROT_READ) && a >= s.start && a < s.end) return s.end - a;
  }
  return 0;
}

}  // namespace tether
