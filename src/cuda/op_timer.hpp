// op_timer.hpp — where a sequence of kernels' device time goes: an event after
// each named operation on one stream, the time between consecutive events added
// to that operation's total. For profiling runs only (a switch that turns CUDA
// graphs off: an event recorded while a stream is captured would join the graph).
//
// Owns: its events (a pool reused step after step) and the per-operation totals.
// Must not know: what the operations compute.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardlm::cuda {

class OpTimer {
 public:
  explicit OpTimer(cudaStream_t stream) : stream_(stream) {}
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Starts a span of operations (an event before the first); the span ends at end().
  void begin();
  // The operation enqueued since the last mark (or begin) is `op`: a static string.
  void mark(const char* op);
  // Waits for the span's last event and adds each interval to its operation's total.
  void end();
  // One line per operation in first-seen order: total ms, ms per `per` (steps), share of the sum.
  std::string report(int64_t per, const char* per_name) const;
  double total_ms() const;

 private:
  cudaEvent_t event(size_t i);
  cudaStream_t stream_;
  std::vector<cudaEvent_t> pool_;
  std::vector<const char*> pending_;  // the span's operations, one per event after the first
  bool open_ = false;
  struct Total {
    std::string op;
    double ms = 0;
    int64_t count = 0;
  };
  std::vector<Total> totals_;
};

}  // namespace shardlm::cuda
