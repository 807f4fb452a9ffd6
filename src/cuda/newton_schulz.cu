// newton_schulz.cu — Muon's Newton–Schulz in bf16 on the GPU behind muon.hpp's
// Orthogonalizer. See src/cuda/newton_schulz.hpp for the contract and
// the precision choice; the host fp32 twin is newton_schulz() in src/train/muon.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <utility>

#include "cuda/gemm.hpp"
#include "cuda/newton_schulz.hpp"
#include "cuda/ops.hpp"
#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {
namespace {

using cuda::bf16;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;
// What cuBLASLt asks for on Hopper, as the backend's Gemm gets.
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;
// Floats per pinned staging chunk (16 MiB): large enough that a DMA runs near the
// link's rate, small enough that the host copy of one chunk hides the DMA of the
// other. An 8192 x 2048 matrix is 4 chunks.
constexpr int64_t kChunkFloats = int64_t(1) << 22;

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Floats per chunk and between the two pinned slots (64-float aligned).
int64_t chunk_floats(const NsCapacity& c) { return std::min(c.numel, kChunkFloats); }
int64_t slot_stride(const NsCapacity& c) { return div_up(chunk_floats(c), 64) * 64; }
size_t pinned_bytes(const NsCapacity& c) { return c.numel > 0 ? sizeof(float) * size_t(2 * slot_stride(c)) : 0; }

// Byte offsets into the one device allocation (each 256-byte aligned).
struct DeviceLayout {
  size_t input = 0;          // (numel) fp32 G; once X is made, the next X in bf16
  size_t x = 0;              // (numel) bf16 X
  size_t gram = 0;           // (k, k) bf16 A = X X^T (X^T X when tall)
  size_t poly = 0;           // (k, k) bf16 b A + c A^2
  size_t gemm_workspace = 0; // kGemmWorkspaceBytes
  size_t sumsq_scratch = 0;  // cuda::sum_squares_scratch_bytes()
  size_t sumsq = 0;          // one double: ||G||_F^2
  size_t total = 0;
};

DeviceLayout device_layout(const NsCapacity& c) {
  DeviceLayout l;
  if (c.numel <= 0) return l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t offset = at;
    at += align256(bytes);
    return offset;
  };
  const size_t n = size_t(c.numel), k = size_t(c.gram_side);
  l.input = take(sizeof(float) * n);
  l.x = take(sizeof(bf16) * n);
  l.gram = take(sizeof(bf16) * k * k);
  l.poly = take(sizeof(bf16) * k * k);
  l.gemm_workspace = take(kGemmWorkspaceBytes);
  l.sumsq_scratch = take(cuda::sum_squares_scratch_bytes());
  l.sumsq = take(sizeof(double));
  l.total = at;
  return l;
}

// x = bf16(g * inv_norm) with inv_norm = float(1 / (sqrt(sumsq) + eps)) in double,
// newton_schulz()'s scaling; the norm is read on the device (no host round trip).
__global__ void normalize_to_bf16_kernel(bf16* __restrict__ x, const float* __restrict__ g,
                                         const double* __restrict__ sumsq, double eps, int64_t n) {
  const float inv_norm = static_cast<float>(1.0 / (sqrt(*sumsq) + eps));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = __float2bfloat16_rn(g[i] * inv_norm);
}

// dst = src on the host, split over the OpenMP threads in 64 KiB blocks.
void host_copy(float* dst, const float* src, int64_t n) {
  constexpr int64_t kBlock = 16384;
  const int64_t blocks = div_up(n, kBlock);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t o = b * kBlock;
    std::memcpy(dst + o, src + o, sizeof(float) * size_t(std::min(kBlock, n - o)));
  }
}

// dst = float(src): bf16 bits are the top half of the fp32 bits, so this is exact.
void widen_bf16(float* dst, const uint16_t* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t(src[i]) << 16);
}

class CudaNewtonSchulz final : public Orthogonalizer {
 public:
  explicit CudaNewtonSchulz(const NsCapacity& capacity) : capacity_(capacity), layout_(device_layout(capacity)) {
    SHARDLM_CHECK(capacity.numel >= 0 && capacity.gram_side >= 0 &&
                      capacity.gram_side * capacity.gram_side <= std::max<int64_t>(capacity.numel, 0),
                  "GPU Newton–Schulz: capacity of %lld elements cannot have a Gram side of %lld",
                  (long long)capacity.numel, (long long)capacity.gram_side);
    if (capacity.numel == 0) return;  // a rank that owns no matrix: nothing to hold
    try {
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      void* p = nullptr;
      device_mem_admit(Mem::Workspace, int64_t(layout_.total));
      const cudaError_t e = cudaMalloc(&p, layout_.total);
      SHARDLM_CHECK(e == cudaSuccess, "out of GPU memory allocating %.1f MiB for Muon's Newton–Schulz: %s",
                    double(layout_.total) / 1048576.0, cudaGetErrorString(e));
      device_ = static_cast<char*>(p);
      device_mem_track(Mem::Workspace, int64_t(layout_.total));
      chunk_ = chunk_floats(capacity);
      slot_stride_ = slot_stride(capacity);
      CUDA_CHECK(cudaMallocHost(&staging_, pinned_bytes(capacity)));
      host_mem_track(Mem::Workspace, int64_t(pinned_bytes(capacity)));
      for (auto& ev : chunk_done_) CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      gemm_ = std::make_unique<cuda::Gemm>(stream_, device_ + layout_.gemm_workspace, kGemmWorkspaceBytes);
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaNewtonSchulz() override { release(); }
  CudaNewtonSchulz(const CudaNewtonSchulz&) = delete;
  CudaNewtonSchulz& operator=(const CudaNewtonSchulz&) = delete;

  const char* name() const override { return "cuda bf16"; }

  void orthogonalize(float* out, const float* G, int64_t rows, int64_t cols, int steps) override {
    SHARDLM_CHECK(rows >= 0 && cols >= 0 && steps >= 0, "GPU Newton–Schulz: rows %lld, cols %lld, steps %d",
                  (long long)rows, (long long)cols, steps);
    const int64_t n = rows * cols;
    if (n == 0) return;
    const bool tall = rows > cols;
    const int64_t k = tall ? cols : rows;  // the Gram matrix is (k, k), the smaller one
    SHARDLM_CHECK(n <= capacity_.numel && k <= capacity_.gram_side,
                  "GPU Newton–Schulz: a (%lld, %lld) matrix exceeds the capacity it was made for (%lld elements, "
                  "Gram side %lld)",
                  (long long)rows, (long long)cols, (long long)capacity_.numel, (long long)capacity_.gram_side);
    float* input = at<float>(layout_.input);
    bf16* x = at<bf16>(layout_.x);
    // The next X takes the input's bytes (2 of its 4 per element): G is dead once
    // the normalisation has read it, and the stream orders the two.
    bf16* next = at<bf16>(layout_.input);
    bf16* gram = at<bf16>(layout_.gram);
    bf16* poly = at<bf16>(layout_.poly);
    double* sumsq = at<double>(layout_.sumsq);

    upload(input, G, n);
    cuda::sum_squares(sumsq, input, n, /*accumulate=*/false, device_ + layout_.sumsq_scratch,
                      cuda::sum_squares_scratch_bytes(), stream_);
    const unsigned blocks = unsigned(std::min(div_up(n, kThreads), kMaxBlocks));
    normalize_to_bf16_kernel<<<blocks, kThreads, 0, stream_>>>(x, input, sumsq, double(kNsEps), n);
    CUDA_CHECK(cudaGetLastError());

    using cuda::GemmOut;
    for (int s = 0; s < steps; ++s) {
      // A = X X^T (k = rows), or X^T X when tall (k = cols); X is (rows, cols), row stride cols.
      if (tall) gemm_->matmul(true, false, k, k, rows, x, cols, x, cols, gram, k, GemmOut::BF16, 1.0f, 0.0f);
      else gemm_->matmul(false, true, k, k, cols, x, cols, x, cols, gram, k, GemmOut::BF16, 1.0f, 0.0f);
      // poly = c A A + b A: the GEMM's beta term reads A from poly (C is also the output).
      CUDA_CHECK(cudaMemcpyAsync(poly, gram, sizeof(bf16) * size_t(k * k), cudaMemcpyDeviceToDevice, stream_));
      gemm_->matmul(false, false, k, k, k, gram, k, gram, k, poly, k, GemmOut::BF16, kNsC, kNsB);
      // next = a X + poly X, or X poly + a X when tall (poly is symmetric).
      CUDA_CHECK(cudaMemcpyAsync(next, x, sizeof(bf16) * size_t(n), cudaMemcpyDeviceToDevice, stream_));
      if (tall) gemm_->matmul(false, false, rows, cols, cols, x, cols, poly, k, next, cols, GemmOut::BF16, 1.0f, kNsA);
      else gemm_->matmul(false, false, rows, cols, rows, poly, k, x, cols, next, cols, GemmOut::BF16, 1.0f, kNsA);
      std::swap(x, next);
    }
    download(out, x, n);
  }

 private:
  template <class T>
  T* at(size_t offset) {
    return reinterpret_cast<T*>(device_ + offset);
  }
  float* slot(int64_t chunk) { return staging_ + (chunk % 2) * slot_stride_; }

  // dst (device, n floats) = src (host), through the two pinned slots: the host
  // copies chunk j into its slot while the DMA of chunk j - 1 runs; a slot is
  // refilled only after the event of its previous DMA (chunk j - 2) has passed.
  void upload(float* dst, const float* src, int64_t n) {
    for (int64_t j = 0; j * chunk_ < n; ++j) {
      const int64_t offset = j * chunk_, count = std::min(chunk_, n - offset);
      cudaEvent_t& done = chunk_done_[j % 2];
      CUDA_CHECK(cudaEventSynchronize(done));  // an event never recorded has passed
      host_copy(slot(j), src + offset, count);
      CUDA_CHECK(cudaMemcpyAsync(dst + offset, slot(j), sizeof(float) * size_t(count), cudaMemcpyHostToDevice,
                                 stream_));
      CUDA_CHECK(cudaEventRecord(done, stream_));
    }
  }

  // dst (host, n floats) = float(src (device, n bf16)): two chunks in flight, each
  // widened on the host as soon as its DMA has landed. Returns when dst is written
  // (the last event passed: everything before it on the stream is done).
  void download(float* dst, const bf16* src, int64_t n) {
    const int64_t chunks = div_up(n, chunk_);
    auto enqueue = [&](int64_t j) {
      const int64_t offset = j * chunk_, count = std::min(chunk_, n - offset);
      CUDA_CHECK(cudaMemcpyAsync(slot(j), src + offset, sizeof(bf16) * size_t(count), cudaMemcpyDeviceToHost,
                                 stream_));
      CUDA_CHECK(cudaEventRecord(chunk_done_[j % 2], stream_));
    };
    for (int64_t j = 0; j < std::min<int64_t>(2, chunks); ++j) enqueue(j);
    for (int64_t j = 0; j < chunks; ++j) {
      const int64_t offset = j * chunk_, count = std::min(chunk_, n - offset);
      CUDA_CHECK(cudaEventSynchronize(chunk_done_[j % 2]));
      widen_bf16(dst + offset, reinterpret_cast<const uint16_t*>(slot(j)), count);
      if (j + 2 < chunks) enqueue(j + 2);
    }
  }

  // Destructors must not throw: statuses are ignored here.
  void release() {
    if (stream_) cudaStreamSynchronize(stream_);
    gemm_.reset();
    for (auto& ev : chunk_done_) {
      if (ev) cudaEventDestroy(ev);
      ev = nullptr;
    }
    if (staging_) {
      cudaFreeHost(staging_);
      host_mem_track(Mem::Workspace, -int64_t(pinned_bytes(capacity_)));
    }
    staging_ = nullptr;
    if (device_) {
      cudaFree(device_);
      device_mem_track(Mem::Workspace, -int64_t(layout_.total));
    }
    device_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  NsCapacity capacity_;
  DeviceLayout layout_;
  cudaStream_t stream_ = nullptr;
  char* device_ = nullptr;               // layout_.total bytes
  float* staging_ = nullptr;             // pinned: 2 slots of slot_stride_ floats
  int64_t chunk_ = 0;                    // floats per chunk (fp32 up, bf16 down)
  int64_t slot_stride_ = 0;
  cudaEvent_t chunk_done_[2] = {nullptr, nullptr};  // the last DMA through each slot
  std::unique_ptr<cuda::Gemm> gemm_;
};

}  // namespace

NsWorkspaceBytes cuda_newton_schulz_bytes(const NsCapacity& capacity) {
  return {int64_t(device_layout(capacity).total), int64_t(pinned_bytes(capacity))};
}

std::unique_ptr<Orthogonalizer> make_cuda_orthogonalizer(const NsCapacity& capacity) {
  return std::make_unique<CudaNewtonSchulz>(capacity);
}

}  // namespace shardlm
