// offload_device.cu — the CUDA side of the offload pipeline (shardlm/offload_device.hpp):
// two copy streams beside the compute stream, a ring of events that names each
// copy by ticket and times it, and the per-unit sums of squares of the clip norm
// on the compute stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/ops.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

class CudaOffloadDevice final : public OffloadDevice {
 public:
  CudaOffloadDevice(cudaStream_t compute, int units) : stream_(compute), units_(units) {
    CUDA_CHECK(cudaGetDevice(&device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&d2h_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&h2d_, cudaStreamNonBlocking));
  }
  ~CudaOffloadDevice() override {
    cudaStreamSynchronize(d2h_);
    cudaStreamSynchronize(h2d_);
    cudaStreamSynchronize(stream_);
    for (auto e : wait_before_) cudaEventDestroy(e);
    for (auto e : wait_after_) cudaEventDestroy(e);
    for (auto e : copy_ready_) cudaEventDestroy(e);
    for (auto e : copy_start_) cudaEventDestroy(e);
    for (auto e : copy_done_) cudaEventDestroy(e);
    cudaStreamDestroy(d2h_);
    cudaStreamDestroy(h2d_);
    if (unit_sumsq_) cuda_free(Mem::Workspace, unit_sumsq_, 8 * units_);
    if (sumsq_scratch_) cuda_free(Mem::Workspace, sumsq_scratch_, int64_t(sumsq_scratch_bytes_));
  }

  void bind_thread() override { CUDA_CHECK(cudaSetDevice(device_)); }
  bool pin_host(void* p, size_t bytes) override {
    // A page shared with a buffer pinned before cannot be registered twice; the
    // buffer then stays pageable: copies into it are correct, only synchronous.
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess;
  }
  void unpin_host(void* p) override {
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
  }
  int64_t copy_to_host(void* host, const void* src, size_t bytes) override {
    return queue_copy(host, src, bytes, /*to_host=*/true);
  }
  int64_t copy_to_device(void* dst, const void* host, size_t bytes) override {
    return queue_copy(dst, host, bytes, /*to_host=*/false);
  }
  void host_wait(int64_t t) override {
    CUDA_CHECK(cudaEventSynchronize(copy_event(t)));
    std::lock_guard<std::mutex> lock(copy_mutex_);
    CopyInfo& c = copy_info_[t % kCopyRing];
    if (c.timed || t < next_copy_ - kCopyRing) return;
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, copy_start_[t % kCopyRing], copy_done_[t % kCopyRing]));
    (c.to_host ? totals_.to_host_bytes : totals_.to_device_bytes) += double(c.bytes);
    (c.to_host ? totals_.to_host_s : totals_.to_device_s) += 1e-3 * ms;
    c.timed = true;
  }
  // The wait between two timed events on the compute stream: the time between
  // them is how long the stream stood still (the training thread only).
  void compute_wait(int64_t t) override {
    const cudaEvent_t copy = copy_event(t);
    if (wait_before_.empty()) {
      wait_before_.resize(kWaitRing);
      wait_after_.resize(kWaitRing);
      wait_timed_.assign(kWaitRing, 1);  // nothing recorded yet
      for (int i = 0; i < kWaitRing; ++i) {
        CUDA_CHECK(cudaEventCreate(&wait_before_[i]));
        CUDA_CHECK(cudaEventCreate(&wait_after_[i]));
      }
    }
    const int64_t w = next_wait_++;
    const int i = int(w % kWaitRing);
    time_wait(i, /*block=*/true);  // the slot's last wait, long done
    CUDA_CHECK(cudaEventRecord(wait_before_[i], stream_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, copy, 0));
    CUDA_CHECK(cudaEventRecord(wait_after_[i], stream_));
    wait_timed_[i] = 0;
  }
  void synchronize() override { CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  Totals totals() override {
    for (size_t i = 0; i < wait_timed_.size(); ++i) time_wait(int(i), /*block=*/false);
    std::lock_guard<std::mutex> lock(copy_mutex_);
    Totals out = totals_;
    out.compute_stall_s = compute_stall_s_;
    return out;
  }

  void queue_sumsq(int unit, const float* grad, int64_t n) override {
    SHARDLM_CHECK(unit >= 0 && unit < units_, "internal: sum of squares for unit %d", unit);
    if (!unit_sumsq_) {  // first use: one double per unit, and the reduction's scratch
      unit_sumsq_ = static_cast<double*>(cuda_malloc(Mem::Workspace, 8 * units_));
      sumsq_scratch_bytes_ = cuda::sum_squares_scratch_bytes();
      sumsq_scratch_ = cuda_malloc(Mem::Workspace, int64_t(sumsq_scratch_bytes_));
    }
    cuda::sum_squares(unit_sumsq_ + unit, grad, n, /*accumulate=*/false, sumsq_scratch_, sumsq_scratch_bytes_, stream_);
  }
  double read_sumsq(int units) override {
    SHARDLM_CHECK(unit_sumsq_ && units <= units_, "internal: no sums of squares queued");
    std::vector<double> host(units);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), unit_sumsq_, 8 * size_t(units), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    double total = 0;
    for (double s : host) total += s;  // unit order: the same sum every run
    return total;
  }

 private:
  // Adds ring slot i's wait to the stall once, when its events are done (block:
  // wait for them); false when they are not done yet.
  bool time_wait(int i, bool block) {
    if (wait_timed_[i]) return true;
    if (block) CUDA_CHECK(cudaEventSynchronize(wait_after_[i]));
    else if (cudaEventQuery(wait_after_[i]) != cudaSuccess) {
      cudaGetLastError();  // cudaErrorNotReady is not an error here
      return false;
    }
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, wait_before_[i], wait_after_[i]));
    compute_stall_s_ += 1e-3 * ms;
    wait_timed_[i] = 1;
    return true;
  }

  // A copy's event, checked to be the copy's own: the ring is far larger than the
  // copies the offload pipeline keeps in flight (two per unit per step).
  cudaEvent_t copy_event(int64_t t) {
    std::lock_guard<std::mutex> lock(copy_mutex_);
    SHARDLM_CHECK(t >= 0 && t < next_copy_ && t >= next_copy_ - kCopyRing,
                  "internal: copy %lld waited on after %d newer ones", (long long)t, kCopyRing);
    return copy_done_[t % kCopyRing];
  }

  // One ticketed copy on its direction's stream, between two timed events. A copy
  // to the host first waits for the work queued on the compute stream so far.
  int64_t queue_copy(void* dst, const void* src, size_t bytes, bool to_host) {
    std::lock_guard<std::mutex> lock(copy_mutex_);
    if (copy_done_.empty()) {  // first copy: the event ring
      copy_ready_.resize(kCopyRing);
      copy_start_.resize(kCopyRing);
      copy_done_.resize(kCopyRing);
      copy_info_.resize(kCopyRing);
      for (int i = 0; i < kCopyRing; ++i) {
        CUDA_CHECK(cudaEventCreateWithFlags(&copy_ready_[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreate(&copy_start_[i]));  // timed: the achieved link bandwidth
        CUDA_CHECK(cudaEventCreate(&copy_done_[i]));
      }
    }
    const int64_t t = next_copy_++;
    const int64_t i = t % kCopyRing;
    cudaStream_t s = to_host ? d2h_ : h2d_;
    if (to_host) {
      CUDA_CHECK(cudaEventRecord(copy_ready_[i], stream_));
      CUDA_CHECK(cudaStreamWaitEvent(s, copy_ready_[i], 0));
    }
    CUDA_CHECK(cudaEventRecord(copy_start_[i], s));  // to the host: passes once the compute stream has got there
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(copy_done_[i], s));
    copy_info_[i] = {bytes, to_host, /*timed=*/false};
    return t;
  }

  cudaStream_t stream_;                  // the backend's compute stream (not owned)
  const int units_;
  int device_ = 0;
  static constexpr int kCopyRing = 16384;
  cudaStream_t d2h_ = nullptr, h2d_ = nullptr;
  std::vector<cudaEvent_t> copy_ready_, copy_start_, copy_done_;
  struct CopyInfo {
    size_t bytes = 0;
    bool to_host = false, timed = false;
  };
  std::vector<CopyInfo> copy_info_;      // (kCopyRing) by ticket
  Totals totals_;
  int64_t next_copy_ = 0;
  std::mutex copy_mutex_;
  static constexpr int kWaitRing = 256;
  std::vector<cudaEvent_t> wait_before_, wait_after_;  // (kWaitRing) compute_wait's timed events
  std::vector<char> wait_timed_;                      // (kWaitRing) the slot's wait is in the stall (or none)
  int64_t next_wait_ = 0;                             // compute waits issued
  double compute_stall_s_ = 0;
  double* unit_sumsq_ = nullptr;         // [unit] the step's per-unit sums of squares
  void* sumsq_scratch_ = nullptr;
  size_t sumsq_scratch_bytes_ = 0;
};

}  // namespace

std::unique_ptr<OffloadDevice> make_cuda_offload_device(void* compute_stream, int units) {
  return std::make_unique<CudaOffloadDevice>(static_cast<cudaStream_t>(compute_stream), units);
}

}  // namespace shardlm
