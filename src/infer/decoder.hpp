// decoder.hpp — the model's forward for sampling: batched prefill of prompts
// into a KV cache, then one token per sequence per decode step, attending over
// the cache. CPU backend, fp32.
//
// A sequence's logits never depend on the other sequences of its batch (so a
// seeded sample does not either): a prompt is prefilled with matmuls of its
// own rows only, and decode steps and the lm-head run
// cpu::linear_rowwise_forward, whose rows do not depend on each other (BLAS
// picks kernels by the matrix's shape, which changes a row's last bits).
//
// Owns: the KV cache (per layer, keys and values (slots, max_len, KV, D)) and
// every buffer a prefill or decode step uses, planned once from DecoderLimits
// through one table of (name, numel, plan row) that both allocates and counts
// (cpu/layers.hpp's BufferRow), so a step allocates nothing; each slot's
// length. The arithmetic is training's own: cpu::layer_qkv_forward and
// cpu::layer_out_forward around attention (prefill: cpu::attention_forward,
// as training attends; decode: cpu::attention_decode_forward, the same sums
// over the cache), then the final RMSNorm and the lm-head. Must not know:
// sampling, prompt files, MPI, output.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cpu/layers.hpp"
#include "infer/model.hpp"

namespace shardlm {

struct DecoderLimits {
  int64_t slots = 8;             // sequences held at once (the decode batch)
  int64_t max_len = 0;           // positions per slot: prompt + generated tokens
};

class Decoder {
 public:
  // Plans and allocates everything; throws Error when a limit is out of range.
  Decoder(const InferenceModel& model, const DecoderLimits& limits);

  // Prompts[i] into slot slots[i] at positions 0 .. len - 1 (what the slot held
  // is forgotten); logits (n, V) of each prompt's last position. At most
  // `slots` prompts, each at most max_len tokens; each runs its own matmuls.
  void prefill(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts, float* logits);
  // tokens[b] appended to slot slots[b] at position length(slots[b]); logits
  // (B, V) of those positions. Distinct slots, each with room for one more.
  void decode(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits);

  int64_t length(int32_t slot) const { return slot_len_[size_t(slot)]; }
  const DecoderLimits& limits() const { return limits_; }
  int64_t cache_bytes() const;       // the KV cache
  int64_t scratch_bytes() const;     // activations, logits input, head scratch
  const ModelConfig& config() const { return model_.config(); }

 private:
  // Embedding and layers 0..L-1 over the N tokens of tokens_ / positions_ /
  // slot_of_ (their k and v stored in the cache); `attend` fills acts_.att.
  template <class Attend>
  void run_layers(int64_t N, cpu::LinearFn linear, Attend&& attend);
  // logits (n, V) from the hidden states rows (n, C): final norm, lm-head (row-wise).
  void head(const float* rows, int64_t n, float* logits);
  void check_slot(int32_t slot) const;
  float* k_cache(int l) { return k_cache_[size_t(l)].data(); }
  float* v_cache(int l) { return v_cache_[size_t(l)].data(); }
  // Writes the N rows of k and v just computed into (slot_of[i], pos_of[i]) of layer l's cache.
  void store_kv(int l, int64_t N, const int32_t* slot_of, const int32_t* pos_of);

  const InferenceModel& model_;
  DecoderLimits limits_;
  int64_t max_rows_ = 0;                 // tokens one step holds: max(max_len (one prompt), slots)
  std::vector<cpu::BufferRow> table_;
  std::vector<Buffer<float>> k_cache_, v_cache_;  // L x (slots, max_len, KV, D)
  Buffer<float> x_, x_next_;             // (max_rows, C) residual stream in, out of a layer
  Buffer<float> last_;                   // (slots, C) each prompt's last hidden state
  cpu::LayerActs acts_;                  // one layer's, reused by every layer
  Buffer<float> head_x_, head_rstd_;     // (slots, C), (slots): the final norm's output
  std::vector<double> inv_freq_;         // (D / 2)
  std::vector<int32_t> tokens_, positions_, seq_ids_, slot_of_;  // (max_rows)
  std::vector<int32_t> attend_len_;      // (slots) decode: tokens each row attends to
  std::vector<int32_t> slot_len_;        // (slots) positions filled per slot
};

}  // namespace shardlm
