// test_decode.cpp — sampling on the GPU (build/test_gpu, `make test-gpu`): the
// decode attention kernel against cpu::attention_decode_forward through paged
// block tables (the same bits whatever the table), the CUDA
// decoder against the CPU decoder on the HF fixtures (prefill and decode
// logits, greedy choices, a weight refreshed through load_bf16; an extend
// against the same ids fed one a decode step), seeded
// sampling on the GPU giving the same tokens twice, and the GPU sampler
// (cuda::sample_rows) drawing the host Sampler's tokens from the same logits. The tolerances are in
// tests/gpu/README.md ("Sampling on the GPU").
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "cpu/ops.hpp"
#include "cpu/rl_loss.hpp"
#include "cuda/decode_attention.hpp"
#include "cuda/sampling.hpp"
#include "infer/decoder.hpp"
#include "infer/decoder_cuda.hpp"
#include "infer/generate.hpp"
#include "infer/model.hpp"
#include "infer/sampler.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

#define CUDA_OK(call) REQUIRE((call) == cudaSuccess)

void require_gpu() {
  REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
  cuda_set_device(0);
}

// Environment variables set while it lives (a null value: left alone), unset after.
using EnvVars = std::initializer_list<std::pair<const char*, const char*>>;
class ScopedEnv {
 public:
  explicit ScopedEnv(EnvVars vars) {
    for (const auto& [name, value] : vars)
      if (value) setenv(name, value, 1), set_.push_back(name);
  }
  ~ScopedEnv() {
    for (const char* name : set_) unsetenv(name);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<const char*> set_;
};

// ‖a − b‖ / ‖b‖ over n values.
double rel_rms(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16_rne(x)); }

struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(size_t bytes) { CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~DeviceBytes() { cudaFree(p); }
  template <class T> T* as() { return static_cast<T*>(p); }
};

// A block table over a pool of KV cache blocks for the kernel tests
// (shardlm/kv_pages.hpp): B + 1 rows, query b reading row B - b, so a row is
// never the query's index. block_size 0: one block per row holding max_len
// positions (rounded up to 16) and the identity table, the layout of a
// contiguous cache. Otherwise the pool's blocks handed out in a shuffled order
// (a row's blocks not adjacent), and queries share_a < share_b sharing their
// blocks below both their last positions, as prefix sharing will (a block
// holding a new token's position is never shared). Entries past a row's
// length are -1.
struct BlockTable {
  int64_t block_size = 0, table_ld = 0, blocks = 0;
  std::vector<int32_t> table;  // (B + 1, table_ld)
  std::vector<int32_t> seq;    // (B) the row query b reads
  int64_t shared = 0;          // blocks the two sharing rows have in common
  KvPages pages(const int32_t* at) const { return {at, table_ld, block_size}; }
};

BlockTable block_table(int64_t max_len, const std::vector<int32_t>& lens, int64_t block_size, int share_a, int share_b,
                       std::mt19937_64& rng) {
  const int64_t B = int64_t(lens.size());
  BlockTable t;
  t.block_size = block_size > 0 ? block_size : (max_len + 15) / 16 * 16;
  t.table_ld = (max_len + t.block_size - 1) / t.block_size;
  t.blocks = (B + 1) * t.table_ld;
  t.table.assign(size_t(t.blocks), -1);
  for (int64_t b = 0; b < B; ++b) t.seq.push_back(int32_t(B - b));
  if (block_size == 0) {
    std::iota(t.table.begin(), t.table.end(), 0);
    return t;
  }
  std::vector<int32_t> order(size_t(t.blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  size_t next = 0;
  if (share_a >= 0) t.shared = (std::min(lens[size_t(share_a)], lens[size_t(share_b)]) - 1) / t.block_size;
  for (int64_t b = 0; b < B; ++b) {
    int32_t* row = t.table.data() + t.seq[size_t(b)] * t.table_ld;
    const int32_t* from = t.table.data() + (share_a >= 0 ? t.seq[size_t(share_a)] : 0) * t.table_ld;
    for (int64_t j = 0; j < (lens[size_t(b)] + t.block_size - 1) / t.block_size; ++j)
      row[j] = b == share_b && j < t.shared ? from[j] : order[next++];
  }
  return t;
}

// One decode-attention case: B queries over max_len positions, lengths given,
// the cache laid out by each of block_table's layouts (one block a row, blocks
// of 16, 32 and 64). Every kernel is checked against the CPU reference; the
// output bits must not depend on the layout (the table moves rows, not the
// arithmetic); rows no query holds are NaN, so a read past a length shows.
void check_decode_attention(int64_t H, int64_t KV, int64_t D, int64_t max_len, std::vector<int32_t> lens,
                            uint64_t seed) {
  const int64_t B = int64_t(lens.size()), KVD = KV * D, q_ld = (H + 2 * KV) * D;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto randoms = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = round_bf16(normal(rng));
    return v;
  };
  // The step's fused rows before RoPE (H q heads, then the new token's KV k
  // and KV v heads), and the positions each query sees, (B, max_len, KV, D).
  const std::vector<float> fused = randoms(B * q_ld);
  std::vector<float> k_seen = randoms(B * max_len * KVD), v_seen = randoms(B * max_len * KVD);
  // The two longest rows hold the same positions below both their last ones: a prefix the table can share.
  std::vector<int> by_len(static_cast<size_t>(B));
  std::iota(by_len.begin(), by_len.end(), 0);
  std::stable_sort(by_len.begin(), by_len.end(), [&](int a, int b) { return lens[size_t(a)] > lens[size_t(b)]; });
  const int share_a = B >= 2 ? std::min(by_len[0], by_len[1]) : -1;
  const int share_b = B >= 2 ? std::max(by_len[0], by_len[1]) : -1;
  if (B >= 2) {
    const int64_t common = std::min(lens[size_t(share_a)], lens[size_t(share_b)]) - 1;
    std::copy_n(k_seen.begin() + share_a * max_len * KVD, common * KVD, k_seen.begin() + share_b * max_len * KVD);
    std::copy_n(v_seen.begin() + share_a * max_len * KVD, common * KVD, v_seen.begin() + share_b * max_len * KVD);
  }
  // RoPE at the new position len - 1, rounded as the kernels round (rope_pair):
  // the rotated q, and the rotated k and v at len - 1, are what the attention
  // without RoPE reads.
  std::vector<float> inv_freq(size_t(D / 2)), q(size_t(B * H * D));
  for (int64_t i = 0; i < D / 2; ++i) inv_freq[size_t(i)] = float(1.0 / std::pow(10000.0, double(2 * i) / double(D)));
  std::vector<int32_t> positions(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t pos = lens[size_t(b)] - 1;
    positions[size_t(b)] = int32_t(pos);
    for (int64_t hh = 0; hh < H + KV; ++hh) {
      const float* x = fused.data() + b * q_ld + hh * D;
      float* to = hh < H ? q.data() + (b * H + hh) * D : k_seen.data() + ((b * max_len + pos) * KV + hh - H) * D;
      for (int64_t i = 0; i < D / 2; ++i) {
        const float a = float(pos) * inv_freq[size_t(i)], cs = std::cos(a), sn = std::sin(a);
        const float x1 = x[i], x2 = x[i + D / 2];
        to[i] = round_bf16(x1 * cs - x2 * sn), to[i + D / 2] = round_bf16(x2 * cs + x1 * sn);
      }
    }
    std::copy_n(fused.begin() + b * q_ld + (H + KV) * D, KVD, v_seen.begin() + (b * max_len + pos) * KVD);
  }
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16_rne(v[i]);
    return out;
  };
  // q packed, and in the fused rows' stride with zeros after it.
  std::vector<float> q_wide(size_t(B * q_ld), 0.0f);
  for (int64_t b = 0; b < B; ++b) std::copy_n(q.begin() + b * H * D, H * D, q_wide.begin() + b * q_ld);
  const std::vector<uint16_t> qb = to_bf16(q), qwb = to_bf16(q_wide), fb = to_bf16(fused);
  DeviceBytes dq(qb.size() * 2), dqw(qwb.size() * 2), dfused(fb.size() * 2), dout(qb.size() * 2), dseq(B * 4),
      dlen(B * 4), dpos(B * 4), drows(B * 4), dinv(inv_freq.size() * 4);
  const size_t scratch_bytes = cuda::decode_attention_scratch_bytes(B, H, D, max_len);
  DeviceBytes scratch(scratch_bytes);
  CUDA_OK(cudaMemcpy(dq.p, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dqw.p, qwb.data(), qwb.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dfused.p, fb.data(), fb.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dlen.p, lens.data(), B * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dpos.p, positions.data(), B * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dinv.p, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice));

  // The kernel D takes (tensor cores at 64 and 128, 16 bytes a lane at 32 and 256, the scalar one
  // otherwise), q packed and in wide rows, or the fused rows with the kernel's own RoPE and store
  // (64 and 128), the cache cut as the decoder would (0), whole (1: no combine) and into the most chunks.
  const int64_t most = std::min<int64_t>(cuda::kDecodeMaxChunks, (max_len + 31) / 32);
  const std::vector<int64_t> chunk_counts = {0, 1, most};
  std::vector<std::vector<uint16_t>> first_bits(2 * 2 * chunk_counts.size());  // the first layout's, per kernel call
  double worst = 0;
  int64_t shared_blocks = 0;
  for (const int64_t block_size : {int64_t(0), int64_t(16), int64_t(32), int64_t(64)}) {
    const BlockTable t = block_table(max_len, lens, block_size, share_a, share_b, rng);
    const KvPages host_pages = t.pages(t.table.data());
    const int64_t bs = t.block_size;
    shared_blocks = std::max(shared_blocks, t.shared);
    CAPTURE(bs);
    // The CPU's cache (blocks, block_size, KV, D); rows no query holds NaN.
    std::vector<float> k_cpu(size_t(t.blocks * bs * KVD), NAN), v_cpu(k_cpu.size(), NAN);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t p = 0; p < lens[size_t(b)]; ++p) {
        const int64_t row = kv_cache_row(host_pages, t.seq[size_t(b)], p);
        std::copy_n(k_seen.begin() + (b * max_len + p) * KVD, KVD, k_cpu.begin() + row * KVD);
        std::copy_n(v_seen.begin() + (b * max_len + p) * KVD, KVD, v_cpu.begin() + row * KVD);
      }
    std::vector<float> want(q.size());
    cpu::attention_decode_forward<float>(want.data(), q.data(), k_cpu.data(), v_cpu.data(), host_pages, t.seq.data(),
                                         lens.data(), B, H, KV, D);
    std::vector<int32_t> cache_rows(static_cast<size_t>(B));  // the new token's row
    for (int64_t b = 0; b < B; ++b)
      cache_rows[size_t(b)] = int32_t(kv_cache_row(host_pages, t.seq[size_t(b)], lens[size_t(b)] - 1));
    // The GPU's (blocks, KV, block_size, D); with `hole` the new tokens' rows NaN too (the kernel's RoPE writes them).
    auto gpu_cache = [&](const std::vector<float>& v, bool hole) {
      std::vector<uint16_t> out(v.size());
      for (int64_t r = 0; r < t.blocks * bs; ++r)
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t d = 0; d < D; ++d)
            out[size_t(((r / bs * KV + h) * bs + r % bs) * D + d)] = f32_to_bf16_rne(v[size_t((r * KV + h) * D + d)]);
      if (hole)
        for (const int32_t r : cache_rows)
          for (int64_t h = 0; h < KV; ++h)
            std::fill_n(out.begin() + ((r / bs * KV + h) * bs + r % bs) * D, D, uint16_t(0x7fc0));
      return out;
    };
    const bool ropes = cuda::decode_attention_ropes(D);
    const std::vector<uint16_t> kb = gpu_cache(k_cpu, false), vb = gpu_cache(v_cpu, false);
    const std::vector<uint16_t> kb_hole = ropes ? gpu_cache(k_cpu, true) : kb;
    const std::vector<uint16_t> vb_hole = ropes ? gpu_cache(v_cpu, true) : vb;
    DeviceBytes dk(kb.size() * 2), dv(vb.size() * 2), dtable(t.table.size() * 4);
    auto upload_cache = [&](bool hole) {
      CUDA_OK(cudaMemcpy(dk.p, (hole ? kb_hole : kb).data(), kb.size() * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dv.p, (hole ? vb_hole : vb).data(), vb.size() * 2, cudaMemcpyHostToDevice));
    };
    CUDA_OK(cudaMemcpy(dtable.p, t.table.data(), t.table.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dseq.p, t.seq.data(), B * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(drows.p, cache_rows.data(), B * 4, cudaMemcpyHostToDevice));
    const KvPages pages = t.pages(dtable.as<int32_t>());
    const cuda::DecodeRope rope_args{dpos.as<int32_t>(), dinv.as<float>(), drows.as<int32_t>(), dk.as<__nv_bfloat16>(),
                                     dv.as<__nv_bfloat16>()};
    for (const bool rope : {false, true}) {
      if (rope && !ropes) continue;
      for (const bool wide : {false, true}) {
        if (rope && !wide) continue;  // RoPE reads the fused rows
        for (size_t ci = 0; ci < chunk_counts.size(); ++ci) {
          const int64_t chunks = chunk_counts[ci];
          CAPTURE(rope);
          CAPTURE(wide);
          CAPTURE(chunks);
          std::vector<uint16_t> runs[2];
          for (auto& got : runs) {
            upload_cache(rope);
            CUDA_OK(cudaMemset(dout.p, 0xff, qb.size() * 2));  // NaN: an unwritten element fails
            const __nv_bfloat16* qp = (rope ? dfused : wide ? dqw : dq).as<__nv_bfloat16>();
            cuda::decode_attention_forward(dout.as<__nv_bfloat16>(), qp, rope || wide ? q_ld : H * D,
                                           dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), pages, dseq.as<int32_t>(),
                                           dlen.as<int32_t>(), B, H, KV, D, max_len, chunks, scratch.p, scratch_bytes,
                                           nullptr, rope ? &rope_args : nullptr);
            CUDA_OK(cudaDeviceSynchronize());
            got.resize(qb.size());
            CUDA_OK(cudaMemcpy(got.data(), dout.p, got.size() * 2, cudaMemcpyDeviceToHost));
          }
          std::vector<float> got(q.size());
          for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(runs[0][i]);
          const double err = rel_rms(got.data(), want.data(), got.size());
          bool finite = true;
          for (float x : got) finite &= std::isfinite(x);
          worst = std::max(worst, err);
          CHECK(finite);
          // One bf16 rounding of the output (~2e-3 as an RMS ratio); the fp32 sums differ by ~1e-6;
          // the tensor-core kernel rounds the probabilities to bf16 as well (~1.4e-3 at D = 64 measured);
          // with RoPE the kernel's sincosf against the host's may move a rotated element by an ulp.
          CHECK(err < 5e-3);
          CHECK(runs[0] == runs[1]);  // deterministic
          std::vector<uint16_t>& first = first_bits[(size_t(rope) * 2 + size_t(wide)) * chunk_counts.size() + ci];
          if (first.empty()) first = runs[0];
          else CHECK(runs[0] == first);  // the same bits through any table
        }
      }
    }
  }
  MESSAGE("decode attention H=" << H << " KV=" << KV << " D=" << D << " max_len=" << max_len
                                << " over blocks of 16, 32, 64 and one a row (" << shared_blocks
                                << " blocks shared): worst |gpu - cpu| / |cpu| = " << worst);
}

// "llama-d64": llama-gqa-tied's config with head dim 64 (4 query heads over
// one kv head) and seeded random weights, written once per process to a
// temporary HF directory. The decode attention's tensor-core kernel and its
// own RoPE and cache store run at head dims 64 and 128 only; the fixtures'
// are 16 and 32.
fs::path d64_model_dir() {
  struct Dir {  // removed when the process exits
    fs::path path;
    ~Dir() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static const Dir dir{[] {
    const fs::path d = fs::temp_directory_path() / ("shardlm-test-d64-" + std::to_string(getpid()));
    fs::create_directories(d);
    ModelConfig c = read_hf_config("tests/fixtures/llama-gqa-tied");
    c.head_dim = 64, c.num_heads = 4, c.num_kv_heads = 1;
    write_hf_config(d, c, "float32");
    const int64_t C = c.hidden_size, I = c.intermediate_size, HD = c.num_heads * c.head_dim;
    const int64_t KVD = c.num_kv_heads * c.head_dim;
    std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"model.embed_tokens.weight", {c.vocab_size, C}},
                                                                        {"model.norm.weight", {C}}};
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
               {"input_layernorm.weight", {C}}, {"post_attention_layernorm.weight", {C}},
               {"self_attn.q_proj.weight", {HD, C}}, {"self_attn.k_proj.weight", {KVD, C}},
               {"self_attn.v_proj.weight", {KVD, C}}, {"self_attn.o_proj.weight", {C, HD}},
               {"mlp.gate_proj.weight", {I, C}}, {"mlp.up_proj.weight", {I, C}}, {"mlp.down_proj.weight", {C, I}}})
        shapes.push_back({p + name, shape});
    }
    std::mt19937_64 rng(64);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::vector<float>> data;
    std::vector<TensorToWrite> tensors;
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t x : shape) n *= x;
      std::vector<float> v(size_t(n), 0.0f);
      const bool norm = shape.size() == 1;  // norm weights near 1, projections at the fixture's 0.1 (std)
      for (float& x : v) x = norm ? 1.0f + 0.1f * normal(rng) : 0.1f * normal(rng);
      data.push_back(std::move(v));
      tensors.push_back({name, shape, "F32", data.back().data()});
    }
    write_safetensors(d / "model.safetensors", tensors);
    return d;
  }()};
  return dir.path;
}

// The fixture (or "llama-d64") with every weight rounded to bf16 in the host
// copy, so the CPU decoder and the GPU's bf16 copy hold the same values.
InferenceModel bf16_fixture(const std::string& name) {
  InferenceModel m = InferenceModel::from_hf(name == "llama-d64" ? d64_model_dir() : fs::path("tests/fixtures") / name);
  for (auto& unit : m.weights->param)
    for (int64_t i = 0; i < unit.size(); ++i) unit.data()[i] = round_bf16(unit.data()[i]);
  return m;
}

std::vector<std::vector<int32_t>> fixture_prompts(int64_t vocab) {
  // Lengths 5, 11, 2 and 17: several passes' worth of rows, one of a single token's neighbour.
  std::vector<std::vector<int32_t>> out;
  for (int len : {5, 11, 2, 17}) {
    std::vector<int32_t> ids;
    for (int t = 0; t < len; ++t) ids.push_back(int32_t((len * 31 + t * 17 + 5) % (vocab - 2)));
    out.push_back(ids);
  }
  return out;
}

// The CUDA decoder, made while these switches are set (a null value: the default).
std::unique_ptr<Decoder> cuda_decoder_with(EnvVars env, const InferenceModel& m, const DecoderLimits& limits) {
  const ScopedEnv scoped(env);
  return make_decoder(m, limits, "cuda");
}

// a and b completion by completion: the same tokens, model and tempered logprobs, and
// sampling logprobs within sampling_tol (0: equal).
void check_same_completions(const std::vector<Completion>& a, const std::vector<Completion>& b, float sampling_tol) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].tokens == b[i].tokens);
    CHECK(a[i].model_logprobs == b[i].model_logprobs);
    CHECK(a[i].tempered_logprobs == b[i].tempered_logprobs);
    REQUIRE(a[i].sampling_logprobs.size() == b[i].sampling_logprobs.size());
    for (size_t t = 0; t < a[i].sampling_logprobs.size(); ++t)
      CHECK(std::fabs(a[i].sampling_logprobs[t] - b[i].sampling_logprobs[t]) <= sampling_tol);
  }
}

// n samples of each prompt as requests (spans into `prompts`, which outlives them).
std::vector<GenerateRequest> sample_requests(const std::vector<std::vector<int32_t>>& prompts, int64_t n) {
  std::vector<GenerateRequest> requests;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int64_t s = 0; s < n; ++s) requests.push_back({int64_t(p), s, prompts[p]});
  return requests;
}

struct Margin {
  int32_t best = 0;
  float gap = 0;  // best logit − second best
};
Margin top2(const float* x, int64_t V) {
  Margin m;
  m.best = int32_t(std::max_element(x, x + V) - x);
  float second = -INFINITY;
  for (int64_t v = 0; v < V; ++v)
    if (v != m.best) second = std::max(second, x[v]);
  m.gap = x[m.best] - second;
  return m;
}

}  // namespace

TEST_CASE("decode attention kernel = cpu::attention_decode_forward on bf16 inputs") {
  require_gpu();
  // Lengths at and around the chunk and warp-group edges (32 positions per chunk up to 2048 positions).
  check_decode_attention(8, 2, 64, 384, {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200, 384}, 1);
  check_decode_attention(32, 8, 128, 1500, {1, 700, 1500, 95}, 2);  // at the most, 47 chunks of 32 positions
  check_decode_attention(12, 1, 40, 100, {3, 100, 64}, 3);          // D not a multiple of 32; 12 heads per kv head
  check_decode_attention(4, 4, 16, 9, {9, 1}, 4);                   // no GQA, tiny head dim
  check_decode_attention(32, 8, 64, 383, {383, 1, 2, 3, 4, 5, 129, 250}, 5);  // the 1B shape (G = 4), short rows
  check_decode_attention(16, 2, 32, 70, {70, 33, 7}, 6);             // D = 32 (4 lanes a row), G = 8: 8 heads a block
  check_decode_attention(8, 1, 256, 40, {40, 3}, 7);                 // D = 256 (a warp a row), G = 8
  check_decode_attention(8, 2, 32, 70, {70, 5, 40}, 8);              // D = 32, G = 4: 4 heads a block
  check_decode_attention(4, 2, 256, 40, {40, 17}, 9);                // D = 256, G = 2: 4 heads a block
  check_decode_attention(8, 2, 96, 130, {130, 1, 64}, 10);           // D = 96: the scalar kernel, 4 elements a lane
  check_decode_attention(4, 1, 160, 40, {40, 7}, 11);                // D = 160: the scalar kernel, 8 elements a lane
}

TEST_CASE("CUDA decoder = CPU decoder on the fixtures: prefill, 16 decode steps, a refreshed weight") {
  require_gpu();
  for (const std::string name : {"llama-gqa-tied", "qwen2-bias", "qwen3-qknorm", "llama-d64", "qwen3-moe", "qwen2-moe"}) {
    CAPTURE(name);
    InferenceModel m = bf16_fixture(name);
    const int64_t V = m.config().vocab_size;
    const auto prompts = fixture_prompts(V);
    constexpr int kSteps = 16;
    const DecoderLimits limits{4, 17 + kSteps};
    CpuDecoder cpu(m, limits);
    const std::unique_ptr<Decoder> gpu = make_decoder(m, limits, "cuda");
    REQUIRE(gpu->weight_bytes() > 0);
    // Decode steps' down projection in K-parts reduced with the residual and the
    // next input norm: another summation order than the CPU's, the same bounds.
    // A model of experts: its layers' experts as grouped GEMMs, and both sides
    // record the routes (router replay).
    const bool experts = m.config().moe();
    CHECK(gpu->describe().find(experts ? "experts as cuBLAS grouped GEMMs" : "down in 4 K-parts") != std::string::npos);
    if (experts) cpu.record_routes(), gpu->record_routes();

    // Prefill into slots out of order; all four prompts in one pass.
    const std::vector<int32_t> slots = {2, 0, 3, 1};
    std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
    std::vector<float> lc(size_t(4 * V)), lg(size_t(4 * V));
    cpu.prefill(slots, spans, lc.data());
    gpu->prefill(slots, spans, lg.data());
    for (int i = 0; i < 4; ++i) {
      const double err = rel_rms(lg.data() + i * V, lc.data() + i * V, size_t(V));
      MESSAGE(name << " prefill prompt " << i << ": |gpu - cpu| / |cpu| = " << err);
      CHECK(err < 3e-2);  // bf16 activations through 2 layers: ~5e-3; a wrong row or position is O(1)
      CHECK(gpu->length(slots[size_t(i)]) == int64_t(prompts[size_t(i)].size()));
    }
    if (experts) {  // the prompts' recorded experts: the same but where bf16 moves a near-tie
      int64_t same = 0, total = 0;
      for (int32_t s : slots) {
        const auto a = cpu.routes(s), b = gpu->routes(s);
        REQUIRE(a.size() == b.size());
        for (size_t k = 0; k < a.size(); ++k) same += a[k] == b[k], ++total;
      }
      MESSAGE(name << " routes recorded in the prefill: " << same << " of " << total << " the CPU's");
      CHECK(same >= total * 9 / 10);
    }

    // Decode, teacher-forced with the CPU's greedy tokens so both see the same inputs.
    // Rows 0..3 at first, then slots 0 and 3 only (a smaller batch, slots not in order).
    int decided = 0;
    double worst = 0, lp_worst = 0;
    std::vector<int32_t> step_slots = slots, tokens(4);
    for (int i = 0; i < 4; ++i) tokens[size_t(i)] = top2(lc.data() + i * V, V).best;
    for (int step = 0; step < kSteps; ++step) {
      if (step == kSteps / 2) {
        step_slots = {3, 0};
        tokens = {tokens[2], tokens[1]};
      }
      const int64_t B = int64_t(step_slots.size());
      cpu.decode(step_slots, tokens, lc.data());
      gpu->decode(step_slots, tokens, lg.data());
      for (int64_t b = 0; b < B; ++b) {
        const float* c = lc.data() + b * V;
        const float* g = lg.data() + b * V;
        const double err = rel_rms(g, c, size_t(V));
        worst = std::max(worst, err);
        CHECK(err < 3e-2);
        float max_diff = 0;
        for (int64_t v = 0; v < V; ++v) max_diff = std::max(max_diff, std::fabs(g[v] - c[v]));
        // Greedy: the same token wherever the CPU's top two are further apart than twice the largest difference.
        const Margin mc = top2(c, V);
        if (mc.gap > 2 * max_diff) {
          ++decided;
          CHECK(top2(g, V).best == mc.best);
        }
        tokens[size_t(b)] = mc.best;
      }
      // The GPU's logprobs of these tokens (from its own copy of the logits) =
      // cpu::token_logprobs on the logits it returned, at temperatures 1 and 0.7.
      for (float T : {1.0f, 0.7f}) {
        std::vector<float> want(static_cast<size_t>(B)), got(static_cast<size_t>(B)), temps(static_cast<size_t>(B), T);
        cpu::token_logprobs<float>(want.data(), lg.data(), tokens.data(), temps.data(), B, V);
        gpu->token_logprobs(got.data(), lg.data(), tokens.data(), T, B);
        for (int64_t b = 0; b < B; ++b) {
          lp_worst = std::max(lp_worst, double(std::fabs(got[size_t(b)] - want[size_t(b)])));
          CHECK(std::fabs(got[size_t(b)] - want[size_t(b)]) < 1e-5);  // fp32 sums in another order: ~1e-7
        }
      }
    }
    MESSAGE(name << " token_logprobs: worst |gpu - cpu::token_logprobs| = " << lp_worst);
    MESSAGE(name << " decode: worst |gpu - cpu| / |cpu| = " << worst << ", greedy compared at " << decided << " of "
                 << 4 * kSteps / 2 + 2 * kSteps / 2 << " rows");
    CHECK(decided >= (4 * kSteps / 2 + 2 * kSteps / 2) / 2);  // the margin rule leaves most rows decided
    CHECK(gpu->decode_steps() == kSteps);
    CHECK(gpu->decode_seconds() > 0);

    // A broadcast's parameter: the final norm's weight set to 0.5 everywhere, in
    // the model (the CPU reads it) and through load_bf16 (the GPU's copy).
    const ParamInfo& norm = m.weights->layout.head().param("model.norm.weight");
    std::vector<uint16_t> halves(size_t(norm.numel), f32_to_bf16_rne(0.5f));
    m.load_bf16(norm, halves.data());
    gpu->load_bf16(norm, halves.data());
    std::vector<float> before = lg;
    for (int32_t slot : slots) cpu.release(slot), gpu->release(slot);  // the sequences end; the prompts again
    cpu.prefill(slots, spans, lc.data());
    gpu->prefill(slots, spans, lg.data());
    const double moved = rel_rms(lg.data(), before.data(), size_t(4 * V));
    const double err = rel_rms(lg.data(), lc.data(), size_t(4 * V));
    MESSAGE(name << " after load_bf16: |gpu - cpu| / |cpu| = " << err << ", logits moved by " << moved);
    CHECK(err < 3e-2);
    CHECK(moved > 0.1);
  }
}

TEST_CASE("seeded sampling on the GPU: the same tokens and logprobs twice; greedy close to the CPU's") {
  require_gpu();
  InferenceModel m = bf16_fixture("qwen3-qknorm");
  const auto prompts = fixture_prompts(m.config().vocab_size);
  const std::vector<GenerateRequest> requests = sample_requests(prompts, 3);
  GenerateOptions o;
  o.sampling = {0.9, 40, 0.95, 7};
  o.max_new_tokens = 20;
  // 12 requests over 5 slots: continuous batching refills slots as sequences end.
  const DecoderLimits limits = plan_limits(m.config(), requests, 5, o.max_new_tokens, "test");
  auto sample = [&](const GenerateOptions& opt, const std::string& backend) {
    std::unique_ptr<Decoder> d = make_decoder(m, limits, backend);
    return generate(*d, requests, opt);
  };
  const std::vector<Completion> a = sample(o, "cuda"), b = sample(o, "cuda");
  REQUIRE(a.size() == requests.size());
  int64_t tokens = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].tokens == b[i].tokens);
    CHECK(a[i].sampling_logprobs == b[i].sampling_logprobs);
    CHECK(a[i].model_logprobs == b[i].model_logprobs);
    tokens += int64_t(a[i].tokens.size());
  }
  CHECK(tokens >= int64_t(requests.size()));
  // Another seed draws other tokens (the seed reaches the GPU path's sampler).
  GenerateOptions other = o;
  other.sampling.seed = 8;
  const std::vector<Completion> c = sample(other, "cuda");
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i].tokens != c[i].tokens;
  CHECK(differ > 0);

  // Greedy on both backends: the fraction of identical tokens, position by
  // position (bf16 near-ties may diverge a sequence late; the teacher-forced
  // case above checks each choice).
  GenerateOptions greedy = o;
  greedy.sampling.temperature = 0;
  const std::vector<Completion> g = sample(greedy, "cuda"), r = sample(greedy, "cpu");
  // Up to and including a sequence's first divergence both sides took their
  // most probable token, so the two model logprobs agree to the logits'
  // bf16 tolerance there too: a divergence is a near-tie, not a wrong choice.
  int64_t same = 0, total = 0, diverged = 0;
  double lp_worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const size_t n = std::min(g[i].tokens.size(), r[i].tokens.size());
    size_t first = n;
    for (size_t t = 0; t < n && first == n; ++t)
      if (g[i].tokens[t] != r[i].tokens[t]) first = t;
    same += int64_t(first);
    total += int64_t(r[i].tokens.size());
    diverged += first < n;
    for (size_t t = 0; t < std::min(first + 1, n); ++t)
      lp_worst = std::max(lp_worst, double(std::fabs(g[i].model_logprobs[t] - r[i].model_logprobs[t])));
  }
  MESSAGE("greedy: " << same << " of " << total << " tokens identical before the first divergence, " << diverged
                     << " of " << g.size() << " sequences diverge; worst model logprob difference up to the "
                     << "divergence " << lp_worst);
  CHECK(lp_worst < 5e-2);
  CHECK(same >= int64_t(g.size()));  // at least a token a sequence on average
}

namespace {

// n rows of V logits drawn by cuda::sample_rows and by the host Sampler with
// the same uniforms: the same tokens, the same sampling logprobs; a second
// device run gives the same bits. Returns the distinct tokens drawn (a check
// that the case samples at all).
size_t check_sampler_rows(const std::vector<float>& logits, int64_t n, int64_t V, const SamplingParams& p,
                          const std::string& what) {
  CAPTURE(what);
  CAPTURE(p.temperature);
  CAPTURE(p.top_k);
  CAPTURE(p.top_p);
  std::vector<double> u(static_cast<size_t>(n));
  std::vector<Sampled> want(static_cast<size_t>(n));
  Sampler host(p, V);
  for (int64_t r = 0; r < n; ++r) {
    const DrawKey key{r, 3, 17};
    u[size_t(r)] = uniform_draw(p.seed, key);
    want[size_t(r)] = host.sample(logits.data() + r * V, key);
  }
  DeviceBytes dl(logits.size() * 4), du(size_t(n) * 8), dt(size_t(n) * 4), dp(size_t(n) * 4);
  CUDA_OK(cudaMemcpy(dl.p, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(du.p, u.data(), size_t(n) * 8, cudaMemcpyHostToDevice));
  std::vector<int32_t> tok[2];
  std::vector<float> lp[2];
  for (int run = 0; run < 2; ++run) {
    cuda::sample_rows(dt.as<int32_t>(), dp.as<float>(), dl.as<float>(), du.as<double>(), n, V, p.temperature, p.top_k,
                      p.top_p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    tok[run].resize(size_t(n));
    lp[run].resize(size_t(n));
    CUDA_OK(cudaMemcpy(tok[run].data(), dt.p, size_t(n) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lp[run].data(), dp.p, size_t(n) * 4, cudaMemcpyDeviceToHost));
  }
  int mismatches = 0;
  double lp_worst = 0;
  for (int64_t r = 0; r < n; ++r) {
    mismatches += tok[0][size_t(r)] != want[size_t(r)].token;
    if (tok[0][size_t(r)] == want[size_t(r)].token)
      lp_worst = std::max(lp_worst, double(std::fabs(lp[0][size_t(r)] - want[size_t(r)].sampling_logprob)));
  }
  CHECK(mismatches == 0);
  CHECK(lp_worst <= 1e-6);
  CHECK(tok[0] == tok[1]);
  CHECK(std::memcmp(lp[0].data(), lp[1].data(), size_t(n) * 4) == 0);
  std::vector<int32_t> distinct = tok[0];
  std::sort(distinct.begin(), distinct.end());
  return size_t(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
}

}  // namespace

TEST_CASE("GPU sampler = host Sampler on the same logits: greedy, temperature, top-k, top-p, ties, many rounds") {
  require_gpu();
  const std::vector<SamplingParams> params = {
      {0.0, 0, 1.0, 1},    {1.0, 0, 1.0, 2},   {0.8, 50, 1.0, 3},  {0.8, 50, 0.95, 4},  {1.0, 0, 0.9, 5},
      {0.7, 3000, 0.5, 6}, {0.05, 0, 0.99, 7}, {1.5, 1, 1.0, 8},   {1.0, 0, 0.01, 9},   {1.2, 5000, 1.0, 10}};
  std::mt19937_64 rng(2026);
  struct Logits {
    std::string name;
    int64_t n, V;
    std::vector<float> x;
  };
  std::vector<Logits> cases;
  {
    Logits c{"normal(0, 2), V = 128256", 16, 128256, {}};
    std::normal_distribution<float> d(0.f, 2.f);
    c.x.resize(size_t(c.n * c.V));
    for (float& v : c.x) v = d(rng);
    cases.push_back(std::move(c));
  }
  {
    Logits c{"bf16-rounded normal(0, 1) (ties), V = 151936", 8, 151936, {}};
    std::normal_distribution<float> d(0.f, 1.f);
    c.x.resize(size_t(c.n * c.V));
    for (float& v : c.x) v = round_bf16(d(rng));
    cases.push_back(std::move(c));
  }
  {
    Logits c{"every logit equal, V = 5000", 4, 5000, std::vector<float>(size_t(4 * 5000), 1.0f)};
    cases.push_back(std::move(c));
  }
  {
    // A trained model's shape: a few tokens far above a long tail, -0 and +0 among them.
    Logits c{"peaked, V = 32000", 8, 32000, {}};
    std::normal_distribution<float> d(-4.f, 1.5f);
    c.x.resize(size_t(c.n * c.V));
    for (float& v : c.x) v = d(rng);
    for (int64_t r = 0; r < c.n; ++r)
      for (int j = 0; j < 6; ++j) c.x[size_t(r * c.V + (r * 977 + j * 4099) % c.V)] = 9.0f - float(j);
    c.x[5] = -0.0f, c.x[6] = 0.0f;
    cases.push_back(std::move(c));
  }
  {
    Logits c{"V = 7", 5, 7, {}};
    std::normal_distribution<float> d(0.f, 1.f);
    c.x.resize(size_t(c.n * c.V));
    for (float& v : c.x) v = d(rng);
    cases.push_back(std::move(c));
  }
  for (const Logits& c : cases)
    for (const SamplingParams& p : params) {
      const size_t distinct = check_sampler_rows(c.x, c.n, c.V, p, c.name);
      // Greedy and top-k 1 repeat a row's argmax; the equal row has one argmax; top-p 0.01 keeps the top token
      // of a peaked row: otherwise 16 draws from a wide distribution are not all one token.
      const bool one = p.temperature == 0 || p.top_k == 1 || c.name.rfind("every", 0) == 0 || c.V == 7;
      if (!one && c.n >= 8 && p.top_p > 0.01) CHECK(distinct > 1);
    }
}

TEST_CASE("CUDA decoder: drawing on the device = drawing on the host from its downloaded logits") {
  require_gpu();
  InferenceModel m = bf16_fixture("qwen3-qknorm");
  const auto prompts = fixture_prompts(m.config().vocab_size);
  const std::vector<GenerateRequest> requests = sample_requests(prompts, 3);
  const DecoderLimits limits = plan_limits(m.config(), requests, 5, 20, "test");
  for (const SamplingParams& sp : {SamplingParams{0.9, 40, 0.95, 7}, SamplingParams{1.0, 0, 1.0, 11},
                                   SamplingParams{0.0, 0, 1.0, 0}}) {
    CAPTURE(sp.temperature);
    GenerateOptions o;
    o.sampling = sp;
    o.max_new_tokens = 20;
    auto run = [&](bool host) {
      std::unique_ptr<Decoder> d = cuda_decoder_with({{"SHARDLM_HOST_SAMPLER", host ? "1" : nullptr}}, m, limits);
      CHECK(d->draws_on_device() == !host);
      return generate(*d, requests, o);
    };
    check_same_completions(run(false), run(true), 1e-6f);
  }
}

namespace {
// The calls column of `op`'s line in a profile report (-1: no such line).
int64_t profiled_calls(const std::string& report, const std::string& op) {
  const size_t at = report.find("\n  " + op + " ");
  if (at == std::string::npos) return -1;
  const size_t end = report.find('\n', at + 1);
  const std::string line = report.substr(at + 1, end - at - 1);
  return std::stoll(line.substr(line.find_last_of(' ') + 1));
}
}  // namespace

TEST_CASE("CUDA decoder: SHARDLM_DECODE_PROFILE=1 changes no token and times every layer's operations") {
  require_gpu();
  for (const char* name : {"llama-gqa-tied", "qwen3-qknorm", "llama-d64"}) {
    CAPTURE(name);
    InferenceModel m = bf16_fixture(name);
    const auto prompts = fixture_prompts(m.config().vocab_size);
    const std::vector<GenerateRequest> requests = sample_requests(prompts, 3);
    const DecoderLimits limits = plan_limits(m.config(), requests, 5, 12, "test");
    GenerateOptions o;
    o.sampling = SamplingParams{0.9, 40, 0.95, 7};
    o.max_new_tokens = 12;
    std::string report, described;
    int64_t steps = 0;
    auto run = [&](bool profile) {
      std::unique_ptr<Decoder> d = cuda_decoder_with({{"SHARDLM_DECODE_PROFILE", profile ? "1" : nullptr}}, m, limits);
      std::vector<Completion> out = generate(*d, requests, o);
      report = d->profile_report(1.0);
      described = d->describe();
      steps = d->decode_steps();
      return out;
    };
    const std::vector<Completion> plain = run(false);
    CHECK(report.empty());
    const std::vector<Completion> profiled = run(true);
    MESSAGE(report);
    check_same_completions(plain, profiled, 0.0f);
    const int64_t L = m.config().num_layers;
    REQUIRE(steps > 0);
    CHECK(profiled_calls(report, "embedding") == steps);
    // At head dim 64 the attention rotates q and k and stores k and v itself.
    const bool rope_inside = m.config().head_dim == 64;
    CHECK(profiled_calls(report, rope_inside ? "rope + kv store + attention" : "attention") == L * steps);
    const bool fused = !m.config().qk_norm;  // the fixtures' q, k, v weights lie together
    if (!rope_inside)  // (inside: "rope + kv store" would find the start of "rope + kv store + attention")
      CHECK(profiled_calls(report, "rope + kv store") == (fused ? L * steps : -1));
    // The down projection in K-parts (the default where the sizes allow) or one GEMM with its residual.
    const bool parts = described.find("K-parts") != std::string::npos;
    CHECK(profiled_calls(report, parts ? "down gemm (K parts)" : "down gemm + add") == L * steps);
    CHECK(profiled_calls(report, "parts + add + next norm") == (parts ? L * steps : -1));
    CHECK(profiled_calls(report, "lm-head") == steps);
    // One q|k|v GEMM where the weights lie together and there is no q/k norm; three otherwise.
    CHECK(std::max<int64_t>(profiled_calls(report, "q|k|v gemm"), 0) +
              std::max<int64_t>(profiled_calls(report, "q, k, v gemms"), 0) == L * steps);
    CHECK((profiled_calls(report, "q/k norms") == L * steps) == bool(m.config().qk_norm));
    CHECK(profiled_calls(report, "draw: sample") >= steps);  // and one after each prefill
    CHECK(report.find("prefill") != std::string::npos);
  }
}

TEST_CASE("CUDA decoder: full-batch steps replayed as the CUDA graphs captured at start-up = the same steps eagerly") {
  require_gpu();
  for (const char* name : {"llama-gqa-tied", "qwen3-qknorm", "llama-d64"}) {
    CAPTURE(name);
    InferenceModel m = bf16_fixture(name);
    const auto prompts = fixture_prompts(m.config().vocab_size);
    // More requests than slots: full-batch steps while prompts wait, partial ones at the end.
    const std::vector<GenerateRequest> requests = sample_requests(prompts, 4);
    const DecoderLimits limits = plan_limits(m.config(), requests, 4, 16, "test");
    REQUIRE(int64_t(requests.size()) > limits.slots);
    GenerateOptions o;
    o.sampling = SamplingParams{0.8, 20, 0.9, 3};
    o.max_new_tokens = 16;
    // The graphs: the embedding, then pieces of 1, 2, 4, ... layers (2 layers: 3 graphs).
    auto run = [&](const char* graphs, const char* described) {
      std::unique_ptr<Decoder> d = cuda_decoder_with({{"SHARDLM_DECODE_GRAPHS", graphs}}, m, limits);
      const std::string says = d->describe();
      CAPTURE(says);
      if (described) CHECK(says.find(described) != std::string::npos);
      else CHECK(says.find("CUDA graph") == std::string::npos);
      return generate(*d, requests, o);
    };
    const auto eager = run("0", nullptr);
    REQUIRE(m.config().num_layers == 2);
    check_same_completions(run(nullptr, "decode steps as 3 CUDA graphs"), eager, 0.0f);
  }
}

TEST_CASE("CUDA decoder: an extend = the same ids fed one a decode step and = the CPU's extend (logits, the cache it "
          "leaves, greedy choices); several turns drawn after extends on the device = on the host") {
  require_gpu();
  for (const std::string name : {"llama-gqa-tied", "qwen2-bias", "qwen3-qknorm", "llama-d64"}) {
    CAPTURE(name);
    InferenceModel m = bf16_fixture(name);
    const int64_t V = m.config().vocab_size;
    const auto prompts = fixture_prompts(V);  // 5, 11, 2 and 17 tokens
    const DecoderLimits limits{4, 80};       // blocks of 16
    CpuDecoder cpu(m, limits);
    const std::unique_ptr<Decoder> extended = make_decoder(m, limits, "cuda"), fed = make_decoder(m, limits, "cuda");
    const std::vector<int32_t> slots = {0, 1, 2, 3};
    const std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
    std::vector<float> lc(size_t(4 * V)), lg(size_t(4 * V)), lf(size_t(4 * V));
    cpu.prefill(slots, spans, lc.data());
    extended->prefill(slots, spans, lg.data());
    fed->prefill(slots, spans, lf.data());
    // Slots 2, 0 and 3 by 1, 20 and 37 ids (past one and two block boundaries;
    // 58 rows over 4 slots: the attention in pieces of 4 rows); slot 1 left out.
    const std::vector<int32_t> ext_slots = {2, 0, 3};
    std::vector<std::vector<int32_t>> ids;
    for (int n : {1, 20, 37}) {
      ids.emplace_back();
      for (int t = 0; t < n; ++t) ids.back().push_back(int32_t((n * 13 + t * 29 + 3) % (V - 2)));
    }
    const std::vector<std::span<const int32_t>> id_spans(ids.begin(), ids.end());
    cpu.extend(ext_slots, id_spans, lc.data());
    extended->extend(ext_slots, id_spans, lg.data());
    CHECK(extended->extend_tokens_computed() == 58);
    CHECK(extended->decode_steps() == 0);
    int decided = 0;
    double worst_fed = 0, worst_cpu = 0;
    std::vector<float> one(static_cast<size_t>(V));
    for (size_t i = 0; i < ext_slots.size(); ++i) {
      for (int32_t id : ids[i]) fed->decode(std::vector<int32_t>{ext_slots[i]}, std::vector<int32_t>{id}, one.data());
      const float* g = lg.data() + int64_t(i) * V;
      const float* c = lc.data() + int64_t(i) * V;
      const double vs_fed = rel_rms(g, one.data(), size_t(V)), vs_cpu = rel_rms(g, c, size_t(V));
      worst_fed = std::max(worst_fed, vs_fed), worst_cpu = std::max(worst_cpu, vs_cpu);
      CHECK(vs_fed < 3e-2);  // the same bf16 arithmetic in other GEMM shapes (fused q|k|v, K-parts): ~1e-2
      CHECK(vs_cpu < 3e-2);
      CHECK(extended->length(ext_slots[i]) == fed->length(ext_slots[i]));
      float max_diff = 0;
      for (int64_t v = 0; v < V; ++v) max_diff = std::max(max_diff, std::fabs(g[v] - c[v]));
      if (const Margin mc = top2(c, V); mc.gap > 2 * max_diff) {
        ++decided;
        CHECK(top2(g, V).best == mc.best);
      }
    }
    CHECK(fed->decode_steps() == 58);
    // A decode step of every slot reads what the extend stored.
    const std::vector<int32_t> next = {3, 4, 5, 6};
    cpu.decode(slots, next, lc.data());
    extended->decode(slots, next, lg.data());
    fed->decode(slots, next, lf.data());
    double worst_after = 0;
    for (int b = 0; b < 4; ++b) {
      const double vs_fed = rel_rms(lg.data() + b * V, lf.data() + b * V, size_t(V));
      const double vs_cpu = rel_rms(lg.data() + b * V, lc.data() + b * V, size_t(V));
      worst_after = std::max({worst_after, vs_fed, vs_cpu});
      CHECK(vs_fed < 3e-2);
      CHECK(vs_cpu < 3e-2);
    }
    MESSAGE(name << " extend: |gpu - gpu fed one a step| / |.| <= " << worst_fed << ", |gpu - cpu extend| / |cpu| <= "
                 << worst_cpu << ", the decode step after it <= " << worst_after << "; greedy compared at " << decided
                 << " of 3 rows");
    for (int32_t s : slots) extended->release(s);
    CHECK(extended->kv().used_blocks() == 0);
  }

  // Several turns: after each stop id the observation goes in by an extend and
  // the next turn's first token is drawn from its last row, on the device or on
  // the host from the downloaded logits: the same tokens and model logprobs.
  InferenceModel m = bf16_fixture("qwen3-qknorm");
  const int64_t V = m.config().vocab_size;
  const auto prompts = fixture_prompts(V);
  const std::vector<GenerateRequest> requests = sample_requests(prompts, 3);
  GenerateOptions o;
  o.sampling = SamplingParams{0.9, 40, 0.95, 7};
  o.max_new_tokens = 40;
  for (int32_t id = 0; id < V; id += 5) o.stop_ids.push_back(id);
  o.next_turn = [&](const GenerateRequest&, const Completion& c) -> std::optional<std::vector<int32_t>> {
    if (c.turns >= 3) return std::nullopt;
    std::vector<int32_t> obs;
    for (int t = 0; t < 18; ++t) obs.push_back(int32_t((c.turns * 7 + t * 3 + 1) % V));  // past a block of 16
    return obs;
  };
  const DecoderLimits limits = plan_limits(m.config(), requests, 5, o.max_new_tokens, "test");
  GenerateStats device_stats;
  auto run = [&](bool host, GenerateStats* stats) {
    std::unique_ptr<Decoder> d = cuda_decoder_with({{"SHARDLM_HOST_SAMPLER", host ? "1" : nullptr}}, m, limits);
    std::vector<Completion> out = generate(*d, requests, o, stats);
    CHECK(d->kv().used_blocks() == 0);
    return out;
  };
  const std::vector<Completion> on_device = run(false, &device_stats), on_host = run(true, nullptr);
  check_same_completions(on_device, on_host, 1e-6f);
  int64_t turns = 0;
  for (const Completion& c : on_device) turns += c.turns;
  MESSAGE("several turns on the GPU: " << turns << " turns over " << on_device.size() << " sequences, "
                                       << device_stats.extends << " extends of " << device_stats.extend_tokens
                                       << " ids");
  CHECK(turns > int64_t(on_device.size()));
  CHECK(device_stats.extends > 0);
}
