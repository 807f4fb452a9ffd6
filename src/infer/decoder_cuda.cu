// decoder_cuda.cu — prefill, extend and decode over a bf16 KV cache on the GPU
// (see infer/decoder_cuda.hpp). The layer is training's (backend_cuda.cu's
// forward_layer): the same kernels in the same order, with the cache store
// after RoPE and decode_attention.hpp's kernel in place of the flash attention
// when the rows attend over the cache (a decode step's new token per
// sequence; an extend's new tokens, each over its sequence's positions up to
// its own).
#include "infer/decoder_cuda.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/ops.hpp"
#include "cuda/attention.hpp"
#include "cuda/check.hpp"
#include "cuda/decode_attention.hpp"
#include "cuda/gemm.hpp"
#include "cuda/moe.hpp"
#include "cuda/op_timer.hpp"
#include "cuda/ops.hpp"
#include "cuda/sampling.hpp"
#include "cuda/token_logprobs.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

namespace {

using cuda::bf16;

// Prefill passes hold at most this many tokens (or one whole prompt when it is
// longer): prompts beyond it wait for the next pass. It bounds the activations
// (1B shape: 16384 x (2 x 8192) bf16 = 512 MiB for the gate|up output).
constexpr int64_t kPrefillTokens = 16384;
constexpr size_t kGemmWorkspace = size_t(32) << 20;   // what cuBLASLt asks for on Hopper
constexpr int64_t kUploadElems = int64_t(16) << 20;   // fp32 -> bf16 staging of the weight upload

// Whether environment variable `name` is set to `value` (the decoder's switches).
bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, value) == 0;
}

// Whether a layer's q, k and v weights (and biases, when it has them) lie one
// after another in its unit: then one GEMM computes q|k|v.
bool qkv_adjacent(const Unit& u) {
  const auto next = [&](const char* a, const char* b) {
    const ParamInfo *pa = u.find_param(a), *pb = u.find_param(b);
    return pa && pb && pb->offset == pa->offset + pa->numel;
  };
  const bool biases = u.find_param("q_proj.bias") || u.find_param("k_proj.bias") || u.find_param("v_proj.bias");
  return next("q_proj.weight", "k_proj.weight") && next("k_proj.weight", "v_proj.weight") &&
         (!biases || (next("q_proj.bias", "k_proj.bias") && next("k_proj.bias", "v_proj.bias")));
}

// A pass's int32 inputs in one block on the device and its pinned host mirror,
// copied whole before the pass: tokens, positions, seq_ids, cache rows (`rows`
// each), then slot, length, last-row source, last-row destination (`slots`
// each). Prefill passes use a block of the largest pass's rows; decode steps a
// block of `slots` rows, so a step uploads 8 x slots values; extend passes a
// block of the largest pass's rows for every field (their attention has a row,
// a slot and a length per new token).
struct StepInts {
  enum Field { Tokens, Positions, SeqIds, CacheRows, SlotOf, Lens, LastSrc, LastDst };
  int32_t* dev = nullptr;
  int32_t* host = nullptr;
  int64_t rows = 0, slots = 0;
  int64_t count() const { return 4 * rows + 4 * slots; }
  int64_t offset(Field f) const { return f < SlotOf ? int64_t(f) * rows : 4 * rows + int64_t(f - SlotOf) * slots; }
  int32_t* d(Field f) const { return dev + offset(f); }
  int32_t* h(Field f) const { return host + offset(f); }
};

// What a pass's rows attend over: the pass itself (a prefill's prompts, the
// flash attention), or the cache, a row per new token (the decode attention):
// an extend's rows (several a sequence), or a decode step's (one a sequence,
// which may take the fused q|k|v GEMM and the K-parts down projection, whose
// buffers hold `slots` rows).
enum class Pass { Prefill, Extend, Decode };

// Adds the time from its construction to its end to `wall` when `on`: a
// decoder call, which returns synchronised, timed from the host.
class CallTimer {
 public:
  template <class Wall>
  CallTimer(bool on, Wall& wall) : seconds_(on ? &wall.seconds : nullptr), calls_(on ? &wall.calls : nullptr) {}
  ~CallTimer() {
    if (!seconds_) return;
    *seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    ++*calls_;
  }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;

 private:
  double* seconds_;
  int64_t* calls_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

class CudaDecoder final : public Decoder {
 public:
  CudaDecoder(const InferenceModel& model, const DecoderLimits& limits);
  ~CudaDecoder() override;

  void load_bf16(const ParamInfo& param, const uint16_t* values) override;
  bool loads_from_device() const override { return true; }
  void load_bf16_device(const ParamInfo& param, const void* values) override;
  float* host_logits() override { return logits_host_; }
  void token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature,
                      int64_t n) override;
  bool draws_on_device() const override { return device_draws_; }
  void draw(const SamplingParams& params, const double* uniforms, int64_t n, Sampled* out, float* model_lp,
            float* tempered_lp) override;

  int64_t cache_bytes() const override { return bytes_of(Mem::Activations); }
  int64_t scratch_bytes() const override { return bytes_of(Mem::Workspace); }
  int64_t weight_bytes() const override { return bytes_of(Mem::ParamShard); }
  const ModelConfig& config() const override { return model_.config(); }
  std::string describe() const override {
    return "cuda bf16 on " + cuda_device_name(device_) +
           (graphs_ ? ", decode steps as " + std::to_string(step_graphs_.size()) + " CUDA graphs" : "") +
           (fused_qkv_ ? ", q|k|v as one GEMM" : "") +
           (grouped_ ? ", the experts as cuBLAS grouped GEMMs" : "") +
           (split_down_ ? ", down in " + std::to_string(cuda::kSplitkParts) + " K-parts with the next norm" : "");
  }
  int64_t decode_steps() const override { return decode_steps_; }
  double decode_seconds() const override {
    add_step_time();
    return decode_seconds_;
  }
  std::string profile_report(double generate_seconds) const override;

 protected:
  // Passes of whole prompts into their blocks, the shared prompts' last blocks
  // copied, then the head over each sequence's row.
  void prefill_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                       std::span<const BlockCopy> copies, std::span<const int32_t> source, float* logits) override;
  void decode_forward(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits) override;
  // Passes of whole slots' new rows (at most prefill_rows_ each; every new k
  // and v stored before the decode attention reads the cache), then the head
  // over each slot's last row.
  void extend_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                      float* logits) override;

 private:
  // Where a broadcast parameter lives in the decoder's bf16 weights (checked against the layout).
  bf16* weight_of(const ParamInfo& param);
  // One row of the plan: what it is, where it is counted, its size; the table
  // both allocates and counts (cache_bytes, scratch_bytes, weight_bytes).
  struct BufferRow {
    const char* name;
    Mem category;
    int64_t bytes;
    void** ptr;
  };
  template <class Add, class Pin>
  static void plan_buffers(const ModelConfig& c, const ModelLayout& layout, const DecoderLimits& limits,
                           CudaDecoder* self, Add&& add, Pin&& pin);
  friend DecoderPlan shardlm::plan_cuda_decoder(const ModelConfig& c, const DecoderLimits& limits);
  int64_t bytes_of(Mem category) const {
    int64_t b = 0;
    for (const BufferRow& r : table_) b += r.category == category ? r.bytes : 0;
    return b;
  }
  void upload_weights();
  const bf16* param(const Unit& u, const char* name) const {
    return unit_w_[size_t(&u - model_.weights->layout.units.data())] + u.param(name).offset;
  }
  // Layer l's weights in its unit's device copy (unit 1 + l).
  LayerWeights<const bf16> weights_of_layer(int l) const {
    return layer_weights(model_.weights->layout.layer(l), static_cast<const bf16*>(unit_w_[size_t(1 + l)]));
  }
  // A pass's int32 inputs: begin_inputs waits until the device has read the
  // last ones (the host mirror is then free); send_inputs uploads `in` and makes
  // it the block run_layers reads.
  void begin_inputs();
  void send_inputs(const StepInts& in);
  // Embedding and every layer over the N rows of the pass's inputs: k and v
  // stored in the cache, attention over the pass (prefill) or the cache.
  void run_layers(int64_t N, Pass pass) {
    embed(N);
    layers(N, pass, 0, int(model_.config().num_layers));
  }
  void embed(int64_t N);
  void layers(int64_t N, Pass pass, int first, int last);  // layers [first, last)
  // Layer l's attention from xn_ into att_ (its k and v stored in the cache):
  // q, k and v as three GEMMs (prefill, extend, q/k norm models), or, decoding,
  // as one (fused_qkv_) whose rows RoPE, the cache store and the decode
  // attention read.
  void attend(int l, int64_t N, Pass pass, const LayerWeights<const bf16>& w);
  // Layer l's MLP as a layer of experts (cuda/moe.hpp): x_out_ = x_mid_ +
  // experts(xn_); recording routes, each row's experts into its slot's table.
  void experts(int l, int64_t N, const LayerWeights<const bf16>& w);
  void attend_fused(int l, int64_t N, const LayerWeights<const bf16>& w);
  // logits_ (n, V) fp32 = lm_head(norm(rows)); rows (n, C) on the device.
  void head(const bf16* rows, int64_t n);
  void download_logits(int64_t n, float* logits);
  // The decode forward of a full batch (B = slots) as CUDA graphs, captured
  // when the decoder is made (after one eager step that builds the GEMM
  // plans), as inference engines capture theirs at start-up; every full-batch
  // step replays them. ~230 launches a step at the 1B shape cost more host time
  // than the GPU needs. In pieces (step_pieces): the embedding alone, then 1,
  // 2, 4, 8, 8, ... layers, the head with the last, so that the GPU waits only
  // for the first, one-kernel piece's launch and the host launches each next
  // piece while the GPU runs the one before (one graph of ~200 nodes took the
  // host 0.24 ms to launch, the GPU idle all that time).
  void capture_full_step();
  struct StepPiece {
    bool embed;        // the embedding first
    int first, last;   // then layers [first, last); the head after the last layer
  };
  std::vector<StepPiece> step_pieces() const;
  // SHARDLM_DECODE_PROFILE=1: op ends the operation enqueued since the last mark (a no-op otherwise).
  void mark(const char* op) {
    if (ops_) ops_->mark(op);
  }
  // The block table's entries written since the last call (KvBlocks::take_written), onto the device copy.
  void send_table();
  // The device block table as the decode attention reads it.
  KvPages device_pages() const { return {block_table_, kv_.table_ld(), kv_.block_size()}; }

  const InferenceModel& model_;
  int device_ = 0;
  int64_t rows_ = 0;           // tokens one pass holds: max(prefill pass, slots)
  int64_t prefill_rows_ = 0;   // tokens one prefill pass holds
  size_t attention_scratch_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t step_begin_ = nullptr, step_end_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::vector<BufferRow> table_;

  std::vector<bf16*> unit_w_;                 // per unit: (padded_numel) bf16, the host layout
  std::vector<bf16*> k_cache_, v_cache_;      // L x (blocks, KV, block_size, D): kv_cache_at (kernel_common.cuh)
  int32_t* block_table_ = nullptr;            // (slots, table_ld) the device copy of kv_'s table
  // Small int32 uploads beside a pass's inputs: block table entries written
  // (index, block) pairs; a prefill's block copies (from, to) and each row's
  // prompt. aux_ on the device, aux_host_ its pinned mirror.
  int32_t* aux_ = nullptr;
  int32_t* aux_host_ = nullptr;
  int64_t aux_table_ = 0;                     // 2 x the table's entries: where the copies' region starts
  bf16 *x_ = nullptr, *x_out_ = nullptr;      // (rows, C) residual stream in, out of a layer
  bf16 *x_mid_ = nullptr, *xn_ = nullptr;     // (rows, C) after attention; normed input of a projection
  bf16 *q_ = nullptr, *q_raw_ = nullptr;      // (rows, H D); q before its norm (qk_norm models)
  bf16 *k_ = nullptr, *k_raw_ = nullptr, *v_ = nullptr;  // (rows, KV D)
  bf16 *att_ = nullptr;                       // (rows, H D)
  bf16 *qkv_ = nullptr;                       // (slots, H D + 2 KV D) a decode step's fused q|k|v
  // q|k|v as one GEMM in decode steps: no q/k norm (Qwen3's needs q and k
  // apart) and their weights adjacent in every layer.
  bool fused_qkv_ = false;
  // Decode steps' down projection as S = cuda::kSplitkParts K-parts (where S
  // divides I into multiples of 8) reduced with the residual and the next
  // input norm (layers()); otherwise one GEMM with the residual in its
  // epilogue (cuBLASLt's split-K and its reduce, then the norm's kernel).
  bool split_down_ = false;
  float* down_parts_ = nullptr;               // (S, slots, C) fp32: the parts
  bf16 *gu_ = nullptr, *h_ = nullptr;         // (rows, 2 I) gate|up; (rows, I) swiglu (dense layers)
  // A model of experts: the layer's routing, rows and workspace at `rows`
  // tokens (cuda/moe.hpp); its forward brings the row offsets to the host, so
  // no CUDA graphs. row_slot_: the pass's rows' slots; route_host_: a layer's
  // experts of the pass on the host (router replay's recording).
  std::unique_ptr<cuda::GroupedGemm> grouped_;
  cuda::MoeLayerActs moe_{};
  cuda::MoeScratch moe_scratch_{};
  std::vector<int64_t> moe_offsets_;
  void** moe_pointers_ = nullptr;
  std::vector<int32_t> row_slot_, route_host_;
  float *rstd_ = nullptr;                     // (rows H) every norm's rstd (not kept: no backward)
  float *lse_ = nullptr;                      // (rows, H) the flash attention's logsumexp
  int32_t* doc_start_ = nullptr;              // (rows) the flash attention's scratch
  void* attention_scratch_ = nullptr;         // decode attention's partials
  bf16 *last_ = nullptr, *head_x_ = nullptr;  // (slots, C) prompts' last hidden states; final norm's output
  float* logits_ = nullptr;                   // (slots, V) fp32
  float* inv_freq_ = nullptr;                 // (D / 2)
  void* gemm_workspace_ = nullptr;
  StepInts prefill_in_, decode_in_;           // a prefill pass's inputs (rows_), a decode step's (slots)
  StepInts extend_in_;                        // an extend pass's (rows_ for every field)
  const StepInts* in_ = nullptr;              // the block the pass being enqueued reads
  float* logits_host_ = nullptr;              // (slots, V) pinned: generate()'s logits
  int32_t* lp_tokens_ = nullptr;              // (slots) token_logprobs' tokens on the device
  float* lp_out_ = nullptr;                   // (slots) and its logprobs
  int32_t* lp_tokens_host_ = nullptr;         // (slots) pinned mirrors
  float* lp_out_host_ = nullptr;
  // draw(): the rows' uniforms, then tokens | sampling | model | tempered
  // logprobs (slots each, 32-bit words), one block each way.
  double* draw_uniforms_ = nullptr;
  double* draw_uniforms_host_ = nullptr;
  uint32_t* draw_out_ = nullptr;
  uint32_t* draw_out_host_ = nullptr;
  // SHARDLM_HOST_SAMPLER=1 draws on the host from downloaded logits (to compare).
  bool device_draws_ = true;
  int64_t last_rows_ = 0;                     // rows of logits_ the last step wrote
  uint16_t* upload_host_ = nullptr;           // (kUploadElems) pinned bf16 staging

  // SHARDLM_DECODE_GRAPHS=0 turns the graphs off (every step eager: to rule
  // them out, or to measure what they save).
  bool graphs_ = true;
  std::vector<cudaGraphExec_t> step_graphs_;  // the full-batch step's pieces, launched in order
  int64_t decode_steps_ = 0;
  // The decode steps' device time, step_begin_ to step_end_, added once the
  // step is done (a step that leaves its logits on the device returns before).
  mutable double decode_seconds_ = 0;
  mutable bool step_pending_ = false;
  void add_step_time() const {
    if (!step_pending_) return;
    CUDA_CHECK(cudaEventSynchronize(step_end_));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, step_begin_, step_end_));
    decode_seconds_ += ms * 1e-3;
    step_pending_ = false;
  }
  // SHARDLM_DECODE_PROFILE=1: every decode step runs eagerly with an event
  // after each operation (ops_), and prefill, decode and draw are timed on the
  // host from call to return (each ends synchronised): profile_report().
  std::unique_ptr<cuda::OpTimer> ops_;
  struct Wall {
    double seconds = 0;
    int64_t calls = 0;
  } prefill_wall_, extend_wall_, decode_wall_, draw_wall_;

  const int32_t* in(StepInts::Field f) const { return in_->d(f); }
};

// Every limit checked, then every device buffer (add: name, where it is counted,
// elements, the member it lands in) and pinned host buffer (pin) in one list:
// the constructor allocates from it, plan_cuda_decoder only counts (self null:
// no member is written, nothing touches a device).
template <class Add, class Pin>
void CudaDecoder::plan_buffers(const ModelConfig& c, const ModelLayout& layout, const DecoderLimits& limits,
                               CudaDecoder* self, Add&& add, Pin&& pin) {
  check_decoder_limits(c, limits);
  // The kernels read 16 positions of a block at a time.
  SHARDLM_CHECK(limits.block_size % 16 == 0, "generate on the GPU: KV blocks of %lld positions; give a multiple of 16",
                (long long)limits.block_size);
  SHARDLM_CHECK(c.head_dim <= 256 && c.num_heads % c.num_kv_heads == 0,
                "generate on the GPU: head_dim %lld (at most 256) with %lld heads over %lld kv heads",
                (long long)c.head_dim, (long long)c.num_heads, (long long)c.num_kv_heads);
  const int64_t prefill_rows = std::max(limits.max_len, std::min(limits.slots * limits.max_len, kPrefillTokens));
  const int64_t rows = std::max(prefill_rows, limits.slots);
  if (std::string e = model_scale_error(c, rows, 1); !e.empty()) SHARDLM_FAIL("generate: %s", e.c_str());
  bool fused = !c.qk_norm;
  for (int64_t l = 0; l < c.num_layers && fused; ++l) fused = qkv_adjacent(layout.layer(int(l)));
  const size_t attention_scratch = cuda::decode_attention_scratch_bytes(limits.slots, c.num_heads, c.head_dim,
                                                                       limits.max_len);
  const int64_t prefill_ints = 4 * rows + 4 * limits.slots, decode_ints = 8 * limits.slots, extend_ints = 8 * rows;
  // The down projection in 4 K-parts where the sizes allow (1.235 against 1.283
  // ms a step with cuBLASLt's one GEMM at the 1B shape, batch 64, on an H200:
  // docs/benchmarks.md).
  const bool split_down = !c.moe() && cuda::splitk_residual_rmsnorm_takes(c.hidden_size) &&
                          c.intermediate_size % (8 * cuda::kSplitkParts) == 0;
  if (self) {
    self->split_down_ = split_down;
    self->prefill_rows_ = prefill_rows;
    self->rows_ = rows;
    self->fused_qkv_ = fused;
    self->attention_scratch_bytes_ = attention_scratch;
    self->prefill_in_.rows = rows, self->prefill_in_.slots = limits.slots;
    self->decode_in_.rows = limits.slots, self->decode_in_.slots = limits.slots;
    self->extend_in_.rows = rows, self->extend_in_.slots = rows;
    self->unit_w_.assign(layout.units.size(), nullptr);
    self->k_cache_.assign(size_t(c.num_layers), nullptr);
    self->v_cache_.assign(size_t(c.num_layers), nullptr);
  }
  // The member a buffer lands in; nullptr when only planning.
  const auto at = [self](auto CudaDecoder::*member) { return self ? &(self->*member) : nullptr; };
  const auto in = [self](std::vector<bf16*> CudaDecoder::*v, size_t i) {
    return self ? &(self->*v)[i] : static_cast<bf16**>(nullptr);
  };

  const int64_t L = c.num_layers, C = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t H = c.num_heads, D = c.head_dim, HD = H * D, KVD = c.num_kv_heads * D;
  const int64_t S = limits.slots, R = rows;
  const int64_t table = S * ((limits.max_len + limits.block_size - 1) / limits.block_size);
  const int64_t aux = 2 * table + 3 * S;
  if (self) self->aux_table_ = 2 * table;
  for (size_t u = 0; u < layout.units.size(); ++u)
    add("weights", Mem::ParamShard, layout.units[u].padded_numel, in(&CudaDecoder::unit_w_, u));
  for (int64_t l = 0; l < L; ++l) {
    add("kv_cache.k", Mem::Activations, pool_blocks(limits) * limits.block_size * KVD,
        in(&CudaDecoder::k_cache_, size_t(l)));
    add("kv_cache.v", Mem::Activations, pool_blocks(limits) * limits.block_size * KVD,
        in(&CudaDecoder::v_cache_, size_t(l)));
  }
  add("block_table", Mem::Workspace, table, at(&CudaDecoder::block_table_));
  add("kv_aux", Mem::Workspace, aux, at(&CudaDecoder::aux_));
  add("x", Mem::Workspace, R * C, at(&CudaDecoder::x_));
  add("x_out", Mem::Workspace, R * C, at(&CudaDecoder::x_out_));
  add("x_mid", Mem::Workspace, R * C, at(&CudaDecoder::x_mid_));
  add("xn", Mem::Workspace, R * C, at(&CudaDecoder::xn_));
  add("q", Mem::Workspace, R * HD, at(&CudaDecoder::q_));
  add("k", Mem::Workspace, R * KVD, at(&CudaDecoder::k_));
  add("v", Mem::Workspace, R * KVD, at(&CudaDecoder::v_));
  if (c.qk_norm) {
    add("q_raw", Mem::Workspace, R * HD, at(&CudaDecoder::q_raw_));
    add("k_raw", Mem::Workspace, R * KVD, at(&CudaDecoder::k_raw_));
  }
  add("att", Mem::Workspace, R * HD, at(&CudaDecoder::att_));
  if (fused) add("qkv", Mem::Workspace, S * (HD + 2 * KVD), at(&CudaDecoder::qkv_));
  bool dense = false;
  for (int64_t l = 0; l < L; ++l) dense |= !c.moe_layer(l);
  if (dense) {
    add("gate_up", Mem::Workspace, R * 2 * I, at(&CudaDecoder::gu_));
    add("h", Mem::Workspace, R * I, at(&CudaDecoder::h_));
  }
  if (c.moe()) {  // cuda/moe.hpp's buffers at R tokens, R K rows
    const int64_t E = c.num_experts, K = c.num_experts_per_tok, Im = c.moe_intermediate_size;
    const int64_t Is = c.shared_expert_intermediate_size, RK = R * K;
    cuda::MoeLayerActs* a = self ? &self->moe_ : nullptr;
    cuda::MoeScratch* sc = self ? &self->moe_scratch_ : nullptr;
    add("moe.probs", Mem::Workspace, R * E, a ? &a->probs : nullptr);
    add("moe.expert", Mem::Workspace, RK, a ? &a->expert : nullptr);
    add("moe.weight", Mem::Workspace, RK, a ? &a->weight : nullptr);
    add("moe.slot", Mem::Workspace, RK, a ? &a->slot : nullptr);
    add("moe.row", Mem::Workspace, RK, a ? &a->row : nullptr);
    add("moe.offsets", Mem::Workspace, E + 1, a ? &a->offsets : nullptr);
    add("moe.gate_up", Mem::Workspace, RK * 2 * Im, a ? &a->gu : nullptr);
    add("moe.h", Mem::Workspace, RK * Im, a ? &a->h : nullptr);
    add("moe.y", Mem::Workspace, RK * C, a ? &a->y : nullptr);
    add("moe.logits", Mem::Workspace, R * E, sc ? &sc->logits : nullptr);
    add("moe.rows", Mem::Workspace, RK * C, sc ? &sc->rows : nullptr);
    add("moe.gemm_pointers", Mem::Workspace, 3 * 2 * E, at(&CudaDecoder::moe_pointers_));
    if (Is > 0) {
      add("moe.shared_gate_up", Mem::Workspace, R * 2 * Is, a ? &a->shared_gu : nullptr);
      add("moe.shared_h", Mem::Workspace, R * Is, a ? &a->shared_h : nullptr);
      add("moe.shared_out", Mem::Workspace, R * C, a ? &a->shared_out : nullptr);
      add("moe.shared_logit", Mem::Workspace, R, a ? &a->shared_logit : nullptr);
    }
  }
  if (split_down) add("down_parts", Mem::Workspace, cuda::kSplitkParts * S * C, at(&CudaDecoder::down_parts_));
  add("rstd", Mem::Workspace, R * std::max<int64_t>(H, 1), at(&CudaDecoder::rstd_));
  add("lse", Mem::Workspace, R * H, at(&CudaDecoder::lse_));
  add("doc_start", Mem::Workspace, R, at(&CudaDecoder::doc_start_));
  add("decode_attention", Mem::Workspace, int64_t(attention_scratch),
      reinterpret_cast<char**>(at(&CudaDecoder::attention_scratch_)));
  add("last", Mem::Workspace, S * C, at(&CudaDecoder::last_));
  add("head_x", Mem::Workspace, S * C, at(&CudaDecoder::head_x_));
  add("logits", Mem::Workspace, S * V, at(&CudaDecoder::logits_));
  add("inv_freq", Mem::Workspace, D / 2, at(&CudaDecoder::inv_freq_));
  add("gemm_workspace", Mem::Workspace, int64_t(kGemmWorkspace),
      reinterpret_cast<char**>(at(&CudaDecoder::gemm_workspace_)));
  add("logprob_tokens", Mem::Workspace, S, at(&CudaDecoder::lp_tokens_));
  add("logprobs", Mem::Workspace, S, at(&CudaDecoder::lp_out_));
  add("draw_uniforms", Mem::Workspace, S, at(&CudaDecoder::draw_uniforms_));
  add("draw_out", Mem::Workspace, 4 * S, at(&CudaDecoder::draw_out_));
  add("prefill_inputs", Mem::Workspace, prefill_ints, self ? &self->prefill_in_.dev : nullptr);
  add("decode_inputs", Mem::Workspace, decode_ints, self ? &self->decode_in_.dev : nullptr);
  add("extend_inputs", Mem::Workspace, extend_ints, self ? &self->extend_in_.dev : nullptr);

  pin(prefill_ints, self ? &self->prefill_in_.host : nullptr);
  pin(aux, at(&CudaDecoder::aux_host_));
  pin(decode_ints, self ? &self->decode_in_.host : nullptr);
  pin(extend_ints, self ? &self->extend_in_.host : nullptr);
  pin(S * V, at(&CudaDecoder::logits_host_));
  pin(kUploadElems, at(&CudaDecoder::upload_host_));
  pin(S, at(&CudaDecoder::lp_tokens_host_));
  pin(S, at(&CudaDecoder::lp_out_host_));
  pin(S, at(&CudaDecoder::draw_uniforms_host_));
  pin(4 * S, at(&CudaDecoder::draw_out_host_));
}

CudaDecoder::CudaDecoder(const InferenceModel& model, const DecoderLimits& limits)
    : Decoder(model.config(), limits), model_(model) {
  const ModelConfig& c = model.config();
  plan_buffers(
      c, model.weights->layout, limits, this,
      [this](const char* name, Mem category, int64_t count, auto** ptr) {
        table_.push_back({name, category, count * int64_t(sizeof(**ptr)), reinterpret_cast<void**>(ptr)});
      },
      [](int64_t count, auto** ptr) {
        CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(ptr), size_t(count) * sizeof(**ptr)));
      });
  CUDA_CHECK(cudaGetDevice(&device_));
  for (BufferRow& r : table_) *r.ptr = cuda_malloc(r.category, r.bytes);

  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&step_begin_));
  CUDA_CHECK(cudaEventCreate(&step_end_));
  gemm_ = std::make_unique<cuda::Gemm>(stream_, gemm_workspace_, kGemmWorkspace);
  if (c.moe()) {
    grouped_ = std::make_unique<cuda::GroupedGemm>(stream_, moe_pointers_, 2 * c.num_experts);
    moe_.host_offsets = &moe_offsets_;
  }
  graphs_ = !env_is("SHARDLM_DECODE_GRAPHS", "0") && !c.moe();
  if (env_is("SHARDLM_DECODE_PROFILE", "1")) {
    ops_ = std::make_unique<cuda::OpTimer>(stream_);
    graphs_ = false;  // an event per operation, recorded eagerly
  }
  device_draws_ = !env_is("SHARDLM_HOST_SAMPLER", "1");

  // RoPE's frequencies as training rounds them (backend_cuda.cu): the double table to float.
  const std::vector<double> inv = cpu::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
  std::vector<float> inv_f(inv.begin(), inv.end());
  CUDA_CHECK(cudaMemcpy(inv_freq_, inv_f.data(), sizeof(float) * inv_f.size(), cudaMemcpyHostToDevice));
  upload_weights();
  // Every entry a valid block (0) until a sequence writes its own: the
  // captured step's warm-up reads through the table before any prefill.
  CUDA_CHECK(cudaMemset(block_table_, 0, size_t(limits.slots * kv_.table_ld()) * sizeof(int32_t)));
  kv_.keep_written();
  if (graphs_) capture_full_step();
}

CudaDecoder::~CudaDecoder() {
  // A destructor cannot throw: the frees report nothing (cuda_free handles its own errors).
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaGraphExec_t g : step_graphs_) cudaGraphExecDestroy(g);
  grouped_.reset();
  gemm_.reset();
  for (BufferRow& r : table_) cuda_free(r.category, *r.ptr, r.bytes);
  if (prefill_in_.host) cudaFreeHost(prefill_in_.host);
  if (aux_host_) cudaFreeHost(aux_host_);
  if (decode_in_.host) cudaFreeHost(decode_in_.host);
  if (extend_in_.host) cudaFreeHost(extend_in_.host);
  if (logits_host_) cudaFreeHost(logits_host_);
  if (upload_host_) cudaFreeHost(upload_host_);
  if (lp_tokens_host_) cudaFreeHost(lp_tokens_host_);
  if (lp_out_host_) cudaFreeHost(lp_out_host_);
  if (draw_uniforms_host_) cudaFreeHost(draw_uniforms_host_);
  if (draw_out_host_) cudaFreeHost(draw_out_host_);
  if (step_begin_) cudaEventDestroy(step_begin_);
  if (step_end_) cudaEventDestroy(step_end_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaDecoder::upload_weights() {
  // The host copy is fp32; what the broadcast brings is bf16, exact in it, so
  // round-to-nearest-even gives the trainers' bf16 bits back.
  const auto& units = model_.weights->layout.units;
  for (size_t u = 0; u < units.size(); ++u) {
    const float* src = model_.weights->param[u].data();
    for (int64_t begin = 0; begin < units[u].padded_numel; begin += kUploadElems) {
      const int64_t n = std::min(kUploadElems, units[u].padded_numel - begin);
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the staging buffer's last copy is done
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) upload_host_[i] = f32_to_bf16_rne(src[begin + i]);
      CUDA_CHECK(cudaMemcpyAsync(unit_w_[u] + begin, upload_host_, size_t(n) * sizeof(uint16_t),
                                 cudaMemcpyHostToDevice, stream_));
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

bf16* CudaDecoder::weight_of(const ParamInfo& p) {
  const ModelLayout& layout = model_.weights->layout;
  const ModelLayout::Located at = layout.find(p.name);
  SHARDLM_CHECK(at.unit && at.param->numel == p.numel, "internal: broadcast parameter %s is not in the model's layout",
                p.name.c_str());
  return unit_w_[size_t(at.unit - layout.units.data())] + at.param->offset;
}

void CudaDecoder::load_bf16(const ParamInfo& p, const uint16_t* values) {
  bf16* dst = weight_of(p);
  // Between two steps (an in-flight update) or two generate() calls: the
  // stream drained first, then a synchronous copy (pageable source), so
  // `values` may be reused when this returns.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(dst, values, size_t(p.numel) * sizeof(uint16_t), cudaMemcpyHostToDevice));
}

void CudaDecoder::load_bf16_device(const ParamInfo& p, const void* values) {
  bf16* dst = weight_of(p);
  // Between two steps (an in-flight update) or two generate() calls, in the
  // stream's order; done before this returns, so the receiver's buffer may
  // take the next unit.
  CUDA_CHECK(cudaMemcpyAsync(dst, values, size_t(p.numel) * sizeof(uint16_t), cudaMemcpyDefault, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaDecoder::begin_inputs() {
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  add_step_time();  // before step_begin_ is recorded again
}

void CudaDecoder::send_inputs(const StepInts& inputs) {
  CUDA_CHECK(cudaMemcpyAsync(inputs.dev, inputs.host, size_t(inputs.count()) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  in_ = &inputs;
}

void CudaDecoder::embed(int64_t N) {
  const ModelConfig& c = model_.config();
  const ModelLayout& layout = model_.weights->layout;
  cuda::embedding_forward(x_, in(StepInts::Tokens), param(layout.embed(), "model.embed_tokens.weight"), N,
                          c.vocab_size, c.hidden_size, stream_);
  mark("embedding");
}

void CudaDecoder::layers(int64_t N, Pass pass, int first, int last) {
  const ModelConfig& c = model_.config();
  const int64_t C = c.hidden_size, I = c.intermediate_size, HD = c.num_heads * c.head_dim;
  const double eps = c.rms_norm_eps;
  const int L = int(c.num_layers);
  // Decode steps (split_down_): the down projection as S = cuda::kSplitkParts
  // K-parts (one batched GEMM, fp32 parts), reduced by one kernel with the
  // residual and the next layer's input norm (cuBLASLt's split-K reduce and the
  // norm's launch in one), so layers after the first find their input normed.
  const bool split = pass == Pass::Decode && split_down_;
  for (int l = first; l < last; ++l) {
    const LayerWeights<const bf16> w = weights_of_layer(l);
    if (!split || l == 0) {
      cuda::rmsnorm_forward(xn_, rstd_, x_, w.input_norm, N, C, eps, stream_);
      mark("input norm");
    }
    if (pass == Pass::Decode && fused_qkv_)
      attend_fused(l, N, w);
    else
      attend(l, N, pass, w);
    // x_out holds the o_proj output until the residual add below overwrites it.
    cuda::linear_forward(*gemm_, x_out_, att_, w.wo, nullptr, N, HD, C);
    mark("o gemm");
    cuda::residual_rmsnorm_forward(x_mid_, xn_, rstd_, x_, x_out_, w.post_norm, N, C, eps, stream_);
    mark("add + norm");
    if (c.moe_layer(l)) {
      experts(l, N, w);
      std::swap(x_, x_out_);
      continue;
    }
    cuda::linear_forward(*gemm_, gu_, xn_, w.w_gate, nullptr, N, C, 2 * I);
    mark("gate|up gemm");
    cuda::swiglu_forward(h_, I, gu_, 2 * I, gu_ + I, 2 * I, N, I, stream_);
    mark("swiglu");
    if (split) {
      const int64_t part = I / cuda::kSplitkParts;
      gemm_->matmul_batched(false, true, N, C, part, h_, I, part, w.w_down, I, part, down_parts_, C, N * C,
                            cuda::kSplitkParts, cuda::GemmOut::F32);
      mark("down gemm (K parts)");
      const bool next = l + 1 < L;
      const cuda::NormWeight norm = next ? weights_of_layer(l + 1).input_norm
                                         : cuda::NormWeight(static_cast<const bf16*>(nullptr));
      cuda::splitk_residual_rmsnorm_forward(x_out_, next ? xn_ : nullptr, rstd_, x_mid_, down_parts_, N * C, norm, N,
                                            C, eps, stream_);
      mark("parts + add + next norm");
    } else {
      cuda::linear_forward(*gemm_, x_out_, h_, w.w_down, nullptr, N, I, C, /*residual=*/x_mid_);
      mark("down gemm + add");
    }
    std::swap(x_, x_out_);
  }
}

void CudaDecoder::experts(int l, int64_t N, const LayerWeights<const bf16>& w) {
  const ModelConfig& c = model_.config();
  const int64_t K = c.num_experts_per_tok;
  const cuda::MoeDims d{N, c.hidden_size, c.num_experts, K, c.moe_intermediate_size,
                        c.shared_expert_intermediate_size, c.norm_topk_prob};
  cuda::MoeExpertParallel every_expert_here;
  cuda::moe_forward(x_out_, x_mid_, xn_, cuda::moe_weights(w, w, c.moe_intermediate_size * c.hidden_size), moe_,
                    moe_scratch_, d, nullptr, 0, every_expert_here, *gemm_, *grouped_, stream_);
  mark("experts");
  if (route_width() == 0) return;
  route_host_.resize(size_t(N * K));
  CUDA_CHECK(cudaMemcpyAsync(route_host_.data(), moe_.expert, sizeof(int32_t) * size_t(N * K), cudaMemcpyDeviceToHost,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  const int32_t* positions = in_->h(StepInts::Positions);
  for (int64_t i = 0; i < N; ++i)
    std::copy_n(route_host_.data() + i * K, K, route_row(row_slot_[size_t(i)], positions[i]) + c.route_offset(l));
}

void CudaDecoder::attend(int l, int64_t N, Pass pass, const LayerWeights<const bf16>& w) {
  const ModelConfig& c = model_.config();
  const int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim, HD = H * D, KVD = KV * D;
  bf16* q_proj = c.qk_norm ? q_raw_ : q_;
  bf16* k_proj = c.qk_norm ? k_raw_ : k_;
  cuda::linear_forward(*gemm_, q_proj, xn_, w.wq, w.bq, N, C, HD);
  cuda::linear_forward(*gemm_, k_proj, xn_, w.wk, w.bk, N, C, KVD);
  cuda::linear_forward(*gemm_, v_, xn_, w.wv, w.bv, N, C, KVD);
  mark("q, k, v gemms");
  if (c.qk_norm) {
    cuda::rmsnorm_forward(q_, rstd_, q_raw_, w.q_norm, N * H, D, c.rms_norm_eps, stream_);
    cuda::rmsnorm_forward(k_, rstd_, k_raw_, w.k_norm, N * KV, D, c.rms_norm_eps, stream_);
    mark("q/k norms");
  }
  cuda::rope_forward(q_, in(StepInts::Positions), inv_freq_, N, H, D, HD, stream_);
  cuda::rope_forward(k_, in(StepInts::Positions), inv_freq_, N, KV, D, KVD, stream_);
  mark("rope");
  cuda::store_kv(k_cache_[size_t(l)], v_cache_[size_t(l)], in(StepInts::CacheRows), k_, v_, KVD, N, KV, D,
                 kv_.block_size(), stream_);
  mark("kv store");
  if (pass == Pass::Prefill) {
    // Every prompt of the pass is a document of its own: it sees its own positions 0 .. t.
    cuda::attention_forward(att_, lse_, q_, k_, v_, in(StepInts::SeqIds), doc_start_, N, H, KV, D, stream_);
  } else {
    // A row per new token over its sequence's block-table row to its own
    // length (an extend's rows of one sequence share the row; every k and v
    // of the pass is stored above). The partials' scratch holds `slots` rows:
    // a longer extend pass goes in pieces of that many.
    for (int64_t first = 0; first < N; first += limits_.slots) {
      const int64_t B = std::min(limits_.slots, N - first);
      cuda::decode_attention_forward(att_ + first * HD, q_ + first * HD, HD, k_cache_[size_t(l)], v_cache_[size_t(l)],
                                     device_pages(), in(StepInts::SlotOf) + first, in(StepInts::Lens) + first, B, H,
                                     KV, D, limits_.max_len, 0, attention_scratch_, attention_scratch_bytes_, stream_);
    }
  }
  mark("attention");
}

void CudaDecoder::attend_fused(int l, int64_t N, const LayerWeights<const bf16>& w) {
  const ModelConfig& c = model_.config();
  const int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim, HD = H * D, KVD = KV * D;
  const int64_t QKV = HD + 2 * KVD;
  // w.wq (and w.bq) start the three adjacent projections (qkv_adjacent).
  cuda::linear_forward(*gemm_, qkv_, xn_, w.wq, w.bq, N, C, QKV);
  mark("q|k|v gemm");
  // The tensor-core attention rotates q and k itself and stores k and v before
  // it reads the cache: no kernel between the GEMM and it.
  if (cuda::decode_attention_ropes(D)) {
    const cuda::DecodeRope rope{in(StepInts::Positions), inv_freq_, in(StepInts::CacheRows), k_cache_[size_t(l)],
                                v_cache_[size_t(l)]};
    cuda::decode_attention_forward(att_, qkv_, QKV, k_cache_[size_t(l)], v_cache_[size_t(l)], device_pages(),
                                   in(StepInts::SlotOf), in(StepInts::Lens), N, H, KV, D, limits_.max_len, 0,
                                   attention_scratch_, attention_scratch_bytes_, stream_, &rope);
    mark("rope + kv store + attention");
    return;
  }
  // q's and k's heads lie side by side in a row: one RoPE over H + KV heads,
  // which also stores k (rotated) and v into the two caches in the same pass.
  cuda::rope_store_kv(qkv_, in(StepInts::Positions), inv_freq_, N, H, KV, D, QKV, k_cache_[size_t(l)],
                      v_cache_[size_t(l)], in(StepInts::CacheRows), kv_.block_size(), stream_);
  mark("rope + kv store");
  cuda::decode_attention_forward(att_, qkv_, QKV, k_cache_[size_t(l)], v_cache_[size_t(l)], device_pages(),
                                 in(StepInts::SlotOf), in(StepInts::Lens), N, H, KV, D, limits_.max_len, 0,
                                 attention_scratch_, attention_scratch_bytes_, stream_);
  mark("attention");
}

void CudaDecoder::head(const bf16* rows, int64_t n) {
  const ModelConfig& c = model_.config();
  const ModelLayout& layout = model_.weights->layout;
  const bf16* lm_head = c.tie_word_embeddings ? param(layout.embed(), "model.embed_tokens.weight")
                                              : param(layout.head(), "lm_head.weight");
  cuda::rmsnorm_forward(head_x_, rstd_, rows, param(layout.head(), "model.norm.weight"), n, c.hidden_size,
                        c.rms_norm_eps, stream_);
  mark("final norm");
  // fp32 logits straight from the GEMM's accumulator: the sampler and the
  // logprobs see no bf16 rounding of the logits.
  gemm_->matmul(false, true, n, c.vocab_size, c.hidden_size, head_x_, c.hidden_size, lm_head, c.hidden_size, logits_,
                c.vocab_size, cuda::GemmOut::F32, 1.0f, 0.0f);
  mark("lm-head");
}

void CudaDecoder::token_logprobs(float* out, const float*, const int32_t* tokens, float temperature, int64_t n) {
  // The device still holds the step's logits (nothing runs between a step and its sampling).
  SHARDLM_CHECK(n >= 0 && n <= last_rows_, "internal: logprobs of %lld rows after a step of %lld", (long long)n,
                (long long)last_rows_);
  std::memcpy(lp_tokens_host_, tokens, size_t(n) * sizeof(int32_t));
  CUDA_CHECK(cudaMemcpyAsync(lp_tokens_, lp_tokens_host_, size_t(n) * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream_));
  cuda::token_logprobs(lp_out_, logits_, lp_tokens_, temperature, n, model_.config().vocab_size, stream_);
  CUDA_CHECK(cudaMemcpyAsync(lp_out_host_, lp_out_, size_t(n) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(out, lp_out_host_, size_t(n) * sizeof(float));
}

void CudaDecoder::draw(const SamplingParams& p, const double* uniforms, int64_t n, Sampled* out, float* model_lp,
                       float* tempered_lp) {
  // The device still holds the step's logits; one upload, four kernels, one download.
  SHARDLM_CHECK(n >= 0 && n <= last_rows_, "internal: a draw of %lld rows after a step of %lld", (long long)n,
                (long long)last_rows_);
  if (n == 0) return;
  const CallTimer timed(ops_ != nullptr, draw_wall_);
  const int64_t S = limits_.slots, V = model_.config().vocab_size;
  if (ops_) ops_->begin();
  std::memcpy(draw_uniforms_host_, uniforms, size_t(n) * sizeof(double));
  CUDA_CHECK(cudaMemcpyAsync(draw_uniforms_, draw_uniforms_host_, size_t(n) * sizeof(double), cudaMemcpyHostToDevice,
                             stream_));
  mark("draw: uniforms up");
  int32_t* tokens = reinterpret_cast<int32_t*>(draw_out_);
  float* sampling = reinterpret_cast<float*>(draw_out_ + S);
  float* model = reinterpret_cast<float*>(draw_out_ + 2 * S);
  float* tempered = reinterpret_cast<float*>(draw_out_ + 3 * S);
  cuda::sample_rows(tokens, sampling, logits_, draw_uniforms_, n, V, p.temperature, p.top_k, p.top_p, stream_);
  mark("draw: sample");
  cuda::token_logprobs(model, logits_, tokens, 1.0f, n, V, stream_);
  if (p.temperature > 0) cuda::token_logprobs(tempered, logits_, tokens, float(p.temperature), n, V, stream_);
  mark("draw: logprobs");
  CUDA_CHECK(cudaMemcpyAsync(draw_out_host_, draw_out_, size_t(4 * S) * sizeof(uint32_t), cudaMemcpyDeviceToHost,
                             stream_));
  mark("draw: results down");
  if (ops_) ops_->end();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int64_t b = 0; b < n; ++b) {
    std::memcpy(&out[b].token, draw_out_host_ + b, sizeof(int32_t));
    std::memcpy(&out[b].sampling_logprob, draw_out_host_ + S + b, sizeof(float));
    std::memcpy(&model_lp[b], draw_out_host_ + 2 * S + b, sizeof(float));
    std::memcpy(&tempered_lp[b], draw_out_host_ + (p.temperature > 0 ? 3 : 2) * S + b, sizeof(float));
  }
}

void CudaDecoder::download_logits(int64_t n, float* logits) {
  last_rows_ = n;
  // Drawn on the device: nothing comes to the host, and nothing waits; draw()
  // enqueues behind the step and waits once for both. (A profile waits, so that
  // each call's host time holds its own work.)
  if (!logits) {
    if (ops_) CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(logits, logits_, size_t(n * model_.config().vocab_size) * sizeof(float),
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

__global__ void set_table_entries_kernel(int32_t* table, const int32_t* pairs, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) table[pairs[2 * i]] = pairs[2 * i + 1];
}

void CudaDecoder::send_table() {
  const std::vector<int32_t> written = kv_.take_written();
  const int64_t n = int64_t(written.size());
  if (n == 0) return;
  SHARDLM_CHECK(2 * n <= aux_table_, "internal: %lld block table entries written, %lld held", (long long)n,
                (long long)(aux_table_ / 2));
  const KvPages pages = kv_.pages();
  for (int64_t i = 0; i < n; ++i) {
    aux_host_[2 * i] = written[size_t(i)];
    aux_host_[2 * i + 1] = pages.table[written[size_t(i)]];
  }
  CUDA_CHECK(cudaMemcpyAsync(aux_, aux_host_, size_t(2 * n) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  set_table_entries_kernel<<<unsigned((n + 255) / 256), 256, 0, stream_>>>(block_table_, aux_, n);
  CUDA_CHECK(cudaGetLastError());
  mark("block table");
}

void CudaDecoder::prefill_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                                  std::span<const BlockCopy> copies, std::span<const int32_t> source,
                                  float* logits) {
  const ModelConfig& c = model_.config();
  const int64_t n = int64_t(source.size()), unique = int64_t(prompts.size()), C = c.hidden_size;
  const int64_t KVD = c.num_kv_heads * c.head_dim;
  const CallTimer timed(ops_ != nullptr, prefill_wall_);
  const KvPages pages = kv_.pages();
  // Passes of whole prompts, each at most prefill_rows_ tokens; prompt u's last state into row u of last_.
  for (int64_t first = 0; first < unique;) {
    begin_inputs();
    if (first == 0) send_table();
    int64_t N = 0, count = 0;
    for (int64_t u = first; u < unique; ++u) {
      const auto& p = prompts[size_t(u)];
      const int64_t len = int64_t(p.size());
      if (count > 0 && N + len > prefill_rows_) break;
      const StepInts& in = prefill_in_;
      row_slot_.resize(size_t(N + len));
      for (int64_t t = 0; t < len; ++t) {
        row_slot_[size_t(N + t)] = slots[size_t(u)];
        in.h(StepInts::Tokens)[N + t] = p[size_t(t)];
        in.h(StepInts::Positions)[N + t] = int32_t(t);
        in.h(StepInts::SeqIds)[N + t] = int32_t(count);
        in.h(StepInts::CacheRows)[N + t] = int32_t(kv_cache_row(pages, slots[size_t(u)], t));
      }
      in.h(StepInts::LastSrc)[count] = int32_t(N + len - 1);
      in.h(StepInts::LastDst)[count] = int32_t(u);
      N += len;
      ++count;
    }
    send_inputs(prefill_in_);
    run_layers(N, Pass::Prefill);
    cuda::copy_rows(last_, in(StepInts::LastDst), x_, in(StepInts::LastSrc), count, C, stream_);
    first += count;
  }
  // The shared prompts' partly filled last blocks, every layer's keys and
  // values (a block is one row of KV x block_size x D); then each sequence's
  // row of last_ from its prompt's.
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // aux_host_ is free again
  int32_t* const from = aux_host_ + aux_table_;
  int32_t* const to = from + limits_.slots;
  int32_t* const rows = to + limits_.slots;
  const int64_t k = int64_t(copies.size());
  for (int64_t i = 0; i < k; ++i) from[i] = copies[size_t(i)].from, to[i] = copies[size_t(i)].to;
  for (int64_t i = 0; i < n; ++i) rows[i] = source[size_t(i)];
  CUDA_CHECK(cudaMemcpyAsync(aux_ + aux_table_, aux_host_ + aux_table_, size_t(3 * limits_.slots) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream_));
  const int32_t* const from_dev = aux_ + aux_table_;
  const int32_t* const to_dev = from_dev + limits_.slots;
  const int32_t* const rows_dev = to_dev + limits_.slots;
  if (k > 0)
    for (int64_t l = 0; l < c.num_layers; ++l) {
      cuda::copy_rows(k_cache_[size_t(l)], to_dev, k_cache_[size_t(l)], from_dev, k, KVD * kv_.block_size(), stream_);
      cuda::copy_rows(v_cache_[size_t(l)], to_dev, v_cache_[size_t(l)], from_dev, k, KVD * kv_.block_size(), stream_);
    }
  cuda::copy_rows(xn_, nullptr, last_, rows_dev, n, C, stream_);
  head(xn_, n);
  download_logits(n, logits);
}

void CudaDecoder::decode_forward(std::span<const int32_t> slots, std::span<const int32_t> tokens_in, float* logits) {
  const int64_t B = int64_t(slots.size());
  const CallTimer timed(ops_ != nullptr, decode_wall_);
  begin_inputs();
  send_table();
  const StepInts& in = decode_in_;
  const KvPages pages = kv_.pages();
  row_slot_.assign(slots.begin(), slots.end());
  for (int64_t b = 0; b < B; ++b) {
    const int32_t s = slots[size_t(b)];
    const int32_t pos = int32_t(kv_.length(s) - 1);
    in.h(StepInts::Tokens)[b] = tokens_in[size_t(b)];
    in.h(StepInts::Positions)[b] = pos;
    in.h(StepInts::CacheRows)[b] = int32_t(kv_cache_row(pages, s, pos));
    in.h(StepInts::SlotOf)[b] = s;
    in.h(StepInts::Lens)[b] = pos + 1;
  }
  send_inputs(decode_in_);
  CUDA_CHECK(cudaEventRecord(step_begin_, stream_));
  if (B == limits_.slots && !step_graphs_.empty()) {
    for (cudaGraphExec_t g : step_graphs_) CUDA_CHECK(cudaGraphLaunch(g, stream_));
  } else {
    if (ops_) ops_->begin();
    run_layers(B, Pass::Decode);
    head(x_, B);
    if (ops_) ops_->end();
  }
  CUDA_CHECK(cudaEventRecord(step_end_, stream_));
  step_pending_ = true;
  download_logits(B, logits);
  ++decode_steps_;
}

void CudaDecoder::extend_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                                 float* logits) {
  const int64_t n = int64_t(slots.size()), C = model_.config().hidden_size;
  const CallTimer timed(ops_ != nullptr, extend_wall_);
  const KvPages pages = kv_.pages();
  // Passes of whole slots' rows, each at most prefill_rows_ (one slot's
  // always fit: fewer than max_len); slot i's last row into row i of last_.
  for (int64_t first = 0; first < n;) {
    begin_inputs();
    if (first == 0) send_table();
    const StepInts& ints = extend_in_;
    int64_t N = 0, count = 0;
    for (int64_t i = first; i < n; ++i) {
      const auto& ids = tokens[size_t(i)];
      const int64_t add = int64_t(ids.size());
      if (count > 0 && N + add > prefill_rows_) break;
      const int32_t s = slots[size_t(i)];
      const int64_t start = kv_.length(s) - add;
      row_slot_.resize(size_t(N + add));
      for (int64_t t = 0; t < add; ++t) {
        row_slot_[size_t(N + t)] = s;
        const int32_t pos = int32_t(start + t);
        ints.h(StepInts::Tokens)[N + t] = ids[size_t(t)];
        ints.h(StepInts::Positions)[N + t] = pos;
        ints.h(StepInts::SeqIds)[N + t] = int32_t(count);
        ints.h(StepInts::CacheRows)[N + t] = int32_t(kv_cache_row(pages, s, pos));
        ints.h(StepInts::SlotOf)[N + t] = s;
        ints.h(StepInts::Lens)[N + t] = pos + 1;
      }
      ints.h(StepInts::LastSrc)[count] = int32_t(N + add - 1);
      ints.h(StepInts::LastDst)[count] = int32_t(i);
      N += add;
      ++count;
    }
    send_inputs(extend_in_);
    run_layers(N, Pass::Extend);
    cuda::copy_rows(last_, in(StepInts::LastDst), x_, in(StepInts::LastSrc), count, C, stream_);
    first += count;
  }
  head(last_, n);
  download_logits(n, logits);
}

std::string CudaDecoder::profile_report(double generate_seconds) const {
  if (!ops_) return "";
  char line[256];
  std::string out = "decode profile (SHARDLM_DECODE_PROFILE=1: no CUDA graphs; an event after each operation):\n";
  const auto wall = [&](const char* what, const Wall& w) {
    std::snprintf(line, sizeof line, "  %-8s %6lld calls %10.1f ms on the host, %.3f ms a call\n", what,
                  (long long)w.calls, 1e3 * w.seconds, w.calls ? 1e3 * w.seconds / double(w.calls) : 0.0);
    out += line;
  };
  wall("prefill", prefill_wall_);
  wall("extend", extend_wall_);
  wall("decode", decode_wall_);
  wall("draw", draw_wall_);
  const double rest = generate_seconds - prefill_wall_.seconds - extend_wall_.seconds - decode_wall_.seconds -
                      draw_wall_.seconds;
  std::snprintf(line, sizeof line, "  %-8s %23.1f ms on the host outside the decoder's calls\n", "other", 1e3 * rest);
  out += line;
  out += "device time per operation (decode steps and draws, summed over the layers):\n";
  out += ops_->report(decode_steps_, "decode steps");
  return out;
}

void CudaDecoder::capture_full_step() {
  // One eager full-batch step first: it builds the GEMM plans, and cuBLASLt may
  // allocate on a shape's first call, which a capture forbids. Its inputs put
  // token 0 at position 0 of every slot (a prefill writes position 0 before any
  // real step reads it) and touch no slot's length.
  const int64_t S = limits_.slots;
  const StepInts& in = decode_in_;
  begin_inputs();
  for (int64_t b = 0; b < S; ++b) {
    in.h(StepInts::Tokens)[b] = 0;
    in.h(StepInts::Positions)[b] = 0;
    in.h(StepInts::CacheRows)[b] = 0;  // block 0's first row: no sequence holds a block yet
    in.h(StepInts::SlotOf)[b] = int32_t(b);
    in.h(StepInts::Lens)[b] = 1;
  }
  send_inputs(decode_in_);
  run_layers(S, Pass::Decode);
  head(x_, S);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  // Every pointer the step reads is fixed: its inputs are decode_in_'s, the
  // weights and cache never move, the decode attention's grid depends on
  // max_len only. x_ and x_out_ swap once per layer inside layers(): each piece
  // keeps the addresses of its capture, the pieces are captured in the order
  // they replay (so each finds x_ where the one before left it), and every pass
  // (replayed or eager) writes x_ from the embedding before it reads it.
  const int L = int(model_.config().num_layers);
  for (const StepPiece& piece : step_pieces()) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    if (piece.embed) embed(S);
    layers(S, Pass::Decode, piece.first, piece.last);
    if (piece.last == L && piece.first < piece.last) head(x_, S);
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(made);
    step_graphs_.push_back(exec);
  }
}

std::vector<CudaDecoder::StepPiece> CudaDecoder::step_pieces() const {
  const int L = int(model_.config().num_layers);
  // The embedding alone first (the host launches a graph at ~3.5 us a node: with
  // the first layer in it the GPU waited ~40 us for it, against ~9 + 21 us for
  // the embedding's and then the layer's), then 1, 2, 4, 8, 8, ... layers: few
  // boundaries (each costs the GPU ~4 us), each piece launched while the one
  // before runs (measured on an H200).
  std::vector<StepPiece> pieces = {{true, 0, 0}};
  for (int first = 0, size = 1; first < L; first += size, size = std::min(2 * size, 8))
    pieces.push_back({false, first, std::min(L, first + size)});
  return pieces;
}

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(const InferenceModel& model, const DecoderLimits& limits) {
  return std::make_unique<CudaDecoder>(model, limits);
}

DecoderPlan plan_cuda_decoder(const ModelConfig& c, const DecoderLimits& limits) {
  const ModelLayout layout(c, 1);
  DecoderPlan plan;
  CudaDecoder::plan_buffers(
      c, layout, limits, nullptr,
      [&plan](const char*, Mem category, int64_t count, auto** ptr) {
        const int64_t bytes = count * int64_t(sizeof(**ptr));
        if (category == Mem::ParamShard) plan.weights += bytes;
        else if (category == Mem::Activations) plan.cache += bytes;
        else plan.scratch += bytes;
      },
      [&plan](int64_t count, auto** ptr) { plan.host += count * int64_t(sizeof(**ptr)); });
  return plan;
}

}  // namespace shardlm
