// decoder.cpp — prefill and decode over the KV cache (see decoder.hpp).
#include "infer/decoder.hpp"
#include "infer/decoder_cuda.hpp"

#include <algorithm>
#include <cstring>

#include "cpu/ops.hpp"
#include "cpu/rl_loss.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "shardlm/memory.hpp"

namespace shardlm {

std::unique_ptr<Decoder> make_decoder(const InferenceModel& model, const DecoderLimits& limits,
                                      const std::string& backend) {
  const DecoderLimits sized = size_pool(model.config(), limits, backend, decoder_device_memory(backend));
  if (backend == "cuda") return make_cuda_decoder(model, sized);
  SHARDLM_CHECK(backend == "cpu", "internal: generate on backend '%s'", backend.c_str());
  return std::make_unique<CpuDecoder>(model, sized);
}

int64_t decoder_device_memory(const std::string& backend) {
  return backend == "cuda" ? cuda_device_memory_bytes(cuda_current_device()) : machine_host_memory().bytes;
}

DecoderLimits size_pool(const ModelConfig& c, DecoderLimits limits, const std::string& backend, int64_t memory_bytes) {
  if (limits.memory_fraction <= 0 || limits.blocks > 0) return limits;
  const double fraction = limits.memory_fraction;
  SHARDLM_CHECK(fraction <= 1, "generate: a KV pool sized from %g of the device's memory; give (0, 1]", fraction);
  const int64_t longest = pool_blocks(DecoderLimits{limits.slots, limits.max_len, limits.block_size, 0, 0});
  const int64_t one = (limits.max_len + limits.block_size - 1) / limits.block_size;
  // The plan is linear in the pool's blocks: what one sequence's blocks cost, and what does not grow.
  DecoderLimits a = limits, b = limits;
  a.blocks = one, b.blocks = 2 * one;
  a.memory_fraction = b.memory_fraction = 0;
  const DecoderPlan pa = plan_decoder(c, a, backend), pb = plan_decoder(c, b, backend);
  const double per_block = double(pb.cache - pa.cache) / double(one);
  const int64_t fixed = pa.weights + pa.scratch + (backend == "cpu" ? pa.host : 0);
  const double budget = fraction * double(memory_bytes) - double(fixed);
  const int64_t blocks = budget > 0 ? int64_t(budget / per_block) : 0;
  SHARDLM_CHECK(blocks >= one,
                "generate: %g of the %s's %.2f GiB is %.2f GiB, and the decoder's weights and scratch take %.2f GiB "
                "of it: no room for one sequence's KV blocks (%lld blocks of %lld positions, %.1f MiB); raise the "
                "fraction (rollout.kv_cache_memory, --kv-cache-memory) or give the pool in tokens",
                fraction, backend == "cuda" ? "GPU" : "host", double(memory_bytes) / 1073741824.0,
                fraction * double(memory_bytes) / 1073741824.0, double(fixed) / 1073741824.0, (long long)one,
                (long long)limits.block_size, per_block * double(one) / 1048576.0);
  limits.blocks = std::min(blocks, longest);
  limits.memory_fraction = 0;
  return limits;
}

int64_t pool_blocks(const DecoderLimits& limits) {
  return limits.blocks > 0 ? limits.blocks : limits.slots * ((limits.max_len + limits.block_size - 1) / limits.block_size);
}

void check_decoder_limits(const ModelConfig& c, const DecoderLimits& limits) {
  SHARDLM_CHECK(limits.slots >= 1 && limits.slots <= 65536, "generate: a batch of %lld sequences; give 1 to 65536",
                (long long)limits.slots);
  SHARDLM_CHECK(limits.max_len >= 1 && limits.max_len <= c.max_position_embeddings,
                "generate: %lld positions per sequence, but the model has max_position_embeddings = %lld",
                (long long)limits.max_len, (long long)c.max_position_embeddings);
  SHARDLM_CHECK(limits.block_size >= 1 && limits.block_size <= 65536,
                "generate: KV blocks of %lld positions; give 1 to 65536", (long long)limits.block_size);
  const int64_t one = (limits.max_len + limits.block_size - 1) / limits.block_size;
  SHARDLM_CHECK(limits.blocks == 0 || limits.blocks >= one,
                "generate: a KV cache of %lld tokens (%lld blocks of %lld) cannot hold one sequence of %lld positions "
                "(the longest prompt + max_new_tokens - 1); give it at least %lld tokens",
                (long long)(limits.blocks * limits.block_size), (long long)limits.blocks, (long long)limits.block_size,
                (long long)limits.max_len, (long long)(one * limits.block_size));
  SHARDLM_CHECK(limits.blocks >= 0 && pool_blocks(limits) <= INT32_MAX / limits.block_size,
                "generate: a KV cache of %lld blocks of %lld positions is over 2^31 positions", 
                (long long)pool_blocks(limits), (long long)limits.block_size);
}

namespace {

const DecoderLimits& checked(const ModelConfig& c, const DecoderLimits& limits) {
  check_decoder_limits(c, limits);
  return limits;
}

}  // namespace

Decoder::Decoder(const ModelConfig& c, const DecoderLimits& limits)
    : limits_(checked(c, limits)), kv_(pool_blocks(limits), limits.block_size, limits.slots, limits.max_len) {}

int64_t Decoder::prefill_blocks(std::span<const std::span<const int32_t>> prompts) const {
  int64_t need = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    const bool shared =
        std::any_of(prompts.begin(), prompts.begin() + ptrdiff_t(i), [&](const auto& q) { return same_span(q, p); });
    // A group's first sample fills the prompt's blocks; the others copy the last one when it is partly filled.
    need += shared ? int64_t(p.size() % size_t(kv_.block_size()) != 0) : kv_.blocks_for(int64_t(p.size()));
  }
  return need;
}

int64_t Decoder::decode_blocks(std::span<const int32_t> slots) const {
  int64_t need = 0;
  for (int32_t s : slots) need += kv_.blocks_to_grow(s, kv_.length(s) + 1);
  return need;
}

int64_t Decoder::extend_blocks(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens) const {
  int64_t need = 0;
  for (size_t i = 0; i < slots.size(); ++i)
    need += kv_.blocks_to_grow(slots[i], kv_.length(slots[i]) + int64_t(tokens[i].size()));
  return need;
}

void Decoder::prefill(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                      float* logits) {
  const int64_t n = static_cast<int64_t>(prompts.size());
  SHARDLM_CHECK(n == int64_t(slots.size()) && n >= 1 && n <= limits_.slots,
                "internal: prefill of %lld prompts into %zu slots (at most %lld)", (long long)n, slots.size(),
                (long long)limits_.slots);
  SHARDLM_CHECK(prefill_blocks(prompts) <= kv_.free_blocks(), "internal: a prefill needs %lld KV blocks, %lld free",
                (long long)prefill_blocks(prompts), (long long)kv_.free_blocks());
  unique_slots_.clear();
  unique_prompts_.clear();
  copies_.clear();
  source_.assign(size_t(n), -1);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t slot = slots[size_t(i)];
    const auto& p = prompts[size_t(i)];
    SHARDLM_CHECK(slot >= 0 && slot < limits_.slots && kv_.length(slot) == 0,
                  "internal: a prefill into slot %d of %lld (holding %lld positions)", slot,
                  (long long)limits_.slots, (long long)(slot >= 0 && slot < limits_.slots ? kv_.length(slot) : 0));
    SHARDLM_CHECK(!p.empty() && int64_t(p.size()) <= limits_.max_len,
                  "internal: a prompt of %zu tokens for sequences of %lld positions", p.size(),
                  (long long)limits_.max_len);
    prefill_given_ += int64_t(p.size());
    for (size_t u = 0; u < unique_prompts_.size(); ++u)
      if (same_span(unique_prompts_[u], p)) source_[size_t(i)] = int32_t(u);
    if (source_[size_t(i)] >= 0) continue;
    source_[size_t(i)] = int32_t(unique_prompts_.size());
    unique_slots_.push_back(slot);
    unique_prompts_.push_back(p);
    kv_.grow(slot, int64_t(p.size()));
    prefill_computed_ += int64_t(p.size());
  }
  // The other samples of each group take its blocks once the first holds them.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t first = unique_slots_[size_t(source_[size_t(i)])];
    if (first == slots[size_t(i)]) continue;
    if (const BlockCopy copy = kv_.share(first, slots[size_t(i)]); copy.from >= 0) copies_.push_back(copy);
  }
  prefill_forward(unique_slots_, unique_prompts_, copies_, source_, logits);
  if (route_width_ == 0) return;
  // A group's later samples computed nothing: their prompt's routes are the first sample's.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t first = unique_slots_[size_t(source_[size_t(i)])];
    if (first != slots[size_t(i)])
      std::copy_n(route_row(first, 0), prompts[size_t(i)].size() * size_t(route_width_), route_row(slots[size_t(i)], 0));
  }
}

void Decoder::record_routes() {
  route_width_ = config().route_width();
  SHARDLM_CHECK(route_width_ > 0, "internal: router replay's routes recorded for arch %s, which has no experts",
                config().arch.c_str());
  routes_.assign(size_t(routes_bytes(config(), limits_)) / sizeof(int32_t), -1);
}

int64_t routes_bytes(const ModelConfig& c, const DecoderLimits& limits) {
  return limits.slots * limits.max_len * c.route_width() * int64_t(sizeof(int32_t));
}

void Decoder::decode(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits) {
  const int64_t B = static_cast<int64_t>(slots.size());
  SHARDLM_CHECK(B == int64_t(tokens.size()) && B >= 1 && B <= limits_.slots,
                "internal: decode of %zu tokens into %lld slots", tokens.size(), (long long)B);
  SHARDLM_CHECK(decode_blocks(slots) <= kv_.free_blocks(), "internal: a decode step needs %lld KV blocks, %lld free",
                (long long)decode_blocks(slots), (long long)kv_.free_blocks());
  for (int32_t s : slots) {
    SHARDLM_CHECK(s >= 0 && s < limits_.slots, "internal: slot %d of %lld", s, (long long)limits_.slots);
    SHARDLM_CHECK(kv_.length(s) >= 1 && kv_.length(s) < limits_.max_len, "internal: slot %d holds %lld of %lld positions",
                  s, (long long)kv_.length(s), (long long)limits_.max_len);
    kv_.grow(s, kv_.length(s) + 1);
    decode_positions_ += kv_.length(s);
  }
  decode_forward(slots, tokens, logits);
}

void Decoder::extend(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                     float* logits) {
  const int64_t n = static_cast<int64_t>(slots.size());
  SHARDLM_CHECK(n == int64_t(tokens.size()) && n >= 1 && n <= limits_.slots,
                "internal: an extend of %zu slots by %zu token lists", slots.size(), tokens.size());
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = slots[size_t(i)];
    const int64_t add = int64_t(tokens[size_t(i)].size());
    SHARDLM_CHECK(s >= 0 && s < limits_.slots, "internal: slot %d of %lld", s, (long long)limits_.slots);
    SHARDLM_CHECK(std::count(slots.begin(), slots.begin() + i, s) == 0, "internal: slot %d twice in an extend", s);
    SHARDLM_CHECK(add >= 1 && kv_.length(s) >= 1 && kv_.length(s) + add <= limits_.max_len,
                  "internal: %lld tokens appended to slot %d, which holds %lld of %lld positions", (long long)add, s,
                  (long long)kv_.length(s), (long long)limits_.max_len);
  }
  SHARDLM_CHECK(extend_blocks(slots, tokens) <= kv_.free_blocks(), "internal: an extend needs %lld KV blocks, %lld free",
                (long long)extend_blocks(slots, tokens), (long long)kv_.free_blocks());
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = slots[size_t(i)];
    kv_.grow(s, kv_.length(s) + int64_t(tokens[size_t(i)].size()));
    extend_computed_ += int64_t(tokens[size_t(i)].size());
  }
  ++extends_;
  extend_forward(slots, tokens, logits);
}

DecoderPlan plan_decoder(const ModelConfig& c, const DecoderLimits& limits, const std::string& backend) {
  if (backend == "cuda") return plan_cuda_decoder(c, limits);
  SHARDLM_CHECK(backend == "cpu", "internal: generate on backend '%s'", backend.c_str());
  const std::vector<cpu::BufferRow> table = CpuDecoder::plan_rows(c, limits, nullptr);
  DecoderPlan plan;
  plan.cache = cpu::rows_bytes(table, Mem::Activations);
  plan.scratch = cpu::rows_bytes(table, Mem::Workspace);
  plan.host = CpuDecoder::logits_bytes(c, limits);
  return plan;
}

// Every limit checked, then the table of buffers: the constructor allocates
// from it, plan_decoder counts it (self null: no slot, nothing allocated).
std::vector<cpu::BufferRow> CpuDecoder::plan_rows(const ModelConfig& c, const DecoderLimits& limits,
                                                  CpuDecoder* self) {
  check_decoder_limits(c, limits);
  const int64_t max_rows = std::max(limits.max_len, limits.slots);
  if (std::string e = model_scale_error(c, max_rows, 1); !e.empty()) SHARDLM_FAIL("generate: %s", e.c_str());
  const int64_t L = c.num_layers, C = c.hidden_size, KVD = c.num_kv_heads * c.head_dim;
  if (self) {
    self->max_rows_ = max_rows;
    self->k_cache_.resize(size_t(L));
    self->v_cache_.resize(size_t(L));
  }
  const auto at = [self](Buffer<float> CpuDecoder::*member) { return self ? &(self->*member) : nullptr; };
  std::vector<cpu::BufferRow> table;
  // The cache's pool is the one buffer that grows with the tokens held: it is what the plan is about.
  const int64_t cache = pool_blocks(limits) * limits.block_size * KVD;
  for (int64_t l = 0; l < L; ++l) {
    table.push_back({"kv_cache.k", self ? &self->k_cache_[size_t(l)] : nullptr, cache, Mem::Activations});
    table.push_back({"kv_cache.v", self ? &self->v_cache_[size_t(l)] : nullptr, cache, Mem::Activations});
  }
  table.push_back({"x", at(&CpuDecoder::x_), max_rows * C, Mem::Workspace});
  table.push_back({"x_next", at(&CpuDecoder::x_next_), max_rows * C, Mem::Workspace});
  table.push_back({"last", at(&CpuDecoder::last_), limits.slots * C, Mem::Workspace});
  std::vector<cpu::BufferRow> act_rows;
  cpu::LayerActs counted;  // planning only: its rows are counted, never allocated
  (self ? self->acts_ : counted).add_rows(c, max_rows, act_rows);
  for (auto& r : act_rows) {
    r.category = Mem::Workspace;
    if (!self) r.slot = nullptr, r.index_slot = nullptr, r.offset_slot = nullptr;
    table.push_back(r);
  }
  table.push_back({"head.x", at(&CpuDecoder::head_x_), limits.slots * C, Mem::Workspace});
  table.push_back({"head.rstd", at(&CpuDecoder::head_rstd_), limits.slots, Mem::Workspace});
  return table;
}

int64_t CpuDecoder::logits_bytes(const ModelConfig& c, const DecoderLimits& limits) {
  return limits.slots * c.vocab_size * int64_t(sizeof(float));
}

CpuDecoder::CpuDecoder(const InferenceModel& model, const DecoderLimits& limits)
    : Decoder(model.config(), limits), model_(model) {
  const ModelConfig& c = model.config();
  table_ = plan_rows(c, limits, this);
  cpu::allocate_rows(table_);
  inv_freq_ = cpu::rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
  tokens_.resize(size_t(max_rows_));
  positions_.resize(size_t(max_rows_));
  seq_ids_.resize(size_t(max_rows_));
  slot_of_.resize(size_t(max_rows_));
  attend_len_.resize(size_t(max_rows_));
  host_logits_.resize(size_t(logits_bytes(c, limits)) / sizeof(float));
  temperatures_.resize(size_t(limits.slots));
}

void Decoder::load_bf16_device(const ParamInfo& param, const void*) {
  SHARDLM_FAIL("internal: this decoder takes no weights from device memory (%s)", param.name.c_str());
}

void Decoder::draw(const SamplingParams&, const double*, int64_t, Sampled*, float*, float*) {
  SHARDLM_FAIL("internal: %s does not draw on its device", describe().c_str());
}

void CpuDecoder::token_logprobs(float* out, const float* logits, const int32_t* tokens, float temperature,
                                int64_t n) {
  SHARDLM_CHECK(n <= limits_.slots, "internal: logprobs of %lld rows, %lld slots", (long long)n,
                (long long)limits_.slots);
  std::fill(temperatures_.begin(), temperatures_.begin() + n, temperature);
  cpu::token_logprobs<float>(out, logits, tokens, temperatures_.data(), n, model_.config().vocab_size);
}

int64_t CpuDecoder::cache_bytes() const { return cpu::rows_bytes(table_, Mem::Activations); }
int64_t CpuDecoder::scratch_bytes() const { return cpu::rows_bytes(table_, Mem::Workspace); }

const float* CpuDecoder::cached(const std::vector<Buffer<float>>& cache, int l, int32_t slot, int64_t pos) const {
  const ModelConfig& c = model_.config();
  SHARDLM_CHECK(l >= 0 && l < int(c.num_layers) && slot >= 0 && slot < limits_.slots && pos >= 0 &&
                    pos < kv_.length(slot),
                "internal: the cache of layer %d, slot %d, position %lld (the slot holds %lld)", l, slot,
                (long long)pos, (long long)(slot >= 0 && slot < limits_.slots ? kv_.length(slot) : 0));
  return cache[size_t(l)].data() + kv_cache_row(kv_.pages(), slot, pos) * c.num_kv_heads * c.head_dim;
}

void CpuDecoder::store_kv(int l, int64_t N, const int32_t* slot_of, const int32_t* pos_of) {
  const ModelConfig& c = model_.config();
  const int64_t KVD = c.num_kv_heads * c.head_dim;
  const KvPages pages = kv_.pages();
  float* kc = k_cache(l);
  float* vc = v_cache(l);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t at = kv_cache_row(pages, slot_of[i], pos_of[i]) * KVD;
    std::memcpy(kc + at, acts_.k.data() + i * KVD, sizeof(float) * KVD);
    std::memcpy(vc + at, acts_.v.data() + i * KVD, sizeof(float) * KVD);
  }
}

void CpuDecoder::head(const float* rows, int64_t n, float* logits) {
  const ModelConfig& c = model_.config();
  cpu::rmsnorm_forward(head_x_.data(), head_rstd_.data(), rows, model_.final_norm(), n, c.hidden_size,
                       c.rms_norm_eps);
  cpu::linear_rowwise_forward<float>(logits, head_x_.data(), model_.lm_head(), nullptr, n, c.hidden_size,
                                     c.vocab_size);
}

template <class Attend>
void CpuDecoder::run_layers(int64_t N, Attend&& attend) {
  const ModelConfig& c = model_.config();
  const cpu::TokenInputs in{N, positions_.data(), seq_ids_.data(), inv_freq_.data()};
  cpu::embedding_forward(x_.data(), tokens_.data(), model_.embedding(), N, c.vocab_size, c.hidden_size);
  for (int l = 0; l < int(c.num_layers); ++l) {
    const LayerWeights<const float> w = model_.layer(l);
    cpu::layer_qkv_forward(c, w, in, x_.data(), acts_, &cpu::linear_rowwise_forward<float>);
    store_kv(l, N, slot_of_.data(), positions_.data());
    attend(l, in);
    cpu::layer_out_forward(c, w, N, x_.data(), x_next_.data(), acts_, &cpu::linear_rowwise_forward<float>);
    if (route_width() > 0 && c.moe_layer(l))
      for (int64_t i = 0; i < N; ++i)
        std::copy_n(acts_.expert.data() + i * c.num_experts_per_tok, c.num_experts_per_tok,
                    route_row(slot_of_[size_t(i)], positions_[size_t(i)]) + c.route_offset(l));
    std::swap(x_, x_next_);
  }
}

void CpuDecoder::prefill_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> prompts,
                                 std::span<const BlockCopy> copies, std::span<const int32_t> source, float* logits) {
  const ModelConfig& c = model_.config();
  const int64_t C = c.hidden_size, KVD = c.num_kv_heads * c.head_dim;
  for (size_t u = 0; u < prompts.size(); ++u) {
    const auto& p = prompts[u];
    const int64_t N = int64_t(p.size());
    // One prompt per pass, its own document.
    for (int64_t t = 0; t < N; ++t) {
      tokens_[size_t(t)] = p[size_t(t)];
      positions_[size_t(t)] = static_cast<int32_t>(t);
      seq_ids_[size_t(t)] = 0;
      slot_of_[size_t(t)] = slots[u];
    }
    run_layers(N, [&](int, const cpu::TokenInputs& in) {
      cpu::attention_forward(acts_.att.data(), acts_.lse.data(), acts_.q.data(), acts_.k.data(), acts_.v.data(),
                             in.seq_ids, N, c.num_heads, c.num_kv_heads, c.head_dim);
    });
    std::memcpy(last_.data() + int64_t(u) * C, x_.data() + (N - 1) * C, sizeof(float) * C);
  }
  const int64_t block = kv_.block_size() * KVD;
  for (int l = 0; l < int(c.num_layers); ++l)
    for (const BlockCopy& b : copies) {
      std::memcpy(k_cache(l) + b.to * block, k_cache(l) + b.from * block, sizeof(float) * block);
      std::memcpy(v_cache(l) + b.to * block, v_cache(l) + b.from * block, sizeof(float) * block);
    }
  // Row i takes its prompt's last state; source[i] <= i, so going down reads rows not yet written.
  for (int64_t i = int64_t(source.size()) - 1; i >= 0; --i)
    if (source[size_t(i)] != i)
      std::memcpy(last_.data() + i * C, last_.data() + int64_t(source[size_t(i)]) * C, sizeof(float) * C);
  head(last_.data(), int64_t(source.size()), logits);
}

void CpuDecoder::decode_forward(std::span<const int32_t> slots, std::span<const int32_t> tokens, float* logits) {
  const ModelConfig& c = model_.config();
  const int64_t B = static_cast<int64_t>(slots.size());
  for (int64_t b = 0; b < B; ++b) {
    const int32_t s = slots[size_t(b)];
    tokens_[size_t(b)] = tokens[size_t(b)];
    positions_[size_t(b)] = static_cast<int32_t>(kv_.length(s) - 1);
    seq_ids_[size_t(b)] = static_cast<int32_t>(b);
    slot_of_[size_t(b)] = s;
    attend_len_[size_t(b)] = static_cast<int32_t>(kv_.length(s));
  }
  run_layers(B, [&](int l, const cpu::TokenInputs&) {
    cpu::attention_decode_forward(acts_.att.data(), acts_.q.data(), k_cache(l), v_cache(l), kv_.pages(),
                                  slot_of_.data(), attend_len_.data(), B, c.num_heads, c.num_kv_heads, c.head_dim);
  });
  head(x_.data(), B, logits);
}

void CpuDecoder::extend_forward(std::span<const int32_t> slots, std::span<const std::span<const int32_t>> tokens,
                                float* logits) {
  const ModelConfig& c = model_.config();
  const int64_t n = static_cast<int64_t>(slots.size()), C = c.hidden_size;
  for (int64_t first = 0; first < n;) {
    // Whole slots while their rows fit (one slot's always do: fewer than max_len).
    int64_t N = 0, end = first;
    for (; end < n; ++end) {
      const auto& ids = tokens[size_t(end)];
      const int64_t add = int64_t(ids.size());
      if (end > first && N + add > max_rows_) break;
      const int32_t s = slots[size_t(end)];
      const int64_t start = kv_.length(s) - add;
      for (int64_t t = 0; t < add; ++t) {
        tokens_[size_t(N + t)] = ids[size_t(t)];
        positions_[size_t(N + t)] = static_cast<int32_t>(start + t);
        seq_ids_[size_t(N + t)] = static_cast<int32_t>(end);
        slot_of_[size_t(N + t)] = s;
        attend_len_[size_t(N + t)] = static_cast<int32_t>(start + t + 1);
      }
      N += add;
    }
    // run_layers stores the pass's keys and values before `attend`: a row
    // reads the rows before it from the cache, as a decode step at its length would.
    run_layers(N, [&](int l, const cpu::TokenInputs&) {
      cpu::attention_decode_forward(acts_.att.data(), acts_.q.data(), k_cache(l), v_cache(l), kv_.pages(),
                                    slot_of_.data(), attend_len_.data(), N, c.num_heads, c.num_kv_heads, c.head_dim);
    });
    for (int64_t i = first, row = 0; i < end; ++i) {
      row += int64_t(tokens[size_t(i)].size());
      std::memcpy(last_.data() + i * C, x_.data() + (row - 1) * C, sizeof(float) * C);
    }
    first = end;
  }
  head(last_.data(), n, logits);
}

}  // namespace shardlm
