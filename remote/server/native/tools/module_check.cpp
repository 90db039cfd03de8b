// Runs a module through the native server's loader, outside the server:
//
//   module_check net.so x.bin -o out/y [--threads N] [--repeat N] [--profile]
//
// loads net.so, reads each input from its raw file (C-order bytes of the
// input's shape and dtype, in metadata order), runs the module --repeat
// times (default 1) and writes output i to out/y<i>.bin. Prints "threads N"
// and, with --profile, one "step I OP NAME SECONDS" line per step of a
// tether_run_profiled pass. --null-inputs passes NULL for every input, to
// see the module's error code reported; --map-only stops after the ELF
// loader, before any module code runs. Errors go to stderr with exit code 2.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../elf_loader.hpp"
#include "../module.hpp"

namespace {

int fail(const std::string& message) {
  fprintf(stderr, "%s\n", message.c_str());
  return 2;
}

bool read_file(const std::string& path, std::vector<unsigned char>* out, std::string* error) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) {
    *error = "cannot read " + path + ": " + strerror(errno);
    return false;
  }
  unsigned char buffer[65536];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, f)) > 0) out->insert(out->end(), buffer, buffer + n);
  bool ok = !ferror(f);
  fclose(f);
  if (!ok) *error = "cannot read " + path;
  return ok;
}

bool write_file(const std::string& path, const std::vector<unsigned char>& data, std::string* error) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(data.data(), 1, data.size(), f) != data.size() || fclose(f) != 0) {
    *error = "cannot write " + path + ": " + strerror(errno);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage = "usage: module_check MODULE.so [INPUT.bin ...] -o OUTPUT_PREFIX [--threads N] "
                      "[--repeat N] [--profile] [--null-inputs] [--map-only]";
  std::string module_path, prefix;
  std::vector<std::string> input_paths;
  int threads = 1, repeat = 1;
  bool profile = false, null_inputs = false, map_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if ((arg == "-o" || arg == "--threads" || arg == "--repeat") && i + 1 < argc) {
      std::string value = argv[++i];
      if (arg == "-o") prefix = value;
      else if (arg == "--threads") threads = atoi(value.c_str());
      else repeat = atoi(value.c_str());
    } else if (arg == "--profile") {
      profile = true;
    } else if (arg == "--null-inputs") {
      null_inputs = true;
    } else if (arg == "--map-only") {
      map_only = true;
    } else if (!arg.empty() && arg[0] == '-') {
      return fail(usage);
    } else if (module_path.empty()) {
      module_path = arg;
    } else {
      input_paths.push_back(arg);
    }
  }
  if (module_path.empty() || (prefix.empty() && !map_only) || repeat < 1) return fail(usage);

  std::string error;
  if (map_only) {
    std::unique_ptr<tether::SharedObject> object = tether::SharedObject::load(module_path, &error);
    if (!object) return fail(error);
    printf("mapped %s\n", module_path.c_str());
    return 0;
  }
  std::unique_ptr<tether::Module> module = tether::Module::load(module_path, threads, &error);
  if (!module) return fail(error);
  if (input_paths.size() != module->inputs().size()) {
    return fail(module_path + " takes " + std::to_string(module->inputs().size()) + " input(s), got " +
                std::to_string(input_paths.size()) + " file(s)");
  }
  std::vector<std::vector<unsigned char>> inputs(input_paths.size());
  std::vector<void*> in_ptrs, out_ptrs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!read_file(input_paths[i], &inputs[i], &error)) return fail(error);
    const tether::TensorSpec& spec = module->inputs()[i];
    if (static_cast<int64_t>(inputs[i].size()) != spec.bytes()) {
      return fail(input_paths[i] + " has " + std::to_string(inputs[i].size()) + " bytes, input '" + spec.name +
                  "' (" + spec.dtype + ") takes " + std::to_string(spec.bytes()));
    }
    in_ptrs.push_back(null_inputs ? nullptr : inputs[i].data());
  }
  std::vector<std::vector<unsigned char>> outputs;
  for (const tether::TensorSpec& spec : module->outputs()) {
    outputs.emplace_back(static_cast<size_t>(spec.bytes()));
    out_ptrs.push_back(outputs.back().data());
  }
  printf("threads %d\n", module->threads());
  for (int r = 0; r < repeat; ++r) {
    if (module->run(in_ptrs.data(), out_ptrs.data(), &error) != 0) return fail(error);
  }
  if (profile) {
    std::vector<double> seconds;
    if (module->run_profiled(in_ptrs.data(), out_ptrs.data(), &seconds, &error) != 0) return fail(error);
    const std::vector<tether::Step>& steps = module->steps();
    for (size_t i = 0; i < seconds.size(); ++i) {
      printf("step %zu %s %s %.9f\n", i, i < steps.size() ? steps[i].op.c_str() : "?",
             i < steps.size() ? steps[i].name.c_str() : "?", seconds[i]);
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!write_file(prefix + std::to_string(i) + ".bin", outputs[i], &error)) return fail(error);
  }
  return 0;
}
