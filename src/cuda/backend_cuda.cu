// backend_cuda.cu — the CUDA backend: bf16 parameters and activations, fp32
// gradients, statistics and losses; cuBLASLt GEMMs (gemm.hpp), the layer kernels of
// ops.hpp, the flash attention of attention.hpp (or cuDNN's, sdpa.hpp) and the
// optimizer kernels of optim_kernels.hpp, all on one compute stream. It keeps a bf16 copy
// of every unit shard for the all-gathers, which the training state (train/state.hpp)
// writes: the device update (train/device_state.cu), the offload pipeline's uploads, or
// set_param_shard from the host masters. Every buffer of the step comes from one table
// (buffer_table) that both allocates and counts the memory plan. With model.fp8 the
// decoder blocks' projections run through cuda::Fp8Linear (cuBLASLt FP8) instead.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/cuda.hpp"
#include "cpu/ops.hpp"
#include "cuda/attention.hpp"
#include "cuda/fp8_attention.hpp"
#include "cuda/fp8_linear.hpp"
#include "cuda/gemm.hpp"
#include "cuda/moe.hpp"
#include "cuda/ops.hpp"
#include "cuda/ring_attention.hpp"
#include "cuda/rl_loss.hpp"
#include "cuda/sdpa.hpp"
#include "shardlm/error.hpp"
#include "shardlm/dtype.hpp"

namespace shardlm {
namespace {

using cuda::bf16;

class CudaBackend final : public Backend {
 public:
  // Nothing touches the device until the first allocation, so the sizes (the
  // memory plan of `shardlm check`) can be asked for on a machine without a GPU.
  CudaBackend() = default;
  ~CudaBackend() override {
    if (!stream_) return;
    cudaStreamSynchronize(stream_);
    ring_.reset();
    ring_comm_.reset();  // its collectives are ordered against stream_: gone before it
    ep_comm_.reset();
    fp8_attention_.reset();  // it holds a reference to sdpa_
    sdpa_.reset();
    fp8_.reset();
    grouped_.reset();
    gemm_.reset();
    for (auto& [ptr, size] : owned_) cudaFree(ptr);
    if (host_staging_) cudaFreeHost(host_staging_);
    cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "cuda"; }
  bool host_resident() const override { return false; }
  int64_t param_bytes() const override { return 2; }

  void* allocate(Mem category, size_t bytes) override {
    init();
    return cuda_malloc(category, static_cast<int64_t>(bytes));  // admitted against the cap, counted
  }
  void deallocate(Mem category, void* ptr, size_t bytes) override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaFree(ptr));
    device_mem_track(category, -static_cast<int64_t>(bytes));
  }
  void zero(void* ptr, size_t bytes) override { CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_)); }

  void add_grad_to_host(float* host_grad, const void* src, int64_t n, DType type) override {
    SHARDLM_CHECK(n <= staging_floats_, "internal: gradient of %lld elements exceeds the staging buffer",
                  (long long)n);
    if (!host_staging_) CUDA_CHECK(cudaMallocHost(&host_staging_, sizeof(float) * staging_floats_));
    CUDA_CHECK(cudaMemcpyAsync(host_staging_, src, dtype_bytes(type) * n, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (type == DType::F32) {
      cpu::accumulate(host_grad, host_staging_, n);
    } else {
      const auto* b = reinterpret_cast<const uint16_t*>(host_staging_);
      for (int64_t i = 0; i < n; ++i) host_grad[i] += bf16_to_f32(b[i]);
    }
  }
  void accumulate(float* dst, const void* src, int64_t n, DType type) override {
    if (type == DType::F32) cuda::accumulate_f32(dst, static_cast<const float*>(src), n, stream_);
    else cuda::add_bf16_to_f32(dst, dst, static_cast<const bf16*>(src), n, stream_);
  }
  void cast_to_bf16(void* dst, const float* src, int64_t n) override {
    cuda::cast_f32_to_bf16(static_cast<bf16*>(dst), src, n, stream_);
  }
  void* stream() override {
    init();
    return stream_;
  }

  void attach_shards(const ModelLayout& layout) override {
    int64_t largest = 0;
    for (const auto& u : layout.units) largest = std::max(largest, u.padded_numel);
    staging_floats_ = largest;  // the staging buffers are made on first use: device state needs none
    for (const auto& u : layout.units) shards_.push_back(static_cast<bf16*>(own(Mem::ParamShard, 2 * u.shard_numel)));
    // Where each unit's fp32 norm weights go in norm_fp32_ (model.norm_dtype).
    int64_t at = 0;
    for (const auto& u : layout.units) {
      UnitNorms n;
      n.base = at;
      for (const NormSlot& slot : norm_slots(u)) {
        auto is = [&](const char* suffix) { return slot.param == u.find_param(suffix); };
        int64_t* where = is("input_layernorm.weight") ? &n.input : is("q_norm.weight") ? &n.q
                       : is("k_norm.weight") ? &n.k : is("post_attention_layernorm.weight") ? &n.post
                       : is("model.norm.weight") ? &n.final : nullptr;
        SHARDLM_CHECK(where, "internal: the CUDA backend has no place for the norm weight %s",
                      slot.param->name.c_str());
        *where = at + slot.packed;
      }
      at += norm_slot_floats(u);
      unit_norms_.push_back(n);
    }
  }

  void set_param_shard(int unit, const float* master, int64_t n) override {
    if (!device_staging_) device_staging_ = static_cast<float*>(own(Mem::Workspace, sizeof(float) * staging_floats_));
    CUDA_CHECK(cudaMemcpyAsync(device_staging_, master, sizeof(float) * n, cudaMemcpyHostToDevice, stream_));
    cuda::cast_f32_to_bf16(shards_[unit], device_staging_, n, stream_);
  }
  const void* param_shard(int unit) const override { return shards_[unit]; }
  void set_params_version(int64_t version) override {
    if (fp8_) fp8_->set_params_version(version);
  }
  float* embedding_rows_fp32() override { return fp32_stream() ? f32(residual_[0]) : nullptr; }
  float* norm_weights_fp32(int unit) override {
    return norm_fp32_ ? norm_fp32_ + unit_norms_[size_t(unit)].base : nullptr;
  }

  void* param_shard_mut(int unit) override { return shards_[unit]; }
  void synchronize() override {
    if (stream_) CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // ------------------------------------------------------------ sizes

  // gu, h: a layer's gate|up and h buffers' width per token, the largest of
  // its kinds of layer: a dense MLP's 2I and I; a layer of experts' K rows of
  // 2Im and Im a token (P K under expert parallelism over P ranks: an owner
  // may receive every rank's rows), then the shared expert's 2Is and Is.
  struct Dims {
    int64_t N, C, I, H, KV, D, HD, KVD, V, chunk;
    int64_t E, K, Im, Is, gu, h, P;
    int64_t expert_rows() const { return P * N * K; }  // the experts' rows a rank may run
  };
  static Dims dims(const ModelConfig& c, const EngineOptions& o) {
    Dims d{o.max_tokens, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
           c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.vocab_size, std::min(o.chunk_tokens, o.max_tokens),
           c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size, 0, 0,
           std::max<int64_t>(o.expert_parallel, 1)};
    bool dense = false;
    for (int64_t l = 0; l < c.num_layers; ++l) dense |= !c.moe_layer(l);
    if (dense) d.gu = 2 * d.I, d.h = d.I;
    const int64_t PK = d.P * d.K;
    if (c.moe()) d.gu = std::max(d.gu, 2 * (PK * d.Im + d.Is)), d.h = std::max(d.h, PK * d.Im + d.Is);
    return d;
  }
  // What the experts on the GPU do not run yet.
  static void check_supported(const ModelConfig& c, const EngineOptions& o) {
    if (!c.moe()) return;
    SHARDLM_CHECK(o.fp8 == Fp8Mode::None, "model.fp8 with a model of experts (arch %s): the experts' grouped GEMMs "
                  "run in bf16 only; set model.fp8 = \"none\"", c.arch.c_str());
    SHARDLM_CHECK(c.hidden_size % 8 == 0, "a model of experts on the GPU needs hidden_size a multiple of 8 (it is "
                  "%lld)", (long long)c.hidden_size);
  }
  // The plan sums the table prepare() allocates from (a planner's, never allocated).
  int64_t activation_bytes(const ModelConfig& c, const EngineOptions& o) const override {
    check_supported(c, o);
    CudaBackend planner;
    return table_bytes(planner.buffer_table(c, o), Mem::Activations);
  }
  int64_t workspace_bytes(const ModelConfig& c, const EngineOptions& o) const override {
    CudaBackend planner;
    return table_bytes(planner.buffer_table(c, o), Mem::Workspace);
  }
  size_t scratch_bytes(const ModelConfig& c, const Dims& d) const {
    size_t s = cuda::rmsnorm_backward_scratch_bytes(d.N, d.C);
    s = std::max(s, cuda::rmsnorm_backward_scratch_bytes(d.N * d.H, d.D));
    // CUB sizes its sort scratch on a device; without one (`shardlm check` on a
    // login node) use a bound: keys, values and their copies plus 1 MiB.
    int devices = 0;
    const bool have_device = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
    if (!have_device) cudaGetLastError();
    s = std::max(s, have_device ? cuda::embedding_backward_scratch_bytes(d.N, d.C) : size_t(16 * d.N + (1 << 20)));
    s = std::max(s, cuda::linear_backward_scratch_bytes(d.N, d.HD));
    s = std::max(s, cuda::linear_backward_scratch_bytes(d.N, d.KVD));
    (void)c;
    return s;
  }
  // Phase-shared memory. Three phases of a step never overlap on the stream:
  //   head       the logits chunk (head_loss_backward, between forward and backward);
  //   MLP bwd    dh, and dgate/dup, which swiglu_backward writes over the layer's
  //              own gate/up activations (it reads each element before writing it);
  //   attn bwd   d_att, dq, dk, dv and cuDNN's backward buffers, made after the
  //              MLP's backward has read gate/up for the last time, dead once the
  //              q/k/v projections' backward has read them.
  // (With model.fp8_attention the region after dv also lends the FP8 attention's
  // scratch to its forward: the layer's gate/up is written only after attention,
  // and the shared region holds nothing live during a forward.)
  // So the attention phase lives in the layer's gate/up buffer (N, 2I), and so does
  // the logits chunk under activation checkpointing (the activations are
  // recomputed in backward, so the shared set is dead during the head); dh and
  // whatever does not fit there share one region of the workspace.
  struct Phases {
    size_t gu_bytes = 0;                                 // one layer's gate/up buffer
    size_t dq = 0, dk = 0, dv = 0, sdpa = 0, attention = 0;  // offsets in the attention phase; its size
    bool attention_in_gu = false, logits_in_gu = false;
    size_t shared = 0;                                   // the shared region's bytes
  };
  static size_t aligned(size_t b) { return (b + 255) / 256 * 256; }
  static Phases phases(const Dims& d, bool sdpa, bool fp8_attention, bool checkpointing) {
    Phases p;
    p.gu_bytes = 2 * size_t(d.N * d.gu);
    p.dq = aligned(2 * size_t(d.N * d.HD));
    p.dk = p.dq + aligned(2 * size_t(d.N * d.HD));
    p.dv = p.dk + aligned(2 * size_t(d.N * d.KVD));
    p.sdpa = p.dv + aligned(2 * size_t(d.N * d.KVD));
    p.attention = p.sdpa + std::max(sdpa ? cuda::CudnnSdpa::backward_buffer_bytes(d.N, d.H, d.KV, d.D) : 0,
                                    fp8_attention ? cuda::Fp8Attention::scratch_bytes(d.N, d.H, d.KV, d.D) : 0);
    const size_t logits = 2 * size_t(d.chunk * d.V);
    p.attention_in_gu = p.attention <= p.gu_bytes;
    p.logits_in_gu = checkpointing && logits <= p.gu_bytes;
    p.shared = std::max({aligned(2 * size_t(d.N * d.h)), p.logits_in_gu ? 0 : aligned(logits),
                         p.attention_in_gu ? 0 : p.attention});
    return p;
  }
  // cuDNN's attention is planned whenever it may be chosen (choose_attention);
  // the context-parallel ring runs shardlm's masked kernels instead.
  static bool sdpa_planned(const EngineOptions& o) {
    return o.attention != "flash" && !o.deterministic && o.context_parallel <= 1;
  }
  static bool fp8_attention_planned(const EngineOptions& o) { return o.fp8_attention && sdpa_planned(o); }
  // The attention phase's base for a layer whose gate/up buffer is `gu`.
  char* attention_phase(bf16* gu) const { return phases_.attention_in_gu ? reinterpret_cast<char*>(gu) : shared_; }
  // The attention phase's buffers, in `base` (a layer's gate/up or the shared region).
  void place_attention_phase(char* base) {
    d_att_ = reinterpret_cast<bf16*>(base), dq_ = reinterpret_cast<bf16*>(base + phases_.dq);
    dk_ = reinterpret_cast<bf16*>(base + phases_.dk), dv_ = reinterpret_cast<bf16*>(base + phases_.dv);
    sdpa_backward_buffers_ = base + phases_.sdpa;
  }
  // ------------------------------------------------------------ buffers

  struct Acts {
    float *rstd1, *q_rstd, *k_rstd, *lse, *rstd2;
    bf16 *xn1, *q_raw, *k_raw, *q, *k, *v, *att, *xn2, *gu, *h;
    void* x_mid;  // the residual stream after attention (bf16 or fp32: StreamBuf)
    // A layer of experts (cuda::MoeLayerActs): gu and h above hold its rows'.
    float *probs, *weight, *shared_logit;
    int32_t *expert, *slot, *row;
    int64_t* offsets;
    bf16 *y, *shared_out;
    std::vector<int64_t> host_offsets;
    std::vector<int32_t> host_ep_rows;  // expert parallelism: (P, E) every rank's rows per expert
  };

  // One buffer of this backend: its name, the plan row it is counted in, its
  // element count and bytes per element (from the pointer's type), and where
  // prepare() puts its address. A row without `point` is planned here and
  // allocated elsewhere (its comment says where).
  struct BufferRow {
    const char* name;
    Mem category;
    int64_t count;
    int64_t elem_bytes;
    std::function<void(void*)> point;
    int64_t bytes() const { return count * elem_bytes; }
  };
  template <class T>
  static BufferRow row(const char* name, Mem category, int64_t count, T** slot) {
    return {name, category, count, int64_t(sizeof(T)), [slot](void* p) { *slot = static_cast<T*>(p); }};
  }
  // A buffer whose size a kernel's *_bytes() function gives in bytes.
  template <class T>
  static BufferRow bytes_row(const char* name, Mem category, size_t bytes, T** slot) {
    return {name, category, int64_t(bytes), 1, [slot](void* p) { *slot = static_cast<T*>(p); }};
  }
  // A buffer of the residual stream or its gradient: bf16, or fp32 under
  // model.residual_dtype = "fp32" (stream_bytes_ per element).
  BufferRow stream_row(const char* name, Mem category, int64_t count, void** slot) const {
    return {name, category, count, stream_bytes_, [slot](void* p) { *slot = p; }};
  }
  static int64_t table_bytes(const std::vector<BufferRow>& rows, Mem category) {
    int64_t bytes = 0;
    for (const BufferRow& r : rows)
      if (r.category == category) bytes += r.bytes();
    return bytes;
  }

  // Every buffer prepare() makes, in the order it makes them (llm.c's
  // fill_in_activation_sizes + malloc_and_point_activations in one list): the
  // saved activations (Mem::Activations) and the batch, backward, head and kernel
  // scratch (Mem::Workspace). Sizes the vectors of buffers so the rows can point
  // into them, and records d_, phases_, delta_bytes_ and scratch_bytes_.
  std::vector<BufferRow> buffer_table(const ModelConfig& c, const EngineOptions& o) {
    d_ = dims(c, o);
    stream_bytes_ = o.residual_fp32 ? 4 : 2;
    const Dims& d = d_;
    const int64_t L = c.num_layers;
    const int64_t kept = o.attention_layers_kept(L);
    const Mem act = Mem::Activations, w = Mem::Workspace;
    std::vector<BufferRow> rows;
    rows.push_back(row("inv_freq", w, d.D / 2, &inv_freq_));  // cpu::rope_inv_freq as float, (D/2)
    if (o.norm_fp32) {  // every unit's norm weights in fp32, packed as norm_slots (model.norm_dtype)
      int64_t floats = 0;
      for (const Unit& u : ModelLayout(c, 1).units) floats += norm_slot_floats(u);
      rows.push_back(row("norm_weights_fp32", w, floats, &norm_fp32_));
    }
    rows.push_back(row("tokens", w, d.N, &tokens_));
    rows.push_back(row("targets", w, d.N, &targets_));
    rows.push_back(row("positions", w, d.N, &positions_));
    rows.push_back(row("seq_ids", w, d.N, &seq_ids_));
    rows.push_back(row("doc_start", w, d.N, &doc_start_));
    rows.push_back(row("weights", w, d.N, &weights_));
    if (o.rl) {
      rows.push_back(row("advantages", w, d.N, &advantages_));
      rows.push_back(row("inference_logprobs", w, d.N, &inference_logprobs_));
      rows.push_back(row("temperatures", w, d.N, &temperatures_));
      rows.push_back(bytes_row("rl_row_stats", w, cuda::rl_loss_row_stats_bytes(d.chunk), &rl_row_stats_));
      rows.push_back(row("rl_stats", w, cuda::kRlStatsFields, &rl_stats_));
      if (o.rl_params.is_level != IsLevel::None) rows.push_back(row("sampling_logprobs", w, d.N, &sampling_logprobs_));
      if (o.rl_params.needs_sequence_terms()) {  // the sample sums
        rows.push_back(row("sequence_log_ratio", w, d.N, &sequence_log_ratio_));
        rows.push_back(row("sequence_log_is", w, d.N, &sequence_log_is_));
      }
      if (o.rl_params.ref_kl_coef > 0) rows.push_back(row("ref_logprobs", w, d.N, &ref_logprobs_));
      // The forward-only passes' logprobs: the sample sums', the frozen reference's.
      if (o.rl_params.needs_sequence_terms() || o.rl_params.ref_kl_coef > 0)
        rows.push_back(row("token_logprobs", w, d.N, &token_logprobs_));
    }

    residual_.assign(size_t(L + 1), nullptr);
    for (auto& x : residual_) rows.push_back(stream_row("residual", act, d.N * d.C, &x));
    acts_.assign(size_t(o.checkpoint_activations ? 1 : L), Acts{});
    for (Acts& a : acts_) {
      rows.push_back(row("rstd1", act, d.N, &a.rstd1));
      rows.push_back(row("rstd2", act, d.N, &a.rstd2));
      rows.push_back(row("xn1", act, d.N * d.C, &a.xn1));
      rows.push_back(stream_row("x_mid", act, d.N * d.C, &a.x_mid));
      rows.push_back(row("xn2", act, d.N * d.C, &a.xn2));
      rows.push_back(row("q", act, d.N * d.HD, &a.q));
      rows.push_back(row("k", act, d.N * d.KVD, &a.k));
      rows.push_back(row("v", act, d.N * d.KVD, &a.v));
      if (kept < L) {  // kept per layer instead when every layer keeps its attention (selective)
        rows.push_back(row("att", act, d.N * d.HD, &a.att));
        rows.push_back(row("lse", act, d.N * d.H, &a.lse));
      }
      rows.push_back(row("gu", act, d.N * d.gu, &a.gu));
      rows.push_back(row("h", act, d.N * d.h, &a.h));
      if (c.moe()) {  // a layer of experts' routing and rows (cuda/moe.hpp)
        const int64_t R = d.N * d.K;
        rows.push_back(row("moe.probs", act, d.N * d.E, &a.probs));
        rows.push_back(row("moe.expert", act, R, &a.expert));
        rows.push_back(row("moe.weight", act, R, &a.weight));
        rows.push_back(row("moe.slot", act, R, &a.slot));
        rows.push_back(row("moe.row", act, R, &a.row));
        rows.push_back(row("moe.offsets", act, d.E + 1, &a.offsets));
        rows.push_back(row("moe.y", act, R * d.C, &a.y));
        if (d.Is > 0) {
          rows.push_back(row("moe.shared_out", act, d.N * d.C, &a.shared_out));
          rows.push_back(row("moe.shared_logit", act, d.N, &a.shared_logit));
        }
      }
      if (c.qk_norm) {
        rows.push_back(row("q_raw", act, d.N * d.HD, &a.q_raw));
        rows.push_back(row("k_raw", act, d.N * d.KVD, &a.k_raw));
        rows.push_back(row("q_rstd", act, d.N * d.H, &a.q_rstd));
        rows.push_back(row("k_rstd", act, d.N * d.KV, &a.k_rstd));
      }
    }
    if (o.checkpoint_activations) rows.push_back(stream_row("recompute_out", act, d.N * d.C, &recompute_out_));
    saved_att_.assign(size_t(kept), nullptr);
    saved_lse_.assign(size_t(kept), nullptr);
    for (int64_t l = 0; l < kept; ++l) {
      rows.push_back(row("saved_att", act, d.N * d.HD, &saved_att_[size_t(l)]));
      rows.push_back(row("saved_lse", act, d.N * d.H, &saved_lse_[size_t(l)]));
    }

    rows.push_back(stream_row("d_x", w, d.N * d.C, &d_x_));  // backward residual-stream gradients
    rows.push_back(stream_row("d_mid", w, d.N * d.C, &d_mid_));
    if (o.residual_fp32) {  // the bf16 operands between the fp32 stream and the GEMMs
      rows.push_back(row("proj_out", w, d.N * d.C, &proj_out_));      // o / down projection output
      rows.push_back(row("d_stream_bf16", w, d.N * d.C, &d_stream_bf16_));  // d_x or d_mid rounded for a GEMM
    }
    rows.push_back(row("d_xn", w, d.N * d.C, &d_xn_));
    phases_ = phases(d, sdpa_planned(o), fp8_attention_planned(o), o.checkpoint_activations);
    rows.push_back(bytes_row("phase_shared", w, phases_.shared, &shared_));  // dh, logits, attention backward
    if (c.qk_norm) {
      rows.push_back(row("dq_raw", w, d.N * d.HD, &dq_raw_));
      rows.push_back(row("dk_raw", w, d.N * d.KVD, &dk_raw_));
    }
    if (c.moe()) {  // the experts' workspace (cuda/moe.hpp) and router replay's routes
      const int64_t R = d.N * d.K;
      rows.push_back(row("moe.logits", w, d.N * d.E, &moe_.logits));
      rows.push_back(row("moe.rows", w, R * d.C, &moe_.rows));
      rows.push_back(row("moe.dweight", w, R, &moe_.dweight));
      rows.push_back(row("moe.dlogits", w, d.N * d.E, &moe_.dlogits));
      rows.push_back(row("moe.wgrad", w, d.E * d.Im * d.C, &moe_.wgrad));
      rows.push_back(row("moe.aux_counts", w, d.E, &moe_.aux_counts));
      rows.push_back(row("moe.aux_prob_sums", w, d.E, &moe_.aux_prob_sums));
      rows.push_back(row("moe.gemm_pointers", w, 3 * 2 * d.E, &moe_pointers_));
      rows.push_back(row("moe.routes", w, d.N * c.route_width(), &routes_));
      if (d.Is > 0) {
        rows.push_back(row("moe.d_shared", w, d.N * d.C, &moe_.d_shared));
        rows.push_back(row("moe.d_shared_logit", w, d.N, &moe_.d_shared_logit));
      }
      // Expert parallelism: every rank's rows of this rank's experts (its device Comm's pinned buffers: engine.cpp).
      if (d.P > 1) rows.push_back(row("moe.ep_owned", w, d.expert_rows() * d.C, &ep_.owned));
    }
    rows.push_back(row("head.xf", w, d.N * d.C, &xf_));
    rows.push_back(row("head.dxf", w, d.N * d.C, &dxf_));
    rows.push_back(row("head.rstd", w, d.N, &rstdf_));
    rows.push_back(row("head.row_loss", w, d.chunk, &row_loss_));
    rows.push_back(row("head.loss_sum", w, 1, &loss_sum_));
    delta_bytes_ = cuda::attention_backward_scratch_bytes(d.N, d.H, d.KV, d.D);
    rows.push_back(bytes_row("attention_delta", w, delta_bytes_, &delta_));
    scratch_bytes_ = scratch_bytes(c, d);
    rows.push_back(bytes_row("kernel_scratch", w, scratch_bytes_, &scratch_));
    // Allocated by choose_attention when cuDNN's attention loads; planned whenever it may be chosen.
    if (sdpa_planned(o))
      rows.push_back({"cudnn_sdpa_persistent", w, int64_t(cuda::CudnnSdpa::persistent_bytes(d.N)), 1, nullptr});
    if (fp8_attention_planned(o))  // its per-layer scales; its scratch is the attention phase's (Phases)
      rows.push_back(bytes_row("fp8_attention_state", w, cuda::Fp8Attention::state_bytes(L), &fp8_attention_state_));
    if (o.context_parallel > 1) {  // the ring (cuda/ring_attention.hpp); its staged Comm's pinned buffers: engine.cpp
      using R = cuda::RingBuffers;
      rows.push_back(row("token_index", w, d.N, &token_index_));
      for (auto& b : ring_buffers_.block) rows.push_back(bytes_row("ring.block", w, R::block_bytes(d.N, d.KVD), &b));
      for (auto& g : ring_buffers_.grad) rows.push_back(bytes_row("ring.grad", w, R::grad_bytes(d.N, d.KVD), &g));
      rows.push_back(bytes_row("ring.acc", w, R::acc_bytes(d.N, d.HD), &ring_buffers_.acc));
      rows.push_back(bytes_row("ring.query_bounds", w, R::bounds_bytes(d.N), &ring_buffers_.query_bounds));
    }
    if (o.fp8 != Fp8Mode::None) {  // the projections' FP8 operands (cuda/fp8_linear.hpp)
      const bool one_pass = cuda::Fp8Linear::dout_one_pass(o.fp8, c, d.N);
      const cuda::Fp8Linear::Sizes s = cuda::Fp8Linear::sizes(c, d.N, o.fp8_weight_cache, one_pass);
      if (o.fp8_weight_cache) {  // every layer's weights' codes, kept across micro-batches
        rows.push_back(row("fp8.weight_cache_codes", w, s.cache_code_bytes, &fp8_buffers_.cache_codes));
        rows.push_back(row("fp8.weight_cache_scales", w, s.cache_scale_count, &fp8_buffers_.cache_scales));
      }
      rows.push_back(row("fp8.a_codes", w, s.a_code_bytes, &fp8_buffers_.a_codes));
      rows.push_back(row("fp8.b_codes", w, s.b_code_bytes, &fp8_buffers_.b_codes));
      rows.push_back(row("fp8.x_codes", w, s.x_code_bytes, &fp8_buffers_.x_codes));
      if (one_pass) rows.push_back(row("fp8.t_codes", w, s.t_code_bytes, &fp8_buffers_.t_codes));
      rows.push_back(row("fp8.a_scales", w, 3 * s.scale_count, &fp8_buffers_.a_scales));
      rows.push_back(row("fp8.b_scales", w, 3 * s.scale_count, &fp8_buffers_.b_scales));
      rows.push_back(row("fp8.x_scales", w, 3 * s.scale_count, &fp8_buffers_.x_scales));
      if (fused_amax(o)) rows.push_back(row("fp8.amaxes", w, kAmaxPerLayer * c.num_layers + kGradAmaxes, &fp8_amaxes_));
    }
    // Allocated by init() with the stream, at the backend's first allocation.
    rows.push_back({"gemm_workspace", w, int64_t(kGemmWorkspace), 1, nullptr});
    return rows;
  }

  void prepare(const ModelConfig& c, const EngineOptions& o) override {
    check_supported(c, o);
    config_ = c;
    options_ = o;
    for (const BufferRow& r : buffer_table(c, o))
      if (r.point) r.point(own(r.category, size_t(r.bytes())));
    const std::vector<double> inv = cpu::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
    std::vector<float> inv_f(inv.begin(), inv.end());
    CUDA_CHECK(cudaMemcpy(inv_freq_, inv_f.data(), 4 * inv_f.size(), cudaMemcpyHostToDevice));
    if (o.checkpoint_activations) shared_att_ = acts_[0].att, shared_lse_ = acts_[0].lse;
    dh_ = reinterpret_cast<bf16*>(shared_);
    logits_ = phases_.logits_in_gu ? acts_[0].gu : reinterpret_cast<bf16*>(shared_);
    place_attention_phase(attention_phase(acts_[0].gu));
    CUDA_CHECK(cudaMemsetAsync(loss_sum_, 0, 8, stream_));
    choose_attention(d_);
    moe_.dh = dh_;
    if (c.moe()) grouped_ = std::make_unique<cuda::GroupedGemm>(stream_, moe_pointers_, 2 * d_.E);
    if (o.fp8 != Fp8Mode::None)
      fp8_ = std::make_unique<cuda::Fp8Linear>(o.fp8, fp8_buffers_, stream_, gemm_workspace_, kGemmWorkspace, c,
                                               o.fp8_weight_cache ? c.num_layers : 0);
  }

  std::string kernels_note() const override {
    if (!fp8_attention_ || attention_passes_ == 0) return attention_note_;
    return attention_note_ + fmt("; FP8 ran %lld of %lld attention passes so far%s", (long long)fp8_attention_passes_,
                                 (long long)attention_passes_,
                                 fp8_attention_on_ ? "" : " (off since cuDNN refused its backward)");
  }

  // device.attention: "flash" (shardlm's kernels), "cudnn" (cuDNN's fused SDPA,
  // an error where it cannot load), "auto" (cuDNN where it loads, else shardlm's,
  // saying why). run.deterministic keeps shardlm's kernels: cuDNN's backward
  // accumulates dq with atomics on Hopper, so reruns would differ in the last bits.
  void choose_attention(const Dims& d) {
    const std::string own_kernels = fmt("shardlm flash kernels (%s)", cuda::attention_kernel_name(d.D));
    if (options_.context_parallel > 1) {
      attention_note_ = fmt("context-parallel ring over %lld ranks, shardlm's masked flash kernels",
                            (long long)options_.context_parallel);
      return;
    }
    if (options_.attention == "flash") {
      attention_note_ = own_kernels + ", as device.attention = \"flash\" asks";
      return;
    }
    if (options_.deterministic) {
      attention_note_ = own_kernels + ": run.deterministic = true keeps them (cuDNN's backward is not bitwise "
                                      "reproducible)";
      return;
    }
    std::string why;
    if (!cuda::cudnn_sdpa_available(&why)) {
      SHARDLM_CHECK(options_.attention != "cudnn", "device.attention = \"cudnn\", but cuDNN cannot be used: %s",
                    why.c_str());
      SHARDLM_CHECK(!options_.fp8_attention, "model.fp8_attention = true, but cuDNN cannot be used: %s", why.c_str());
      attention_note_ = own_kernels + "; cuDNN's attention is not used: " + why;
      return;
    }
    void* persistent = own(Mem::Workspace, cuda::CudnnSdpa::persistent_bytes(d.N));
    sdpa_ = std::make_unique<cuda::CudnnSdpa>(d.N, d.H, d.KV, d.D, persistent, stream_);
    attention_note_ = "cuDNN fused attention, " + cuda::cudnn_sdpa_version() + "; shardlm's kernels where an "
                      "engine refuses a shape";
    if (options_.fp8_attention) {
      fp8_attention_ = std::make_unique<cuda::Fp8Attention>(*sdpa_, d.N, d.H, d.KV, d.D, config_.num_layers,
                                                            fp8_attention_state_, stream_);
      fp8_attention_used_.assign(size_t(config_.num_layers), false);
      attention_note_ = "cuDNN fused attention in FP8 (model.fp8_attention), " + cuda::cudnn_sdpa_version() +
                        "; bf16 where cuDNN refuses FP8 for a shape (documents of different lengths; on Hopper the "
                        "backward at head dims other than 128), shardlm's kernels where it refuses both";
    }
  }

  // cuDNN's attention when it takes this micro-batch's shape, else shardlm's
  // kernels (same tensors, same meaning); a refusal is reported once per shape.
  // With model.fp8_attention, cuDNN's FP8 graphs first (cuda/fp8_attention.hpp);
  // the backward runs in FP8 where the layer's forward did.
  void attention_forward(Acts& a, int64_t N) {
    if (ring_) return ring_->forward(a.att, a.lse, a.q, a.k, a.v, token_index_, seq_ids_, N, d_.H, d_.KV, d_.D);
    if (fp8_attention_) {
      ++attention_passes_;
      fp8_attention_used_[size_t(layer_)] =
          fp8_attention_on_ &&
          fp8_attention_->forward(layer_, a.att, a.lse, a.q, a.k, a.v, N, attention_phase(a.gu) + phases_.sdpa);
      if (fp8_attention_used_[size_t(layer_)]) {
        ++fp8_attention_passes_;
        return;
      }
      if (fp8_attention_on_) note_fp8_attention_refusal("forward");
    }
    if (sdpa_ && sdpa_->forward(a.att, a.lse, a.q, a.k, a.v)) return;
    note_sdpa_refusal();
    cuda::attention_forward(a.att, a.lse, a.q, a.k, a.v, seq_ids_, doc_start_, N, d_.H, d_.KV, d_.D, stream_);
  }
  void attention_backward(Acts& a, int64_t N) {
    if (ring_)
      return ring_->backward(dq_, dk_, dv_, d_att_, a.q, a.k, a.v, a.att, a.lse, token_index_, seq_ids_,
                             static_cast<float*>(delta_), N, d_.H, d_.KV, d_.D);
    if (fp8_attention_) ++attention_passes_;
    if (fp8_attention_ && fp8_attention_on_ && fp8_attention_used_[size_t(layer_)]) {
      if (fp8_attention_->backward(layer_, dq_, dk_, dv_, d_att_, a.q, a.k, a.v, a.att, a.lse, N,
                                   sdpa_backward_buffers_)) {
        ++fp8_attention_passes_;
        return;
      }
      // Refused for a shape every micro-batch has (the head dim): bf16 from here on;
      // this micro-batch's backwards from its FP8 forwards' outputs and logsumexps.
      fp8_attention_on_ = false;
      note_fp8_attention_refusal("backward");
    }
    if (sdpa_ && sdpa_->backward(dq_, dk_, dv_, d_att_, a.q, a.k, a.v, a.att, a.lse, sdpa_backward_buffers_)) return;
    note_sdpa_refusal();
    cuda::attention_backward(dq_, dk_, dv_, d_att_, a.q, a.k, a.v, a.att, a.lse, seq_ids_, doc_start_,
                             static_cast<float*>(delta_), N, d_.H, d_.KV, d_.D, stream_);
  }
  void note_fp8_attention_refusal(const char* pass) {
    const std::string note = std::string(pass) + ": " + sdpa_->last_plan_note();
    if (note == reported_fp8_refusal_) return;
    reported_fp8_refusal_ = note;
    std::fprintf(stderr, "shardlm: cuDNN refused FP8 attention (model.fp8_attention), bf16 attention runs %s: %s\n",
                 fp8_attention_on_ ? "this shape" : "every layer from here on", note.c_str());
  }
  void note_sdpa_refusal() {
    if (!sdpa_) return;
    SHARDLM_CHECK(options_.attention != "cudnn",
                  "device.attention = \"cudnn\", but cuDNN has no engine for this micro-batch's attention: %s; use "
                  "device.attention = \"auto\" to fall back to shardlm's kernels",
                  sdpa_->last_plan_note().c_str());
    if (sdpa_->last_plan_note() == reported_refusal_) return;
    reported_refusal_ = sdpa_->last_plan_note();
    std::fprintf(stderr, "shardlm: cuDNN attention refused a shape, shardlm's kernels run it: %s\n",
                 reported_refusal_.c_str());
  }

  // ------------------------------------------------------------ compute

  void load_batch(const TokenBatch& b) override {
    SHARDLM_CHECK(b.N <= d_.N, "micro-batch of %lld tokens exceeds the planned %lld", (long long)b.N, (long long)d_.N);
    n_ = b.N;
    has_routes_ = b.routes != nullptr;
    if (has_routes_) upload(routes_, b.routes, 4 * b.N * config_.route_width());
    if (config_.moe()) {  // the load-balancing loss's counts start anew
      CUDA_CHECK(cudaMemsetAsync(moe_.aux_counts, 0, 8 * d_.E, stream_));
      CUDA_CHECK(cudaMemsetAsync(moe_.aux_prob_sums, 0, 8 * d_.E, stream_));
      aux_rows_ = 0;
      aux_scale_ = b.router_aux_scale;
    }
    has_rl_inputs_ = b.advantages != nullptr;
    host_targets_.assign(b.targets ? b.targets : b.tokens, (b.targets ? b.targets : b.tokens) + b.N);
    host_weights_.assign(b.N, 0.0f);
    if (b.weights) std::memcpy(host_weights_.data(), b.weights, 4 * b.N);
    upload(tokens_, b.tokens, 4 * b.N);
    upload(positions_, b.positions, 4 * b.N);
    upload(seq_ids_, b.seq_ids, 4 * b.N);
    if (b.targets) upload(targets_, b.targets, 4 * b.N);
    if (b.weights) upload(weights_, b.weights, 4 * b.N);
    if (options_.rl && b.advantages) {  // an eval micro-batch of an RL run has none: head_loss only
      SHARDLM_CHECK(b.targets && b.weights && b.advantages && b.inference_logprobs && b.temperatures,
                    "internal: an RL micro-batch without targets, weights, advantages, logprobs or temperatures");
      upload(advantages_, b.advantages, 4 * b.N);
      upload(inference_logprobs_, b.inference_logprobs, 4 * b.N);
      upload(temperatures_, b.temperatures, 4 * b.N);
      has_sampling_logprobs_ = sampling_logprobs_ && b.sampling_logprobs;
      if (has_sampling_logprobs_) upload(sampling_logprobs_, b.sampling_logprobs, 4 * b.N);
      // The sample sums come with the training micro-batches, not with the
      // forward-only pass that makes them.
      has_sequence_terms_ = sequence_log_ratio_ && b.sequence_log_ratio && b.sequence_log_is;
      if (has_sequence_terms_) {
        upload(sequence_log_ratio_, b.sequence_log_ratio, 8 * b.N);
        upload(sequence_log_is_, b.sequence_log_is, 8 * b.N);
      }
      has_ref_logprobs_ = ref_logprobs_ && b.ref_logprobs;  // likewise the reference's
      if (has_ref_logprobs_) upload(ref_logprobs_, b.ref_logprobs, 4 * b.N);
    }
    if (ring_) {
      SHARDLM_CHECK(b.token_index, "internal: a context-parallel micro-batch without token indices");
      upload(token_index_, b.token_index, 4 * b.N);
    }
    cuda::attention_doc_start(doc_start_, seq_ids_, n_, stream_);
    if (sdpa_) sdpa_->set_documents(b.seq_ids, b.N);
  }

  // The ring's device Comm joins the group's ranks (NCCL, or MPI staged through
  // pinned host memory as comm.backend says) on this backend's stream.
  void set_context_parallel(Comm& group) override {
    SHARDLM_CHECK(options_.context_parallel == group.size() && ring_buffers_.acc,
                  "internal: the CUDA backend was planned for model.context_parallel = %lld, the group has %d ranks",
                  (long long)options_.context_parallel, group.size());
    ring_comm_ = make_device_comm(group, options_.comm_backend, stream_,
                                  cuda::RingBuffers::staging_bytes(d_.N, d_.KVD), options_.comm_timeout_s);
    ring_ = std::make_unique<cuda::RingAttention>(*ring_comm_, ring_buffers_, d_.N, stream_);
  }

  // Expert parallelism's rows travel over a device Comm of their own on this
  // backend's stream (NCCL, or MPI staged through pinned host memory as
  // comm.backend says), sized for the largest exchange: every rank's rows to one owner.
  void set_expert_parallel(Comm& group) override {
    SHARDLM_CHECK(options_.expert_parallel == group.size() && ep_.owned,
                  "internal: the CUDA backend was planned for model.expert_parallel = %lld, the group has %d ranks",
                  (long long)options_.expert_parallel, group.size());
    ep_comm_ = make_device_comm(group, options_.comm_backend, stream_, expert_staging_bytes(config_, options_),
                                options_.comm_timeout_s);
    ep_.group = ep_comm_.get();
  }
  // The pinned bytes of one of the staged Comm's two buffers: P N K rows of C bf16.
  static int64_t expert_staging_bytes(const ModelConfig& c, const EngineOptions& o) {
    return 2 * o.expert_parallel * o.max_tokens * c.num_experts_per_tok * c.hidden_size;
  }
  void set_layer_experts(int l, const Unit& unit, const void* shard, float* grads) override {
    SHARDLM_CHECK(ep_.group && unit.kind == UnitKind::Experts && unit.layer == l,
                  "internal: unit %s handed in as layer %d's own experts", unit.name.c_str(), l);
    SHARDLM_CHECK(expert_stride(unit) == 3 * d_.Im * d_.C, "internal: unit %s is not expert after expert",
                  unit.name.c_str());
    own_experts_ = layer_weights(unit, bf(shard));
    own_expert_grads_ = grads ? layer_weights(unit, grads) : LayerWeights<float>{};
  }

  // A bf16 stream's start; an fp32 stream starts from the masters' rows, which
  // the engine writes (embedding_rows_fp32).
  void embed_forward(const void* table) override {
    SHARDLM_CHECK(!fp32_stream(), "internal: the fp32 stream starts from embedding_rows_fp32, not the bf16 table");
    cuda::embedding_forward(bf(residual_[0]), tokens_, bf(table), n_, d_.V, d_.C, stream_);
  }

  // Under tensorwise FP8 the projections' operands' amaxes come from the
  // kernels that write the operands, and the forward's inputs' amaxes serve the
  // backward's transposed copies; no amax pass of its own. The same amaxes as
  // an amax pass finds (tests/gpu/test_cuda_ops.cu), so the same codes and
  // losses bit for bit; on the H200 at 1B/4096 with the weight cache 236.1
  // against 243.4 ms a step with the amax passes (docs/kernels.md).
  // fp8_amaxes_ holds, per layer, its four projection inputs' (kXn1 .. kH:
  // written in the forward, read again in the backward, and rewritten alike by
  // a recompute), then the stream gradient's (the last norm backward's: the
  // down and o projections' dout), dgate's and dup's.
  enum AmaxSlot { kXn1, kAtt, kXn2, kH, kAmaxPerLayer };
  enum GradAmax { kStreamGrad, kDgate, kDup, kGradAmaxes };
  static bool fused_amax(const EngineOptions& o) { return o.fp8 == Fp8Mode::Tensorwise; }
  float* amax_at(AmaxSlot s) const { return fp8_amaxes_ ? fp8_amaxes_ + layer_ * kAmaxPerLayer + s : nullptr; }
  float* grad_amax_at(GradAmax g) const {
    return fp8_amaxes_ ? fp8_amaxes_ + config_.num_layers * kAmaxPerLayer + g : nullptr;
  }
  // An operand's amax as Fp8Linear takes it: written already (ready), or to be
  // computed into the slot; {} without fused amaxes.
  cuda::Fp8Linear::Amax amax_ready(float* at) const { return at ? cuda::Fp8Linear::Amax{at, true} : cuda::Fp8Linear::Amax{}; }
  cuda::Fp8Linear::Amax amax_kept(float* at) const { return at ? cuda::Fp8Linear::Amax{at, false} : cuda::Fp8Linear::Amax{}; }

  void layer_forward(int l, const Unit& unit, const void* params) override {
    layer_ = l;
    forward_layer(layer_weights(unit, bf(params)), layer_norms(l, unit, bf(params)), residual_[l], residual_[l + 1],
                  acts(l));
    if (config_.moe_layer(l) && aux_scale_ != 0) {  // not in a recompute: counted once a micro-batch
      cuda::MoeLayerActs a = moe_acts(acts(l));
      cuda::moe_aux_add(a, moe_, moe_dims(), stream_);
      aux_rows_ += n_;
    }
  }

  LossStats head_loss_backward(const void* norm_weight, const void* lm_head, float* norm_grad, float* lm_head_grad,
                               float grad_scale) override {
    const Dims& d = d_;
    SHARDLM_CHECK(!options_.rl || has_rl_inputs_, "internal: an RL micro-batch without advantages, logprobs or temperatures");
    const void* x = residual_[config_.num_layers];
    norm_forward(xf_, rstdf_, x, final_norm(norm_weight));
    LossStats stats;
    // RL: the chunks add their sums into rl_stats_, zeroed here (no chunk may run).
    if (options_.rl) CUDA_CHECK(cudaMemsetAsync(rl_stats_, 0, 8 * cuda::kRlStatsFields, stream_));
    for (int64_t t0 = 0; t0 < n_; t0 += d.chunk) {
      const int64_t n = std::min(d.chunk, n_ - t0);
      int64_t loss_rows = 0;
      for (int64_t i = t0; i < t0 + n; ++i) loss_rows += host_targets_[i] >= 0 && host_weights_[i] > 0.0f;
      stats.loss_tokens += loss_rows;
      if (loss_rows == 0) {  // no loss in this chunk: its gradient is exactly zero
        CUDA_CHECK(cudaMemsetAsync(dxf_ + t0 * d.C, 0, 2 * n * d.C, stream_));
        continue;
      }
      cuda::linear_forward(*gemm_, logits_, xf_ + t0 * d.C, bf(lm_head), nullptr, n, d.C, d.V);
      if (options_.rl) {
        cuda::rl_loss_forward_backward(logits_, rl_row_stats_, rl_stats_, targets_ + t0, weights_ + t0,
                                       rl_device_inputs().at(t0), options_.rl_params, grad_scale, n, d.V,
                                       /*accumulate=*/true, stream_);
      } else {
        cuda::cross_entropy_forward_backward(logits_, row_loss_, targets_ + t0, weights_ + t0, grad_scale, n, d.V,
                                             stream_);
        cuda::sum_rows(loss_sum_, row_loss_, n, /*accumulate=*/true, stream_);
      }
      cuda::linear_backward(*gemm_, dxf_ + t0 * d.C, lm_head_grad, nullptr, logits_, xf_ + t0 * d.C, bf(lm_head), n,
                            d.C, d.V, scratch_, scratch_bytes_);
    }
    norm_backward(d_x_, norm_grad, dxf_, x, final_norm(norm_weight), rstdf_, nullptr, grad_amax_at(kStreamGrad));
    // The one host synchronisation of a micro-batch: the loss value (RL: all its statistics).
    double loss = 0;
    std::array<double, cuda::kRlStatsFields> rl{};
    if (options_.rl) {
      CUDA_CHECK(cudaMemcpyAsync(rl.data(), rl_stats_, sizeof rl, cudaMemcpyDeviceToHost, stream_));
    } else {
      CUDA_CHECK(cudaMemcpyAsync(&loss, loss_sum_, 8, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaMemsetAsync(loss_sum_, 0, 8, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (options_.rl) {
      LossStats device = LossStats::from_array(rl);
      SHARDLM_CHECK(device.loss_tokens == stats.loss_tokens,
                    "internal: the RL loss kernel counted %lld loss tokens, the host %lld",
                    (long long)device.loss_tokens, (long long)stats.loss_tokens);
      add_router_aux(device);
      return device;
    }
    stats.loss = loss;
    add_router_aux(stats);
    return stats;
  }

  // The micro-batch's load-balancing loss, E sum_e (counts_e / rows) (prob
  // sums_e / rows), as the CPU's cpu::RouterAux forms it.
  void add_router_aux(LossStats& stats) {
    if (!config_.moe() || aux_scale_ == 0 || aux_rows_ == 0) return;
    std::vector<double> counts(size_t(d_.E)), sums(size_t(d_.E));
    CUDA_CHECK(cudaMemcpyAsync(counts.data(), moe_.aux_counts, 8 * d_.E, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemcpyAsync(sums.data(), moe_.aux_prob_sums, 8 * d_.E, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    double sum = 0;
    const double rows = double(aux_rows_);
    for (int64_t e = 0; e < d_.E; ++e) sum += (counts[size_t(e)] / rows) * (sums[size_t(e)] / rows);
    stats.router_aux_sum = double(d_.E) * sum;
    stats.router_aux_batches = 1;
  }

  void layer_backward(int l, const Unit& unit, const void* params, float* grads) override {
    layer_ = l;
    const LayerWeights<const bf16> w = layer_weights(unit, bf(params));
    const LayerNorms norms = layer_norms(l, unit, bf(params));
    const LayerWeights<float> g = layer_weights(unit, grads);
    Acts& a = acts(l);
    const void* x_in = residual_[l];
    if (options_.checkpoint_activations)
      forward_layer(w, norms, x_in, recompute_out_, a, /*skip_attention=*/keeps_attention(l));
    const Dims& d = d_;
    const int64_t N = n_;
    if (config_.moe_layer(l)) {  // MLP: x_out = x_mid + experts(xn2); gate|up's rows take their gradients
      cuda::MoeLayerActs ma = moe_acts(a);
      SHARDLM_CHECK(!ep_.group || own_expert_grads_.e_gate, "internal: layer %d's backward without its own experts' "
                    "gradients", l);
      cuda::moe_backward(d_xn_, stream_grad_bf16(d_x_), a.xn2, moe_weights(w), moe_grads(g), ma, moe_, moe_dims(),
                         aux_scale_, aux_rows_, ep_, *gemm_, *grouped_, scratch_, scratch_bytes_, stream_);
    } else {
      // MLP: x_out = x_mid + down(silu(gate) * up)
      project_backward(cuda::Fp8Linear::Down, dh_, g.w_down, nullptr, stream_grad_bf16(d_x_), a.h, w.w_down, d.I,
                       d.C, cuda::Dinp::Overwrite, false, amax_ready(amax_at(kH)),
                       amax_ready(grad_amax_at(kStreamGrad)));
      // dgate/dup in place of gate/up (Phases): dgu is a.gu from here on.
      bf16* dgu = a.gu;
      cuda::swiglu_backward(dgu, 2 * d.I, dgu + d.I, 2 * d.I, dh_, d.I, a.gu, 2 * d.I, a.gu + d.I, 2 * d.I, N, d.I,
                            stream_, grad_amax_at(kDgate), grad_amax_at(kDup));
      gate_up_backward(dgu, a.xn2, w, g);
    }
    norm_backward(d_mid_, g.post_norm, d_xn_, a.x_mid, norms.post, a.rstd2, d_x_, grad_amax_at(kStreamGrad));
    // attention: x_mid = x_in + o(attn(rope(norm(q)), rope(norm(k)), v)); its
    // gradients go where gate/up were (dead now), when they fit there
    if (phases_.attention_in_gu) place_attention_phase(reinterpret_cast<char*>(a.gu));
    project_backward(cuda::Fp8Linear::O, d_att_, g.wo, nullptr, stream_grad_bf16(d_mid_), a.att, w.wo, d.HD, d.C,
                     cuda::Dinp::Overwrite, false, amax_ready(amax_at(kAtt)), amax_ready(grad_amax_at(kStreamGrad)));
    attention_backward(a, N);
    cuda::rope_backward(dq_, positions_, inv_freq_, N, d.H, d.D, d.HD, stream_);
    cuda::rope_backward(dk_, positions_, inv_freq_, N, d.KV, d.D, d.KVD, stream_);
    const bf16* dq = dq_;
    const bf16* dk = dk_;
    if (config_.qk_norm) {
      cuda::rmsnorm_backward(dq_raw_, g.q_norm, dq_, a.q_raw, norms.q, a.q_rstd, nullptr, N * d.H, d.D, scratch_,
                             scratch_bytes_, stream_);
      cuda::rmsnorm_backward(dk_raw_, g.k_norm, dk_, a.k_raw, norms.k, a.k_rstd, nullptr, N * d.KV, d.D, scratch_,
                             scratch_bytes_, stream_);
      dq = dq_raw_;
      dk = dk_raw_;
    }
    project_backward(cuda::Fp8Linear::Q, d_xn_, g.wq, g.bq, dq, a.xn1, w.wq, d.C, d.HD, cuda::Dinp::Overwrite, false,
                     amax_ready(amax_at(kXn1)));
    // k's and v's input gradients are added to q's in their GEMMs' epilogues.
    project_backward(cuda::Fp8Linear::K, d_xn_, g.wk, g.bk, dk, a.xn1, w.wk, d.C, d.KVD, cuda::Dinp::Accumulate,
                     /*same_input=*/true);
    project_backward(cuda::Fp8Linear::V, d_xn_, g.wv, g.bv, dv_, a.xn1, w.wv, d.C, d.KVD, cuda::Dinp::Accumulate,
                     /*same_input=*/true);
    norm_backward(d_x_, g.input_norm, d_xn_, x_in, norms.input, a.rstd1, d_mid_, grad_amax_at(kStreamGrad));
  }

  void embed_backward(float* table_grad) override {
    // An fp32 stream's gradient reaches the table rounded to bf16 (the copy the
    // first layer's input-norm backward wrote): the table's gradient is fp32.
    cuda::embedding_backward(table_grad, stream_grad_bf16(d_x_), tokens_, n_, d_.V, d_.C, scratch_, scratch_bytes_,
                             stream_);
  }

  // Forward only: head_loss_backward's cross-entropy chunks without the
  // backward GEMMs (grad_scale 0 leaves zeros in the scratch logits).
  LossStats head_loss(const void* norm_weight, const void* lm_head) override {
    const Dims& d = d_;
    norm_forward(xf_, rstdf_, residual_[config_.num_layers], final_norm(norm_weight));
    LossStats stats;
    for (int64_t t0 = 0; t0 < n_; t0 += d.chunk) {
      const int64_t n = std::min(d.chunk, n_ - t0);
      int64_t loss_rows = 0;
      for (int64_t i = t0; i < t0 + n; ++i) loss_rows += host_targets_[i] >= 0 && host_weights_[i] > 0.0f;
      stats.loss_tokens += loss_rows;
      if (loss_rows == 0) continue;
      cuda::linear_forward(*gemm_, logits_, xf_ + t0 * d.C, bf(lm_head), nullptr, n, d.C, d.V);
      cuda::cross_entropy_forward_backward(logits_, row_loss_, targets_ + t0, weights_ + t0, 0.0f, n, d.V, stream_);
      cuda::sum_rows(loss_sum_, row_loss_, n, /*accumulate=*/true, stream_);
    }
    double loss = 0;
    CUDA_CHECK(cudaMemcpyAsync(&loss, loss_sum_, 8, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemsetAsync(loss_sum_, 0, 8, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    stats.loss = loss;
    return stats;
  }

  // Forward only: the RL loss's logp of each row, chunk by chunk as
  // head_loss_backward forms the logits; one copy to the host at the end.
  void head_token_logprobs(const void* norm_weight, const void* lm_head, float* logprobs) override {
    const Dims& d = d_;
    SHARDLM_CHECK(token_logprobs_ && has_rl_inputs_,
                  "internal: token logprobs need an RL micro-batch on a backend planned for a sequence-level loss");
    norm_forward(xf_, rstdf_, residual_[config_.num_layers], final_norm(norm_weight));
    for (int64_t t0 = 0; t0 < n_; t0 += d.chunk) {
      const int64_t n = std::min(d.chunk, n_ - t0);
      if (std::none_of(host_targets_.begin() + t0, host_targets_.begin() + t0 + n, [](int32_t y) { return y >= 0; })) {
        CUDA_CHECK(cudaMemsetAsync(token_logprobs_ + t0, 0, 4 * n, stream_));
        continue;
      }
      cuda::linear_forward(*gemm_, logits_, xf_ + t0 * d.C, bf(lm_head), nullptr, n, d.C, d.V);
      cuda::rl_token_logprobs(token_logprobs_ + t0, logits_, targets_ + t0, temperatures_ + t0, n, d.V, stream_);
    }
    CUDA_CHECK(cudaMemcpyAsync(logprobs, token_logprobs_, 4 * n_, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void head_logits(const void* norm_weight, const void* lm_head, float* logits) override {
    const Dims& d = d_;
    norm_forward(xf_, rstdf_, residual_[config_.num_layers], final_norm(norm_weight));
    std::vector<uint16_t> host(d.chunk * d.V);
    for (int64_t t0 = 0; t0 < n_; t0 += d.chunk) {
      const int64_t n = std::min(d.chunk, n_ - t0);
      cuda::linear_forward(*gemm_, logits_, xf_ + t0 * d.C, bf(lm_head), nullptr, n, d.C, d.V);
      CUDA_CHECK(cudaMemcpyAsync(host.data(), logits_, 2 * n * d.V, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      for (int64_t i = 0; i < n * d.V; ++i) logits[t0 * d.V + i] = bf16_to_f32(host[i]);
    }
  }

 private:
  static constexpr size_t kGemmWorkspace = size_t(32) << 20;

  void init() {
    if (stream_) return;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    gemm_workspace_ = own(Mem::Workspace, kGemmWorkspace);
    gemm_ = std::make_unique<cuda::Gemm>(stream_, gemm_workspace_, kGemmWorkspace);
  }

  // The RL loss's per-token inputs of the loaded micro-batch, in device memory.
  RlTokenInputs rl_device_inputs() const {
    return {advantages_, inference_logprobs_, has_sampling_logprobs_ ? sampling_logprobs_ : nullptr, temperatures_,
            has_sequence_terms_ ? sequence_log_ratio_ : nullptr, has_sequence_terms_ ? sequence_log_is_ : nullptr,
            has_ref_logprobs_ ? ref_logprobs_ : nullptr};
  }

  static const bf16* bf(const void* p) { return static_cast<const bf16*>(p); }
  static bf16* bf(void* p) { return static_cast<bf16*>(p); }
  static const float* f32(const void* p) { return static_cast<const float*>(p); }
  static float* f32(void* p) { return static_cast<float*>(p); }

  // The residual stream's kernels, for either of its types (model.residual_dtype).
  bool fp32_stream() const { return stream_bytes_ == 4; }
  // amax (nullptr: none): the normed output's, for its FP8 projections (fused amaxes).
  void norm_forward(bf16* out, float* rstd, const void* x, cuda::NormWeight weight, float* amax = nullptr) {
    if (fp32_stream()) cuda::rmsnorm_forward(out, rstd, f32(x), weight, n_, d_.C, config_.rms_norm_eps, stream_, amax);
    else cuda::rmsnorm_forward(out, rstd, bf(x), weight, n_, d_.C, config_.rms_norm_eps, stream_, amax);
  }
  // x_mid = x_in + projected (rounded to the stream's type), normed = its norm.
  void add_norm_forward(void* x_mid, bf16* normed, float* rstd, const void* x_in, const bf16* projected,
                        cuda::NormWeight weight, float* amax = nullptr) {
    const double eps = config_.rms_norm_eps;
    if (fp32_stream())
      cuda::residual_rmsnorm_forward(f32(x_mid), normed, rstd, f32(x_in), projected, weight, n_, d_.C, eps, stream_,
                                     amax);
    else
      cuda::residual_rmsnorm_forward(bf(x_mid), normed, rstd, bf(x_in), projected, weight, n_, d_.C, eps, stream_,
                                     amax);
  }
  // dinp = the norm's backward + dresidual; an fp32 stream also leaves dinp
  // rounded to bf16 in d_stream_bf16_ for the projection backward that reads it.
  // amax (nullptr: none): the bf16 gradient's, for the projection backward that reads it.
  void norm_backward(void* dinp, float* dweight, const bf16* dout, const void* inp, cuda::NormWeight weight,
                     const float* rstd, const void* dresidual, float* amax = nullptr) {
    if (fp32_stream())
      cuda::rmsnorm_backward(f32(dinp), d_stream_bf16_, dweight, dout, f32(inp), weight, rstd, f32(dresidual), n_,
                             d_.C, scratch_, scratch_bytes_, stream_, amax);
    else
      cuda::rmsnorm_backward(bf(dinp), dweight, dout, bf(inp), weight, rstd, bf(dresidual), n_, d_.C, scratch_,
                             scratch_bytes_, stream_, amax);
  }
  // The stream gradient norm_backward wrote last, as a GEMM operand (bf16).
  const bf16* stream_grad_bf16(const void* d) const { return fp32_stream() ? d_stream_bf16_ : bf(d); }
  Acts& acts(int l) {
    if (!options_.checkpoint_activations) return acts_[size_t(l)];
    Acts& a = acts_[0];
    const bool kept = keeps_attention(l);
    a.att = kept ? saved_att_[size_t(l)] : shared_att_, a.lse = kept ? saved_lse_[size_t(l)] : shared_lse_;
    return a;
  }

  // Selective checkpointing: layer l's attention output outlives the forward.
  bool keeps_attention(int64_t l) const { return l < int64_t(saved_att_.size()); }

  void* own(Mem category, size_t bytes) {
    void* p = allocate(category, bytes);
    owned_.emplace_back(p, bytes);
    return p;
  }
  void upload(void* dst, const void* src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }

  // A layer's norm weights as its kernels read them: the fp32 copies
  // (model.norm_dtype = "fp32") or the gathered unit's bf16.
  struct LayerNorms {
    cuda::NormWeight input, q, k, post;
  };
  LayerNorms layer_norms(int l, const Unit& unit, const bf16* params) const {
    const LayerWeights<const bf16> w = layer_weights(unit, params);
    if (!norm_fp32_) return {w.input_norm, w.q_norm, w.k_norm, w.post_norm};
    const UnitNorms& n = unit_norms_[size_t(1 + l)];
    auto at = [&](int64_t off) -> const float* { return off < 0 ? nullptr : norm_fp32_ + off; };
    return {at(n.input), at(n.q), at(n.k), at(n.post)};
  }
  cuda::NormWeight final_norm(const void* gathered) const {
    if (!norm_fp32_) return bf(gathered);
    return static_cast<const float*>(norm_fp32_ + unit_norms_.back().final);
  }

  // The layer of experts' views (cuda/moe.hpp): its activations in `a`, its
  // sizes at this micro-batch.
  cuda::MoeLayerActs moe_acts(Acts& a) const {
    const int64_t R = d_.P * n_ * d_.K;  // the experts' rows (every rank's, at most, under expert parallelism)
    return {a.probs,  a.expert, a.weight, a.slot, a.row, a.offsets, a.gu, a.h, a.y,
            a.gu + R * 2 * d_.Im, a.h + R * d_.Im, a.shared_out, a.shared_logit, &a.host_offsets, &a.host_ep_rows};
  }
  // The routed experts' weights and gradients: the layer unit's, or under
  // expert parallelism this rank's own (set_layer_experts).
  cuda::MoeWeights moe_weights(const LayerWeights<const bf16>& w) const {
    return ep_.group ? cuda::moe_weights(w, own_experts_, 3 * d_.Im * d_.C) : cuda::moe_weights(w, w, d_.Im * d_.C);
  }
  cuda::MoeGrads moe_grads(const LayerWeights<float>& g) const {
    return ep_.group ? cuda::moe_grads(g, own_expert_grads_, 3 * d_.Im * d_.C) : cuda::moe_grads(g, g, d_.Im * d_.C);
  }
  cuda::MoeDims moe_dims() const { return {n_, d_.C, d_.E, d_.K, d_.Im, d_.Is, config_.norm_topk_prob}; }

  // skip_attention: activation checkpointing's second forward in backward, for a
  // layer whose attention output selective checkpointing kept.
  void forward_layer(const LayerWeights<const bf16>& w, const LayerNorms& norms, const void* x_in, void* x_out,
                     Acts& a, bool skip_attention = false) {
    const Dims& d = d_;
    const int64_t N = n_;
    const double eps = config_.rms_norm_eps;
    norm_forward(a.xn1, a.rstd1, x_in, norms.input, amax_at(kXn1));
    bf16* q_proj = config_.qk_norm ? a.q_raw : a.q;
    bf16* k_proj = config_.qk_norm ? a.k_raw : a.k;
    project(cuda::Fp8Linear::Q, q_proj, a.xn1, w.wq, w.bq, d.C, d.HD, nullptr, false, amax_ready(amax_at(kXn1)));
    project(cuda::Fp8Linear::K, k_proj, a.xn1, w.wk, w.bk, d.C, d.KVD, nullptr, /*same_input=*/true);
    project(cuda::Fp8Linear::V, a.v, a.xn1, w.wv, w.bv, d.C, d.KVD, nullptr, /*same_input=*/true);
    if (config_.qk_norm) {
      cuda::rmsnorm_forward(a.q, a.q_rstd, a.q_raw, norms.q, N * d.H, d.D, eps, stream_);
      cuda::rmsnorm_forward(a.k, a.k_rstd, a.k_raw, norms.k, N * d.KV, d.D, eps, stream_);
    }
    cuda::rope_forward(a.q, positions_, inv_freq_, N, d.H, d.D, d.HD, stream_);
    cuda::rope_forward(a.k, positions_, inv_freq_, N, d.KV, d.D, d.KVD, stream_);
    if (!skip_attention) attention_forward(a, N);
    // A bf16 stream: x_out holds the o_proj output until the residual add below
    // overwrites it. An fp32 one: the projections write bf16 into proj_out_, added
    // to the stream unrounded.
    bf16* projected = fp32_stream() ? proj_out_ : bf(x_out);
    project(cuda::Fp8Linear::O, projected, a.att, w.wo, nullptr, d.HD, d.C, nullptr, false, amax_kept(amax_at(kAtt)));
    add_norm_forward(a.x_mid, a.xn2, a.rstd2, x_in, projected, norms.post, amax_at(kXn2));
    if (config_.moe_layer(layer_)) {  // x_out = x_mid + the experts' weighted sum, added unrounded
      cuda::MoeLayerActs ma = moe_acts(a);
      const int32_t* forced = has_routes_ ? routes_ + config_.route_offset(layer_) : nullptr;
      if (fp32_stream())
        return cuda::moe_forward(f32(x_out), f32(a.x_mid), a.xn2, moe_weights(w), ma, moe_, moe_dims(), forced,
                                 config_.route_width(), ep_, *gemm_, *grouped_, stream_);
      return cuda::moe_forward(bf(x_out), bf(a.x_mid), a.xn2, moe_weights(w), ma, moe_, moe_dims(), forced,
                               config_.route_width(), ep_, *gemm_, *grouped_, stream_);
    }
    gate_up_forward(a.gu, a.xn2, w);
    cuda::swiglu_forward(a.h, d.I, a.gu, 2 * d.I, a.gu + d.I, 2 * d.I, N, d.I, stream_, amax_at(kH));
    if (!fp32_stream())
      return project(cuda::Fp8Linear::Down, bf(x_out), a.h, w.w_down, nullptr, d.I, d.C, /*residual=*/bf(a.x_mid),
                     false, amax_ready(amax_at(kH)));
    project(cuda::Fp8Linear::Down, proj_out_, a.h, w.w_down, nullptr, d.I, d.C, nullptr, false,
            amax_ready(amax_at(kH)));
    cuda::add_bf16_to_f32(f32(x_out), f32(a.x_mid), proj_out_, N * d.C, stream_);
  }

  // A decoder block's projection over the micro-batch's n_ tokens: out (N, OC) =
  // inp (N, IC) weight^T + bias [+ residual], a bf16 cuBLASLt GEMM or model.fp8's.
  // same_input: the last projection's input again (q, k and v all read xn1), in
  // the forward or the backward: FP8 reuses its codes rather than quantising the
  // same values once more.
  // model.fp8_weight_cache: the cache slot of the current layer's weight `which` (-1: no cache).
  int fp8_slot(cuda::Fp8Linear::Weight which) const {
    return options_.fp8_weight_cache ? int(layer_ * cuda::Fp8Linear::kWeights + which) : -1;
  }
  // inp_amax, dout_amax: the operands' amaxes where the fused amaxes hold them.
  void project(cuda::Fp8Linear::Weight which, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
               int64_t IC, int64_t OC, const bf16* residual = nullptr, bool same_input = false,
               cuda::Fp8Linear::Amax inp_amax = {}) {
    if (!fp8_) return cuda::linear_forward(*gemm_, out, inp, weight, bias, n_, IC, OC, residual);
    fp8_->forward(out, OC, inp, weight, bias, n_, IC, OC, residual, same_input, fp8_slot(which), inp_amax);
  }
  void project_backward(cuda::Fp8Linear::Weight which, bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                        const bf16* inp, const bf16* weight, int64_t IC, int64_t OC,
                        cuda::Dinp mode = cuda::Dinp::Overwrite, bool same_input = false,
                        cuda::Fp8Linear::Amax inp_amax = {}, cuda::Fp8Linear::Amax dout_amax = {}) {
    if (!fp8_)
      return cuda::linear_backward(*gemm_, dinp, dweight, dbias, dout, inp, weight, n_, IC, OC, scratch_,
                                   scratch_bytes_, mode);
    fp8_->backward(dinp, mode == cuda::Dinp::Accumulate, dweight, dbias, dout, OC, inp, weight, n_, IC, OC, scratch_,
                   scratch_bytes_, same_input, fp8_slot(which), inp_amax, dout_amax);
  }
  // gate|up (N, 2I) = xn2 [w_gate; w_up]^T: one bf16 GEMM over the two adjacent
  // weights, or two FP8 ones (each weight its own scales, as the CPU's).
  void gate_up_forward(bf16* gu, const bf16* xn2, const LayerWeights<const bf16>& w) {
    const Dims& d = d_;
    if (!fp8_) return cuda::linear_forward(*gemm_, gu, xn2, w.w_gate, nullptr, n_, d.C, 2 * d.I);
    fp8_->forward(gu, 2 * d.I, xn2, w.w_gate, nullptr, n_, d.C, d.I, nullptr, false, fp8_slot(cuda::Fp8Linear::Gate),
                  amax_ready(amax_at(kXn2)));
    fp8_->forward(gu + d.I, 2 * d.I, xn2, w.w_up, nullptr, n_, d.C, d.I, /*residual=*/nullptr, /*same_input=*/true,
                  fp8_slot(cuda::Fp8Linear::Up));
  }
  // d_xn_ = dgu (N, 2I) [w_gate; w_up]; the weights' gradients accumulated.
  void gate_up_backward(const bf16* dgu, const bf16* xn2, const LayerWeights<const bf16>& w,
                        const LayerWeights<float>& g) {
    const Dims& d = d_;
    if (!fp8_)
      return cuda::linear_backward(*gemm_, d_xn_, g.w_gate, nullptr, dgu, xn2, w.w_gate, n_, d.C, 2 * d.I, scratch_,
                                   scratch_bytes_);
    // dgate and dup are column blocks of dgu, read in place (rows 2I apart); xn2's
    // transposed codes are made once for both.
    for (int half = 0; half < 2; ++half)
      fp8_->backward(d_xn_, /*accumulate_dinp=*/half == 1, half ? g.w_up : g.w_gate, nullptr, dgu + half * d.I,
                     2 * d.I, xn2, half ? w.w_up : w.w_gate, n_, d.C, d.I, scratch_, scratch_bytes_,
                     /*same_input=*/half == 1, fp8_slot(half ? cuda::Fp8Linear::Up : cuda::Fp8Linear::Gate),
                     amax_ready(amax_at(kXn2)), amax_ready(grad_amax_at(half ? kDup : kDgate)));
  }

  cudaStream_t stream_ = nullptr;
  void* gemm_workspace_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::GroupedGemm> grouped_;  // a model of experts' grouped GEMMs
  cuda::MoeScratch moe_{};                 // its workspace (dh is dh_)
  void** moe_pointers_ = nullptr;          // the grouped GEMMs' operand arrays
  int32_t* routes_ = nullptr;              // router replay: (N, route_width) the sampler's experts
  bool has_routes_ = false;                // the loaded micro-batch carries them
  double aux_scale_ = 0;                   // its load-balancing loss's weight (0: none)
  int64_t aux_rows_ = 0;                   // the rows its counts were taken over
  std::unique_ptr<cuda::Fp8Linear> fp8_;   // model.fp8's projections (nullptr: bf16 GEMMs)
  cuda::Fp8Linear::Buffers fp8_buffers_;   // its scratch, from the buffer table
  float* fp8_amaxes_ = nullptr;            // the fused amaxes' slots (fused_amax), else nullptr
  std::vector<std::pair<void*, size_t>> owned_;
  std::vector<bf16*> shards_;            // per unit: bf16 copy of the master shard
  // model.norm_dtype = "fp32": every unit's norm weights in fp32 (norm_slots
  // packing, the engine keeps them equal to the masters), and where each is.
  struct UnitNorms {
    int64_t base = 0;                               // the unit's first float in norm_fp32_
    int64_t input = -1, q = -1, k = -1, post = -1, final = -1;  // each weight's first float; -1: none
  };
  float* norm_fp32_ = nullptr;
  std::vector<UnitNorms> unit_norms_;
  float* host_staging_ = nullptr;        // pinned (max padded numel) for gradients to the host
  float* device_staging_ = nullptr;      // (max padded numel) masters on their way to bf16
  int64_t staging_floats_ = 0;

  ModelConfig config_;
  EngineOptions options_;
  Dims d_{};
  int64_t n_ = 0;                        // tokens of the current micro-batch
  int64_t layer_ = 0;                    // the layer under way (model.fp8_weight_cache's slots)
  bool has_rl_inputs_ = false;           // the loaded micro-batch carries advantages (RL training)
  std::vector<int32_t> host_targets_;
  std::vector<float> host_weights_;
  int32_t *tokens_ = nullptr, *targets_ = nullptr, *positions_ = nullptr, *seq_ids_ = nullptr, *doc_start_ = nullptr;
  float* weights_ = nullptr;
  float *advantages_ = nullptr, *inference_logprobs_ = nullptr, *temperatures_ = nullptr;  // RL, (N) each
  float* sampling_logprobs_ = nullptr;   // RL with loss.is_level: (N); used when the micro-batch has them
  double *sequence_log_ratio_ = nullptr, *sequence_log_is_ = nullptr;  // RL, a loss over whole samples: (N) each
  float* token_logprobs_ = nullptr;  // RL, a loss over whole samples or a reference KL: (N) a forward-only pass's logprobs
  float* ref_logprobs_ = nullptr;    // RL, loss.ref_kl_coef > 0: (N) the frozen reference's logprobs
  bool has_sampling_logprobs_ = false, has_sequence_terms_ = false, has_ref_logprobs_ = false;  // the loaded micro-batch's
  float* inv_freq_ = nullptr;
  std::vector<void*> residual_;          // (L + 1) x (N, C) of the stream's type (stream_bytes_)
  int64_t stream_bytes_ = 2;             // the residual stream's element: 2 (bf16) or 4 (fp32)
  bf16* proj_out_ = nullptr;             // fp32 stream: (N, C) a projection's bf16 output before its add
  bf16* d_stream_bf16_ = nullptr;        // fp32 stream: (N, C) the last stream gradient rounded to bf16
  std::vector<Acts> acts_;
  void* recompute_out_ = nullptr;        // (N, C) of the stream's type
  std::vector<bf16*> saved_att_;         // selective checkpointing: K x (N, H, D) for layers [0, K)
  std::vector<float*> saved_lse_;        // K x (N, H)
  bf16* shared_att_ = nullptr;           // checkpointing: the other layers' attention output, lse
  float* shared_lse_ = nullptr;
  void *d_x_ = nullptr, *d_mid_ = nullptr;  // (N, C) each, the stream's type
  bf16 *d_xn_ = nullptr, *d_att_ = nullptr;
  bf16 *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr, *dq_raw_ = nullptr, *dk_raw_ = nullptr;
  bf16* dh_ = nullptr;                   // (N, I), in the shared region
  Phases phases_;                        // where the phase-shared buffers live
  char* shared_ = nullptr;
  bf16 *xf_ = nullptr, *dxf_ = nullptr, *logits_ = nullptr;
  float *rstdf_ = nullptr, *row_loss_ = nullptr;
  double* loss_sum_ = nullptr;
  double* rl_row_stats_ = nullptr;       // RL: (kRlStatsFields, chunk) per-row statistics of a chunk
  double* rl_stats_ = nullptr;           // RL: (kRlStatsFields) sums over the micro-batch
  void* delta_ = nullptr;
  size_t delta_bytes_ = 0;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::unique_ptr<cuda::CudnnSdpa> sdpa_;  // cuDNN's attention, when chosen (choose_attention)
  // model.fp8_attention: cuDNN's FP8 graphs over sdpa_, its scales' memory, which
  // layers' forward ran in FP8 this micro-batch, and whether FP8 is still tried
  // (off for good once a backward is refused).
  std::unique_ptr<cuda::Fp8Attention> fp8_attention_;
  void* fp8_attention_state_ = nullptr;
  std::vector<bool> fp8_attention_used_;
  bool fp8_attention_on_ = true;
  int64_t attention_passes_ = 0, fp8_attention_passes_ = 0;  // kernels_note's count
  std::string reported_fp8_refusal_;
  int32_t* token_index_ = nullptr;         // context parallelism: (N) index in the group's micro-batch
  cuda::RingBuffers ring_buffers_;         // context parallelism: the ring's blocks and accumulators
  std::unique_ptr<Comm> ring_comm_;        // set_context_parallel: the device Comm over the group
  std::unique_ptr<cuda::RingAttention> ring_;
  cuda::MoeExpertParallel ep_;             // expert parallelism: its exchange (group: set_expert_parallel)
  std::unique_ptr<Comm> ep_comm_;          // the device Comm its rows travel over
  // The layer's own experts and their gradients (set_layer_experts).
  LayerWeights<const bf16> own_experts_{};
  LayerWeights<float> own_expert_grads_{};
  void* sdpa_backward_buffers_ = nullptr;  // its backward buffers, in the shared region
  std::string attention_note_, reported_refusal_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace shardlm
