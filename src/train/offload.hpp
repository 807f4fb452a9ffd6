// offload.hpp — the offload placement of the training state (train/state.hpp):
// model.optim_cpu_offload on a GPU. The fp32 masters and moments (and, unless
// optim_offload_grads = "device", each step's gradient) stay in host memory, and
// a pipeline keeps the GPU busy around them.
//
// Owns: OffloadState (the device accumulators that sum the micro-batches'
// gradients, the hand-over of each unit's step gradient as its backward
// finishes, the clip norm's per-unit sums of squares, the engine's hooks, and
// the split: units [0, k) whose state stays on the GPU as DeviceUnits,
// model.optim_gpu_state_gib) and
// OffloadPipeline, the worker thread that does the host side of a step (the
// per-unit CPU update, each unit's after its step gradient has landed, and its
// bf16 cast), the two pinned bf16 buffers the updated shards go up from in turn
// (and the two fp32 landing buffers with device_grads), and the ordering
// between the compute stream and the copies (OffloadDevice's tickets). Knows
// the sharded model, the optimizer, the Backend and OffloadDevice interfaces;
// not CUDA, not MPI (the clip norm's all-reduce is the step's), not the deck.
//
// A step (the engine and the step drive OffloadState, which drives the pipeline):
//   begin_step(micro_batches)
//   per micro-batch: engine.forward_backward()  -> begin_micro_batch(): first / last?;
//                    the micro-batches' gradients add up in the device
//                    accumulators; in the last one unit_done(unit) hands each
//                    unit over (grad_ready) as its backward (and reduction)
//                    finishes; param_ready(unit) before a unit's shard is read
//   sumsq = grad_sumsq()                        // on the GPU, as each unit was handed over
//   all-reduce, clip, update(lr, clip)          // returns at once
//   the next step's forward: param_ready(u) waits, per unit, for that unit's update and upload
//   pull() = finish()                           // before checkpoints, export, broadcast
//
// Gradients cross the link once per step: the micro-batches are summed on the
// device (4 bytes per parameter shard of GPU memory), because one fp32 copy of
// every gradient per micro-batch moves more bytes than a micro-batch computes
// in time (docs/benchmarks.md, "Offload"). Exact clipping (and NaN/Inf step
// skipping) needs the global norm before any unit is updated, so the update
// cannot start during backward: it runs while the next step's forward starts,
// unit u's update and upload overlapping the forward of the units before it
// (the embedding first). The copies overlap backward; the norm's sums of squares
// are taken on the GPU, so the update waits for no host pass over the gradients.
// With device_grads (model.optim_offload_grads = "device") the copies move to the
// worker instead, one unit ahead of the update, into two landing buffers: no host
// gradient shards, and the engine zeroes its accumulators only after the next
// step's first forward (every unit's update, so every copy, is done by then).
//
// The device units come first in forward order, so the next forward computes
// on them while the worker updates the offloaded rest. With
// model.optim_offload_speculate the worker does not wait for the norm: the
// step calls speculate(lr) before its last micro-batch, each offloaded unit is
// updated as it is handed over (clip 1, its state copied aside first), and
// update() confirms, redoes from the copies (clipped) or discard() restores
// them (NaN/Inf): the exact path's bits in every case.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/offload_device.hpp"
#include "shardlm/memory.hpp"
#include "train/optim.hpp"
#include "train/shard.hpp"
#include "train/state.hpp"

namespace shardlm {

class OffloadPipeline {
 public:
  // cpu_threads: the worker's OpenMP threads (device.cpu_threads); 0 = OpenMP's
  // default (the team that first touched the host shards). device_grads
  // (model.optim_offload_grads = "device"): the model has no host gradient
  // shards; each unit's step gradient stays in the engine's device accumulator
  // and is copied into one of two pinned landing buffers one unit ahead of its
  // update, instead of into its host shard during backward.
  // device_shards: each unit's bf16 parameter shard in device memory, where
  // its updates go up to.
  // gate: an async checkpoint's copy of the host shards, which each unit's update waits for.
  // first_offloaded: units [0, first_offloaded) keep their state on the device
  // (OffloadState's DeviceUnits): the pipeline takes no gradient of theirs,
  // updates none, and never makes the compute stream wait for them.
  // speculative: keep a copy of each offloaded unit's state (its fp32 master
  // and moments) so that speculate() may update units during the backward.
  OffloadPipeline(ShardedModel& model, Optimizer& optimizer, OffloadDevice& device, std::vector<void*> device_shards,
                  int cpu_threads = 0, bool device_grads = false, HostSnapshotGate* gate = nullptr,
                  int first_offloaded = 0, bool speculative = false);
  ~OffloadPipeline();
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  void begin_step(int64_t micro_batches);
  // The engine, at the start of each micro-batch: is it the step's first (zero
  // the device accumulators) or last (hand each unit over as it finishes)?
  struct MicroBatch { bool first, last; };
  MicroBatch next_micro_batch();
  // The engine, in the step's last micro-batch: `unit`'s step gradient (n fp32
  // in device memory, the shard) is complete on the compute stream. Returns the
  // copy's ticket: the device buffer may be written again once the compute
  // stream has waited for it. With device_grads no copy yet (-1): the buffer is
  // read until the unit's update is done.
  int64_t grad_ready(int unit, const float* src, int64_t n);
  // Before the compute stream reads `unit`'s parameter shard.
  void param_ready(int unit);
  // Count the optimizer's step and update every offloaded unit with lr and the
  // clip factor (the worker does it, unit by unit in forward order); returns
  // at once. A NaN/Inf step calls nothing (or discard(), after speculate()).
  void update(double lr, float clip);
  // The update under the backward (a speculative pipeline, before the step's
  // last micro-batch; lr: the step's): the step is counted now and each
  // offloaded unit handed over from here on is updated at once, as if the
  // step were neither clipped nor skipped, after a copy of its state is kept.
  // update(lr, 1) then only confirms it; any other clip factor (or lr) redoes
  // every offloaded unit from its copy with it, in forward order; discard()
  // (a NaN/Inf step) restores every unit from its copy and counts the step
  // back. Either way the result is the exact path's, bit for bit.
  void speculate(double lr);
  void discard();
  // Steps whose speculative updates were redone or discarded, so far.
  int64_t redone_steps() const { return redone_steps_; }
  // Wait until the worker is idle: host masters and moments are final.
  void finish();
  // Updates asked for so far (training thread), and: unit's update number
  // `mark` is done (any thread; the checkpoint snapshot's copier).
  int64_t updates_asked() const { return updates_asked_; }
  void wait_unit_updated(int unit, int64_t mark);

  // Host bytes of the two pinned bf16 upload buffers, and with device_grads the
  // two fp32 landing buffers (the memory plan); and of the speculative
  // pipeline's copies of the offloaded units' state.
  static int64_t host_bytes(const ModelLayout& layout, bool device_grads = false);
  static int64_t speculation_bytes(const ModelLayout& layout, int optim_states, int first_offloaded);

  // Where the time goes (seconds, summed over the run), for the run summary:
  // the worker's updates and landings, and the compute-issuing thread's waits.
  struct Timing {
    double update_s = 0;       // worker: CPU AdamW/SGD + bf16 cast + upload issue
    double grad_wait_s = 0;    // worker, within update_s: waiting for the gradient copies to land
    double param_wait_s = 0;   // main: forward waiting for a unit's update
    int64_t updates = 0;
    int64_t pinned_bytes = 0, pin_wanted_bytes = 0;
  };
  Timing timing();
  // One line for the run summary: the timings per update, what was pinned, and
  // the copies' bytes and achieved bandwidth (device-timed).
  std::string summary();

 private:
  struct Task {
    enum Kind {
      Update,     // one step's update of every offloaded unit
      Speculate,  // one unit's update as the step hands it over (clip 1), its state kept first
      Accept,     // the speculated step stands: every unit's update is final
      Redo,       // every unit's state restored from its copy and updated with the clip factor
      Discard,    // every unit's state restored from its copy (a skipped step)
    } kind = Update;
    int unit = -1;       // Speculate: the unit
    double lr = 0;
    float clip = 1;
    int64_t number = 0;  // 1, 2, ...: updates_asked_ when it was asked for
    int64_t step = 0;    // the optimizer's step number (bias correction)
  };
  void run();
  void update_unit(int unit, const Task& t);
  void discard_unit(int unit, const Task& t);
  void keep_state(int unit, bool restore);  // unit's master and moments into (or back from) kept_[unit]
  int next_slot();
  void issue_grad_copy(int unit);
  void push(const Task& t);

  ShardedModel& model_;
  Optimizer& optimizer_;
  OffloadDevice& device_;
  const std::vector<void*> device_shards_;   // [unit] the bf16 shard on the device
  const int units_;
  const int first_offloaded_;                // units [first_offloaded_, units_) are the pipeline's
  const int cpu_threads_;
  const bool device_grads_;
  std::vector<Buffer<float>> landing_;       // device_grads: 2 x (largest shard) pinned fp32, in turn
  std::vector<Buffer<float>> kept_;          // speculative: [unit] (1 + states) x shard numel, the state before the update
  std::vector<Buffer<uint16_t>> slots_;      // 2 x (largest shard) pinned: updated shards in bf16, in turn
  std::vector<int64_t> slot_upload_;         // [slot] ticket of the upload that last read it (worker only)
  int next_slot_ = 0;                        // worker only
  std::vector<int64_t> upload_numel_;        // [unit] elements uploaded: the shard's parameters, not its padding
  std::vector<void*> pinned_;                // host ranges registered with the backend

  int64_t micro_batches_ = 1, micro_batch_ = 0;  // this step's, and how many have started (main thread)
  int landed_ = 0;                           // offloaded units handed over this step (main thread)
  std::vector<bool> waited_;                 // [unit] compute waited for this step's upload (main thread)

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;                   // guarded by mutex_
  std::vector<int64_t> grad_copy_;           // [unit] ticket of this step's gradient copy to the host; guarded
  std::vector<const float*> grad_src_;       // device_grads: [unit] its device accumulator; guarded
  std::vector<int64_t> upload_;              // [unit] ticket of the latest upload, -1: none pending; guarded
  std::vector<int> updating_;                // [unit] updates asked for and not yet uploaded (a speculative one
                                             // and its redo); guarded
  std::vector<int64_t> unit_updates_;        // [unit] updates done on the host; guarded
  int64_t updates_asked_ = 0;                // main thread
  bool speculating_ = false;                 // main thread: speculate() was called this step
  Task speculation_;                         // main thread: its lr, number, step
  int64_t redone_steps_ = 0;                 // main thread
  HostSnapshotGate* gate_ = nullptr;
  bool busy_ = false, stopping_ = false;     // guarded
  Timing timing_;                            // guarded
  std::thread worker_;
};

// The offload placement: the device accumulators every unit's step gradient
// is summed in; units [0, device_units) with their state on the GPU, updated
// there from their accumulators (DeviceUnits, train/state.hpp: the device
// placement's kernels); the rest through the pipeline above, whose CPU updates
// run under the next forward of the device units; and the engine's hooks.
class OffloadState final : public TrainingState {
 public:
  OffloadState(ShardedModel& model, Optimizer& optimizer, const OptimSection& optim, Backend& backend, int cpu_threads,
               bool device_grads, int device_units = 0, bool speculative = false);
  ~OffloadState() override;

  StatePlacement placement() const override { return StatePlacement::Offload; }
  const char* setup_what() const override { return "pinning the offload buffers"; }
  void begin_step(int64_t micro_batches) override { pipeline_->begin_step(micro_batches); }
  void begin_micro_batch() override;
  void after_forward() override;
  void param_ready(int unit) override { pipeline_->param_ready(unit); }
  const float* master_shard(int unit) override;
  bool master_on_device(int unit) const override { return unit < first_offloaded_; }
  float* direct_grad(int unit) override { return accumulators_[unit]; }
  void add_reduced(int unit, const void* reduced, int64_t n, DType type) override;
  void unit_done(int unit) override;
  bool finishes_reductions_early() const override { return last_micro_batch_; }
  double grad_sumsq() override;
  void update(double lr, float clip) override;
  void speculate(double lr) override {
    if (speculative_) pipeline_->speculate(lr);
  }
  void discard() override { pipeline_->discard(); }
  int64_t redone_steps() const override { return speculative_ ? pipeline_->redone_steps() : -1; }
  void pull() override;
  int64_t snapshot_mark() override;
  void wait_unit_updated(int unit, int64_t mark) override;
  void push() override;
  std::string summary() override;

 private:
  ShardedModel& model_;
  Optimizer& optimizer_;
  Backend& backend_;
  std::unique_ptr<OffloadDevice> device_;
  std::vector<float*> accumulators_;     // [unit] fp32 step gradient shards (device), micro-batches summed
  std::vector<int64_t> accumulator_copy_;  // [unit] ticket of their last copy to the host, -1: none
  std::unique_ptr<DeviceUnits> device_units_;  // units [0, device_units_->count()), or none
  int first_offloaded_ = 0;
  bool speculative_ = false;
  std::unique_ptr<OffloadPipeline> pipeline_;
  bool first_micro_batch_ = true, last_micro_batch_ = true;  // of the micro-batch under way
};

}  // namespace shardlm
