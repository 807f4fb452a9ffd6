// offload.hpp — model.optim_cpu_offload on a GPU: the fp32 masters, moments and
// gradient accumulators stay in host memory, and this pipeline keeps the GPU
// busy around them.
//
// Owns: the worker thread that does the host side of a step (landing each
// unit's gradient as its reduction finishes, accumulating micro-batches, the
// per-unit sums of squares for clipping, the per-unit CPU update and its bf16
// cast), the pinned landing and bf16 buffers, and the ordering between the
// compute stream and the copies (Backend's copy tickets). Knows the sharded
// model, the optimizer and the Backend interface; not CUDA, not MPI (the clip
// norm's all-reduce is the caller's), not the deck.
//
// A step:
//   begin_step(micro_batches)
//   per micro-batch: engine.forward_backward()  -> grad_ready(unit, ...) per unit,
//                                                  param_ready(unit) before a unit's shard is read
//   sumsq = grad_sumsq()                        // waits for the last micro-batch's gradients
//   all-reduce, clip, update(lr, clip)          // returns at once
//   the next step's forward: param_ready(u) waits, per unit, for that unit's update and upload
//   finish()                                    // before checkpoints, export, broadcast
//
// Exact clipping (and NaN/Inf step skipping) needs the global norm before any
// unit is updated, so the update cannot start during backward: it runs while
// the next step's forward starts, unit u's update and upload overlapping the
// forward of the units before it (the embedding first). The gradient copies and
// the micro-batch accumulation overlap backward.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/optim.hpp"
#include "shardlm/shard.hpp"

namespace shardlm {

class OffloadPipeline {
 public:
  // cpu_threads: the worker's OpenMP threads (device.cpu_threads); 0 = one fewer
  // than OpenMP's default, leaving a core to the thread that issues GPU work.
  OffloadPipeline(ShardedModel& model, Optimizer& optimizer, Backend& backend, int cpu_threads = 0);
  ~OffloadPipeline();
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  void begin_step(int64_t micro_batches);
  // The engine: `unit`'s reduced gradient slice (n elements of `type` in device
  // memory) is complete on the compute stream. Returns the copy's ticket: the
  // device buffer may be reused once the compute stream has waited for it.
  int64_t grad_ready(int unit, const void* src, int64_t n, DType type);
  // Before the compute stream reads `unit`'s parameter shard.
  void param_ready(int unit);
  // Sum over this rank's units of grad^2 (double, in unit order) once the last
  // micro-batch's gradients have landed.
  double grad_sumsq();
  // Update every unit with lr and the clip factor (the worker does it, unit by
  // unit in forward order); returns at once. A NaN/Inf step calls nothing.
  void update(double lr, float clip);
  // Wait until the worker is idle: host masters and moments are final.
  void finish();

  // Host bytes of the landing and bf16 buffers (the memory plan).
  static int64_t host_bytes(const ModelLayout& layout);

  // Where the time goes (seconds, summed over the run), for the run summary:
  // the worker's updates and landings, and the compute-issuing thread's waits.
  struct Timing {
    double update_s = 0;       // worker: CPU AdamW/SGD + bf16 cast + upload issue
    double land_s = 0;         // worker: waiting for gradient copies, accumulating, sums of squares
    double param_wait_s = 0;   // main: forward waiting for a unit's update
    double norm_wait_s = 0;    // main: end of backward waiting for the last sums of squares
    int64_t updates = 0;
    int64_t pinned_bytes = 0, pin_wanted_bytes = 0;
  };
  Timing timing();
  // One line for the run summary: the timings per update, what was pinned, and
  // the copies' bytes and achieved bandwidth (device-timed).
  std::string summary();

 private:
  struct Task {
    enum Kind { Grad, Update } kind = Grad;
    int unit = -1;
    int64_t ticket = -1;
    int landing = -1;         // landing buffer, -1: the copy went straight into the grad shard
    DType type = DType::F32;
    bool first = false, last = false;
    double lr = 0;
    float clip = 1;
  };
  void run();
  void land(const Task& t);
  void update_unit(int unit, double lr, float clip);
  void push(const Task& t);

  ShardedModel& model_;
  Optimizer& optimizer_;
  Backend& backend_;
  const int units_;
  const int cpu_threads_;
  std::vector<Buffer<uint16_t>> bf16_;       // [unit] (shard numel) the updated shard in bf16, pinned
  std::vector<Buffer<float>> landing_;       // 2 x (max shard numel) pinned: micro-batches after the first
  std::vector<void*> pinned_;                // host ranges registered with the backend

  int64_t micro_batches_ = 1;
  std::vector<int64_t> arrivals_;            // [unit] gradients landed this step (main thread)
  std::vector<bool> waited_;                 // [unit] compute waited for this step's upload (main thread)

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;                   // guarded by mutex_
  std::vector<bool> landing_free_;           // guarded
  std::vector<double> sumsq_;                // [unit] guarded
  int sumsq_done_ = 0;                       // guarded
  std::vector<int64_t> upload_;              // [unit] ticket of the latest upload, -1: none pending; guarded
  std::vector<bool> updating_;               // [unit] an update was asked for and not yet uploaded; guarded
  bool busy_ = false, stopping_ = false;     // guarded
  Timing timing_;                            // guarded
  std::thread worker_;
};

}  // namespace shardlm
