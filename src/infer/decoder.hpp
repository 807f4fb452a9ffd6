// decoder.hpp — the model's forward for sampling: batched prefill of prompts
// into a paged KV cache, then one token per sequence per decode step, attending
// over the cache; an extend appends several tokens to a sequence (an
// environment's observation between two turns) in one forward against its
// kept cache. Decoder is the interface generate() drives; CpuDecoder
// (here, fp32) and the CUDA decoder (infer/decoder_cuda.hpp, bf16) implement
// its forward, and make_decoder picks one by the resolved device backend, once.
//
// Decoder (the base) keeps the cache's bookkeeping for both (KvBlocks: the
// pool, the block tables, the lengths): a prefill hands each prompt the blocks
// it fills, and the samples of a group (the same prompt span in one prefill)
// share their prompt's blocks, so the prompt is computed once; a decode step
// or an extend adds blocks to a sequence that crosses into new ones; release()
// gives a sequence's blocks back. The backends compute over the blocks they are given.
// With router replay on (record_routes), the base also keeps each slot's
// table of the experts every fed position was routed to, which the backend's
// forward fills and a prefill copies to a group's later samples.
//
// CpuDecoder:
// A sequence's logits never depend on the other sequences of its batch, nor on
// how its cache was filled (so a seeded sample does not either): every matmul
// is cpu::linear_rowwise_forward, whose rows do not depend on each other (BLAS
// picks kernels by the matrix's shape, which changes a row's last bits), and
// the prefill's attention (cpu::attention_forward) sums term for term as the
// decode step's (cpu::attention_decode_forward) does: a prompt prefilled whole
// leaves the cache bits a token-by-token decode would. An extend stores every
// new row's keys and values first and then runs the decode step's attention
// once per new row, each with its own length: the cache and logits of tokens
// fed one a decode step, bit for bit.
//
// Owns: the KV cache's storage (per layer, keys and values (blocks,
// block_size, KV, D)) and every buffer a prefill, extend or decode step uses, planned
// once from DecoderLimits through one table of (name, numel, plan row) that
// both allocates and counts (cpu/layers.hpp's BufferRow), so a step allocates
// nothing. The arithmetic is training's own: cpu::layer_qkv_forward and
// cpu::layer_out_forward around attention, then the final RMSNorm and the
// lm-head. Must not know: sampling, prompt files, MPI, output.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cpu/layers.hpp"
#include "infer/kv_blocks.hpp"
#include "infer/model.hpp"
#include "infer/sampler.hpp"

namespace shardlm {

// Two prompts are one group's (computed once, blocks shared) when they are
// the same span: the same tokens at the same address.
inline bool same_span(std::span<const int32_t> a, std::span<const int32_t> b) {
  return a.data() == b.data() && a.size() == b.size();
}

struct DecoderLimits {
  int64_t slots = 8;             // sequences held at once (the decode batch at most)
  int64_t max_len = 0;           // positions one sequence may reach: prompt + generated tokens
  int64_t block_size = 16;       // positions per KV block (on the GPU a multiple of 16)
  int64_t blocks = 0;            // blocks in the pool; 0: every slot at max_len (pool_blocks)
  // With blocks = 0: the decoder may take this fraction of its device's memory
  // (the GPU's; the CPU backend's: the host's) for its weights copy, scratch
  // and KV pool, the pool getting what is left, at most every slot at max_len.
  // Sized when the decoder is made (size_pool); 0: off.
  double memory_fraction = 0;
};
// The pool's blocks: limits.blocks, or slots x ceil(max_len / block_size).
int64_t pool_blocks(const DecoderLimits& limits);

// What generate() needs of a forward over a KV cache. Logits are fp32 in host
// memory, (n, V) row-major, whatever the backend computes in; a decoder that
// draws on its device (draws_on_device()) is given nullptr instead, keeps
// them there for draw(), and may return before the step is done (draw() waits
// for both).
class Decoder {
 public:
  // Checks the limits against the model (Error naming the one out of range)
  // and sets up the pool.
  Decoder(const ModelConfig& c, const DecoderLimits& limits);
  virtual ~Decoder() = default;
  // Prompts[i] into the empty slot slots[i] at positions 0 .. len - 1; logits
  // (n, V) of each prompt's last position. Prompts that are the same span (the
  // same tokens at the same address: the samples of a group) are computed
  // once; the later slots share the first one's blocks and get its logits row.
  // At most `slots` prompts, each at most max_len tokens, with
  // prefill_blocks(prompts) blocks free.
  void prefill(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts, float* logits);
  // tokens[b] appended to slot slots[b] at position length(slots[b]); logits
  // (B, V) of those positions. Distinct slots, each with room for one more, and
  // decode_blocks(slots) blocks free.
  void decode(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits);
  // tokens[i] (n_i >= 1 ids) appended to slot slots[i], which holds a
  // sequence, at positions length .. length + n_i - 1, all in one forward
  // (a prefill against the kept cache: the projections and the MLP over every
  // new row at once, each row attending over its slot's cached positions and
  // the new ones up to its own); logits (n, V) of each slot's last new
  // position. Distinct slots, each with room for its n_i, and
  // extend_blocks(slots, tokens) blocks free.
  void extend(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens, float* logits);
  // The slot's blocks back to the pool (those no other slot shares): its
  // sequence ended or gave way.
  void release(int32_t slot) { kv_.release(slot); }
  // Router replay (a model of experts, loss.router_replay): from now on every
  // forward records, for each position it feeds, the experts the router chose
  // at each layer of experts (ModelConfig::route_width() entries: each
  // layer's K in turn; a group's samples get their shared prompt's). Sized
  // once here: slots x max_len rows. routes(slot): the rows of positions 0 ..
  // length(slot) - 1. route_width() 0: not recording.
  void record_routes();
  int64_t route_width() const { return route_width_; }
  std::span<const int32_t> routes(int32_t slot) const {
    return {routes_.data() + size_t(slot * limits_.max_len * route_width_), size_t(length(slot) * route_width_)};
  }
  // Blocks a prefill of these prompts takes / a decode step of these slots
  // adds / an extend of these slots by these tokens adds.
  int64_t prefill_blocks(std::span<const std::span<const int32_t>> prompts) const;
  int64_t decode_blocks(std::span<const int32_t> slots) const;
  int64_t extend_blocks(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens) const;
  const KvBlocks& kv() const { return kv_; }
  int64_t length(int32_t slot) const { return kv_.length(slot); }
  const DecoderLimits& limits() const { return limits_; }
  // Prompt tokens the prefills computed (a group's prompt once), and those they were given.
  int64_t prefill_tokens_computed() const { return prefill_computed_; }
  int64_t prefill_tokens_given() const { return prefill_given_; }
  // Cached positions the decode steps attended over, summed (a step reads each
  // of its sequences' keys and values once): the KV part of the HBM floor.
  int64_t decode_positions_read() const { return decode_positions_; }
  // Tokens the extends appended (each computed once, in its extend's
  // forward; counted apart from the prefills' and the decode steps'), and the
  // extend calls.
  int64_t extend_tokens_computed() const { return extend_computed_; }
  int64_t extends() const { return extends_; }

  // One parameter's new values (bf16, as the weight broadcast carries them),
  // after the InferenceModel took them: a decoder with its own copy of the
  // weights (the GPU's) refreshes that parameter; the CPU reads the model's.
  virtual void load_bf16(const ParamInfo& param, const uint16_t* values) = 0;
  // Whether the decoder takes new weights straight from device memory
  // (load_bf16_device: the GPU decoder, a device-to-device copy), so the weight
  // broadcast that arrives in GPU memory need not cross to the host. The
  // InferenceModel's host copy is then not refreshed: nothing reads it once
  // the decoder is made.
  virtual bool loads_from_device() const { return false; }
  virtual void load_bf16_device(const ParamInfo& param, const void* values);
  // A (slots, V) host buffer the decoder owns, the fastest place for its
  // logits (pinned memory on the GPU: the download runs at full PCIe speed).
  virtual float* host_logits() = 0;
  // log_softmax(logits / temperature)[tokens[b]] for the n rows of the last
  // prefill, extend or decode (`logits`: where that step put them). CpuDecoder runs
  // the trainer's cpu::token_logprobs on them; the GPU computes it from its own
  // copy of the step's logits (the host would need ~20 ms a step at batch 64
  // and V = 128256 for the softmax sums).
  virtual void token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature,
                              int64_t n) = 0;
  // Whether draw() samples where the logits are (the GPU): generate() then
  // passes prefill, extend and decode no host logits and calls draw() after
  // each step.
  virtual bool draws_on_device() const { return false; }
  // Row b of the last step's logits drawn with uniforms[b] (uniform_draw of its
  // key) as the host Sampler draws (infer/sampler.hpp): out[b], and the token's
  // model and tempered logprobs as token_logprobs gives them (tempered = model
  // when greedy). Only where draws_on_device().
  virtual void draw(const SamplingParams& params, const double* uniforms, int64_t n, Sampled* out, float* model_lp,
                    float* tempered_lp);

  virtual int64_t cache_bytes() const = 0;     // the KV cache
  virtual int64_t scratch_bytes() const = 0;   // activations, logits, head scratch
  virtual int64_t weight_bytes() const = 0;    // weights held beside the InferenceModel's (0: none)
  virtual const ModelConfig& config() const = 0;
  // "cpu fp32" | "cuda bf16 on DEVICE": for the start-up line.
  virtual std::string describe() const = 0;
  // Decode steps run and their time on the device (0 when not measured), for
  // the HBM-floor comparison of bench runs.
  virtual int64_t decode_steps() const { return 0; }
  virtual double decode_seconds() const { return 0; }
  // Where a generate() call of `generate_seconds` went, when the decoder was
  // asked to profile (the GPU's SHARDLM_DECODE_PROFILE=1); "" otherwise.
  virtual std::string profile_report(double /*generate_seconds*/) const { return ""; }

 protected:
  // The backend's prefill: the forward of `prompts` (distinct spans) into
  // `slots`, whose blocks kv() already lists; then each layer's keys and
  // values of copies[i].from into copies[i].to; then logits (n, V) where row
  // i is the last position of prompt source[i].
  virtual void prefill_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                               std::span<const BlockCopy> copies, std::span<const int32_t> source,
                               float* logits) = 0;
  // The backend's decode step: tokens[b] at position length(slots[b]) - 1 of
  // each slot, whose blocks kv() already lists.
  virtual void decode_forward(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits) = 0;
  // The backend's extend: tokens[i] at positions length(slots[i]) - n_i ..
  // length(slots[i]) - 1 of each slot, whose blocks kv() already lists.
  virtual void extend_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                              float* logits) = 0;

  // Row `pos` of the slot's routes (route_width() entries), for the backend's forward to fill.
  int32_t* route_row(int32_t slot, int64_t pos) {
    return routes_.data() + size_t((slot * limits_.max_len + pos) * route_width_);
  }

  DecoderLimits limits_;
  KvBlocks kv_;

 private:
  int64_t route_width_ = 0;
  std::vector<int32_t> routes_;  // (slots, max_len, route_width) when recording
  int64_t prefill_computed_ = 0, prefill_given_ = 0, decode_positions_ = 0, extend_computed_ = 0, extends_ = 0;
  // prefill's plan, reused: the distinct prompts, their slots, each slot's source.
  std::vector<int32_t> unique_slots_, source_;
  std::vector<std::span<const int32_t>> unique_prompts_;
  std::vector<BlockCopy> copies_;
};

// What a decoder holds, counted from the same table it allocates from, before
// anything is allocated: `shardlm check`'s plan for an RL job's inference ranks.
struct DecoderPlan {
  int64_t weights = 0;   // its own copy of the weights (the GPU's bf16); 0: it reads the InferenceModel's
  int64_t cache = 0;     // the KV cache
  int64_t scratch = 0;   // the largest step's activations, logits, head scratch
  int64_t host = 0;      // host buffers beside them (the GPU's pinned logits and staging; the CPU's logits)
};
// Router replay's table of a decoder that records routes (Decoder::record_routes):
// slots x max_len rows of the model's route width, int32, in host memory.
int64_t routes_bytes(const ModelConfig& c, const DecoderLimits& limits);
// The limits both decoders accept: 1 to 65536 slots, 1 to max_position_embeddings
// positions. Throws Error naming the one out of range.
void check_decoder_limits(const ModelConfig& c, const DecoderLimits& limits);
// backend "cpu": everything in host memory; "cuda": weights, cache and scratch
// on the device (computed without one). Throws Error naming a limit out of range.
DecoderPlan plan_decoder(const ModelConfig& c, const DecoderLimits& limits, const std::string& backend);

// limits with memory_fraction set and blocks = 0: blocks sized from that
// fraction of `memory_bytes` less the decoder's weights copy and scratch (and
// on the CPU its host buffers), at most every slot at max_len; throws Error
// naming the fraction when that leaves less than one sequence's blocks. Other
// limits are returned as they are.
DecoderLimits size_pool(const ModelConfig& c, DecoderLimits limits, const std::string& backend, int64_t memory_bytes);
// The memory a decoder on `backend` plans against: the bound GPU's total, or
// the host's (machine_host_memory).
int64_t decoder_device_memory(const std::string& backend);

// backend: "cpu" or "cuda" (device.backend after "auto" is resolved; the CUDA
// device already bound). Throws Error for "cuda" in a build without CUDA.
// limits.memory_fraction sizes the pool here (size_pool).
std::unique_ptr<Decoder> make_decoder(const InferenceModel& model, const DecoderLimits& limits,
                                      const std::string& backend);

class CpuDecoder final : public Decoder {
 public:
  // Plans and allocates everything; throws Error when a limit is out of range.
  CpuDecoder(const InferenceModel& model, const DecoderLimits& limits);

  void load_bf16(const ParamInfo&, const uint16_t*) override {}
  float* host_logits() override { return host_logits_.data(); }
  void token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature,
                      int64_t n) override;

  int64_t cache_bytes() const override;
  int64_t scratch_bytes() const override;
  int64_t weight_bytes() const override { return 0; }
  const ModelConfig& config() const override { return model_.config(); }
  std::string describe() const override { return "cpu fp32"; }
  // The keys or values (KV, D) layer l holds for position pos of the
  // sequence in `slot` (below its length): for tests that compare caches
  // filled in different ways.
  const float* cached_keys(int l, int32_t slot, int64_t pos) const { return cached(k_cache_, l, slot, pos); }
  const float* cached_values(int l, int32_t slot, int64_t pos) const { return cached(v_cache_, l, slot, pos); }

  // The table of buffers for these limits (each checked); self null: planning
  // only (plan_decoder), no slots.
  static std::vector<cpu::BufferRow> plan_rows(const ModelConfig& c, const DecoderLimits& limits, CpuDecoder* self);
  static int64_t logits_bytes(const ModelConfig& c, const DecoderLimits& limits);  // host_logits()'s

 protected:
  // Each prompt runs its own pass (see the header).
  void prefill_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                       std::span<const BlockCopy> copies, std::span<const int32_t> source, float* logits) override;
  void decode_forward(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits) override;
  // Passes of whole slots' new rows (at most max_rows_ each), the decode
  // step's attention per row (see the header).
  void extend_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                      float* logits) override;

 private:
  // Embedding and layers 0..L-1 over the N tokens of tokens_ / positions_ /
  // slot_of_ (their k and v stored in the cache); `attend` fills acts_.att.
  template <class Attend>
  void run_layers(int64_t N, Attend&& attend);
  // logits (n, V) from the hidden states rows (n, C): final norm, lm-head (row-wise).
  void head(const float* rows, int64_t n, float* logits);
  const float* cached(const std::vector<Buffer<float>>& cache, int l, int32_t slot, int64_t pos) const;
  float* k_cache(int l) { return k_cache_[size_t(l)].data(); }
  float* v_cache(int l) { return v_cache_[size_t(l)].data(); }
  // Writes the N rows of k and v just computed into position pos_of[i] of slot slot_of[i], layer l.
  void store_kv(int l, int64_t N, const int32_t* slot_of, const int32_t* pos_of);

  const InferenceModel& model_;
  int64_t max_rows_ = 0;                 // tokens one step holds: max(max_len (one prompt), slots)
  std::vector<cpu::BufferRow> table_;
  std::vector<Buffer<float>> k_cache_, v_cache_;  // L x (blocks, block_size, KV, D)
  Buffer<float> x_, x_next_;             // (max_rows, C) residual stream in, out of a layer
  Buffer<float> last_;                   // (slots, C) each prompt's last hidden state
  cpu::LayerActs acts_;                  // one layer's, reused by every layer
  Buffer<float> head_x_, head_rstd_;     // (slots, C), (slots): the final norm's output
  std::vector<double> inv_freq_;         // (D / 2)
  std::vector<int32_t> tokens_, positions_, seq_ids_, slot_of_;  // (max_rows)
  std::vector<int32_t> attend_len_;      // (max_rows) decode, extend: positions each row attends to
  std::vector<float> host_logits_;       // (slots, V) generate()'s logits
  std::vector<float> temperatures_;      // (slots) token_logprobs' argument
};

}  // namespace shardlm
