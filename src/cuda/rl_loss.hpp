// rl_loss.hpp — the RL policy loss on the GPU: fused forward + backward on a
// chunk of bf16 lm-head logits, in place (the RL counterpart of
// cuda::cross_entropy_forward_backward), and its statistics.
//
// Owns: shardlm::cuda::{rl_loss_forward_backward, rl_loss_row_stats_bytes,
// rl_token_logprobs}. The
// formula, the mask and the statistics are exactly those of src/cpu/rl_loss.hpp
// (cpu::rl_loss_forward_backward is the reference; tests/gpu/test_cuda_rl_loss.cu
// checks this kernel against it; docs/kernels.md gives tolerance and determinism).
// Must not know: MPI, NCCL, the model, rollouts (per-token arrays come expanded),
// the deck, files. Included only by .cu files and the GPU tests (CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ops.hpp"
#include "cpu/rl_loss.hpp"

namespace shardlm::cuda {

// Fields of the per-row and summed statistics, in cpu::RlChunkStats::to_array order:
// loss, loss_tokens, masked_high, masked_low, entropy, mismatch_kl, advantage,
// is_ratio, is_capped, is_masked.
inline constexpr int kRlStatsFields = cpu::RlChunkStats::kFields;

// Bytes of row_stats for a chunk of n rows: (kRlStatsFields, n) doubles.
size_t rl_loss_row_stats_bytes(int64_t n);

// Fused forward + backward on a chunk of logits (n, V), in place, one row per
// thread block cluster (the row stays in the cluster's shared memory: HBM sees one
// read and one write of the logits), all math in fp32 with double sums as the CPU.
//   logits (n, V) bf16 in, dlogits = grad_scale * dloss/dlogits out (bf16);
//   row_stats (kRlStatsFields, n) double, overwritten: each row's contribution to
//     every field (0 on rows without loss), field-major (row_stats[f * n + row]);
//   stats (kRlStatsFields) double on the device: the sums over the chunk's rows,
//     overwritten, or added to when accumulate (several chunks of a micro-batch
//     sum on the device; RlChunkStats::from_array on the host reads them);
//   targets (n) int32, < 0 = no target; weights (n) fp32 or nullptr (= 1), <= 0 =
//     no loss; inputs: the per-token RL inputs (shardlm/loss.hpp: advantages,
//     inference and sampling logprobs, temperatures, the sample sums the
//     objective needs), read on loss rows only. All device pointers.
// The per-row scalars are cpu::rl_row_terms (cpu/rl_terms.hpp), the CPU's own.
// A loss row whose target is >= V or whose temperature is not positive and finite
// (the CPU throws; the data loader validates both on the host) gets a zero gradient
// and NaN loss, entropy and mismatch KL, so the run's NaN check reports it.
// Deterministic: every sum runs in a fixed order that depends only on n and V
// (threads, then a fixed block tree, then cluster ranks in rank order; the chunk
// sums in one block per field in a fixed order). No atomics. V <= 409600.
void rl_loss_forward_backward(bf16* logits, double* row_stats, double* stats, const int32_t* targets,
                              const float* weights, const RlTokenInputs& inputs, const cpu::RlLossParams& params,
                              float grad_scale, int64_t n, int64_t V, bool accumulate, cudaStream_t stream);

// Forward only: out (n) fp32 = log_softmax(logits / tau)[target] of each row of
// bf16 logits (n, V) with a target, 0 for a row without (target < 0): the logp
// the loss kernel forms, up to summation order (one block per row). A row with
// a target >= V or a temperature that is not positive and finite gets NaN.
// Device pointers; targets, temperatures (n). Deterministic.
void rl_token_logprobs(float* out, const bf16* logits, const int32_t* targets, const float* temperatures, int64_t n,
                       int64_t V, cudaStream_t stream);

}  // namespace shardlm::cuda
