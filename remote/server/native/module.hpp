// A compiled module (docs/module-abi.md) loaded into the native board
// server: its metadata, and one inference at a time on one or more threads.
// The reference behaviour is minirt's (minirt/module.py): the same checks,
// the same error texts, the same use of tether_run_parallel.
//
//   std::string error;
//   auto m = tether::Module::load("net.so", /*threads=*/0, &error);
//   if (!m) { fprintf(stderr, "%s\n", error.c_str()); return 2; }
//   std::vector<float> x(m->inputs()[0].bytes() / 4), y(m->outputs()[0].bytes() / 4);
//   void* in[] = {x.data()};
//   void* out[] = {y.data()};
//   if (m->run(in, out, &error) != 0) fprintf(stderr, "%s\n", error.c_str());
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tether {

class SharedObject;
class WorkerPool;

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // numpy name: float32, int64, int32, bool, ...
  std::vector<int64_t> dynamic_axes;  // a dynamic module's axes holding its dimension (shape: at the maximum)
  // An output whose size along count_axis depends on the data: shape holds
  // the upper bound, and a run leaves the actual size, an int64, at
  // count_offset in the workspace (docs/module-abi.md, "count"). -1: none.
  int64_t count_axis = -1, count_offset = -1;
  int64_t bytes() const;
  // The shape with the dynamic axes at `size` (size < 0: as declared).
  std::vector<int64_t> shape_at(int64_t size) const;
};

struct Step {
  std::string op, name;
};

class Module {
 public:
  // Maps and relocates the module at `path` (elf_loader.hpp) and reads its
  // metadata; nullptr with *error set to a message that names the file,
  // what is wrong and what to do. threads as for set_threads().
  static std::unique_ptr<Module> load(const std::string& path, int threads, std::string* error);
  ~Module();  // joins the worker threads, then unmaps the module
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& path() const { return path_; }
  const std::string& metadata_json() const { return metadata_json_; }  // tether_metadata() text
  const std::string& name() const { return name_; }
  const std::vector<TensorSpec>& inputs() const { return inputs_; }
  const std::vector<TensorSpec>& outputs() const { return outputs_; }
  int64_t workspace_bytes() const { return workspace_bytes_; }
  // After a run: output `index`'s shape (at dynamic size `size`, as run()),
  // with a counted axis cut to the size the run left; its `data` is
  // compacted in place to that shape, *bytes set to the bytes it keeps.
  std::vector<int64_t> cut_output(size_t index, int64_t size, void* data, size_t* bytes) const;
  const std::vector<Step>& steps() const { return steps_; }  // empty when the metadata has none
  bool has_parallel() const { return parallel_ != nullptr; }
  bool has_profiled() const { return profiled_ != nullptr; }
  // A module compiled with a dynamic dimension (metadata "dynamic"): the
  // specs' dynamic_axes hold it, their shapes give its upper bound, and
  // run() takes any size in [dynamic_min(), dynamic_max()].
  bool dynamic() const { return dynamic_max_ > 0; }
  const std::string& dynamic_name() const { return dynamic_name_; }
  int64_t dynamic_min() const { return dynamic_min_; }
  int64_t dynamic_max() const { return dynamic_max_; }

  int threads() const { return threads_; }
  // Threads per run: n <= 0 means one per online core; always 1 for a module
  // without tether_run_parallel. The worker threads start with the first
  // run that needs them (after the server has forked the session process).
  void set_threads(int n);

  // One inference: one pointer per input and per output, in metadata order,
  // each to a contiguous buffer of the tensor's bytes(). Returns 0, or
  // nonzero with *error set ("net.so: tether_run returned 1 (a required
  // pointer was NULL)"). Runs do not overlap: a second caller waits.
  // size: for a dynamic() module, the size of its dynamic dimension
  // (tether_run_dims); -1 runs tether_run (the upper bound).
  int run(void* const* inputs, void* const* outputs, std::string* error, int64_t size = -1);
  // One single-threaded pass of tether_run_profiled: (*seconds)[i] is the
  // time of step i, one entry per step the module marked (steps().size()
  // for a module whose metadata lists them). -1 with *error for a module
  // without tether_run_profiled.
  int run_profiled(void* const* inputs, void* const* outputs, std::vector<double>* seconds,
                   std::string* error);

 private:
  typedef int32_t (*RunFunction)(void* const*, void* const*, void*);
  typedef int32_t (*ParallelFunction)(void* const*, void* const*, void*, int32_t, int32_t, void*);
  typedef int32_t (*DimsFunction)(void* const*, void* const*, void*, const int64_t*);
  typedef int32_t (*ParallelDimsFunction)(void* const*, void* const*, void*, const int64_t*, int32_t, int32_t,
                                          void*);
  typedef int32_t (*ProfiledFunction)(void* const*, void* const*, void*, void (*)(void*, int32_t),
                                      void*);
  Module() = default;
  bool read_metadata(const char* text, std::string* error);
  std::string run_error(const char* function, int status) const;

  std::string path_;
  std::unique_ptr<SharedObject> object_;
  std::string metadata_json_, name_;
  std::vector<TensorSpec> inputs_, outputs_;
  std::vector<Step> steps_;
  int64_t workspace_bytes_ = 0;
  void* workspace_ = nullptr;  // 64-byte aligned, workspace_bytes_ (at least 64)
  RunFunction run_ = nullptr;
  ParallelFunction parallel_ = nullptr;
  ProfiledFunction profiled_ = nullptr;
  DimsFunction run_dims_ = nullptr;
  ParallelDimsFunction parallel_dims_ = nullptr;
  std::string dynamic_name_;
  int64_t dynamic_min_ = 0, dynamic_max_ = 0;
  int threads_ = 1;
  std::unique_ptr<WorkerPool> pool_;
  std::mutex running_;  // one run at a time owns the workspace and the pool
};

}  // namespace tether
