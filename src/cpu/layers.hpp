// layers.hpp — one decoder layer and the lm-head loss on the CPU backend,
// composed from the kernels in cpu/ops.hpp.
//
// Owns: the saved-activation layout of a layer (LayerActs) and the rows it and the
// backward and head scratch add to the CPU backend's buffer table, layer forward and
// backward on gathered weights, the chunked lm-head + cross-entropy, and the three
// hooks a layer calls instead of its local kernels (Attention: the ring; Linear:
// model.fp8's projections; Experts: expert parallelism's exchange). Knows
// nothing about units, shards or MPI: the engine hands it weight and gradient
// views into gathered buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "shardlm/memory.hpp"
#include "shardlm/model.hpp"
#include "cpu/moe.hpp"
#include "cpu/ops.hpp"
#include "cpu/rl_loss.hpp"

namespace shardlm::cpu {

struct TokenInputs;

// Who computes a layer's attention when it is not the local kernel
// (attention_forward / attention_backward over this rank's N tokens): the
// context-parallel ring (cpu/ring_attention.hpp). Same arguments, same
// conventions as those two kernels.
class Attention {
 public:
  virtual ~Attention() = default;
  virtual void forward(float* out, float* lse, const float* q, const float* k, const float* v, const TokenInputs& in,
                       int64_t H, int64_t KV, int64_t D) = 0;
  virtual void backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const TokenInputs& in, int64_t H,
                        int64_t KV, int64_t D) = 0;
};

// Who multiplies a layer's projections (q, k, v, o, gate, up, down) when it is
// not the fp32 GEMM (linear_forward / linear_backward): model.fp8's emulation
// (cpu/fp8_linear.hpp). Same arguments, same conventions as those two kernels.
class Linear {
 public:
  virtual ~Linear() = default;
  virtual void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t IC,
                       int64_t OC) = 0;
  virtual void backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, int64_t N, int64_t IC, int64_t OC) = 0;
};

struct LayerActs;
struct LayerGradScratch;

// Who runs a layer's routed experts when this rank holds only some of them:
// expert parallelism's exchange (cpu/expert_parallel.hpp). The layer has routed
// its N tokens (acts' routing, from xn2). forward: out (N, C) overwritten with
// the routed experts' weighted sum (moe_experts_forward's), acts' expert rows
// filled. backward: from dout (N, C), dx (N, C) overwritten with the experts'
// part of the input gradient and dweight (N, K) with d loss / d weight
// (moe_experts_backward's), the owned experts' gradients accumulated into g's.
// w's and g's e_gate, e_up, e_down are this rank's experts.
class Experts {
 public:
  virtual ~Experts() = default;
  virtual void forward(float* out, LayerActs& acts, const LayerWeights<const float>& w, int64_t N) = 0;
  virtual void backward(float* dx, float* dweight, const float* dout, const LayerActs& acts,
                        const LayerWeights<const float>& w, const LayerWeights<float>& g, LayerGradScratch& s,
                        int64_t N) = 0;
};

// Token-level inputs of a micro-batch, shared by every layer. N = rows * seq_len
// (this rank's share of it under context parallelism).
struct TokenInputs {
  int64_t N = 0;
  const int32_t* positions = nullptr;  // (N)
  const int32_t* seq_ids = nullptr;    // (N) attention joins equal, adjacent ids only
  const double* inv_freq = nullptr;    // (head_dim / 2)
  // Context parallelism: each token's index in the group's whole micro-batch
  // (the causal order across ranks), and the ring that attends over it.
  const int32_t* token_index = nullptr;  // (N) or nullptr
  Attention* attention = nullptr;        // nullptr: the local kernels
  Linear* linear = nullptr;              // model.fp8's projections; nullptr: the fp32 GEMMs
  Experts* experts = nullptr;            // expert parallelism's exchange; nullptr: every expert here
};

// One buffer of the CPU backend's table: the Buffer it fills, its fp32 element
// count, and the row of the memory plan (Mem::Activations or Mem::Workspace) it is
// counted in. The backend allocates from its table (allocate_rows) and sums the same
// table for the plan (rows_bytes), so the plan cannot drift from what is allocated.
struct BufferRow {
  const char* name;
  Buffer<float>* slot;
  int64_t numel;
  Mem category;
  // An index buffer instead (the experts' routing): numel elements of its type.
  Buffer<int32_t>* index_slot = nullptr;
  Buffer<int64_t>* offset_slot = nullptr;
  int64_t bytes() const { return numel * (offset_slot ? 8 : 4); }
};
void allocate_rows(const std::vector<BufferRow>& rows);
int64_t rows_bytes(const std::vector<BufferRow>& rows, Mem category);

// What a layer's backward needs from its forward. With activation checkpointing
// the engine keeps one LayerActs and recomputes it per layer in backward.
struct LayerActs {
  Buffer<float> rstd1;   // (N)
  Buffer<float> xn1;     // (N, C) input_layernorm output
  Buffer<float> q_raw;   // (N, H, D) q before q_norm (qk_norm only)
  Buffer<float> k_raw;   // (N, KV, D)
  Buffer<float> q_rstd;  // (N * H)
  Buffer<float> k_rstd;  // (N * KV)
  Buffer<float> q;       // (N, H, D) after norm and RoPE
  Buffer<float> k;       // (N, KV, D)
  Buffer<float> v;       // (N, KV, D)
  Buffer<float> att;     // (N, H, D)
  Buffer<float> lse;     // (N, H)
  Buffer<float> x_mid;   // (N, C) residual after attention
  Buffer<float> rstd2;   // (N)
  Buffer<float> xn2;     // (N, C)
  Buffer<float> gate;    // (N, I) (a layer of experts: the shared expert's, (N, I shared))
  Buffer<float> up;      // (N, I)
  Buffer<float> h;       // (N, I) silu(gate) * up
  // A layer of experts (cpu/moe.hpp; R = N K routed rows, Im the experts' width;
  // under expert parallelism over P ranks the owner's rows are up to Ro = P R,
  // every rank's rows of this rank's experts, else Ro = R):
  Buffer<float> router_logits;            // (N, E)
  Buffer<float> probs;                    // (N, E)
  Buffer<int32_t> expert, slot, row;      // (N, K), (R), (R)
  Buffer<float> weight;                   // (N, K)
  Buffer<int64_t> offsets;                // (E + 1)
  Buffer<float> xs, y;                    // (Ro, C) the experts' inputs, (R, C) their outputs of this rank's rows
  Buffer<float> e_gate, e_up, e_h;        // (Ro, Im)
  Buffer<int32_t> ep_rows;                // (P, E) expert parallelism: every rank's rows per expert
  Buffer<float> shared_out;               // (N, C) the shared expert's output, before its gate
  Buffer<float> shared_logit;             // (N) shared_expert_gate(xn2)
  // Views of the routing buffers (read only through a const LayerActs).
  MoeRouting<float> routing() const;
  // Appends a row per buffer above (the qk_norm ones only with qk_norm, the
  // experts' only in a model with experts; P: model.expert_parallel).
  void add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows, int64_t P = 1);
};

// Scratch for one layer's backward (and the head), reused by every layer.
struct LayerGradScratch {
  Buffer<float> d_mid;   // (N, C)
  Buffer<float> d_xn;    // (N, C)
  Buffer<float> d_tmp;   // (N, C)
  Buffer<float> d_att;   // (N, H, D)
  Buffer<float> dq, dk, dv;          // (N, H|KV, D)
  Buffer<float> dq_raw, dk_raw;      // (N, H|KV, D) (qk_norm only)
  Buffer<float> dh, dgate, dup;      // (N, I)
  // A layer of experts: (N, K), (Ro, C), (Ro, Im) x 3, (Ro, C), (N, E) x 2, (N, C), (N)
  // (Ro: LayerActs' owner rows).
  Buffer<float> d_weight, d_y, d_eh, d_egate, d_eup, d_xs, d_logits, d_probs, d_shared, d_shared_logit;
  void add_rows(const ModelConfig& c, int64_t N, std::vector<BufferRow>& rows, int64_t P = 1);
};

// x_out (N, C) = layer(x_in (N, C)); fills acts. With run_attention = false,
// acts.att and acts.lse already hold this layer's attention (selective activation
// checkpointing's recompute) and attention itself is skipped.
// `forced`, `forced_stride`: router replay's experts (layer_out_forward).
void layer_forward(const ModelConfig& c, const LayerWeights<const float>& w, const TokenInputs& in,
                   const float* x_in, float* x_out, LayerActs& acts, bool run_attention = true,
                   const int32_t* forced = nullptr, int64_t forced_stride = 0);

// The two halves of layer_forward around attention, for a caller that attends
// in its own way (sampling with a KV cache, src/infer/): layer_forward is
// qkv, attention_forward, out, so a caller composing the same three gets the
// same bits. qkv fills acts' rstd1, xn1, (q_raw, k_raw, q_rstd, k_rstd), q, k,
// v (q and k normed and rotated); out reads acts.att and fills the rest.
// `linear` is the matmul they run: training's linear_forward (BLAS) or its
// TokenInputs::linear (model.fp8), or linear_rowwise_forward where each row must
// not depend on the others (decode).
using LinearFn = std::function<void(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t)>;
// `forced` (a layer of experts, router replay): the experts each token takes
// instead of its top-k, N rows of K at a stride of forced_stride (moe_route).
void layer_qkv_forward(const ModelConfig& c, const LayerWeights<const float>& w, const TokenInputs& in,
                       const float* x_in, LayerActs& acts, LinearFn linear = &linear_forward<float>);
// `experts`: TokenInputs::experts (nullptr: every expert here).
void layer_out_forward(const ModelConfig& c, const LayerWeights<const float>& w, int64_t N, const float* x_in,
                       float* x_out, LayerActs& acts, LinearFn linear = &linear_forward<float>,
                       const int32_t* forced = nullptr, int64_t forced_stride = 0, Experts* experts = nullptr);

// d_x (N, C): in, the gradient at the layer's output; out, at its input.
// Parameter gradients are accumulated into g. A layer of experts adds
// `router_aux` (nullptr: none) to the router's gradient: the load-balancing
// loss's, with every layer's expert counts of the micro-batch (RouterAux).
struct RouterAux;
void layer_backward(const ModelConfig& c, const LayerWeights<const float>& w, const LayerWeights<float>& g,
                    const TokenInputs& in, const float* x_in, const LayerActs& acts, float* d_x,
                    LayerGradScratch& s, const RouterAux* router_aux = nullptr);

// The load-balancing loss of one micro-batch (transformers'
// load_balancing_loss_func over every layer of experts): each layer's forward
// adds its routing (add), the head reads the loss, each layer's backward its
// gradient, `scale` times the loss (model.router_aux_loss_coef over the
// update's micro-batches of every rank).
struct RouterAux {
  std::vector<double> counts, prob_sums;  // (E) over the layers' rows
  int64_t rows = 0;                       // routed tokens: N per layer of experts
  double scale = 0;
  void reset(int64_t E, double scale);
  void add(const LayerActs& acts, int64_t N, int64_t E, int64_t K);
  double loss() const;
};

// Final norm + lm-head + cross-entropy, forward and backward in one pass over
// token chunks, so (chunk, V) logits are the most ever held.
struct HeadScratch {
  Buffer<float> xf;      // (N, C) normed final hidden state
  Buffer<float> rstd;    // (N)
  Buffer<float> dxf;     // (N, C)
  Buffer<float> logits;  // (chunk, V)
  int64_t chunk = 0;
  // Sets chunk = min(chunk_tokens, N) and appends a row per buffer above.
  void add_rows(const ModelConfig& c, int64_t N, int64_t chunk_tokens, std::vector<BufferRow>& rows);
};

// Returns sum of weight * NLL; writes d_x (N, C) = gradient at the final hidden
// state with every token's loss scaled by grad_scale; accumulates g_norm (C) and
// g_lm (V, C). `lm_head` is the embedding when tied.
// With `rl` set, the RL policy loss replaces cross-entropy (rl_loss.hpp).
struct RlInputs {
  RlTokenInputs tokens;  // (N) each
  RlLossParams params;
};
RlChunkStats head_loss_backward(const ModelConfig& c, const float* norm_w, const float* lm_head, float* g_norm,
                                float* g_lm, const float* x, const int32_t* targets, const float* weights,
                                float grad_scale, int64_t N, float* d_x, HeadScratch& s,
                                const RlInputs* rl = nullptr);

// Forward only: logprobs (N) = log_softmax(logits / tau)[target] of each row
// with a target (0 elsewhere), chunk by chunk as head_loss_backward forms the
// logits, so each is the logp the RL loss computes for the row (the step's
// forward-only pass before a sequence-level loss, train/sequence_pass.hpp).
void head_token_logprobs(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x,
                         const int32_t* targets, const float* temperatures, int64_t N, float* logprobs,
                         HeadScratch& s);

// Logits (N, V) for the forward command and tests.
void head_logits(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x, int64_t N,
                 float* logits, HeadScratch& s);

// Forward only: the cross-entropy sums of head_loss_backward (the same chunks
// and arithmetic, so the same loss bit for bit), no gradients.
RlChunkStats head_loss(const ModelConfig& c, const float* norm_w, const float* lm_head, const float* x,
                       const int32_t* targets, const float* weights, int64_t N, HeadScratch& s);

}  // namespace shardlm::cpu
