// token_logprobs.hpp — log_softmax(logits / temperature)[token] of each row of
// fp32 logits on the GPU: what the CUDA decoder reports as a sampled token's
// model and tempered logprobs, so the host never runs a softmax over the vocabulary.
//
// Owns: shardlm::cuda::token_logprobs. Its CPU counterpart is
// cpu::token_logprobs (cpu/rl_loss.hpp, the trainer's function), which
// tests/gpu/test_decode.cpp compares it with. Must not know: the model, the
// sampler, MPI. Async on the caller's stream; no allocation.
//
// One block per row: the row's max, then sum exp((x - max) / T) with fp32
// terms summed in double per thread and the threads' sums added in a fixed
// order (deterministic, no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace shardlm::cuda {

// out (n) fp32 overwritten; logits (n, V) fp32 with row stride V; tokens (n)
// int32 in [0, V) (a row with a token outside gets NaN); temperature > 0.
void token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature, int64_t n,
                    int64_t V, cudaStream_t stream);

}  // namespace shardlm::cuda
