// decoder.hpp — the model's forward for sampling: batched prefill of prompts
// into a KV cache, then one token per sequence per decode step, attending over
// the cache. CPU backend, fp32.
//
// Owns: the KV cache (per layer, keys and values (slots, max_len, KV, D)) and
// every buffer a prefill or decode step uses, planned once from DecoderLimits
// through one table of (name, numel, plan row) that both allocates and counts
// (cpu/layers.hpp's BufferRow), so a step allocates nothing; each slot's
// length. The arithmetic is training's own: cpu::layer_qkv_forward and
// cpu::layer_out_forward around attention (prefill: cpu::attention_forward on
// the packed prompts, as training attends over packed documents; decode:
// cpu::attention_decode_forward, the same sums over the cache), and
// cpu::head_logits. Must not know: sampling, prompts files, MPI, output.
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
  int64_t prefill_tokens = 0;    // prompt tokens one prefill call takes at most (>= the longest prompt)
};

class Decoder {
 public:
  // Plans and allocates everything; throws Error when a limit is out of range.
  Decoder(const InferenceModel& model, const DecoderLimits& limits);

  // Prompts[i] into slot slots[i] at positions 0 .. len - 1 (what the slot held
  // is forgotten); logits (n, V) of each prompt's last position. At most
  // `slots` prompts and prefill_tokens tokens together, each at most max_len.
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
  // Layers 0..L-1 over x_ (N tokens already embedded), then nothing: the
  // attention step is prefill's or decode's.
  template <class Attend>
  void run_layers(int64_t N, Attend&& attend);
  void check_slot(int32_t slot) const;
  float* k_cache(int l) { return k_cache_[size_t(l)].data(); }
  float* v_cache(int l) { return v_cache_[size_t(l)].data(); }
  // Writes the N rows of k and v just computed into (slot_of[i], pos_of[i]) of layer l's cache.
  void store_kv(int l, int64_t N, const int32_t* slot_of, const int32_t* pos_of);

  const InferenceModel& model_;
  DecoderLimits limits_;
  int64_t max_rows_ = 0;                 // tokens one step holds: max(prefill_tokens, slots)
  std::vector<cpu::BufferRow> table_;
  std::vector<Buffer<float>> k_cache_, v_cache_;  // L x (slots, max_len, KV, D)
  Buffer<float> x_, x_next_;             // (max_rows, C) residual stream in, out of a layer
  Buffer<float> last_;                   // (slots, C) each prompt's last hidden state
  cpu::LayerActs acts_;                  // one layer's, reused by every layer
  cpu::HeadScratch head_;                // final norm of at most `slots` rows
  std::vector<double> inv_freq_;         // (D / 2)
  std::vector<int32_t> tokens_, positions_, seq_ids_, slot_of_;  // (max_rows)
  std::vector<int32_t> attend_len_;      // (slots) decode: tokens each row attends to
  std::vector<int32_t> slot_len_;        // (slots) positions filled per slot
};

}  // namespace shardlm
