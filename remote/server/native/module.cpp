#include "module.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "elf_loader.hpp"
#include "json.hpp"
#include "string_printf.hpp"

namespace tether {

namespace {

constexpr int32_t kAbiVersion = 1;
// Threads tether_run_parallel takes at most (docs/module-abi.md).
constexpr int kMaxThreads = 255;
constexpr size_t kWorkspaceAlignment = 64;
// Worker threads run the module's kernels, which may keep large arrays on
// the stack: give them what a main thread gets (musl's default is 128 KiB).
constexpr size_t kWorkerStackBytes = 8 << 20;

// tether_run return codes (docs/module-abi.md).
const char* run_error_reason(int status) {
  switch (status) {
    case 1: return "a required pointer was NULL";
    case 2: return "a dynamic dimension's size is outside its range";
    default: return "unknown error code";
  }
}

int64_t dtype_bytes(const std::string& dtype) {
  static const struct {
    const char* name;
    int64_t bytes;
  } kSizes[] = {{"float32", 4}, {"int64", 8}, {"int32", 4}, {"bool", 1},    {"float16", 2},
                {"float64", 8}, {"int8", 1},  {"uint8", 1}, {"int16", 2},   {"uint16", 2},
                {"uint32", 4},  {"uint64", 8}, {"bfloat16", 2},
                // the low-bit types, one byte per element (crosscompile/lowbit.py)
                {"float8_e4m3fn", 1}, {"float8_e4m3fnuz", 1}, {"float8_e5m2", 1}, {"float8_e5m2fnuz", 1},
                {"float8_e8m0fnu", 1}, {"float4_e2m1fn", 1}, {"int4", 1}, {"uint4", 1}, {"int2", 1}, {"uint2", 1}};
  for (const auto& size : kSizes) {
    if (dtype == size.name) return size.bytes;
  }
  return 0;
}

double now_seconds() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// struct tether_sync (docs/module-abi.md): the module's barrier state,
// zeroed per run, and the C library's syscall() to sleep on a futex with.
struct TetherSync {
  int32_t arrived, generation;
  long (*syscall)(long, ...);
};

struct Marks {
  std::vector<int32_t> steps;
  std::vector<double> times;
};

// void mark(void *ctx, int32_t step) of tether_run_profiled: no float
// arguments, so the soft- and hard-float ARM conventions agree on it.
void mark(void* ctx, int32_t step) {
  double t = now_seconds();
  Marks* marks = static_cast<Marks*>(ctx);
  marks->steps.push_back(step);
  marks->times.push_back(t);
}

}  // namespace

// size - 1 worker threads plus the caller's, all entering
// tether_run_parallel together. As in minirt, the caller does not wait for
// the workers to return: when its own call returns, every thread has passed
// the barrier after the last op it shared, so the outputs are complete and a
// worker has nothing left but to return. The next run waits for that
// instead, since the workers still hold the run's sync state.
class WorkerPool {
 public:
  typedef int32_t (*Function)(void* const*, void* const*, void*, int32_t, int32_t, void*);
  // tether_run_parallel_dims: the same with the dims array before thread.
  typedef int32_t (*DimsFunction)(void* const*, void* const*, void*, const int64_t*, int32_t, int32_t, void*);

  explicit WorkerPool(int size) : size_(size) {}

  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (pthread_t thread : threads_) pthread_join(thread, nullptr);
  }

  int size() const { return size_; }

  // Starts the workers; false with *error when the system refuses a thread.
  bool start(std::string* error) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, kWorkerStackBytes);
    for (int i = 1; i < size_; ++i) {
      workers_.push_back({this, i});
    }
    for (Worker& worker : workers_) {
      pthread_t thread;
      int rc = pthread_create(&thread, &attr, &WorkerPool::main, &worker);
      if (rc != 0) {
        pthread_attr_destroy(&attr);
        *error = string_printf("cannot start %d worker threads: %s; set fewer threads", size_ - 1,
                               strerror(rc));
        return false;
      }
      threads_.push_back(thread);
    }
    pthread_attr_destroy(&attr);
    return true;
  }

  // With dims_fn (and size) the run calls it instead of fn.
  int32_t run(Function fn, DimsFunction dims_fn, int64_t size, void* const* inputs, size_t n_inputs,
              void* const* outputs, size_t n_outputs, void* workspace) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return busy_ == 0; });
      // The pool's own copies of the pointer arrays (with a terminator, so
      // never NULL) outlive the call for workers still returning from it.
      inputs_.assign(inputs, inputs + n_inputs);
      inputs_.push_back(nullptr);
      outputs_.assign(outputs, outputs + n_outputs);
      outputs_.push_back(nullptr);
      sync_ = TetherSync{0, 0, &::syscall};
      fn_ = fn;
      dims_fn_ = dims_fn;
      dims_ = size;
      workspace_ = workspace;
      busy_ = size_ - 1;
      ++generation_;
    }
    start_.notify_all();
    return call(0);
  }

 private:
  struct Worker {
    WorkerPool* pool;
    int thread;
  };

  static void* main(void* arg) {
    Worker* worker = static_cast<Worker*>(arg);
    worker->pool->work(worker->thread);
    return nullptr;
  }

  void work(int thread) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (generation_ == seen) return;  // stopping, and no run left to join
      seen = generation_;
      lock.unlock();
      // All threads return the same status; thread 0's is the one reported.
      call(thread);
      lock.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }

  int32_t call(int thread) {
    if (dims_fn_) return dims_fn_(inputs_.data(), outputs_.data(), workspace_, &dims_, thread, size_, &sync_);
    return fn_(inputs_.data(), outputs_.data(), workspace_, thread, size_, &sync_);
  }

  const int size_;
  std::vector<Worker> workers_;
  std::vector<pthread_t> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  bool stopping_ = false;
  uint64_t generation_ = 0;
  int busy_ = 0;  // workers that have not yet returned from the current run
  Function fn_ = nullptr;
  DimsFunction dims_fn_ = nullptr;
  int64_t dims_ = 0;
  std::vector<void*> inputs_, outputs_;
  void* workspace_ = nullptr;
  TetherSync sync_ = {0, 0, nullptr};
};

int64_t TensorSpec::bytes() const {
  int64_t n = dtype_bytes(dtype);
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> Module::cut_output(size_t index, int64_t size, void* data, size_t* bytes) const {
  const TensorSpec& spec = outputs_[index];
  std::vector<int64_t> shape = spec.shape_at(size);
  TensorSpec actual = spec;
  actual.shape = shape;
  *bytes = static_cast<size_t>(actual.bytes());
  if (spec.count_axis < 0) return shape;
  int64_t count = 0;
  std::memcpy(&count, static_cast<const char*>(workspace_) + spec.count_offset, sizeof count);
  size_t axis = static_cast<size_t>(spec.count_axis);
  int64_t bound = shape[axis];
  if (count < 0 || count > bound) count = bound;  // cannot happen with a sound module; keep the bound
  // Rows of `inner` bytes: `outer` blocks of `bound` rows each keep their first `count`.
  int64_t outer = 1, inner = dtype_bytes(spec.dtype);
  for (size_t a = 0; a < axis; ++a) outer *= shape[a];
  for (size_t a = axis + 1; a < shape.size(); ++a) inner *= shape[a];
  char* base = static_cast<char*>(data);
  for (int64_t o = 1; o < outer; ++o) {
    std::memmove(base + o * count * inner, base + o * bound * inner, static_cast<size_t>(count * inner));
  }
  shape[axis] = count;
  *bytes = static_cast<size_t>(outer * count * inner);
  return shape;
}

std::vector<int64_t> TensorSpec::shape_at(int64_t size) const {
  std::vector<int64_t> out = shape;
  if (size >= 0) {
    for (int64_t axis : dynamic_axes) out[static_cast<size_t>(axis)] = size;
  }
  return out;
}

std::unique_ptr<Module> Module::load(const std::string& path, int threads, std::string* error) {
  std::unique_ptr<SharedObject> object = SharedObject::load(path, error);
  if (!object) return nullptr;
  auto abi_version = reinterpret_cast<int32_t (*)()>(object->function("tether_abi_version"));
  auto metadata = reinterpret_cast<const char* (*)()>(object->function("tether_metadata"));
  auto run = reinterpret_cast<RunFunction>(object->function("tether_run"));
  const char* missing = !abi_version ? "tether_abi_version"
                        : !metadata  ? "tether_metadata"
                        : !run       ? "tether_run"
                                     : nullptr;
  if (missing) {
    *error = path + " is not a Tether module: it exports no function " + missing +
             "; expected a module written by crosscompile's export_library()";
    return nullptr;
  }
  int32_t version = abi_version();
  if (version != kAbiVersion) {
    *error = string_printf("%s uses module ABI version %d, but this server supports version %d; "
                           "rebuild the module with a matching crosscompile",
                           path.c_str(), version, kAbiVersion);
    return nullptr;
  }
  std::unique_ptr<Module> module(new Module());
  module->path_ = path;
  module->run_ = run;
  // Optional (docs/module-abi.md): modules from before them lack them.
  module->parallel_ = reinterpret_cast<ParallelFunction>(object->function("tether_run_parallel"));
  module->profiled_ = reinterpret_cast<ProfiledFunction>(object->function("tether_run_profiled"));
  module->run_dims_ = reinterpret_cast<DimsFunction>(object->function("tether_run_dims"));
  module->parallel_dims_ = reinterpret_cast<ParallelDimsFunction>(object->function("tether_run_parallel_dims"));
  const char* text = metadata();
  size_t room = object->readable_bytes(text);
  size_t length = room ? strnlen(text, room) : 0;
  if (length == room) {
    *error = path + " has unreadable metadata: tether_metadata() returned a pointer to no "
                    "NUL-terminated string in the module; rebuild it with crosscompile";
    return nullptr;
  }
  module->object_ = std::move(object);
  if (!module->read_metadata(text, error)) return nullptr;
  size_t workspace = static_cast<size_t>(module->workspace_bytes_);
  workspace = workspace < kWorkspaceAlignment ? kWorkspaceAlignment : workspace;
  workspace = (workspace + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1);
  if (posix_memalign(&module->workspace_, kWorkspaceAlignment, workspace) != 0) {
    module->workspace_ = nullptr;
    *error = string_printf("cannot allocate the %lld-byte workspace of %s; free memory on the board or "
                           "load a smaller model",
                           static_cast<long long>(module->workspace_bytes_), path.c_str());
    return nullptr;
  }
  memset(module->workspace_, 0, workspace);
  module->set_threads(threads);
  return module;
}

bool Module::read_metadata(const char* text, std::string* error) {
  metadata_json_ = text;
  JsonValue doc;
  std::string why;
  if (!parse_json(metadata_json_, &doc, &why) || doc.kind != JsonValue::kObject) {
    if (why.empty()) why = "it is not a JSON object";
    *error = path_ + " has unreadable metadata: " + why + "; rebuild it with crosscompile";
    return false;
  }
  auto bad = [&](const std::string& what) {
    *error = path_ + " has unreadable metadata: " + what + "; rebuild it with crosscompile";
    return false;
  };
  const JsonValue* name = doc.get("name");
  if (name && name->kind == JsonValue::kString) name_ = name->text;
  const char* lists[] = {"inputs", "outputs"};
  for (const char* key : lists) {
    std::vector<TensorSpec>& specs = key[0] == 'i' ? inputs_ : outputs_;
    const JsonValue* list = doc.get(key);
    if (!list || list->kind != JsonValue::kArray) return bad(std::string("no \"") + key + "\" list");
    for (size_t i = 0; i < list->items.size(); ++i) {
      const JsonValue& entry = list->items[i];
      std::string where = string_printf("%s[%zu]", key, i);
      const JsonValue* tname = entry.get("name");
      const JsonValue* shape = entry.get("shape");
      const JsonValue* dtype = entry.get("dtype");
      if (!tname || tname->kind != JsonValue::kString) return bad(where + " has no name");
      if (!dtype || dtype->kind != JsonValue::kString) return bad(where + " has no dtype");
      if (!shape || shape->kind != JsonValue::kArray) return bad(where + " has no shape");
      TensorSpec spec;
      spec.name = tname->text;
      spec.dtype = dtype->text;
      if (dtype_bytes(spec.dtype) == 0) return bad(where + " has the unknown dtype " + spec.dtype);
      for (const JsonValue& d : shape->items) {
        if (d.kind != JsonValue::kNumber || !d.integral || d.integer < 0) {
          return bad(where + " has a shape that is not a list of sizes");
        }
        spec.shape.push_back(d.integer);
      }
      const JsonValue* axes = entry.get("dynamic_axes");
      if (axes && axes->kind == JsonValue::kArray) {
        for (const JsonValue& a : axes->items) {
          if (a.kind != JsonValue::kNumber || !a.integral || a.integer < 0 ||
              a.integer >= static_cast<int64_t>(spec.shape.size())) {
            return bad(where + " has dynamic_axes that are not axes of its shape");
          }
          spec.dynamic_axes.push_back(a.integer);
        }
      }
      const JsonValue* count = entry.get("count");
      if (count && count->kind == JsonValue::kObject) {
        const JsonValue* axis = count->get("axis");
        const JsonValue* offset = count->get("offset");
        if (!axis || !offset || axis->kind != JsonValue::kNumber || offset->kind != JsonValue::kNumber ||
            !axis->integral || !offset->integral || axis->integer < 0 ||
            axis->integer >= static_cast<int64_t>(spec.shape.size()) || offset->integer < 0 ||
            offset->integer % 8 != 0) {
          return bad(where + " has a count that is not {axis, offset} of one of its axes and an aligned offset");
        }
        spec.count_axis = axis->integer;
        spec.count_offset = offset->integer;
      }
      specs.push_back(spec);
    }
  }
  const JsonValue* workspace = doc.get("workspace_bytes");
  if (!workspace || workspace->kind != JsonValue::kNumber || !workspace->integral || workspace->integer < 0) {
    return bad("no \"workspace_bytes\" count");
  }
  workspace_bytes_ = workspace->integer;
  for (const TensorSpec& spec : outputs_) {
    if (spec.count_offset >= 0 && spec.count_offset + 8 > workspace_bytes_) {
      return bad("output " + spec.name + " has its count outside the workspace");
    }
  }
  const JsonValue* dynamic = doc.get("dynamic");
  if (dynamic && dynamic->kind == JsonValue::kArray && !dynamic->items.empty()) {
    const JsonValue& dim = dynamic->items[0];
    const JsonValue* dim_name = dim.get("name");
    const JsonValue* low = dim.get("min");
    const JsonValue* high = dim.get("max");
    bool counts = low && high && low->kind == JsonValue::kNumber && high->kind == JsonValue::kNumber &&
                  low->integral && high->integral && 1 <= low->integer && low->integer <= high->integer;
    if (dynamic->items.size() != 1 || !dim_name || dim_name->kind != JsonValue::kString || !counts) {
      return bad("a \"dynamic\" entry that is not one {name, min, max} with 1 <= min <= max");
    }
    bool carried = false;
    for (const auto* specs : {&inputs_, &outputs_}) {
      for (const TensorSpec& spec : *specs) {
        for (int64_t axis : spec.dynamic_axes) {
          if (spec.shape[static_cast<size_t>(axis)] != high->integer) {
            return bad("tensor " + spec.name + " is not at the dynamic dimension's upper bound on its dynamic_axes");
          }
        }
        carried = carried || (specs == &inputs_ && !spec.dynamic_axes.empty());
      }
    }
    if (!carried) return bad("a dynamic dimension that no input's dynamic_axes holds");
    if (!run_dims_) return bad("a dynamic dimension but no function tether_run_dims");
    dynamic_name_ = dim_name->text;
    dynamic_min_ = low->integer;
    dynamic_max_ = high->integer;
  }
  const JsonValue* steps = doc.get("steps");
  if (steps && steps->kind == JsonValue::kArray) {
    for (const JsonValue& entry : steps->items) {
      const JsonValue* op = entry.get("op");
      const JsonValue* step_name = entry.get("name");
      Step step;
      step.op = op && op->kind == JsonValue::kString ? op->text : "?";
      step.name = step_name && step_name->kind == JsonValue::kString ? step_name->text : "";
      steps_.push_back(step);
    }
  }
  return true;
}

Module::~Module() {
  pool_.reset();  // the workers run module code: join them before unmapping it
  free(workspace_);
}

void Module::set_threads(int n) {
  std::lock_guard<std::mutex> lock(running_);
  if (n <= 0) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    n = cores > 0 ? static_cast<int>(cores) : 1;
  }
  n = std::min(n, kMaxThreads);
  threads_ = parallel_ ? n : 1;
  if (pool_ && pool_->size() != threads_) pool_.reset();
}

std::string Module::run_error(const char* function, int status) const {
  return string_printf("%s: %s returned %d (%s)", path_.c_str(), function, status,
                       run_error_reason(status));
}

int Module::run(void* const* inputs, void* const* outputs, std::string* error, int64_t size) {
  bool dims = size >= 0 && dynamic();
  std::lock_guard<std::mutex> lock(running_);
  int status;
  if (threads_ > 1 && (!dims || parallel_dims_)) {
    if (!pool_) {
      std::unique_ptr<WorkerPool> pool(new WorkerPool(threads_));
      std::string why;
      if (!pool->start(&why)) {
        *error = path_ + ": " + why;
        return -1;
      }
      pool_ = std::move(pool);
    }
    status = pool_->run(parallel_, dims ? parallel_dims_ : nullptr, size, inputs, inputs_.size(), outputs,
                        outputs_.size(), workspace_);
  } else {
    status = dims ? run_dims_(inputs, outputs, workspace_, &size) : run_(inputs, outputs, workspace_);
  }
  if (status != 0) {
    *error = run_error(dims ? "tether_run_dims" : "tether_run", status);
    return status;
  }
  return 0;
}

int Module::run_profiled(void* const* inputs, void* const* outputs, std::vector<double>* seconds,
                         std::string* error) {
  if (!profiled_) {
    *error = path_ + " has no tether_run_profiled, so it cannot be profiled per layer; rebuild it "
                     "with this crosscompile";
    return -1;
  }
  std::lock_guard<std::mutex> lock(running_);
  Marks marks;
  // Room for every mark up front: no allocation between two marks.
  marks.steps.reserve(steps_.size() + 1 > 4096 ? steps_.size() + 1 : 4096);
  marks.times.reserve(marks.steps.capacity());
  int status = profiled_(inputs, outputs, workspace_, &mark, &marks);
  if (status != 0) {
    *error = run_error("tether_run_profiled", status);
    return status;
  }
  bool in_order = !marks.steps.empty();
  for (size_t i = 0; i < marks.steps.size(); ++i) {
    in_order = in_order && marks.steps[i] == static_cast<int32_t>(i);
  }
  if (!in_order) {
    std::string got;
    for (int32_t step : marks.steps) got += (got.empty() ? "" : ", ") + std::to_string(step);
    *error = path_ + ": tether_run_profiled marked steps [" + got + "], expected 0, 1, 2, ... in order";
    return -1;
  }
  seconds->clear();
  for (size_t i = 1; i < marks.times.size(); ++i) seconds->push_back(marks.times[i] - marks.times[i - 1]);
  return 0;
}

}  // namespace tether
