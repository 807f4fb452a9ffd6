// ring_attention.cu — the context-parallel ring on the CUDA backend (bf16 blocks,
// fp32 accumulators). Contract: cuda/ring_attention.hpp; reference:
// cpu/ring_attention.cpp (the same steps, in the same order).
#include "cuda/ring_attention.hpp"

#include "cuda/attention.hpp"
#include "cuda/check.hpp"
#include "cuda/ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {
namespace {

int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// One rank's block inside a RingBuffers::block buffer, laid out for the n tokens
// of the current micro-batch (every rank of the group holds the same n):
// k (n, KV, D) | v (n, KV, D) bf16 | token_index (n) | seq_id (n) | tile bounds.
struct Block {
  __nv_bfloat16* k;
  __nv_bfloat16* v;
  int32_t* index;
  int32_t* seq;
  int32_t* bounds;
  int64_t bytes;  // what travels
  AttentionTokens tokens(int64_t n) const { return {index, seq, bounds, n}; }
};
Block block_at(void* base, int64_t n, int64_t KVD) {
  char* p = static_cast<char*>(base);
  const int64_t kv = aligned(2 * n * KVD), ids = aligned(4 * n);
  Block b;
  b.k = reinterpret_cast<__nv_bfloat16*>(p);
  b.v = reinterpret_cast<__nv_bfloat16*>(p + kv);
  b.index = reinterpret_cast<int32_t*>(p + 2 * kv);
  b.seq = reinterpret_cast<int32_t*>(p + 2 * kv + ids);
  b.bounds = reinterpret_cast<int32_t*>(p + 2 * kv + 2 * ids);
  b.bytes = 2 * kv + 2 * ids + int64_t(attention_tile_bounds_bytes(n));
  return b;
}

void check_inputs(const int32_t* token_index, const int32_t* seq_id, int64_t n, int64_t capacity) {
  SHARDLM_CHECK(token_index && seq_id, "internal: ring attention without token indices or sequence ids");
  SHARDLM_CHECK(n <= capacity, "internal: ring attention over %lld tokens, its buffers hold %lld", (long long)n,
                (long long)capacity);
}

}  // namespace

int64_t RingBuffers::block_bytes(int64_t N, int64_t KVD) { return block_at(nullptr, N, KVD).bytes; }
int64_t RingBuffers::bounds_bytes(int64_t N) { return int64_t(attention_tile_bounds_bytes(N)); }

// This rank's own block, the first the ring attends to.
static Block pack_own(void* base, const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* token_index,
                      const int32_t* seq_id, int64_t n, int64_t KVD, cudaStream_t stream) {
  const Block b = block_at(base, n, KVD);
  CUDA_CHECK(cudaMemcpyAsync(b.k, k, size_t(2 * n * KVD), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(b.v, v, size_t(2 * n * KVD), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(b.index, token_index, size_t(4 * n), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(b.seq, seq_id, size_t(4 * n), cudaMemcpyDeviceToDevice, stream));
  attention_tile_bounds(b.bounds, b.index, b.seq, n, stream);
  return b;
}

void RingAttention::forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                            const __nv_bfloat16* v, const int32_t* token_index, const int32_t* seq_id, int64_t n,
                            int64_t H, int64_t KV, int64_t D) {
  check_inputs(token_index, seq_id, n, capacity_);
  const int64_t KVD = KV * D;
  pack_own(b_.block[0], k, v, token_index, seq_id, n, KVD, stream_);
  attention_tile_bounds(b_.query_bounds, token_index, seq_id, n, stream_);
  const AttentionTokens queries{token_index, seq_id, b_.query_bounds, n};
  // Step s attends to rank (r - s)'s block while rank (r - s - 1)'s arrives; the
  // first block overwrites the accumulators, the others merge into them.
  int held = 0;
  for (int step = 0; step < group_.size(); ++step) {
    const Block b = block_at(b_.block[held], n, KVD);
    CommRequest arriving;
    if (step + 1 < group_.size()) arriving = group_.ring_exchange(b_.block[held], b_.block[1 - held], b.bytes);
    attention_masked_forward(b_.acc, lse, step == 0, q, queries, b.k, b.v, b.tokens(n), H, KV, D, stream_);
    arriving.wait();
    held = 1 - held;
  }
  cast_f32_to_bf16(out, b_.acc, n * H * D, stream_);
}

void RingAttention::backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                             const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                             const __nv_bfloat16* out, const float* lse, const int32_t* token_index,
                             const int32_t* seq_id, float* delta, int64_t n, int64_t H, int64_t KV, int64_t D) {
  check_inputs(token_index, seq_id, n, capacity_);
  const int64_t KVD = KV * D, grad_bytes = RingBuffers::grad_bytes(n, KVD);
  attention_masked_delta(delta, dout, out, n, H, D, stream_);
  float* dq_acc = b_.acc;  // forward's accumulator is dead by now
  CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, size_t(4 * n * H * D), stream_));
  CUDA_CHECK(cudaMemsetAsync(b_.grad[0], 0, size_t(grad_bytes), stream_));
  pack_own(b_.block[0], k, v, token_index, seq_id, n, KVD, stream_);
  attention_tile_bounds(b_.query_bounds, token_index, seq_id, n, stream_);
  const AttentionTokens queries{token_index, seq_id, b_.query_bounds, n};
  // Step s: rank (r - s)'s block and its dk/dv accumulators. The block moves on
  // while its dk/dv are added; the accumulators move on while dq is added. After
  // C hops the accumulators are back with their owner.
  int held = 0;
  for (int step = 0; step < group_.size(); ++step) {
    const Block b = block_at(b_.block[held], n, KVD);
    CommRequest arriving;
    if (step + 1 < group_.size()) arriving = group_.ring_exchange(b_.block[held], b_.block[1 - held], b.bytes);
    float* grad = b_.grad[held];
    attention_masked_backward(nullptr, grad, grad + n * KVD, dout, q, lse, delta, queries, b.k, b.v, b.tokens(n),
                              H, KV, D, stream_);
    arriving.wait();
    CommRequest grads = group_.ring_exchange(grad, b_.grad[1 - held], grad_bytes);
    attention_masked_backward(dq_acc, nullptr, nullptr, dout, q, lse, delta, queries, b.k, b.v, b.tokens(n), H, KV,
                              D, stream_);
    grads.wait();
    held = 1 - held;
  }
  cast_f32_to_bf16(dq, dq_acc, n * H * D, stream_);
  cast_f32_to_bf16(dk, b_.grad[held], n * KVD, stream_);
  cast_f32_to_bf16(dv, b_.grad[held] + n * KVD, n * KVD, stream_);
}

}  // namespace shardlm::cuda
