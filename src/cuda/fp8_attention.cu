// fp8_attention.cu — attention with FP8 operands for training. See
// src/cuda/fp8_attention.hpp.
#include "cuda/fp8_attention.hpp"

#include <cuda_fp8.h>

#include <algorithm>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/fp8.hpp"
#include "cuda/ops_common.cuh"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

namespace {

using bf16 = __nv_bfloat16;
using dev::align256;
using dev::grid_capped;
using dev::kThreads;

// One scale from one amax: scale = 2^floor(log2(448 / (amax * headroom))), 1
// where the amax is 0 or not finite; descale = 1 / scale (exact: a power of two).
struct ScaleFrom {
  int amax, scale, descale;
  float headroom;
};
struct ScaleList {
  ScaleFrom item[6];
  int n;
};
__global__ void pow2_scales_kernel(float* slots, ScaleList list) {
  const int i = threadIdx.x;
  if (i >= list.n) return;
  const ScaleFrom f = list.item[i];
  const float amax = slots[f.amax] * f.headroom;
  float scale = 1.0f;
  if (amax > 0.0f && isfinite(amax)) scale = exp2f(floorf(log2f(cpu::kFp8E4M3Max / amax)));
  scale = fminf(fmaxf(scale, 0x1p-100f), 0x1p100f);
  slots[f.scale] = scale;
  slots[f.descale] = 1.0f / scale;
}

// out = codes (e4m3) * descale, rounded to bf16 (exact for a power-of-two descale).
__global__ void decode_kernel(const uint8_t* __restrict__ codes, int64_t n, const float* __restrict__ descale,
                              bf16* __restrict__ out) {
  const float d = *descale;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(codes[i]), __NV_E4M3);
    out[i] = __float2bfloat16(__half2float(__half(h)) * d);
  }
}

}  // namespace

size_t Fp8Attention::state_bytes(int64_t layers) { return align256(sizeof(float) * kSlots * layers); }

size_t Fp8Attention::scratch_bytes(int64_t max_tokens, int64_t H, int64_t KV, int64_t D) {
  const size_t n = static_cast<size_t>(max_tokens), q = n * H * D, kv = n * KV * D;
  return 4 * align256(q) + 4 * align256(kv) + CudnnSdpa::fp8_backward_workspace_bytes(max_tokens, H, D);
}

Fp8Attention::Fp8Attention(CudnnSdpa& sdpa, int64_t max_tokens, int64_t H, int64_t KV, int64_t D, int64_t layers,
                           void* state, cudaStream_t stream)
    : sdpa_(sdpa), max_tokens_(max_tokens), H_(H), KV_(KV), D_(D), layers_(layers), stream_(stream),
      scalars_(static_cast<float*>(state)), has_history_(static_cast<size_t>(layers), false) {
  // Every scale and descale 1 (the delayed ones' first run), P's 448; amaxes 0.
  std::vector<float> init(size_t(kSlots * layers), 0.0f);
  for (int64_t l = 0; l < layers; ++l) {
    float* at = init.data() + l * kSlots;
    std::fill(at + kScaleQ, at + kDescaleDV + 1, 1.0f);
    at[kScaleS] = cpu::kFp8E4M3Max;
    at[kDescaleS] = 1.0f / cpu::kFp8E4M3Max;
  }
  CUDA_CHECK(cudaMemcpyAsync(scalars_, init.data(), sizeof(float) * init.size(), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));  // init is the host's
}

Fp8Attention::Scratch Fp8Attention::carve(void* scratch) const {
  const size_t n = static_cast<size_t>(max_tokens_), q = n * H_ * D_, kv = n * KV_ * D_;
  char* p = static_cast<char*>(scratch);
  auto codes = [&](size_t count) {
    uint8_t* at = reinterpret_cast<uint8_t*>(p);
    p += align256(count);
    return at;
  };
  Scratch s;
  s.q8 = codes(q);
  s.o8 = codes(q);
  s.do8 = codes(q);
  s.dq8 = codes(q);
  s.k8 = codes(kv);
  s.v8 = codes(kv);
  s.dk8 = codes(kv);
  s.dv8 = codes(kv);
  s.backward_workspace = p;
  return s;
}

void Fp8Attention::check_call(int64_t layer, int64_t N) const {
  SHARDLM_CHECK(layer >= 0 && layer < layers_ && N >= 1 && N <= max_tokens_,
                "internal: FP8 attention layer %lld of %lld, %lld tokens (planned %lld)", (long long)layer,
                (long long)layers_, (long long)N, (long long)max_tokens_);
}

CudnnSdpa::Fp8Scales Fp8Attention::scales(int64_t layer) const {
  float* s = scalars_ + layer * kSlots;
  return CudnnSdpa::Fp8Scales{s + kDescaleQ, s + kDescaleK, s + kDescaleV, s + kDescaleO, s + kDescaleDO,
                              s + kDescaleS, s + kDescaleDP, s + kScaleS,  s + kScaleO,   s + kScaleDP,
                              s + kScaleDQ,  s + kScaleDK,  s + kScaleDV,  s + kAmaxS,    s + kAmaxO,
                              s + kAmaxDP,   s + kAmaxDQ,   s + kAmaxDK,   s + kAmaxDV};
}

bool Fp8Attention::forward(int64_t layer, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                           int64_t N, void* scratch) {
  check_call(layer, N);
  const Scratch c = carve(scratch);
  float* s = scalars_ + layer * kSlots;
  fp8_amax(q, N * H_ * D_, s + kAmaxQ, stream_);
  fp8_amax(k, N * KV_ * D_, s + kAmaxK, stream_);
  fp8_amax(v, N * KV_ * D_, s + kAmaxV, stream_);
  const ScaleList list{{{kAmaxQ, kScaleQ, kDescaleQ, 1.0f},
                        {kAmaxK, kScaleK, kDescaleK, 1.0f},
                        {kAmaxV, kScaleV, kDescaleV, 1.0f},
                        {kAmaxV, kScaleO, kDescaleO, 1.0f}},
                       4};
  pow2_scales_kernel<<<1, 32, 0, stream_>>>(s, list);
  CUDA_CHECK(cudaGetLastError());
  fp8_quantize(q, N, H_ * D_, s + kScaleQ, Fp8Scaling::Tensor, Fp8Format::E4M3, c.q8, false, stream_);
  fp8_quantize(k, N, KV_ * D_, s + kScaleK, Fp8Scaling::Tensor, Fp8Format::E4M3, c.k8, false, stream_);
  fp8_quantize(v, N, KV_ * D_, s + kScaleV, Fp8Scaling::Tensor, Fp8Format::E4M3, c.v8, false, stream_);
  if (!sdpa_.forward_fp8(c.o8, lse, c.q8, c.k8, c.v8, scales(layer))) return false;
  decode_kernel<<<grid_capped(N * H_ * D_, kThreads), kThreads, 0, stream_>>>(c.o8, N * H_ * D_, s + kDescaleO, out);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

bool Fp8Attention::backward(int64_t layer, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                            const bf16* k, const bf16* v, const bf16* out, const float* lse, int64_t N, void* scratch) {
  check_call(layer, N);
  const Scratch c = carve(scratch);
  float* s = scalars_ + layer * kSlots;
  // The forward's codes again, at the forward's scales (kept in the layer's slots).
  fp8_quantize(q, N, H_ * D_, s + kScaleQ, Fp8Scaling::Tensor, Fp8Format::E4M3, c.q8, false, stream_);
  fp8_quantize(k, N, KV_ * D_, s + kScaleK, Fp8Scaling::Tensor, Fp8Format::E4M3, c.k8, false, stream_);
  fp8_quantize(v, N, KV_ * D_, s + kScaleV, Fp8Scaling::Tensor, Fp8Format::E4M3, c.v8, false, stream_);
  fp8_quantize(out, N, H_ * D_, s + kScaleO, Fp8Scaling::Tensor, Fp8Format::E4M3, c.o8, false, stream_);
  fp8_amax(dout, N * H_ * D_, s + kAmaxDO, stream_);
  const ScaleList current{{{kAmaxDO, kScaleDO, kDescaleDO, 1.0f}}, 1};
  pow2_scales_kernel<<<1, 32, 0, stream_>>>(s, current);
  CUDA_CHECK(cudaGetLastError());
  fp8_quantize(dout, N, H_ * D_, s + kScaleDO, Fp8Scaling::Tensor, Fp8Format::E4M3, c.do8, false, stream_);
  // Delayed: dP's, dq's, dk's and dv's scales from the amaxes the graph wrote last
  // time. A layer's first backward runs the graph twice more before: at unit
  // scales (dP's and dv's amaxes, taken before their scales, are right; dq's and
  // dk's are of dP's unit-scale codes), then at dP's scale (dq's and dk's right).
  const ScaleList delayed{{{kAmaxDP, kScaleDP, kDescaleDP, 2.0f},
                           {kAmaxDQ, kScaleDQ, kDescaleDQ, 2.0f},
                           {kAmaxDK, kScaleDK, kDescaleDK, 2.0f},
                           {kAmaxDV, kScaleDV, kDescaleDV, 2.0f}},
                          4};
  const CudnnSdpa::Fp8Scales sc = scales(layer);
  for (int warmup = has_history_[size_t(layer)] ? 0 : 2; warmup > 0; --warmup) {
    if (warmup == 1) pow2_scales_kernel<<<1, 32, 0, stream_>>>(s, delayed);
    if (!sdpa_.backward_fp8(c.dq8, c.dk8, c.dv8, c.do8, c.q8, c.k8, c.v8, c.o8, lse, sc, c.backward_workspace)) return false;
  }
  has_history_[size_t(layer)] = true;
  pow2_scales_kernel<<<1, 32, 0, stream_>>>(s, delayed);
  CUDA_CHECK(cudaGetLastError());
  if (!sdpa_.backward_fp8(c.dq8, c.dk8, c.dv8, c.do8, c.q8, c.k8, c.v8, c.o8, lse, sc, c.backward_workspace)) return false;
  decode_kernel<<<grid_capped(N * H_ * D_, kThreads), kThreads, 0, stream_>>>(c.dq8, N * H_ * D_, s + kDescaleDQ, dq);
  decode_kernel<<<grid_capped(N * KV_ * D_, kThreads), kThreads, 0, stream_>>>(c.dk8, N * KV_ * D_, s + kDescaleDK, dk);
  decode_kernel<<<grid_capped(N * KV_ * D_, kThreads), kThreads, 0, stream_>>>(c.dv8, N * KV_ * D_, s + kDescaleDV, dv);
  CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace shardlm::cuda
