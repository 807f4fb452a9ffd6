// ops.hpp — CPU reference kernels (forward + backward) for the transformer ops.
//
// Owns: shardlm::cpu::{gemm, linear, embedding, rmsnorm, rope, swiglu, attention,
// cross_entropy, add/accumulate/scale/copy/sum_squares}, templated on T (float for the
// CPU backend, double for finite-difference tests). These are the reference the
// CUDA kernels are checked against.
// Must not know: MPI, the model (units, parameter names, shards), files, devices.
// It reads only RopeScaling from model_config.hpp.
//
// Conventions (every function):
//   - Row-major, tokens-major: activations are (N, C), N = tokens in the packed
//     micro-batch; q is (N, H, D), k and v are (N, KV, D).
//   - Outputs first, then inputs, then sizes (llm.c order).
//   - Activation gradients (dinp, dx, dq, dk, dv, dgate, dup) are OVERWRITTEN.
//     Parameter gradients (dweight, dbias, dtable) are ACCUMULATED (+=), because
//     they sum over micro-batches; the caller zeroes them once per step.
//   - Deterministic: the result is bit-identical for any OpenMP thread count.
//     Every reduction over tokens runs in a fixed order inside one task, or inside
//     a BLAS GEMM (OpenBLAS does not split K across threads).
//   - Reductions of scalars over many terms (mean of squares, softmax sums,
//     losses, norms) accumulate in double; vectors stay in T.
//   - Kernels allocate nothing: they work in the buffers they are given (only the
//     set-up function rope_inv_freq returns a vector).
//   - Token ids, targets and positions are int32.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/kv_pages.hpp"
#include "shardlm/model_config.hpp"

namespace shardlm::cpu {

// ---------------------------------------------------------------- GEMM / linear

// C(M, N) = alpha * op(A)(M, K) * op(B)(K, N) + beta * C, row-major, through
// cblas_sgemm / cblas_dgemm. op(A) = A^T when trans_a (then A is stored (K, M)).
// beta = 0 overwrites C (NaNs in C are not propagated).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// torch.nn.Linear: out = inp W^T + bias.
//   out (N, OC) overwritten; inp (N, IC); weight (OC, IC); bias (OC) or nullptr.
template <class T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias,
                    int64_t N, int64_t IC, int64_t OC);

// linear_forward with each output element one dot product in a fixed order
// (8 strided partial sums, then a fixed tree), no BLAS: a row's result does not
// depend on N, on the other rows or on the thread count. BLAS picks kernels by
// the matrix's shape, so a row of linear_forward changes in its last bits with
// N; sampling's decode steps use this one so that a sequence's tokens do not
// depend on which sequences shared its batch. Reads each weight row once for
// all N rows (decode is weight-bandwidth bound); not for training.
template <class T>
void linear_rowwise_forward(T* out, const T* inp, const T* weight, const T* bias,
                            int64_t N, int64_t IC, int64_t OC);

//   dinp (N, IC) overwritten (nullptr: skip); dweight (OC, IC) +=;
//   dbias (OC) += (nullptr: no bias); dout (N, OC).
template <class T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int64_t N, int64_t IC, int64_t OC);

// dbias (OC) += the sum over the N rows of dout (N, OC), in double (linear_backward's bias part).
template <class T>
void bias_backward(T* dbias, const T* dout, int64_t N, int64_t OC);

// ---------------------------------------------------------------- embedding

// out[t] = table[ids[t]].  out (N, C) overwritten; ids (N) in [0, V); table (V, C).
// Throws shardlm::Error on an id out of range.
template <class T>
void embedding_forward(T* out, const int32_t* ids, const T* table,
                       int64_t N, int64_t V, int64_t C);

// dtable[ids[t]] += dout[t], tokens added in index order (parallel over columns).
//   dtable (V, C) +=; dout (N, C).
template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids,
                        int64_t N, int64_t V, int64_t C);

// ---------------------------------------------------------------- RMSNorm

// HF LlamaRMSNorm: out = weight * (inp * rstd), rstd = 1/sqrt(mean(inp^2) + eps).
// Rows are independent, so Qwen3's per-head q/k norm is rows = N*heads, C = head_dim.
//   out (rows, C) overwritten; rstd (rows) saved for backward; inp (rows, C);
//   weight (C). The mean of squares accumulates in double, then rstd is in T.
//   out may alias inp (in-place normalisation).
template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight,
                     int64_t rows, int64_t C, double eps);

//   dinp (rows, C) overwritten (may not alias dout); dweight (C) +=.
template <class T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp,
                      const T* weight, const T* rstd, int64_t rows, int64_t C);

// ---------------------------------------------------------------- RoPE

// inv_freq (head_dim / 2), in double, exactly as HF _compute_default_rope_parameters
// (1 / theta^(2i/D)) followed, for scaling.type == "llama3", by
// _compute_llama3_parameters. scaling.type must be "none" or "llama3".
std::vector<double> rope_inv_freq(int64_t head_dim, double rope_theta,
                                  const RopeScaling& scaling);

// In-place rotation of x (N, heads, D) by position_ids (N), HF rotate_half
// convention: pairs (i, i + D/2), angle = pos * inv_freq[i]; inv_freq (D/2).
//   out[i]       = x[i] * cos - x[i + D/2] * sin
//   out[i + D/2] = x[i + D/2] * cos + x[i] * sin
// Like HF: inv_freq is rounded to T, the angle is computed as T(pos) * inv_freq in
// T, and cos/sin in T. For T = float that is HF's float32 angle (which loses
// precision at large positions, exactly as HF does); for T = double it is exact.
template <class T>
void rope_forward(T* x, const int32_t* position_ids, const double* inv_freq,
                  int64_t N, int64_t heads, int64_t D);

// In-place inverse rotation (the transpose): dx (N, heads, D) from dout, same layout.
template <class T>
void rope_backward(T* dx, const int32_t* position_ids, const double* inv_freq,
                   int64_t N, int64_t heads, int64_t D);

// ---------------------------------------------------------------- SwiGLU

// h = silu(gate) * up, elementwise. h, gate, up (N, I); n = N * I.
template <class T>
void swiglu_forward(T* h, const T* gate, const T* up, int64_t n);

//   dgate, dup (N, I) overwritten; dh (N, I).
template <class T>
void swiglu_backward(T* dgate, T* dup, const T* dh, const T* gate, const T* up,
                     int64_t n);

// ---------------------------------------------------------------- attention

// Causal attention over packed documents, GQA, scale 1/sqrt(D).
// A document is a maximal run of equal seq_id (N); token i attends to token j iff
// j <= i and j is in i's run. Adjacent documents, including the last of one packed
// row and the first of the next, must therefore have different seq_id (a global
// document index does it). Query head h reads kv head h / (H / KV).
//   out (N, H, D) overwritten; lse (N, H) logsumexp of the scaled scores, saved for
//   backward; q (N, H, D); k, v (N, KV, D).
// Memory O(N*H): probabilities are recomputed, never stored.
template <class T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const int32_t* seq_id, int64_t N, int64_t H, int64_t KV,
                       int64_t D);

// FlashAttention-2 style backward from q, k, v, out, lse:
// p = exp(s - lse), delta_i = sum(dout_i * out_i), ds = p * (dout_i . v_j - delta_i).
//   dq (N, H, D), dk, dv (N, KV, D) overwritten; dout (N, H, D).
// Pass 1 owns dq rows (parallel over queries); pass 2 owns dk/dv rows (parallel
// over keys, queries and the group's heads summed in order), so no thread races.
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                        const T* v, const T* out, const T* lse,
                        const int32_t* seq_id, int64_t N, int64_t H, int64_t KV,
                        int64_t D);

// Decode with a paged KV cache: one new token per sequence attends to its
// cached keys and values, positions [0, len[b]) (its own key and value already
// written at len[b] - 1), read through the block table (shardlm/kv_pages.hpp).
// Term for term the arithmetic attention_forward does for the last token of a
// document of len[b] tokens (same dot products, same online max and double
// sum, same second pass), so a decoded token sees what the full forward
// computes at that position, wherever its blocks lie. Query head h reads kv
// head h / (H / KV); scale 1/sqrt(D).
//   out (B, H, D) overwritten; q (B, H, D); k_cache, v_cache (blocks,
//   block_size, KV, D); seq (B): the table row query b reads; len (B) in
//   [1, pages.capacity()].
template <class T>
void attention_decode_forward(T* out, const T* q, const T* k_cache, const T* v_cache, const KvPages& pages,
                              const int32_t* seq, const int32_t* len, int64_t B, int64_t H, int64_t KV, int64_t D);

// ---------------------------------------------------------------- cross-entropy

// Fused forward + backward on a chunk of logits (n, V), in place.
// Returns sum over rows of weight * (logsumexp(logits) - logits[target]) in double,
// and overwrites logits with dlogits = weight * (softmax - onehot(target)) *
// grad_scale. A row with target < 0 or weight == 0 adds no loss and gets a zero
// gradient. weights (n) or nullptr (= 1); targets (n) in [-inf, V) (throws if >= V).
template <class T>
double cross_entropy_forward_backward(T* logits, const int32_t* targets,
                                      const T* weights, T grad_scale, int64_t n,
                                      int64_t V);

// ---------------------------------------------------------------- helpers

// out = a + b (out may alias a or b). Residual: add(x, x, branch, n).
template <class T>
void add(T* out, const T* a, const T* b, int64_t n);

// y += x.
template <class T>
void accumulate(T* y, const T* x, int64_t n);

// x *= alpha.
template <class T>
void scale(T* x, T alpha, int64_t n);

// dst = src (n elements, not overlapping), on every thread: one thread's memcpy
// streams ~10 GB/s, a fraction of the host's bandwidth (Muon's exchange copies).
template <class T>
void copy(T* dst, const T* src, int64_t n);

// sum(x^2) in double, summed in fixed blocks then in block order: the same bits at
// any thread count (for the global gradient norm).
template <class T>
double sum_squares(const T* x, int64_t n);

}  // namespace shardlm::cpu
