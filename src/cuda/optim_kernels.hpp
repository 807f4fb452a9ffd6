// optim_kernels.hpp — the optimizer update on the GPU: AdamW and SGD on flat fp32
// shards (optionally writing the bf16 shard the next all-gather reads), per-segment
// weight decay, and the clipping factor computed on the device; kernels in
// optim_kernels.cu.
//
// Owns: shardlm::cuda::{OptimSegment, AdamWConfig, SgdConfig, adamw_step[_segments],
// sgd_step[_segments], clip_scale}. Each update is the CPU optimizer's
// (src/train/optim.cpp, src/cpu/adamw.hpp) to the last bit and is checked against it
// by tests/gpu/test_cuda_ops.cu; the conventions of ops.hpp hold (async on the given
// stream, no allocation, no host synchronisation, deterministic).
// Must not know: the training state that owns the shards (which units, where the
// state lives), MPI, the model, the deck.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace shardlm::cuda {

using bf16 = __nv_bfloat16;

// One segment of a flat shard: elements [offset, offset + count) share a weight
// decay (0 for norms and biases). A table is sorted by offset, non-overlapping, at
// most kMaxOptimSegments entries; elements in no segment (padding) are left as they
// are. Built once at start-up and copied to the device.
struct OptimSegment {
  int64_t offset;
  int64_t count;
  float weight_decay;
  float reserved = 0.0f;
};
inline constexpr int kMaxOptimSegments = 256;

// AdamW exactly as Optimizer::step (src/train/optim.cpp), in fp32 with the same operation
// order and no fused multiply-adds, so a step matches the CPU one to the last bit:
//   g = grad * grad_scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   p -= lr wd p; p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).
struct AdamWConfig {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;        // 1-based step count for the bias corrections
  float grad_scale = 1.0f; // clipping factor (and any other gradient scale)
};
struct SgdConfig {
  double lr = 0, momentum = 0, weight_decay = 0;
  float grad_scale = 1.0f;
};

// Every update takes an optional device_scale (a device float, e.g. from clip_scale):
// the gradient is also multiplied by *device_scale, and a non-finite *device_scale
// skips the update (parameters and state untouched), so clipping and the NaN skip
// need no host synchronisation. nullptr: grad_scale alone.
// param_bf16 (n) or nullptr: the updated parameters rounded to bf16, written in the
// same pass (the bf16 shard the next all-gather reads).
void adamw_step(float* param, bf16* param_bf16, const float* grad, float* m, float* v,
                int64_t n, const AdamWConfig& config, const float* device_scale,
                cudaStream_t stream);
// A whole unit shard (n elements) in one launch, weight decay per segment
// (config.weight_decay is ignored). segments: device table of num_segments.
void adamw_step_segments(float* param, bf16* param_bf16, const float* grad, float* m,
                         float* v, int64_t n, const OptimSegment* segments,
                         int num_segments, const AdamWConfig& config,
                         const float* device_scale, cudaStream_t stream);
// SGD as Optimizer::step: d = g * grad_scale + wd * p; with momentum
// buf = mu * buf + d, d = buf; p -= lr * d. momentum_buf nullptr when momentum == 0.
void sgd_step(float* param, bf16* param_bf16, const float* grad, float* momentum_buf,
              int64_t n, const SgdConfig& config, const float* device_scale,
              cudaStream_t stream);
void sgd_step_segments(float* param, bf16* param_bf16, const float* grad,
                       float* momentum_buf, int64_t n, const OptimSegment* segments,
                       int num_segments, const SgdConfig& config,
                       const float* device_scale, cudaStream_t stream);

// *scale_out = the clipping factor train.cpp computes on the host, from a device sum
// of squares: norm = sqrt(*sumsq); max_norm > 0 && norm > max_norm ?
// max_norm / (norm + 1e-6) : 1; NaN when the norm is not finite (the update skips).
void clip_scale(float* scale_out, const double* sumsq, double max_norm,
                cudaStream_t stream);

}  // namespace shardlm::cuda
