// memory.hpp — planned, counted host memory.
//
// Owns: Buffer<T> (64-byte aligned, move-only, tagged with what it holds) and the
// per-category counters (current and peak bytes) that the memory plan is checked
// against and that the end-of-run report prints; the MemoryPlan those are checked
// against (its rows come from the engine and the training state). The hot loop
// allocates nothing: buffers are made at start-up from the plan's sizes. Knows
// nothing about models.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace shardlm {

enum class Mem { ParamShard, GradShard, OptimState, Gathered, Activations, Workspace, Data, Snapshot, kCount };
constexpr int kMemCategories = static_cast<int>(Mem::kCount);
const char* mem_name(Mem m);

struct MemCounters {
  std::array<int64_t, kMemCategories> current{}, peak{};
  int64_t total_current = 0, total_peak = 0;
};

void* mem_alloc(Mem category, size_t bytes);   // aligned to 64 bytes; throws on failure
void mem_free(Mem category, void* ptr, size_t bytes);
MemCounters host_memory();                     // this process's counters
// Host memory allocated elsewhere (pinned buffers of the CUDA runtime), counted
// with mem_alloc's.
void host_mem_track(Mem category, int64_t delta_bytes);
// Device (GPU) memory, counted the same way by the device backend.
void device_mem_track(Mem category, int64_t delta_bytes);
// device.memory_limit_gib: a cap on the device memory counted here (0: none), so
// that a large GPU can stand in for a smaller one. device_mem_admit throws,
// naming the category and the totals, when `bytes` more would pass it; device
// allocators call it before allocating.
void set_device_memory_limit(int64_t bytes);
void device_mem_admit(Mem category, int64_t bytes);
MemCounters device_memory();
void reset_host_peaks();                       // peak := current (per category and total)

// The memory this machine gives its processes: physical memory, or the
// cgroup's limit when that is lower (containers, Slurm's --mem). `source` says
// which ("MemTotal", "cgroup memory.max").
struct MachineMemory {
  int64_t bytes = 0;
  const char* source = "";
};
MachineMemory machine_host_memory();

template <class T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(Mem category, int64_t count) : category_(category), count_(count) {
    if (count_ > 0) ptr_ = static_cast<T*>(mem_alloc(category_, bytes()));
  }
  ~Buffer() { release(); }
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) { release(); swap(o); }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  int64_t size() const { return count_; }
  size_t bytes() const { return static_cast<size_t>(count_) * sizeof(T); }
  T& operator[](int64_t i) { return ptr_[i]; }
  const T& operator[](int64_t i) const { return ptr_[i]; }
  void release() {
    if (ptr_) mem_free(category_, ptr_, bytes());
    ptr_ = nullptr;
    count_ = 0;
  }

 private:
  void swap(Buffer& o) {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    std::swap(category_, o.category_);
  }
  T* ptr_ = nullptr;
  Mem category_ = Mem::Workspace;
  int64_t count_ = 0;
};

// Where the fp32 training state lives (train/state.hpp), chosen once per run.
enum class StatePlacement { Host, Device, Offload };

// Bytes per rank a run will allocate, by row: the training state's (train/state.hpp:
// host fp32 shards in every placement, being the state, its device mirror or the
// CPU optimizer's; device state or accumulators on a GPU) and the engine's (the
// backend's parameter copies, gathered units, gradient slots, activations,
// workspace: in device memory on a GPU backend, host memory on the CPU).
struct MemoryPlan {
  bool device = false;
  int64_t param_shards = 0, grad_shards = 0, optim_state = 0;  // host
  int64_t param_copies = 0;                                     // device: bf16 shards
  int64_t gathered = 0, activations = 0, workspace = 0;         // device when `device`, else host
  int64_t host_workspace = 0;                                   // host: broadcast / export staging
  int64_t comm_staging = 0;                                     // host: pinned buffers of the staged MPI device Comm
  int64_t offload_buffers = 0;                                  // host: the offload pipeline's bf16 shards
  int64_t device_state = 0;  // GPU: fp32 masters + gradients + optimizer state (their host shards become mirrors)
  int64_t device_grads = 0;  // GPU: the offload pipeline's fp32 gradient accumulators
  int64_t data_reader = 0;   // host: token readers of data.path and eval.path (data.hpp's DataMemory)
  int64_t checkpoint_snapshot = 0;  // host: the async checkpoint's copy of the state (ckpt.async)
  int64_t reference_weights = 0;    // host: RL's frozen starting weights, fp32 (loss.ref_kl_coef > 0)
  int64_t reference_copies = 0;     // GPU: their bf16 copy the reference pass reads
  // Of which the pool gives up on a host without room (ckpt.async_host_gib = 0:
  // it then takes half of what is left and stages saves); the plan fits without it.
  int64_t checkpoint_snapshot_flexible = 0;
  // GPU: the device copy of the state async saves download from (device
  // state, ckpt.async), taken only where the GPU has room after everything
  // else; without it the update after a save waits for the download. Not in
  // device_total(): the plan fits without it.
  int64_t checkpoint_device_snapshot = 0;
  // GPU: of activations + workspace, what model.residual_dtype = "fp32" adds
  // over a bf16 stream (named in the error of a plan that does not fit).
  int64_t fp32_stream = 0;
  int64_t host_total() const {
    return param_shards + grad_shards + optim_state + host_workspace + comm_staging + offload_buffers + data_reader +
           checkpoint_snapshot + reference_weights +
           (device ? 0 : gathered + activations + workspace);
  }
  int64_t device_total() const {
    return device ? device_state + device_grads + param_copies + reference_copies + gathered + activations + workspace
                  : 0;
  }
  int64_t total() const { return host_total() + device_total(); }
};
std::string format_memory_plan(const MemoryPlan& plan, int world);
// The plan against the machine, before anything large is built: "" when
// `ranks_on_node` ranks' host plans fit `host` and `ranks_per_gpu` ranks'
// device plans fit `gpu_bytes` (0: not checked); else a sentence with the
// numbers and what makes the plan smaller.
std::string plan_fit_error(const MemoryPlan& plan, int ranks_on_node, const MachineMemory& host, int ranks_per_gpu,
                           int64_t gpu_bytes);

}  // namespace shardlm
