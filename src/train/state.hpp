// state.hpp — where the training state lives: the fp32 master shards, the step's
// gradient shards and the optimizer's moments, chosen once at start-up.
//
//   host     the CPU reference: everything in host memory, Optimizer::step; with a
//            GPU backend (Muon under optim_cpu_offload) the engine hands each
//            reduced gradient down to the host and the bf16 copies are refreshed
//            before every step.
//   device   GPU backends without optim_cpu_offload: masters, gradients and
//            moments in device memory, one fused update per unit on the compute
//            stream; the host shards are a mirror (pull / push).
//   offload  GPU backends with optim_cpu_offload (AdamW, SGD): masters and
//            moments in pinned host memory, gradients summed on the device and
//            handed over unit by unit, a CPU update per unit that overlaps the
//            next step's forward (train/offload.hpp); the first units' state
//            on the GPU where the plan leaves room (DeviceUnits below).
//
// Owns, per placement: the gradient buffers and their zeroing, the sum of squares
// for the clip norm, the update, pull / push for checkpoints, export and the
// broadcast, and its rows of the memory plan. The engine asks it where a unit's
// gradient goes and when a unit's parameters may be read; the step asks it for
// the norm and the update. Knows the Backend interface, not CUDA, not MPI (the
// norm's all-reduce is the step's), not the deck beyond the choice itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/config.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/memory.hpp"
#include "train/optim.hpp"
#include "train/shard.hpp"

namespace shardlm {

const char* placement_name(StatePlacement p);

// The deck's choice: a GPU keeps the state on the device unless
// model.optim_cpu_offload moves it to the host (AdamW and SGD through the offload
// pipeline; Muon's collective step keeps the plain host path).
StatePlacement state_placement_for(const Config& config);
// model.optim_offload_grads = "device" under the offload pipeline: no host
// gradient shards, the step's gradient stays in the device accumulators.
bool offload_grads_on_device(const Config& config);
// Whether the model keeps fp32 gradient shards in host memory.
bool host_grad_shards(StatePlacement placement, bool offload_device_grads);
// Under the offload pipeline: units [0, n) keep their optimizer state on the
// GPU (model.optim_gpu_units, resolved at start-up); 0 otherwise.
int offload_device_units(const Config& config);

// The offload placement's split: the GPU bytes of units [0, units)'s fp32
// masters and moments, and the most units, from the embedding on, whose state
// fits `budget_bytes`. The device units come first because the next forward
// reaches them first: the offloaded rest is updated by the CPU under their
// forward.
int64_t offload_device_unit_bytes(const ModelLayout& layout, int optim_states, int units);
int offload_device_units_within(const ModelLayout& layout, int optim_states, int64_t budget_bytes);

// The state's rows of a rank's memory plan (param, grad, optimizer shards on the
// host; device state, device gradients, offload buffers) for `layout`, with
// the placement and offload choices of `options`.
void plan_state_memory(MemoryPlan& plan, const EngineOptions& options, const ModelLayout& layout, int optim_states,
                       const Backend& backend);

// A reader of the host shards on another thread: an async checkpoint's
// writer reading the device placement's host mirror while training goes on.
// pull() overwrites the mirror (the filesystem broadcast pulls on every
// broadcast step), so it waits until the reader is done. At most one reader.
class HostShardReader {
 public:
  // Training thread, before the reader starts; `progress` is the reader's
  // counter, which the waiting thread follows (watchdog.hpp).
  void begin(const std::atomic<int64_t>* progress) {
    progress_ = progress;
    reading_.store(true);
  }
  void end() { reading_.store(false); }  // the reader's thread, after its last read
  // Training thread: returns once no reader reads the host shards (watched).
  void wait_done();

 private:
  std::atomic<bool> reading_{false};
  const std::atomic<int64_t>* progress_ = nullptr;
};

// An async checkpoint's snapshot of host-resident state (CPU backend,
// optim_cpu_offload) in flight: a copier thread copies the host shards unit by
// unit into the snapshot pool while training goes on, and the next update of
// a unit waits until that unit is copied (in practice it already is: the copy
// runs at memory speed under the next forward and backward).
class HostSnapshotGate {
 public:
  // Training thread, before the copier starts: it copies the state as of
  // update number `mark`; later updates wait for it.
  void begin(int64_t mark) {
    mark_.store(mark);
    copied_.store(0);
    active_.store(true);  // after the mark: a thread that sees it active sees this mark
  }
  void copied(int units) { copied_.store(units); }  // copier: units [0, units) are in the snapshot
  void end() { active_.store(false); }              // copier: done (or abandoned)
  // The thread about to make update number `update` of `unit` (or of every
  // unit: -1): returns at once for updates up to the mark (the snapshot
  // waits for those), else once the unit is copied (watched).
  void wait(int unit, int64_t update);

 private:
  std::atomic<bool> active_{false};
  std::atomic<int64_t> copied_{0};
  std::atomic<int64_t> mark_{0};
};

class TrainingState {
 public:
  virtual ~TrainingState() = default;
  virtual StatePlacement placement() const = 0;
  const char* name() const { return placement_name(placement()); }

  // ---- one step, as the engine and the step drive it
  // Before the step's first micro-batch: gradients start from zero and the
  // backend's parameter copies follow the masters.
  virtual void begin_step(int64_t micro_batches) = 0;
  // The engine, at the start of each micro-batch, and after its forward.
  virtual void begin_micro_batch() {}
  virtual void after_forward() {}
  // Before the compute stream reads `unit`'s parameter shard.
  virtual void param_ready(int /*unit*/) {}
  // `unit`'s fp32 master shard (shard_numel), current for reads after
  // param_ready(unit): host memory, or device memory in the order of the
  // backend's stream. The engine copies the norm weights from it
  // (model.norm_dtype = "fp32").
  virtual const float* master_shard(int unit) = 0;
  virtual bool master_on_device(int /*unit*/) const { return false; }
  // Counts the changes of the masters (updates and pushes), from 0; the
  // engine's fp32 norm copies are refreshed when it moves.
  int64_t param_version() const { return param_version_; }
  // Where one rank's backward may add `unit`'s whole gradient directly (backend
  // memory, shard_numel fp32); nullptr: through the engine's gradient slots.
  virtual float* direct_grad(int unit) = 0;
  // `unit`'s reduced gradient (n elements of `type` in backend memory) is added
  // into its gradient shard.
  virtual void add_reduced(int unit, const void* reduced, int64_t n, DType type) = 0;
  // `unit`'s gradient of this micro-batch is complete in its shard (after
  // add_reduced, or after the backward wrote it directly).
  virtual void unit_done(int /*unit*/) {}
  // Whether the engine should finish each unit's reduction a unit after it
  // started (so the state can move it on early) rather than when the slot is reused.
  virtual bool finishes_reductions_early() const { return false; }
  // This rank's sum of squares of the step's gradient (one host synchronisation).
  virtual double grad_sumsq() = 0;
  // Update with lr and the clip factor; counts the optimizer step. May return
  // before the update is done (offload): param_ready waits per unit.
  virtual void update(double lr, float clip) = 0;
  // The update under the backward (offload, model.optim_offload_speculate):
  // before the step's last micro-batch, its lr; then update() or, for a
  // NaN/Inf step, discard() (which a placement without it ignores).
  virtual void speculate(double /*lr*/) {}
  virtual void discard() {}
  // Steps whose speculative update was redone or discarded so far; -1: no speculation.
  virtual int64_t redone_steps() const { return -1; }

  // ---- outside the step
  // The host shards (model.param, optimizer.state) hold the current state:
  // before a checkpoint, an export or a host broadcast. Callers wait for the
  // host reader first (TrainSession::pull_state).
  virtual void pull() {}
  HostShardReader host_reader;
  // The host shards changed (a checkpoint load): the state follows them.
  virtual void push() = 0;
  // Page-lock the host shards for DMA where pull() copies into them (the device
  // mirror, which async checkpoints snapshot from); unpinned when the state goes.
  // With it, the device placement also takes a device copy of the state for
  // snapshots when the GPU has room left (device_snapshot_bytes; 0: none).
  struct Pinned { int64_t bytes = 0, wanted_bytes = 0, device_snapshot_bytes = 0; };
  virtual Pinned pin_host_shards() { return {}; }
  // Asynchronous snapshots (ckpt.async, device placement): starts copying the
  // current state into the host shards on a copy stream and returns at once;
  // the training thread goes on. With the device copy, the state is copied
  // there first on the compute stream (milliseconds, stream-ordered before
  // the next update) and downloaded from it; without, the next update waits
  // on the GPU for the download. False where a placement has no such path
  // (the caller pulls instead).
  virtual bool start_snapshot() { return false; }
  // Any thread: `unit`'s part of the snapshot started last is in the host shards.
  virtual void wait_snapshot(int /*unit*/) {}
  // Host-resident state: the update in flight when a snapshot starts
  // (offload: the worker's) is identified by a mark taken on the training
  // thread; the copier waits per unit for that update before copying the
  // unit, instead of the training thread waiting for all of it (pull()).
  // Updates after the mark wait for the copier (snapshot_gate).
  virtual int64_t snapshot_mark() { return 0; }
  virtual void wait_unit_updated(int /*unit*/, int64_t /*mark*/) {}
  HostSnapshotGate snapshot_gate;
  // One line for the run summary ("" when there is nothing to say).
  virtual std::string summary() { return ""; }
  // Seconds the constructor spent placing the state (uploading it, pinning
  // buffers), and what it was doing, for the setup line; nullptr when nothing.
  double setup_s = 0;
  virtual const char* setup_what() const { return nullptr; }

 protected:
  int64_t param_version_ = 0;  // update() and push() add one
};

// The state for options.state (and the offload split of `options`) over the
// session's model and optimizer; the
// backend's parameter copies are made current before it returns.
std::unique_ptr<TrainingState> make_training_state(const EngineOptions& options, ShardedModel& model,
                                                   Optimizer& optimizer, const OptimSection& optim, Backend& backend,
                                                   int cpu_threads);
// The host placement without an optimizer: what an Engine used on its own
// (forward passes, tests) puts its gradients into.
std::unique_ptr<TrainingState> make_host_state(ShardedModel& model, Optimizer* optimizer, Backend& backend);
// The device placement's implementation (src/train/device_state.cu; a CPU-only
// build refuses it).
std::unique_ptr<TrainingState> make_cuda_device_state(ShardedModel& model, Optimizer& optimizer,
                                                      const OptimSection& optim, Backend& backend);

// Units [0, count()) with their fp32 masters and moments in device memory,
// updated on the compute stream by the device placement's fused AdamW/SGD
// kernel (bit for bit the host Optimizer's update), which also writes each
// unit's bf16 parameter shard: the device placement's state, and the resident
// part of the offload placement (model.optim_gpu_state_gib). Their host shards
// are a mirror (pull / push).
class DeviceUnits {
 public:
  virtual ~DeviceUnits() = default;
  virtual int count() const = 0;
  // Queue one update (the optimizer's step number `step`) of every unit.
  virtual void update(int64_t step, double lr, float clip) = 0;
  virtual void pull() = 0;  // host shards <- device, after the work queued so far
  virtual void push() = 0;  // device <- host shards, and the bf16 parameter shards cast from them
  virtual const float* master(int unit) const = 0;  // unit's fp32 master shard (device memory)
};
// The CUDA implementation (src/train/device_state.cu): units [0, count), the
// update reading grads[u] (fp32 shard, device memory).
std::unique_ptr<DeviceUnits> make_cuda_device_units(ShardedModel& model, Optimizer& optimizer,
                                                    const OptimSection& optim, Backend& backend, int count,
                                                    std::vector<float*> grads);

}  // namespace shardlm
