// moe.hpp — the mixture-of-experts MLP of Qwen3-MoE and Qwen2-MoE on the CPU:
// the router, top-k routing, the experts (SwiGLU each) over the tokens routed
// to them, the weighted combination, their backward, and the load-balancing
// auxiliary loss as transformers computes it (load_balancing_loss_func).
//
// Owns: MoeRouting (which experts each token goes to, with what weight, and
// the tokens grouped by expert: the permutation the experts' GEMMs run over),
// moe_route, moe_experts_forward / backward and the steps they are made of
// (rows gathered, the experts' GEMMs over groups of rows, rows combined: expert
// parallelism moves the rows between the steps), moe_route_backward, the aux
// loss's value and gradient. Templated on T as cpu/ops.hpp (float for the
// backend, double for finite-difference tests), with its conventions: outputs
// first, activation gradients overwritten, parameter gradients accumulated,
// scalar sums in double, nothing allocated, bit-identical for any thread count.
// Must not know: units, shards, MPI, the model's layout beyond the sizes.
//
// Shapes: N tokens, C hidden, E experts, K experts a token, I the experts'
// intermediate size. Expert e's weights: gate (I, C), up (I, C), down (C, I),
// stored expert after expert: w_gate (E, I, C), w_up (E, I, C), w_down (E, C, I).
// The router's weight is (E, C): its logits are linear_forward(x, router).
#pragma once

#include <cstdint>

namespace shardlm::cpu {

// Which experts each token goes to. Rows of the permuted order: expert 0's
// tokens first (in token order), then expert 1's, ...; row r is token
// slot[r] / K's choice slot[r] % K.
template <class T>
struct MoeRouting {
  T* probs = nullptr;         // (N, E) the router's softmax
  int32_t* expert = nullptr;  // (N, K) the chosen experts, highest probability first (ties: lower index)
  T* weight = nullptr;        // (N, K) their weights: the probabilities, renormalised to sum 1 with norm_topk
  int64_t* offsets = nullptr; // (E + 1) expert e's rows are [offsets[e], offsets[e + 1])
  int32_t* slot = nullptr;    // (N K) row -> n K + j
  int32_t* row = nullptr;     // (N K) n K + j -> row
};

// probs, expert, weight, offsets, slot, row from the router's logits (N, E).
// The softmax in double per token; top-k by probability (torch.topk's order;
// equal probabilities: the lower index first).
// Router replay: `forced` (N rows of K experts, row n at forced + n *
// forced_stride; stride 0: K) names the experts instead of the top-k, in that
// order; their weights are still this softmax's probabilities (renormalised
// with norm_topk), so the router keeps its gradient and moe_route_backward
// runs unchanged. A row whose first entry is negative (a position nothing was
// recorded for: padding) takes the top-k. Entries must be distinct experts in
// [0, E) (the caller checks: rows come from a file).
template <class T>
void moe_route(MoeRouting<T>& r, const T* logits, int64_t N, int64_t E, int64_t K, bool norm_topk,
               const int32_t* forced = nullptr, int64_t forced_stride = 0);

// out (N, C) = sum over j of weight[n, j] * expert[n, j](x[n]); saves, per
// permuted row, the gathered input xs (N K, C), gate, up, h = silu(gate) * up
// (N K, I) and the expert's output y (N K, C) for the backward. `rowwise`: the
// GEMMs are linear_rowwise_forward (each row's bits independent of the other
// rows an expert gets: sampling), else linear_forward.
template <class T>
void moe_experts_forward(T* out, T* xs, T* gate, T* up, T* h, T* y, const T* x, const MoeRouting<T>& r,
                         const T* w_gate, const T* w_up, const T* w_down, int64_t N, int64_t C, int64_t I, int64_t E,
                         int64_t K, bool rowwise = false);

// The steps of moe_experts_forward (which is the three in this order):
// xs (N K, C) <- each permuted row's token of x (N, C);
template <class T>
void moe_gather_rows(T* xs, const T* x, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K);
// the experts' GEMMs over `groups` groups of rows, group g = rows
// [offsets[g], offsets[g + 1]) of xs, run by expert g % experts, whose gate,
// up and down weights start `expert_stride` floats after the previous
// expert's (moe_experts_forward: groups = experts = E, stride I C; expert
// parallelism: a group per (source rank, owned expert));
template <class T>
void moe_expert_gemms_forward(T* gate, T* up, T* h, T* y, const T* xs, const int64_t* offsets, int64_t groups,
                              int64_t experts, const T* w_gate, const T* w_up, const T* w_down, int64_t expert_stride,
                              int64_t C, int64_t I, bool rowwise = false);
// out (N, C) <- each token's weighted sum of its K rows of y (N K, C), j = 0 .. K - 1.
template <class T>
void moe_combine(T* out, const T* y, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K);

// From dout (N, C): dx (N, C) overwritten with the experts' part of the input
// gradient; dweight (N, K) overwritten with d loss / d weight[n, j]; the
// experts' weight gradients accumulated. Scratch: dy (N K, C), dh, dgate, dup
// (N K, I), dxs (N K, C).
template <class T>
void moe_experts_backward(T* dx, T* dweight, T* dw_gate, T* dw_up, T* dw_down, T* dy, T* dh, T* dgate, T* dup,
                          T* dxs, const T* dout, const T* xs, const T* gate, const T* up, const T* h, const T* y,
                          const MoeRouting<T>& r, const T* w_gate, const T* w_up, const T* w_down, int64_t N,
                          int64_t C, int64_t I, int64_t E, int64_t K);

// The steps of moe_experts_backward (which is the three in this order):
// dy (N K, C) <- each permuted row's weight times its token's dout, and
// dweight (N, K) <- dout . y of each row;
template <class T>
void moe_rows_backward(T* dy, T* dweight, const T* dout, const T* y, const MoeRouting<T>& r, int64_t N, int64_t C,
                       int64_t K);
// the GEMMs' backward over the groups of moe_expert_gemms_forward: dxs (rows,
// C) overwritten, the experts' weight gradients (at the same stride)
// accumulated group after group; scratch dh, dgate, dup (rows, I);
template <class T>
void moe_expert_gemms_backward(T* dxs, T* dw_gate, T* dw_up, T* dw_down, T* dh, T* dgate, T* dup, const T* dy,
                               const T* xs, const T* gate, const T* up, const T* h, const int64_t* offsets,
                               int64_t groups, int64_t experts, const T* w_gate, const T* w_up, const T* w_down,
                               int64_t expert_stride, int64_t C, int64_t I);
// dx (N, C) <- each token's sum of its K rows of dxs (N K, C), j = 0 .. K - 1.
template <class T>
void moe_scatter_rows(T* dx, const T* dxs, const MoeRouting<T>& r, int64_t N, int64_t C, int64_t K);

// dlogits (N, E) overwritten from dweight (N, K) (through the renormalisation
// with norm_topk, the selection, and the softmax) and dprobs (N, E) (a
// gradient on every probability, the aux loss's; nullptr: none).
template <class T>
void moe_route_backward(T* dlogits, const T* dweight, const T* dprobs, const MoeRouting<T>& r, int64_t N, int64_t E,
                        int64_t K, bool norm_topk);

// The load-balancing loss of transformers' load_balancing_loss_func over R
// routed rows (every layer's tokens together): E * sum over e of
// (counts[e] / R) * (prob_sums[e] / R), counts[e] the times expert e was
// chosen (any of the K places), prob_sums[e] its probabilities summed over
// the rows. moe_aux_counts adds one layer's rows to both (double).
template <class T>
void moe_aux_counts(double* counts, double* prob_sums, const MoeRouting<T>& r, int64_t N, int64_t E, int64_t K);
double moe_aux_loss(const double* counts, const double* prob_sums, int64_t rows, int64_t E);
// dprobs (N, E) of one layer's rows for scale * the aux loss over `rows` rows in all: scale E counts[e] / rows².
template <class T>
void moe_aux_backward(T* dprobs, const double* counts, int64_t rows, int64_t N, int64_t E, double scale);

}  // namespace shardlm::cpu
