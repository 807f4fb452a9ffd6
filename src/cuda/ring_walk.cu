// ring_walk.cu — the context-parallel ring on the CUDA backend (bf16 blocks, fp32
// accumulators): the blocks' layout, packing this rank's own, and the walk of the C
// steps with their exchanges over the group's Comm. Contract: cuda/ring_attention.hpp;
// reference: cpu/ring_attention.cpp (the same steps, in the same order). Each step's
// attention is ring_attention.cu's attention_masked_*: the flash kernels under the
// ring's mask, forward merged by log-sum-exp, gradients added to fp32 accumulators.
#include "cuda/ring_attention.hpp"

#include "cuda/check.hpp"
#include "cuda/ops.hpp"
#include "shardlm/comm.hpp"
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

// This rank's own block, the first the ring attends to, packed into block[0]; returns
// this rank's queries (their tile bounds computed into query_bounds).
AttentionTokens start_ring(const RingBuffers& b, const __nv_bfloat16* k, const __nv_bfloat16* v,
                           const int32_t* token_index, const int32_t* seq_id, int64_t n, int64_t KVD,
                           int64_t capacity, cudaStream_t stream) {
  check_inputs(token_index, seq_id, n, capacity);
  const Block own = block_at(b.block[0], n, KVD);
  CUDA_CHECK(cudaMemcpyAsync(own.k, k, size_t(2 * n * KVD), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(own.v, v, size_t(2 * n * KVD), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(own.index, token_index, size_t(4 * n), cudaMemcpyDeviceToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(own.seq, seq_id, size_t(4 * n), cudaMemcpyDeviceToDevice, stream));
  attention_tile_bounds(own.bounds, own.index, own.seq, n, stream);
  attention_tile_bounds(b.query_bounds, token_index, seq_id, n, stream);
  return {token_index, seq_id, b.query_bounds, n};
}

// The ring's C steps. Step s holds rank (r - s)'s block in block[held] while rank
// (r - s - 1)'s arrives in the other buffer: while_moving(step, block, held) runs
// before the arrival is waited for, once_arrived(block, held) after (the held block
// is intact until the next step's exchange overwrites it). Returns the buffer the
// last step's exchange delivered into: where accumulators that travel with the
// blocks are after their C hops.
template <class WhileMoving, class OnceArrived>
int walk_ring(Comm& group, const RingBuffers& b, int64_t n, int64_t KVD, WhileMoving&& while_moving,
              OnceArrived&& once_arrived) {
  int held = 0;
  for (int step = 0; step < group.size(); ++step) {
    const Block block = block_at(b.block[held], n, KVD);
    CommRequest arriving;
    if (step + 1 < group.size()) arriving = group.ring_exchange(b.block[held], b.block[1 - held], block.bytes);
    while_moving(step, block, held);
    arriving.wait();
    once_arrived(block, held);
    held = 1 - held;
  }
  return held;
}

}  // namespace

int64_t RingBuffers::block_bytes(int64_t N, int64_t KVD) { return block_at(nullptr, N, KVD).bytes; }
int64_t RingBuffers::bounds_bytes(int64_t N) { return int64_t(attention_tile_bounds_bytes(N)); }

void RingAttention::forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                            const __nv_bfloat16* v, const int32_t* token_index, const int32_t* seq_id, int64_t n,
                            int64_t H, int64_t KV, int64_t D) {
  const int64_t KVD = KV * D;
  const AttentionTokens queries = start_ring(b_, k, v, token_index, seq_id, n, KVD, capacity_, stream_);
  // The first block overwrites the accumulators, the others merge into them.
  walk_ring(
      group_, b_, n, KVD,
      [&](int step, const Block& b, int /*held*/) {
        attention_masked_forward(b_.acc, lse, step == 0, q, queries, b.k, b.v, b.tokens(n), H, KV, D, stream_);
      },
      [](const Block&, int) {});
  cast_f32_to_bf16(out, b_.acc, n * H * D, stream_);
}

void RingAttention::backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                             const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                             const __nv_bfloat16* out, const float* lse, const int32_t* token_index,
                             const int32_t* seq_id, float* delta, int64_t n, int64_t H, int64_t KV, int64_t D) {
  const int64_t KVD = KV * D, grad_bytes = RingBuffers::grad_bytes(n, KVD);
  const AttentionTokens queries = start_ring(b_, k, v, token_index, seq_id, n, KVD, capacity_, stream_);
  attention_masked_delta(delta, dout, out, n, H, D, stream_);
  float* dq_acc = b_.acc;  // forward's accumulator is dead by now
  CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, size_t(4 * n * H * D), stream_));
  CUDA_CHECK(cudaMemsetAsync(b_.grad[0], 0, size_t(grad_bytes), stream_));
  // Each block travels with its dk/dv accumulators: the block moves on while its
  // dk/dv are added; the accumulators move on while dq is added. After C hops the
  // accumulators are back with their owner.
  const int last = walk_ring(
      group_, b_, n, KVD,
      [&](int /*step*/, const Block& b, int held) {
        float* grad = b_.grad[held];
        attention_masked_backward(nullptr, grad, grad + n * KVD, dout, q, lse, delta, queries, b.k, b.v,
                                  b.tokens(n), H, KV, D, stream_);
      },
      [&](const Block& b, int held) {
        CommRequest grads = group_.ring_exchange(b_.grad[held], b_.grad[1 - held], grad_bytes);
        attention_masked_backward(dq_acc, nullptr, nullptr, dout, q, lse, delta, queries, b.k, b.v, b.tokens(n),
                                  H, KV, D, stream_);
        grads.wait();
      });
  cast_f32_to_bf16(dq, dq_acc, n * H * D, stream_);
  cast_f32_to_bf16(dk, b_.grad[last], n * KVD, stream_);
  cast_f32_to_bf16(dv, b_.grad[last] + n * KVD, n * KVD, stream_);
}

}  // namespace shardlm::cuda
