// comm_cuda.cu — the unit loop's Comm for GPU backends: all-gather and
// reduce-scatter (and context parallelism's ring_exchange) on device buffers,
// through NCCL (one GPU per rank) or through MPI staged in pinned host memory
// (several ranks sharing one GPU, which NCCL refuses). The small collectives (all-reduce of host doubles, broadcast,
// barrier, all_to_all_v) go to the host Comm it wraps.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/cuda.hpp"
#include "cuda/ops.hpp"
#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/runtime.hpp"

#define NCCL_CHECK(call)                                                                                   \
  do {                                                                                                     \
    ncclResult_t nccl_status_ = (call);                                                                    \
    if (nccl_status_ != ncclSuccess)                                                                       \
      throw ::shardlm::Error(::shardlm::fmt("%s failed at %s:%d: %s", #call, __FILE__, __LINE__,           \
                                            ncclGetErrorString(nccl_status_)));                            \
  } while (0)

namespace shardlm {
namespace {

// The host-side collectives every device Comm forwards unchanged.
class HostForwarding : public Comm {
 public:
  HostForwarding(Comm& host, const char* kind) : host_(host), kind_(kind) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  bool device_buffers() const override { return true; }
  void all_reduce_sum(double* v, int64_t n) override { host_.all_reduce_sum(v, n); }
  void all_reduce_sum(int64_t* v, int64_t n) override { host_.all_reduce_sum(v, n); }
  void broadcast(void* bytes, int64_t n, int root) override { host_.broadcast(bytes, n, root); }
  using Comm::broadcast;
  void barrier() override { host_.barrier(); }
  void all_to_all_v(const float* send, const int64_t* sc, const int64_t* sd, float* recv, const int64_t* rc,
                    const int64_t* rd) override {
    host_.all_to_all_v(send, sc, sd, recv, rc, rd);
  }

 protected:
  // DESIGN.md rule 4: NCCL is only ever handed device memory, and neither is a
  // device Comm. Checked on every call (one driver query, ~1 us), so a host
  // tensor reaching one, e.g. an offloaded master shard, is an error that names
  // the buffer, not a fault (or, staged, a silent extra copy).
  void require_device(const void* p, const char* what) {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) cudaGetLastError();
    SHARDLM_CHECK(e == cudaSuccess && (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged),
                  "%s was handed host memory for its %s (%p): device communicators only ever get device "
                  "buffers; stage host data through a device buffer first",
                  kind_, what, p);
  }

  Comm& host_;
  const char* kind_;  // "NCCL" | "staged MPI": named in errors
};

// ------------------------------------------------------------------ NCCL

ncclDataType_t nccl_type(DType t) { return t == DType::F32 ? ncclFloat32 : ncclBfloat16; }

// SHARDLM_FAULT=nccl_stall@R: hold the comm stream for `ns` so a collective
// looks stuck (the watchdog test); bounded, so a missed abort cannot hang a run.
__global__ void stall_kernel(long long ns) {
  const long long start = clock64();
  while (clock64() - start < ns) __nanosleep(1000000);
}

// NCCL on its own stream. Each collective waits for everything queued on the
// compute stream before it (an event), so a gather into a slot never overtakes
// the compute that still reads it and a reduction never reads gradients that are
// not written yet; CommRequest::wait() makes the compute stream wait for the
// collective's own event. Nothing here synchronises the host.
//
// A watchdog thread polls the oldest collectives in flight and NCCL's
// asynchronous error: an error or a collective older than comm.timeout_s (a
// dead or stuck peer) ends the job with a message instead of a silent hang.
class NcclDeviceComm final : public HostForwarding {
 public:
  NcclDeviceComm(Comm& host, cudaStream_t compute, double timeout_s)
      : HostForwarding(host, "NCCL"), compute_(compute), timeout_s_(timeout_s) {
    CUDA_CHECK(cudaGetDevice(&device_));
    // MPI is the only bootstrap: rank 0's unique id reaches the others by broadcast.
    ncclUniqueId id;
    if (host.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    host.broadcast(&id, sizeof(id), 0);
    NCCL_CHECK(ncclCommInitRank(&nccl_, host.size(), id, host.rank()));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ready_.resize(kRing);
    done_.resize(kRing);
    for (int i = 0; i < kRing; ++i) {
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_[i], cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclDeviceComm() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(nccl_);
    for (int i = 0; i < kRing; ++i) cudaEventDestroy(ready_[i]), cudaEventDestroy(done_[i]);
    cudaStreamDestroy(stream_);
  }

  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void* shard, void* full, int64_t count, DType t) override {
    require_device(shard, "all-gather input");
    require_device(full, "all-gather output");
    const int64_t ticket = begin();
    NCCL_CHECK(ncclAllGather(shard, full, size_t(count), nccl_type(t), nccl_, stream_));
    return end(ticket, "all-gather", count * dtype_bytes(t));
  }
  CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType t) override {
    require_device(full, "reduce-scatter input");
    require_device(shard, "reduce-scatter output");
    const int64_t ticket = begin();
    NCCL_CHECK(ncclReduceScatter(full, shard, size_t(count), nccl_type(t), ncclSum, nccl_, stream_));
    return end(ticket, "reduce-scatter", count * dtype_bytes(t));
  }
  CommRequest broadcast(void* buf, int64_t count, DType t, int root) override {
    require_device(buf, "broadcast buffer");
    const int64_t ticket = begin();
    NCCL_CHECK(ncclBroadcast(buf, buf, size_t(count), nccl_type(t), root, nccl_, stream_));
    return end(ticket, "broadcast", count * dtype_bytes(t));
  }
  using HostForwarding::broadcast;
  // Context parallelism's ring: send to rank + 1 and receive from rank - 1 as one
  // NCCL group on the comm stream, so the block travels while the compute stream
  // works on the one held; watched like the collectives.
  CommRequest ring_exchange(const void* send, void* recv, int64_t bytes) override {
    require_device(send, "ring send buffer");
    require_device(recv, "ring receive buffer");
    const int64_t ticket = begin();
    const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclSend(send, size_t(bytes), ncclUint8, next, nccl_, stream_));
    NCCL_CHECK(ncclRecv(recv, size_t(bytes), ncclUint8, prev, nccl_, stream_));
    NCCL_CHECK(ncclGroupEnd());
    return end(ticket, "ring exchange", bytes);
  }

  void all_to_all_v_device(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                           const int64_t* recv_bytes, const int64_t* recv_displs) override {
    require_device(send, "all-to-all send buffer");
    require_device(recv, "all-to-all receive buffer");
    const int64_t ticket = begin();
    int64_t total = 0;
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size(); ++p) {
      if (send_bytes[p] > 0)
        NCCL_CHECK(ncclSend(static_cast<const char*>(send) + send_displs[p], size_t(send_bytes[p]), ncclUint8, p,
                            nccl_, stream_));
      if (recv_bytes[p] > 0)
        NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + recv_displs[p], size_t(recv_bytes[p]), ncclUint8, p, nccl_,
                            stream_));
      total += send_bytes[p];
    }
    NCCL_CHECK(ncclGroupEnd());
    end(ticket, "all-to-all", total).wait();
  }

  void complete(int64_t ticket) override {
    // A ticket older than the ring has had its event recorded again by a later
    // collective on the same stream, which completes after it: waiting on the
    // newer one is safe but over-waits, so the engine never holds one that long.
    SHARDLM_CHECK(ticket >= next_ticket_ - kRing, "internal: NCCL request %lld waited on after %d newer ones",
                  (long long)ticket, kRing);
    CUDA_CHECK(cudaStreamWaitEvent(compute_, done_[ticket % kRing], 0));
  }

 private:
  static constexpr int kRing = 32;  // collectives in flight at most (the engine holds <= 6)


  int64_t begin() {
    const int64_t ticket = next_ticket_++;
    CUDA_CHECK(cudaEventRecord(ready_[ticket % kRing], compute_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_[ticket % kRing], 0));
    if (ticket == 0 && fault_armed("nccl_stall")) {
      stall_kernel<<<1, 1, 0, stream_>>>(30LL * 2000000000LL);  // ~30 s at 2 GHz
      CUDA_CHECK(cudaGetLastError());
    }
    return ticket;
  }
  CommRequest end(int64_t ticket, const char* what, int64_t bytes) {
    CUDA_CHECK(cudaEventRecord(done_[ticket % kRing], stream_));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_flight_.push_back({ticket, std::chrono::steady_clock::now(), what, bytes});
    }
    wake_.notify_all();
    return CommRequest(this, ticket);
  }

  struct InFlight {
    int64_t ticket;
    std::chrono::steady_clock::time_point issued;
    const char* what;
    int64_t bytes;
  };

  void watch() {
    cudaSetDevice(device_);  // the current device is per thread
    const auto poll = std::chrono::milliseconds(timeout_s_ >= 10 ? 500 : 50);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      wake_.wait_for(lock, poll);
      while (!in_flight_.empty()) {
        const InFlight f = in_flight_.front();
        // The slot may carry a newer collective's event by now; that one
        // completes after this one (same stream), so "done" is still true.
        const cudaError_t q = cudaEventQuery(done_[f.ticket % kRing]);
        if (q == cudaSuccess) {
          in_flight_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady)
          fatal(fmt("NCCL %s (%lld bytes) failed on the device: %s", f.what, (long long)f.bytes,
                    cudaGetErrorString(q)));
        const double age = std::chrono::duration<double>(std::chrono::steady_clock::now() - f.issued).count();
        if (age > timeout_s_)
          fatal(fmt("NCCL %s of %lld bytes has not completed after %.0f s (comm.timeout_s = %g): a rank died or "
                    "is stuck; aborting the job",
                    f.what, (long long)f.bytes, age, timeout_s_));
        break;
      }
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(nccl_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
        fatal(fmt("NCCL reported an asynchronous error: %s", ncclGetErrorString(async)));
    }
  }

  cudaStream_t compute_ = nullptr, stream_ = nullptr;
  double timeout_s_;
  int device_ = 0;
  ncclComm_t nccl_ = nullptr;
  std::vector<cudaEvent_t> ready_, done_;  // (kRing) by ticket % kRing
  int64_t next_ticket_ = 0;                // issuing thread only
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InFlight> in_flight_;         // guarded by mutex_
  bool stopping_ = false;                  // guarded by mutex_
  std::thread watchdog_;
};

// ------------------------------------------------------------------ MPI, staged

// Device buffers through two pinned host buffers and the host MPI Comm: copy
// out, MPI collective, copy back, all ordered on the compute stream. Blocking
// (the host waits for the device before each MPI call), so it overlaps nothing;
// it exists for runs of several ranks on one GPU and for testing the sharded GPU
// path anywhere.
class StagedDeviceComm final : public HostForwarding {
 public:
  StagedDeviceComm(Comm& host, cudaStream_t compute, int64_t staging_bytes)
      : HostForwarding(host, "staged MPI"), compute_(compute), staging_bytes_(staging_bytes) {
    CUDA_CHECK(cudaMallocHost(&send_, size_t(staging_bytes)));
    CUDA_CHECK(cudaMallocHost(&recv_, size_t(staging_bytes)));
    host_mem_track(Mem::Workspace, 2 * staging_bytes);
  }
  ~StagedDeviceComm() override {
    cudaStreamSynchronize(compute_);
    cudaFreeHost(send_);
    cudaFreeHost(recv_);
    host_mem_track(Mem::Workspace, -2 * staging_bytes_);
  }

  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void* shard, void* full, int64_t count, DType t) override {
    require_device(shard, "all-gather input");
    require_device(full, "all-gather output");
    const int64_t bytes = count * dtype_bytes(t);
    stage_out(shard, bytes, bytes * size());
    host_.all_gather(send_, recv_, count, t).wait();
    CUDA_CHECK(cudaMemcpyAsync(full, recv_, size_t(bytes * size()), cudaMemcpyHostToDevice, compute_));
    return {};
  }
  CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType t) override {
    require_device(full, "reduce-scatter input");
    require_device(shard, "reduce-scatter output");
    const int64_t bytes = count * dtype_bytes(t);
    stage_out(full, bytes * size(), bytes * size());
    host_.reduce_scatter(send_, recv_, count, t).wait();
    CUDA_CHECK(cudaMemcpyAsync(shard, recv_, size_t(bytes), cudaMemcpyHostToDevice, compute_));
    return {};
  }
  CommRequest broadcast(void* buf, int64_t count, DType t, int root) override {
    require_device(buf, "broadcast buffer");
    const int64_t bytes = count * dtype_bytes(t);
    stage_out(buf, rank() == root ? bytes : 0, bytes);
    host_.broadcast(send_, count, t, root).wait();
    CUDA_CHECK(cudaMemcpyAsync(buf, send_, size_t(bytes), cudaMemcpyHostToDevice, compute_));
    return {};
  }
  using HostForwarding::broadcast;
  // Context parallelism's ring through the host: the block goes out to pinned
  // memory now and MPI starts (the host Comm's ring_exchange, numbered and
  // watched); CommRequest::wait() waits for MPI on the host while the kernels
  // queued meanwhile run, then queues the copy into `recv` on the compute stream.
  // One exchange in flight at a time (the rings start the next after waiting).
  CommRequest ring_exchange(const void* send, void* recv, int64_t bytes) override {
    require_device(send, "ring send buffer");
    require_device(recv, "ring receive buffer");
    SHARDLM_CHECK(!ring_in_flight_.pending(), "internal: a staged ring exchange started before the last one ended");
    stage_out(send, bytes, bytes);
    ring_in_flight_ = host_.ring_exchange(send_, recv_, bytes);
    ring_recv_ = recv;
    ring_bytes_ = bytes;
    return CommRequest(this, ++ring_ticket_);
  }
  // Out to pinned memory in one copy (the send blocks are one span), MPI's
  // exchange in 4-byte words between the pinned buffers, back in one copy.
  void all_to_all_v_device(const void* send, const int64_t* send_bytes, const int64_t* send_displs, void* recv,
                           const int64_t* recv_bytes, const int64_t* recv_displs) override {
    require_device(send, "all-to-all send buffer");
    require_device(recv, "all-to-all receive buffer");
    const int P = size();
    int64_t send_end = 0, recv_end = 0;
    words_.assign(size_t(4 * P), 0);
    for (int p = 0; p < P; ++p) {
      SHARDLM_CHECK(send_bytes[p] % 4 == 0 && send_displs[p] % 4 == 0 && recv_bytes[p] % 4 == 0 &&
                        recv_displs[p] % 4 == 0,
                    "internal: a staged all-to-all of blocks that are not whole 4-byte words (rank %d)", p);
      send_end = std::max(send_end, send_displs[p] + send_bytes[p]);
      recv_end = std::max(recv_end, recv_displs[p] + recv_bytes[p]);
      words_[size_t(p)] = send_bytes[p] / 4, words_[size_t(P + p)] = send_displs[p] / 4;
      words_[size_t(2 * P + p)] = recv_bytes[p] / 4, words_[size_t(3 * P + p)] = recv_displs[p] / 4;
    }
    stage_out(send, send_end, std::max(send_end, recv_end));
    host_.all_to_all_v(static_cast<const float*>(send_), words_.data(), words_.data() + P,
                       static_cast<float*>(recv_), words_.data() + 2 * P, words_.data() + 3 * P);
    CUDA_CHECK(cudaMemcpyAsync(recv, recv_, size_t(recv_end), cudaMemcpyHostToDevice, compute_));
  }

  void complete(int64_t ticket) override {
    SHARDLM_CHECK(ticket == ring_ticket_ && ring_recv_, "internal: staged ring exchange %lld completed out of turn",
                  (long long)ticket);
    ring_in_flight_.wait();
    CUDA_CHECK(cudaMemcpyAsync(ring_recv_, recv_, size_t(ring_bytes_), cudaMemcpyHostToDevice, compute_));
    ring_recv_ = nullptr;
  }

 private:
  // Copy `bytes` of device memory to send_ and wait for it; the wait also
  // finishes the previous call's copy out of recv_, which MPI overwrites next.
  void stage_out(const void* src, int64_t bytes, int64_t largest) {
    SHARDLM_CHECK(largest <= staging_bytes_, "internal: a %lld-byte collective exceeds the %lld-byte staging buffer",
                  (long long)largest, (long long)staging_bytes_);
    CUDA_CHECK(cudaMemcpyAsync(send_, src, size_t(bytes), cudaMemcpyDeviceToHost, compute_));
    CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  cudaStream_t compute_;
  int64_t staging_bytes_;
  void* send_ = nullptr;  // pinned (staging_bytes)
  void* recv_ = nullptr;  // pinned (staging_bytes)
  std::vector<int64_t> words_;  // all_to_all_v_device's counts and displacements in 4-byte words (4 P)
  CommRequest ring_in_flight_;  // the host exchange of the ring's message in flight
  void* ring_recv_ = nullptr;   // its device destination, until complete()
  int64_t ring_bytes_ = 0;
  int64_t ring_ticket_ = 0;
};

// --------------------------------------------------------- CUDA IPC broadcast

// The weight broadcast between processes that share one GPU (an RL job's
// trainer and inference ranks on a one-GPU machine), opted in with
// SHARDLM_BROADCAST_IPC=1 (select_broadcast_comm): the root's buffer is opened
// by the others through a CUDA IPC handle and copied device to device, instead
// of through pinned host memory and MPI as StagedDeviceComm does. Per call:
// the root waits for its compute stream (the buffer is written), sends the
// handle of the buffer's allocation (cached per buffer) over the host Comm,
// the others copy and wait, and a barrier keeps the root from writing the
// buffer again before every copy is done. Broadcast only: the weight
// broadcast's device Comm makes no other call.
class IpcDeviceComm final : public HostForwarding {
 public:
  IpcDeviceComm(Comm& host, cudaStream_t compute) : HostForwarding(host, "CUDA IPC"), compute_(compute) {}
  ~IpcDeviceComm() override {
    for (auto& o : opened_) cudaIpcCloseMemHandle(o.second);
  }

  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void*, void*, int64_t, DType) override { return unsupported("all-gather"); }
  CommRequest reduce_scatter(const void*, void*, int64_t, DType) override { return unsupported("reduce-scatter"); }
  CommRequest ring_exchange(const void*, void*, int64_t) override { return unsupported("ring exchange"); }
  CommRequest broadcast(void* buf, int64_t count, DType t, int root) override {
    require_device(buf, "broadcast buffer");
    const int64_t bytes = count * dtype_bytes(t);
    struct {
      cudaIpcMemHandle_t handle;
      int64_t bytes;
    } msg{};
    if (rank() == root) {
      CUDA_CHECK(cudaStreamSynchronize(compute_));
      if (buf != exported_ptr_) {  // the handle of the allocation that starts at buf
        const cudaError_t e = cudaIpcGetMemHandle(&exported_, buf);
        SHARDLM_CHECK(e == cudaSuccess, "CUDA IPC broadcast: no IPC handle for the buffer at %p (%s): it must start "
                                        "a cudaMalloc allocation", buf, cudaGetErrorString(e));
        exported_ptr_ = buf;
      }
      msg.handle = exported_;
      msg.bytes = bytes;
    }
    host_.broadcast(&msg, int64_t(sizeof(msg)), root);
    if (rank() != root) {
      SHARDLM_CHECK(msg.bytes == bytes, "CUDA IPC broadcast: the root sends %lld bytes, this rank expects %lld",
                    (long long)msg.bytes, (long long)bytes);
      CUDA_CHECK(cudaMemcpyAsync(buf, open(msg.handle), size_t(bytes), cudaMemcpyDeviceToDevice, compute_));
      CUDA_CHECK(cudaStreamSynchronize(compute_));
    }
    host_.barrier();
    return {};
  }
  using HostForwarding::broadcast;

 private:
  CommRequest unsupported(const char* what) {
    SHARDLM_FAIL("internal: the CUDA IPC device Comm carries the weight broadcast only, not a %s", what);
  }
  // The root's allocation mapped here, opened once per handle.
  void* open(const cudaIpcMemHandle_t& h) {
    const std::string key(reinterpret_cast<const char*>(&h), sizeof(h));
    for (auto& o : opened_)
      if (o.first == key) return o.second;
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    SHARDLM_CHECK(e == cudaSuccess, "CUDA IPC broadcast: cannot open the root's buffer (%s)", cudaGetErrorString(e));
    opened_.emplace_back(key, p);
    return p;
  }

  cudaStream_t compute_;
  void* exported_ptr_ = nullptr;
  cudaIpcMemHandle_t exported_{};
  std::vector<std::pair<std::string, void*>> opened_;
};

}  // namespace

std::unique_ptr<Comm> make_device_comm(Comm& host, const std::string& kind, void* compute_stream,
                                       int64_t staging_bytes, double timeout_s) {
  auto stream = static_cast<cudaStream_t>(compute_stream);
  if (kind == "nccl") return std::make_unique<NcclDeviceComm>(host, stream, timeout_s);
  if (kind == "ipc") return std::make_unique<IpcDeviceComm>(host, stream);
  SHARDLM_CHECK(kind == "mpi", "comm.backend = \"%s\" is not a device communicator (nccl or mpi)", kind.c_str());
  return std::make_unique<StagedDeviceComm>(host, stream, staging_bytes);
}


}  // namespace shardlm
