// offload_device.hpp — what the offload pipeline (train/offload.hpp) needs of a
// GPU beside its compute: ticketed asynchronous copies between pinned host
// memory and the device, and the per-unit sums of squares of the clip norm.
//
// Owns the interface only; the CUDA build implements it (src/cuda/offload_device.cu,
// make_cuda_offload_device in shardlm/cuda.hpp) and the offload tests on a host
// "device" (tests/unit/test_offload.cpp). Knows nothing about the model,
// the optimizer or the deck.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardlm {

class OffloadDevice {
 public:
  virtual ~OffloadDevice() = default;
  // Make the calling thread use this device (the pipeline's worker).
  virtual void bind_thread() = 0;
  // Page-lock host memory for DMA; false: it stays pageable (copies into it are
  // then correct, only synchronous).
  virtual bool pin_host(void* p, size_t bytes) = 0;
  virtual void unpin_host(void* p) = 0;
  // Each copy runs on a copy stream of its own direction and is named by a
  // ticket. A copy to the host first waits for the work queued on the compute
  // stream so far; a copy to the device reads host memory that is ready when it
  // is called. Callable from the worker thread (after bind_thread()).
  virtual int64_t copy_to_host(void* host, const void* device, size_t bytes) = 0;
  virtual int64_t copy_to_device(void* device, const void* host, size_t bytes) = 0;
  virtual void host_wait(int64_t ticket) = 0;     // the host waits for a copy
  virtual void compute_wait(int64_t ticket) = 0;  // the compute stream waits for a copy
  // Wait for the work queued on the compute stream.
  virtual void synchronize() = 0;
  // The sum of squares of unit `unit`'s device fp32 gradient (n elements),
  // queued on the compute stream; read_sumsq sums units 0..units-1 in unit
  // order (double) after one synchronisation.
  virtual void queue_sumsq(int unit, const float* grad, int64_t n) = 0;
  virtual double read_sumsq(int units) = 0;
  // Bytes and device-timed seconds of the copies the host has waited for, per
  // direction (the offload summary's achieved link bandwidth); and the
  // device-timed seconds the compute stream stood still in compute_wait (what
  // the forward really lost to the pipeline: the issuing thread's own waits
  // overlap the GPU work it queued before).
  struct Totals {
    double to_host_bytes = 0, to_host_s = 0, to_device_bytes = 0, to_device_s = 0;
    double compute_stall_s = 0;
  };
  virtual Totals totals() = 0;
};

}  // namespace shardlm
