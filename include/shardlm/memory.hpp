// memory.hpp — planned, counted host memory.
//
// Owns: Buffer<T> (64-byte aligned, move-only, tagged with what it holds) and the
// per-category counters (current and peak bytes) that the memory plan is checked
// against and that the end-of-run report prints. The hot loop allocates nothing:
// buffers are made at start-up from the plan's sizes. Knows nothing about models.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
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

}  // namespace shardlm
