// sampling.hpp — drawing the next token of each row of fp32 logits on the GPU,
// with the host Sampler's semantics (infer/sampler.hpp): logits / temperature,
// top-k (the k largest, the lower id on ties), top-p over what top-k left (the
// fewest most probable tokens whose probability sums to at least top_p),
// renormalised; temperature 0 is the argmax (the lower id on ties). The
// uniform of each row comes from the host (uniform_draw of the row's key), so
// a token is a function of (logits, key) on both backends.
//
// Owns: shardlm::cuda::sample_rows. Must not know: the model, the decoder,
// keys, MPI. Async on the caller's stream; no allocation.
//
// One block per row, deterministic (no floating-point atomics). The kept set is
// walked in the Sampler's order (most probable first, the lower id on ties)
// in rounds of up to kSampleRound tokens: each round finds the next tokens of
// that order by a radix select on (logit, id), sorts them in shared memory and
// sums their weights exp((logit - max) / T) in double one after the other, as
// the host does. So top-k and top-p give the host's tokens and sums bit for bit,
// except that the total mass of an untruncated row (and of the vocabulary
// before a top-p without top-k) is a fixed-order tree sum where the host sums in
// sequence: a token can differ only where a draw lands within ~1e-16 of a
// boundary. A top-p without top-k whose nucleus holds N tokens takes
// ceil(N / kSampleRound) rounds (each a few passes over the row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace shardlm::cuda {

inline constexpr int kSampleRound = 2048;

// tokens (n) and sampling_logprobs (n: log p of the token under the distribution
// it was drawn from; 0 when greedy) overwritten; logits (n, V) fp32 row-major;
// uniforms (n) in [0, 1), device memory. temperature >= 0, top_k >= 0 (0: off),
// top_p in (0, 1] (1: off), as sampling_params_error accepts them.
void sample_rows(int32_t* tokens, float* sampling_logprobs, const float* logits, const double* uniforms, int64_t n,
                 int64_t V, double temperature, int64_t top_k, double top_p, cudaStream_t stream);

}  // namespace shardlm::cuda
