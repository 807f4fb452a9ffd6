// moe.hpp — a layer of experts on the GPU: the router's top-k, the rows of
// (token, choice) grouped by expert, the experts' SwiGLU as grouped GEMMs, the
// weighted sum back into the stream, and the backward of each; the
// load-balancing loss's counts; under expert parallelism the rows' trips to
// their experts' ranks and back. Mirrors cpu/moe.hpp (same routing, same
// permutation, same order of each token's K terms) and is checked against it
// through the backend (tests/gpu/test_backend.cpp: the transformers fixtures
// and the CPU's losses).
//
// Owns: shardlm::cuda::{GroupedGemm, MoeDims, MoeLayerActs, MoeScratch,
// MoeExpertParallel, MoeWeights, MoeGrads, moe_forward, moe_backward,
// moe_aux_add}. Knows the Comm interface; must not know MPI, NCCL, the deck. Included only by .cu files.
//
// The permutation: row r of the grouped buffers is the (token, choice) slot
// slot[r] = token * K + choice; the rows of expert e are [offsets[e],
// offsets[e + 1]), in token order (a stable grouping, as the CPU's). The
// grouped GEMMs take their sizes on the host, so a forward copies the offsets
// to the host once per layer (one synchronisation); the backward reuses them.
//
// Precision: router logits and probabilities fp32, the experts' operands bf16
// with fp32 accumulation; each token's K outputs (and the shared expert's) are
// summed in fp32 and added to the stream once. The experts' weight gradients
// come from the grouped GEMM in bf16 (cuBLAS's grouped GEMM writes C in the
// operands' type where this cuBLAS takes no fp32 C for bf16 operands) and are
// accumulated into the fp32 gradients; where it takes fp32 C, straight into
// them with beta 1. Deterministic: no atomics; every sum in a fixed order.
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <vector>

#include "cpu/expert_parallel.hpp"
#include "cuda/gemm.hpp"
#include "cuda/ops.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/model.hpp"

namespace shardlm::cuda {

// cuBLAS's grouped GEMM (one launch for many products of different sizes),
// with gemm.hpp's row-major semantics. Each product i: C_i (M_i, N_i) = op(A_i)
// op(B_i) + beta C_i, bf16 operands and C, fp32 accumulation; products with a
// zero size are left out (a zero K leaves C_i untouched: the caller zeroes it
// where it must).
class GroupedGemm {
 public:
  struct Product {
    int64_t M, N, K;
    const bf16* A;
    int64_t lda;
    const bf16* B;
    int64_t ldb;
    void* C;  // bf16, or fp32 with GemmOut::F32
    int64_t ldc;
  };
  // pointers: device memory for 3 * max_products pointers (the operand arrays).
  GroupedGemm(cudaStream_t stream, void** pointers, int64_t max_products);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;
  // out F32: C in fp32 (weight gradients accumulated with beta 1), where this
  // cuBLAS takes that mix of types; false (nothing run) where it does not, and
  // from then on (the caller writes bf16 and adds it).
  bool run(bool trans_a, bool trans_b, const std::vector<Product>& products, float beta,
           GemmOut out = GemmOut::BF16);

 private:
  cudaStream_t stream_;
  void** pointers_;
  int64_t max_products_;
  cublasHandle_t handle_ = nullptr;
  std::vector<const void*> host_pointers_;
  bool f32_out_ = true;  // fp32 C still to be tried, or taken
};

struct MoeDims {
  int64_t N, C, E, K, Im, Is;  // tokens, width, experts, experts a token, their width, the shared expert's (0: none)
  bool norm_topk;
  int64_t rows() const { return N * K; }
};

// What a layer of experts keeps from its forward for its backward (the
// activations of one layer, or of the layer being recomputed).
struct MoeLayerActs {
  float* probs;       // (N, E) the router's softmax
  int32_t* expert;    // (N, K) the chosen experts, most probable first
  float* weight;      // (N, K) their weights (renormalised with norm_topk)
  int32_t* slot;      // (R) row -> token * K + choice
  int32_t* row;       // (R) token * K + choice -> row
  int64_t* offsets;   // (E + 1) expert e's rows start at offsets[e]
  bf16* gu;           // (R, 2 Im) gate | up; in backward dgate | dup (P R rows under expert parallelism)
  bf16* h;            // (R, Im) silu(gate) * up (P R rows under expert parallelism)
  bf16* y;            // (R, C) each row's expert output
  bf16* shared_gu;    // (N, 2 Is) the shared expert's gate | up (Is > 0)
  bf16* shared_h;     // (N, Is)
  bf16* shared_out;   // (N, C) its output before its gate
  float* shared_logit;  // (N) its gate's logit
  std::vector<int64_t>* host_offsets;  // (E + 1) the offsets on the host
  std::vector<int32_t>* host_ep_rows;  // expert parallelism: (P, E) every rank's rows per expert, from the forward
};

// Expert parallelism (model.expert_parallel = P > 1): this rank runs its own
// Ep = E / P experts (MoeWeights' gate, up and down, expert after expert) over
// every rank's rows of them. A layer's rows, grouped by expert, go to their
// experts' owners and the outputs come back (Comm::all_to_all_v_device over
// `group`); the backward sends the rows' gradients, gets the inputs' gradients
// back, and sends the inputs again for the weight gradients. An owner keeps
// what it receives in source-rank order and runs its grouped GEMMs over
// (source, expert) groups, so no row is reordered: cpu/expert_parallel.hpp's
// plan, in bytes of bf16 rows. The weight gradients run one grouped launch per
// source rank, in rank order (no two products of a launch add into one
// expert's fp32 gradient), so the sums keep one order run after run.
struct MoeExpertParallel {
  Comm* group = nullptr;     // nullptr: every expert on this rank
  bf16* owned = nullptr;     // (P R, C) workspace: the rows received, then their outputs or gradients
  cpu::ExpertExchange plan;  // the layer's exchange, on the host
};

// Workspace of a layer of experts (shared by every layer).
struct MoeScratch {
  float* logits;      // (N, E) the router's logits
  bf16* rows;         // (R, C) the gathered inputs; in backward d y, then d inputs
  bf16* dh;           // (R, Im + ...) d h of the experts (P R rows under expert parallelism); (N, Is) of the shared expert after them
  float* dweight;     // (R) d loss / d weight of each row
  bf16* dlogits;      // (N, E) d loss / d router logits
  bf16* wgrad;        // (E, max(Im C)) one kind of the experts' weight gradients in bf16
  bf16* d_shared;     // (N, C) d shared_out (Is > 0)
  bf16* d_shared_logit;  // (N) (Is > 0)
  double* aux_counts;    // (E) the micro-batch's rows per expert over its layers of experts
  double* aux_prob_sums; // (E) and the router probabilities' sums
};

// A layer's weights as the kernels read them (gathered bf16). The experts'
// gate, up and down start `stride` elements after the previous expert's
// (expert_stride: Im C in a layer unit, 3 Im C in an experts unit).
struct MoeWeights {
  const bf16 *router, *gate, *up, *down, *s_gate_up, *s_down, *s_weight;
  int64_t stride;
};
struct MoeGrads {
  float *router, *gate, *up, *down, *s_gate_up, *s_down, *s_weight;
  int64_t stride;
};
// A layer of experts' views in its unit (the shared expert's gate and up are
// adjacent: one (2 Is, C) matrix); `experts`: the routed experts' (the layer
// unit's own, or under expert parallelism this rank's experts unit's).
inline MoeWeights moe_weights(const LayerWeights<const bf16>& w, const LayerWeights<const bf16>& experts,
                              int64_t stride) {
  return {w.router, experts.e_gate, experts.e_up, experts.e_down, w.s_gate, w.s_down, w.s_weight, stride};
}
inline MoeGrads moe_grads(const LayerWeights<float>& g, const LayerWeights<float>& experts, int64_t stride) {
  return {g.router, experts.e_gate, experts.e_up, experts.e_down, g.s_gate, g.s_down, g.s_weight, stride};
}

// Forward of a layer of experts on xn (N, C): the routing into `a` (forced:
// router replay's experts, (N) rows of `forced_stride` with K entries each, a
// row starting with -1 routed by the router; nullptr: none), the experts, and
// out = residual + sum_j weight_j y_j (+ sigmoid(z) shared) in the stream's
// type S (bf16 or float). out may be residual.
template <class S>
void moe_forward(S* out, const S* residual, const bf16* xn, const MoeWeights& w, MoeLayerActs& a,
                 const MoeScratch& s, const MoeDims& d, const int32_t* forced, int64_t forced_stride,
                 MoeExpertParallel& ep, Gemm& gemm, GroupedGemm& grouped, cudaStream_t stream);

// The load-balancing loss's counts of a layer's routing: s.aux_counts[e] += its
// rows of expert e, s.aux_prob_sums[e] += sum over tokens of probs[., e].
void moe_aux_add(const MoeLayerActs& a, const MoeScratch& s, const MoeDims& d, cudaStream_t stream);

// Backward: d_xn (N, C) overwritten with the gradient at xn from dout (N, C)
// (the stream's gradient at the layer's output, bf16); the weights'
// gradients accumulated. aux_scale: d loss / d aux loss (0: no aux loss);
// aux_rows: the rows the counts were taken over.
void moe_backward(bf16* d_xn, const bf16* dout, const bf16* xn, const MoeWeights& w, const MoeGrads& g,
                  MoeLayerActs& a, const MoeScratch& s, const MoeDims& d, double aux_scale, int64_t aux_rows,
                  MoeExpertParallel& ep, Gemm& gemm, GroupedGemm& grouped, void* scratch, size_t scratch_bytes,
                  cudaStream_t stream);

}  // namespace shardlm::cuda
