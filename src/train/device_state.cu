// device_state.cu — the device placement of the training state (train/state.hpp):
// fp32 master shards, gradient shards and optimizer moments in device memory,
// one fused AdamW/SGD kernel per unit on the backend's compute stream, which
// also writes the unit's bf16 parameter shard. The host shards (model.param,
// optimizer.state) are a mirror, refreshed by pull() and read back by push().
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "cuda/ops.hpp"
#include "cuda/optim_kernels.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "train/state.hpp"

namespace shardlm {
namespace {

using cuda::bf16;

// Device allocations counted against the plan's categories, freed together.
class DeviceAllocations {
 public:
  DeviceAllocations() = default;
  DeviceAllocations(const DeviceAllocations&) = delete;
  DeviceAllocations& operator=(const DeviceAllocations&) = delete;
  ~DeviceAllocations() {
    for (auto& [category, ptr, bytes] : owned_) cuda_free(category, ptr, int64_t(bytes));
  }
  void* own(Mem category, size_t bytes) {
    void* p = cuda_malloc(category, static_cast<int64_t>(bytes));  // admitted against the cap, counted
    owned_.push_back({category, p, bytes});
    return p;
  }

 private:
  struct Owned {
    Mem category;
    void* ptr;
    size_t bytes;
  };
  std::vector<Owned> owned_;
};

// Units [0, count) with their fp32 masters and moments in device memory and
// one fused AdamW/SGD kernel each on the compute stream, which also writes the
// unit's bf16 parameter shard: the whole device placement, and the resident
// part of the offload placement (train/state.hpp's DeviceUnits).
class CudaDeviceUnits final : public DeviceUnits {
 public:
  // grads: [unit] the fp32 gradient shard the update reads (device memory),
  // or empty: one is allocated per unit (grad(u)).
  CudaDeviceUnits(ShardedModel& model, Optimizer& optimizer, const OptimSection& optim, Backend& backend, int count,
                  std::vector<float*> grads)
      : model_(model), optimizer_(optimizer), optim_(optim), backend_(backend),
        stream_(static_cast<cudaStream_t>(backend.stream())) {
    SHARDLM_CHECK(optim.name == "adamw" || optim.name == "sgd", "optim.name = \"%s\" has no GPU update yet",
                  optim.name.c_str());
    SHARDLM_CHECK(grads.empty() || int(grads.size()) >= count, "internal: %zu gradient shards for %d device units",
                  grads.size(), count);
    const ModelLayout& layout = model.layout;
    const int states = optimizer.states();
    for (int u = 0; u < count; ++u) {
      const int64_t n = layout.units[u].shard_numel;
      UnitState st;
      st.n = n;
      st.param = static_cast<float*>(memory_.own(Mem::ParamShard, 4 * n));
      st.grad = grads.empty() ? static_cast<float*>(memory_.own(Mem::GradShard, 4 * n)) : grads[u];
      for (int i = 0; i < states; ++i) st.states.push_back(static_cast<float*>(memory_.own(Mem::OptimState, 4 * n)));
      // One segment per run of adjacent parameters with the same weight decay
      // (a layer of experts' hundreds of matrices are one run).
      std::vector<cuda::OptimSegment> table;
      for (const auto& s : model.segments(layout.units[u])) {
        const float wd = s.param->weight_decay() ? static_cast<float>(optim.weight_decay) : 0.0f;
        if (!table.empty() && table.back().weight_decay == wd && table.back().offset + table.back().count == s.shard_offset)
          table.back().count += s.count;
        else
          table.push_back({s.shard_offset, s.count, wd});
      }
      SHARDLM_CHECK(int(table.size()) <= cuda::kMaxOptimSegments,
                    "unit %s has %zu runs of parameters with one weight decay, more than the %d of one update",
                    layout.units[u].name.c_str(), table.size(), cuda::kMaxOptimSegments);
      st.segments = static_cast<cuda::OptimSegment*>(
          memory_.own(Mem::OptimState, sizeof(cuda::OptimSegment) * std::max<size_t>(1, table.size())));
      st.num_segments = static_cast<int>(table.size());
      CUDA_CHECK(cudaMemcpy(st.segments, table.data(), sizeof(cuda::OptimSegment) * table.size(),
                            cudaMemcpyHostToDevice));
      units_.push_back(st);
    }
  }

  int count() const override { return static_cast<int>(units_.size()); }
  const float* master(int unit) const override { return units_[size_t(unit)].param; }
  int64_t numel(size_t u) const { return units_[u].n; }
  float* grad(size_t u) { return units_[u].grad; }
  size_t states() const { return units_.empty() ? 0 : units_[0].states.size(); }
  // Array a of unit u: 0 the fp32 masters, 1.. the optimizer states.
  float* array(size_t u, size_t a) { return a == 0 ? units_[u].param : units_[u].states[a - 1]; }

  void update(int64_t step, double lr, float clip) override {
    for (size_t u = 0; u < units_.size(); ++u) {
      UnitState& st = units_[u];
      bf16* shard = static_cast<bf16*>(backend_.param_shard_mut(static_cast<int>(u)));
      if (optim_.name == "adamw") {
        cuda::AdamWConfig c;
        c.lr = lr, c.beta1 = optim_.beta1, c.beta2 = optim_.beta2, c.eps = optim_.eps, c.step = step, c.grad_scale = clip;
        cuda::adamw_step_segments(st.param, shard, st.grad, st.states[0], st.states[1], st.n, st.segments,
                                  st.num_segments, c, nullptr, stream_);
      } else {
        cuda::SgdConfig c;
        c.lr = lr, c.momentum = optim_.momentum, c.grad_scale = clip;
        cuda::sgd_step_segments(st.param, shard, st.grad, st.states.empty() ? nullptr : st.states[0], st.n,
                                st.segments, st.num_segments, c, nullptr, stream_);
      }
    }
  }

  void pull() override {
    for (size_t u = 0; u < units_.size(); ++u) {
      UnitState& st = units_[u];
      CUDA_CHECK(cudaMemcpyAsync(model_.param[u].data(), st.param, 4 * st.n, cudaMemcpyDeviceToHost, stream_));
      for (size_t i = 0; i < st.states.size(); ++i)
        CUDA_CHECK(cudaMemcpyAsync(optimizer_.state(int(i))[u].data(), st.states[i], 4 * st.n,
                                   cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }

  void push() override {
    for (size_t u = 0; u < units_.size(); ++u) {
      UnitState& st = units_[u];
      CUDA_CHECK(cudaMemcpyAsync(st.param, model_.param[u].data(), 4 * st.n, cudaMemcpyHostToDevice, stream_));
      for (size_t i = 0; i < st.states.size(); ++i)
        CUDA_CHECK(cudaMemcpyAsync(st.states[i], optimizer_.state(int(i))[u].data(), 4 * st.n,
                                   cudaMemcpyHostToDevice, stream_));
      cuda::cast_f32_to_bf16(static_cast<bf16*>(backend_.param_shard_mut(static_cast<int>(u))), st.param, st.n,
                             stream_);
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffers may change after we return
    }
  }

 private:
  struct UnitState {
    int64_t n = 0;
    float* param = nullptr;               // fp32 master shard
    float* grad = nullptr;                // fp32 gradient shard
    std::vector<float*> states;           // AdamW exp_avg, exp_avg_sq | SGD momentum
    cuda::OptimSegment* segments = nullptr;
    int num_segments = 0;
  };

  ShardedModel& model_;
  Optimizer& optimizer_;
  const OptimSection optim_;
  Backend& backend_;
  cudaStream_t stream_;                  // the backend's compute stream (not owned)
  DeviceAllocations memory_;
  std::vector<UnitState> units_;
};

class CudaDeviceState final : public TrainingState {
 public:
  CudaDeviceState(ShardedModel& model, Optimizer& optimizer, const OptimSection& optim, Backend& backend)
      : model_(model), optimizer_(optimizer), backend_(backend),
        stream_(static_cast<cudaStream_t>(backend.stream())),
        units_(model, optimizer, optim, backend, static_cast<int>(model.layout.units.size()), {}) {
    sumsq_scratch_bytes_ = cuda::sum_squares_scratch_bytes();
    sumsq_scratch_ = memory_.own(Mem::Workspace, sumsq_scratch_bytes_);
    sumsq_ = static_cast<double*>(memory_.own(Mem::Workspace, 8));
    CUDA_CHECK(cudaGetDevice(&device_));
  }
  ~CudaDeviceState() override {
    cudaStreamSynchronize(stream_);
    if (copy_stream_) {
      cudaStreamSynchronize(copy_stream_);
      for (cudaEvent_t e : unit_copied_) cudaEventDestroy(e);
      cudaEventDestroy(state_current_);
      cudaEventDestroy(snapshot_done_);
      cudaStreamDestroy(copy_stream_);
    }
    for (void* p : pinned_)
      if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  }

  StatePlacement placement() const override { return StatePlacement::Device; }
  const char* setup_what() const override { return "the state's upload to the GPU"; }

  void begin_step(int64_t) override {
    for (size_t u = 0; u < units(); ++u) CUDA_CHECK(cudaMemsetAsync(units_.grad(u), 0, 4 * units_.numel(u), stream_));
  }
  float* direct_grad(int unit) override { return units_.grad(size_t(unit)); }
  const float* master_shard(int unit) override { return units_.master(unit); }
  bool master_on_device(int) const override { return true; }
  void add_reduced(int unit, const void* reduced, int64_t n, DType type) override {
    backend_.accumulate(units_.grad(size_t(unit)), reduced, n, type);
  }

  double grad_sumsq() override {
    for (size_t u = 0; u < units(); ++u)
      cuda::sum_squares(sumsq_, units_.grad(u), units_.numel(u), /*accumulate=*/u > 0, sumsq_scratch_,
                        sumsq_scratch_bytes_, stream_);
    double host = 0;
    CUDA_CHECK(cudaMemcpyAsync(&host, sumsq_, 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return host;
  }

  void update(double lr, float clip) override {
    if (update_waits_for_snapshot_) {  // no device copy: the download reads the live state
      CUDA_CHECK(cudaStreamWaitEvent(stream_, snapshot_done_, 0));
      update_waits_for_snapshot_ = false;
    }
    const int64_t step = optimizer_.steps_taken() + 1;
    units_.update(step, lr, clip);
    optimizer_.set_steps_taken(step);
    ++param_version_;
  }

  void pull() override { units_.pull(); }

  // A page shared with a buffer pinned before cannot be registered twice; the
  // buffer then stays pageable: downloads into it are correct, only slower.
  Pinned pin_host_shards() override {
    Pinned out;
    auto pin = [&](Buffer<float>& b) {
      out.wanted_bytes += static_cast<int64_t>(b.bytes());
      if (b.bytes() == 0) return;
      if (cudaHostRegister(b.data(), b.bytes(), cudaHostRegisterDefault) != cudaSuccess) {
        cudaGetLastError();
        return;
      }
      pinned_.push_back(b.data());
      out.bytes += static_cast<int64_t>(b.bytes());
    };
    for (auto& b : model_.param) pin(b);
    for (int k = 0; k < optimizer_.states(); ++k)
      for (auto& b : optimizer_.state(k)) pin(b);
    prepare_snapshots();
    out.device_snapshot_bytes = snapshot_bytes_;
    return out;
  }

  bool start_snapshot() override {
    SHARDLM_CHECK(copy_stream_, "internal: start_snapshot before pin_host_shards");
    const size_t arrays = 1 + units_.states();
    if (snapshot_bytes_ > 0) {
      // Device to device on the compute stream: after the last update, before
      // the next; ~2 x 4 bytes per element at HBM speed.
      for (size_t u = 0; u < units(); ++u)
        for (size_t a = 0; a < arrays; ++a)
          CUDA_CHECK(cudaMemcpyAsync(snapshot_array(u, a), units_.array(u, a), 4 * units_.numel(u),
                                     cudaMemcpyDeviceToDevice, stream_));
    }
    CUDA_CHECK(cudaEventRecord(state_current_, stream_));
    downloaded_.assign(units(), false);
    if (snapshot_bytes_ > 0) return true;  // each unit downloads when the writer comes to it (wait_snapshot)
    // No device copy: all of it now, and the next update waits on the GPU.
    CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, state_current_, 0));
    for (size_t u = 0; u < units(); ++u) {
      download(u);
      CUDA_CHECK(cudaEventRecord(unit_copied_[u], copy_stream_));
    }
    CUDA_CHECK(cudaEventRecord(snapshot_done_, copy_stream_));
    update_waits_for_snapshot_ = true;
    return true;
  }

  void wait_snapshot(int unit) override {
    CUDA_CHECK(cudaSetDevice(device_));  // the writer thread's calls go to this rank's GPU
    if (snapshot_bytes_ > 0 && !downloaded_[size_t(unit)]) {
      downloaded_[size_t(unit)] = true;  // once per unit: the writer asks for each of its arrays
      // From the device copy, when the writer needs it: the download spreads
      // over the write (~1 GB/s) instead of taking the link for 0.3 s at once,
      // during which the compute stream's own small downloads (the loss, the
      // norm) queued behind it and the steps after a save slowed by ~25%.
      CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, state_current_, 0));
      download(size_t(unit));
      CUDA_CHECK(cudaEventRecord(unit_copied_[size_t(unit)], copy_stream_));
    }
    CUDA_CHECK(cudaEventSynchronize(unit_copied_[size_t(unit)]));
  }

  void push() override {
    units_.push();
    ++param_version_;
  }

 private:
  size_t units() const { return size_t(units_.count()); }

  // The copy stream, its events and, where the GPU has room left after
  // everything else is allocated (start-up), one device copy of the state.
  void prepare_snapshots() {
    if (copy_stream_) return;
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&state_current_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&snapshot_done_, cudaEventDisableTiming));
    unit_copied_.resize(units());
    // Blocking sync: the writer thread sleeps on them instead of spinning
    // against the training thread's launches for the driver's locks.
    for (auto& e : unit_copied_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
    int64_t bytes = 0;
    for (size_t u = 0; u < units(); ++u) bytes += 4 * units_.numel(u) * int64_t(1 + units_.states());
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    // Room for the libraries' workspaces and fragmentation after it.
    constexpr int64_t kMargin = int64_t(4) << 30;
    if (int64_t(free_bytes) < bytes + kMargin) return;
    const char* no_copy = std::getenv("SHARDLM_CKPT_NO_DEVICE_COPY");  // tests: the path without room
    if (no_copy && *no_copy) return;
    try {
      snapshot_ = static_cast<float*>(memory_.own(Mem::Snapshot, size_t(bytes)));  // admitted against device.memory_limit_gib
    } catch (const Error&) {
      return;  // over the cap: the download reads the live state, the next update waits for it
    }
    snapshot_bytes_ = bytes;
    int64_t at = 0;
    for (size_t u = 0; u < units(); ++u) {
      snapshot_offset_.push_back(at);
      at += units_.numel(u) * int64_t(1 + units_.states());
    }
  }
  // Unit u's arrays into the host shards on the copy stream, from the device
  // copy (or the live state), in 32 MiB copies.
  void download(size_t u) {
    constexpr int64_t kChunk = int64_t(8) << 20;  // floats
    const size_t arrays = 1 + units_.states();
    for (size_t a = 0; a < arrays; ++a) {
      float* host = a == 0 ? model_.param[u].data() : optimizer_.state(int(a - 1))[u].data();
      const float* from = snapshot_bytes_ > 0 ? snapshot_array(u, a) : units_.array(u, a);
      for (int64_t at = 0; at < units_.numel(u); at += kChunk)
        CUDA_CHECK(cudaMemcpyAsync(host + at, from + at, 4 * std::min(kChunk, units_.numel(u) - at),
                                   cudaMemcpyDeviceToHost, copy_stream_));
    }
  }
  // Array a of unit u in the device copy (CudaDeviceUnits::array's numbering).
  float* snapshot_array(size_t u, size_t a) {
    return snapshot_ + snapshot_offset_[u] + int64_t(a) * units_.numel(u);
  }

  ShardedModel& model_;
  Optimizer& optimizer_;
  Backend& backend_;
  cudaStream_t stream_;                  // the backend's compute stream (not owned)
  CudaDeviceUnits units_;                // masters, gradients, moments and their update
  DeviceAllocations memory_;             // the norm's scratch, the snapshot's device copy
  std::vector<void*> pinned_;            // host shards page-locked by pin_host_shards
  void* sumsq_scratch_ = nullptr;
  size_t sumsq_scratch_bytes_ = 0;
  double* sumsq_ = nullptr;
  int device_ = 0;
  cudaStream_t copy_stream_ = nullptr;   // snapshots' downloads, beside the compute stream
  cudaEvent_t state_current_ = nullptr;  // compute stream: the state (or its device copy) to snapshot is written
  cudaEvent_t snapshot_done_ = nullptr;  // copy stream: the whole download
  std::vector<cudaEvent_t> unit_copied_; // copy stream: unit u's arrays are in the host shards
  float* snapshot_ = nullptr;            // the device copy (snapshot_bytes_), or none
  int64_t snapshot_bytes_ = 0;
  std::vector<int64_t> snapshot_offset_; // unit u's arrays in snapshot_, in floats
  bool update_waits_for_snapshot_ = false;
  std::vector<bool> downloaded_;         // [unit] this snapshot's download issued (the writer thread's)
};

}  // namespace

std::unique_ptr<TrainingState> make_cuda_device_state(ShardedModel& model, Optimizer& optimizer,
                                                      const OptimSection& optim, Backend& backend) {
  return std::make_unique<CudaDeviceState>(model, optimizer, optim, backend);
}

std::unique_ptr<DeviceUnits> make_cuda_device_units(ShardedModel& model, Optimizer& optimizer,
                                                    const OptimSection& optim, Backend& backend, int count,
                                                    std::vector<float*> grads) {
  return std::make_unique<CudaDeviceUnits>(model, optimizer, optim, backend, count, std::move(grads));
}

}  // namespace shardlm
