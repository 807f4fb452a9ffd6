// test_model.cpp — the model against Hugging Face fixtures, finite differences
// through the whole model, layout and init invariants, training, export, and
// bad inputs. Single process (SelfComm); the MPI suites cover sharding.
#include <doctest/doctest.h>

#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../test_util.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "run_command.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/h5util.hpp"
#include "train/engine.hpp"
#include "train/forward.hpp"
#include "train/shard.hpp"
#include "train/train.hpp"

using namespace shardlm;
using shardlm_test::read_h5;
using shardlm_test::rel_error;
namespace fs = std::filesystem;

namespace {


void write_tokens_h5(const fs::path& file, const std::vector<int32_t>& tokens, hsize_t rows, hsize_t cols) {
  h5::Handle f(H5_CHECK(H5Fcreate(file.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
  const hsize_t dims[2] = {rows, cols};
  h5::Handle space(H5_CHECK(H5Screate_simple(2, dims, nullptr)), H5Sclose);
  h5::Handle d(H5_CHECK(H5Dcreate2(f, "tokens", H5T_STD_I32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)),
               H5Dclose);
  H5_CHECK(H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokens.data()));
}


struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("shardlm-model-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// The fixture batch: two packed rows with document-local positions.
struct FixtureBatch {
  std::vector<int32_t> tokens, targets, positions, seq_ids;
  std::vector<float> weights;
  TokenBatch batch() const {
    return {int64_t(tokens.size()), tokens.data(), targets.data(), weights.data(), positions.data(), seq_ids.data()};
  }
};

FixtureBatch read_fixture_batch(const fs::path& ref) {
  FixtureBatch b;
  b.tokens = read_h5<int32_t>(ref, "tokens", H5T_NATIVE_INT32);
  b.targets = read_h5<int32_t>(ref, "targets", H5T_NATIVE_INT32);
  b.positions = read_h5<int32_t>(ref, "positions", H5T_NATIVE_INT32);
  b.weights = read_h5<float>(ref, "weights", H5T_NATIVE_FLOAT);
  // The fixture numbers documents per row; the engine sees all rows as one
  // token stream, so make the ids distinct across rows.
  const auto local = read_h5<int32_t>(ref, "seq_ids", H5T_NATIVE_INT32);
  const size_t cols = 24;
  b.seq_ids.resize(local.size());
  for (size_t i = 0; i < local.size(); ++i) b.seq_ids[i] = int32_t(1000 * (i / cols) + local[i]);
  return b;
}

Config tiny_deck(std::vector<std::string> sets = {}) {
  DeckResult r = parse_deck("inputs/tiny-sft.toml", sets, 1);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

}  // namespace

TEST_SUITE("model") {

TEST_CASE("HF fixtures: logits, loss and every parameter gradient match transformers") {
  for (const std::string name : {"llama-gqa-tied", "qwen3-qknorm", "qwen2-bias", "qwen3-moe", "qwen2-moe"}) {
    CAPTURE(name);
    const fs::path dir = fs::path("tests/fixtures") / name, ref = dir / "reference.h5";
    const ModelConfig config = read_hf_config(dir);
    auto comm = make_self_comm();
    ShardedModel model(config, 0, 1);
    model.load_hf(SafetensorsReader(dir));
    const FixtureBatch fb = read_fixture_batch(ref);
    EngineOptions options;
    options.max_tokens = int64_t(fb.tokens.size());
    options.chunk_tokens = 10;  // several lm-head chunks, one of them partial
    Engine engine(model, *comm, options);

    const auto ref_logits = read_h5<float>(ref, "logits", H5T_NATIVE_FLOAT);
    std::vector<float> logits(ref_logits.size(), NAN);
    engine.forward_logits(fb.batch(), logits.data());
    const double logit_err = rel_error(logits.data(), ref_logits.data(), logits.size());
    MESSAGE(name << ": logits relative error " << logit_err);
    CHECK(logit_err < 1e-4);

    double loss_tokens = 0;
    for (float w : fb.weights) loss_tokens += w;
    // A model of experts: the fixture's loss adds router_aux_loss_coef times the
    // load-balancing loss over the whole batch (one micro-batch here).
    TokenBatch batch = fb.batch();
    if (config.moe()) batch.router_aux_scale = config.router_aux_loss_coef;
    const LossStats stats = engine.forward_backward(batch, float(1.0 / loss_tokens));
    double loss = stats.loss / loss_tokens;
    if (config.moe()) {
      REQUIRE(config.router_aux_loss);
      REQUIRE(stats.router_aux_batches == 1);
      const double ref_aux = read_h5<double>(ref, "aux_loss", H5T_NATIVE_DOUBLE)[0];
      MESSAGE(name << ": load-balancing loss " << stats.router_aux_sum << ", transformers " << ref_aux);
      CHECK(std::fabs(stats.router_aux_sum - ref_aux) / ref_aux < 1e-5);
      loss += config.router_aux_loss_coef * stats.router_aux_sum;
    }
    const double ref_loss = read_h5<double>(ref, "loss", H5T_NATIVE_DOUBLE)[0];
    CHECK(std::fabs(loss - ref_loss) / ref_loss < 1e-5);

    double worst = 0;
    int checked = 0;
    for (const auto& [unit, p] : model.layout.all_params()) {
      const auto ref_grad = read_h5<float>(ref, "grads/" + p->name, H5T_NATIVE_FLOAT);
      REQUIRE(int64_t(ref_grad.size()) == p->numel);
      const size_t ui = size_t(unit - model.layout.units.data());
      const double err = rel_error(model.grad[ui].data() + p->offset, ref_grad.data(), ref_grad.size());
      CHECK_MESSAGE(err < 1e-3, p->name << " gradient relative error " << err);
      worst = std::max(worst, err);
      ++checked;
    }
    MESSAGE(name << ": " << checked << " gradients, worst relative error " << worst);
    CHECK(checked == int(model.layout.all_params().size()));
  }
}

TEST_CASE("whole-model finite differences agree with backward (fp32, directional; dense, and experts with the "
          "load-balancing loss)") {
  for (const bool experts : {false, true}) {
    CAPTURE(experts);
    ModelConfig c;
    c.arch = "qwen3";
    c.vocab_size = 50;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_layers = 2;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 8;
    c.max_position_embeddings = 64;
    c.qk_norm = true;
    c.attention_bias = true;
    c.rms_norm_eps = 1e-6;
    if (experts) {  // Qwen2-MoE's layer: q/k/v biases, routed experts and a shared expert
      c.arch = "qwen2_moe";
      c.qk_norm = false;
      c.num_experts = 4;
      c.num_experts_per_tok = 2;
      c.moe_intermediate_size = 12;
      c.shared_expert_intermediate_size = 16;
      c.router_aux_loss = true;
    }
    auto comm = make_self_comm();
    ShardedModel model(c, 0, 1);
    model.init_seeded(7, 0.3);
    // Norm weights away from 1 and non-zero biases, so every parameter matters.
    std::mt19937_64 rng(11);
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    for (size_t u = 0; u < model.layout.units.size(); ++u)
      for (const auto& s : model.segments(model.layout.units[u]))
        if (s.param->kind == ParamKind::Norm || s.param->kind == ParamKind::Bias)
          for (int64_t i = 0; i < s.count; ++i) model.param[u][s.shard_offset + i] += 0.2f * gauss(rng);

    const int64_t N = 16;
    std::vector<int32_t> tokens(N), targets(N), positions(N), seq(N);
    std::vector<float> weights(N, 1.0f);
    for (int64_t i = 0; i < N; ++i) {
      tokens[i] = int32_t(rng() % 50);
      seq[i] = i < 7 ? 0 : 1;  // two documents
      positions[i] = int32_t(i < 7 ? i : i - 7);
      targets[i] = (i == 6 || i == N - 1) ? -1 : int32_t(rng() % 50);
    }
    TokenBatch b{N, tokens.data(), targets.data(), weights.data(), positions.data(), seq.data()};
    b.router_aux_scale = experts ? 0.5 : 0.0;  // large, so that its gradient shows in every router
    EngineOptions o;
    o.max_tokens = N;
    o.chunk_tokens = 5;
    Engine engine(model, *comm, o);
    model.zero_grads();
    engine.forward_backward(b, 1.0f);
    std::vector<std::vector<float>> grad;
    for (auto& g : model.grad) grad.emplace_back(g.data(), g.data() + g.size());

    int checked = 0;
    for (size_t u = 0; u < model.layout.units.size(); ++u)
      for (const auto& s : model.segments(model.layout.units[u])) {
        // Direction: the gradient of this parameter plus an equal-norm random part.
        std::vector<float> dir(s.count);
        double gnorm = 0, rnorm = 0;
        std::vector<float> r(s.count);
        for (int64_t i = 0; i < s.count; ++i) {
          r[i] = gauss(rng);
          rnorm += double(r[i]) * r[i];
          gnorm += double(grad[u][s.shard_offset + i]) * grad[u][s.shard_offset + i];
        }
        double analytic = 0;
        for (int64_t i = 0; i < s.count; ++i) {
          dir[i] = float(grad[u][s.shard_offset + i] / std::sqrt(gnorm) + r[i] / std::sqrt(rnorm));
          analytic += double(grad[u][s.shard_offset + i]) * dir[i];
        }
        auto loss_at = [&](float eps) {
          float* p = model.param[u].data() + s.shard_offset;
          std::vector<float> saved(p, p + s.count);
          for (int64_t i = 0; i < s.count; ++i) p[i] += eps * dir[i];
          model.zero_grads();
          const LossStats st = engine.forward_backward(b, 1.0f);
          const double l = st.loss + b.router_aux_scale * st.router_aux_sum;
          std::memcpy(p, saved.data(), sizeof(float) * s.count);
          return l;
        };
        const float eps = 2e-3f;
        const double numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
        const double err = std::fabs(numeric - analytic) / std::max(std::fabs(analytic), 1e-3);
        CHECK_MESSAGE(err < 1e-2, s.param->name << ": analytic " << analytic << " numeric " << numeric);
        ++checked;
      }
    CHECK(checked == int(model.layout.all_params().size()));
  }
}

TEST_CASE("layout: HF names and shapes, equal aligned shards at any world size") {
  ModelConfig c = tiny_deck().model.arch;
  const ModelLayout one(c, 1);
  REQUIRE(one.units.size() == size_t(c.num_layers + 2));
  CHECK(one.embed().params[0].name == "model.embed_tokens.weight");
  CHECK(one.layer(1).param("self_attn.k_proj.weight").name == "model.layers.1.self_attn.k_proj.weight");
  CHECK(one.layer(1).param("self_attn.k_proj.weight").shape == std::vector<int64_t>{2 * 16, 64});
  CHECK(one.head().find_param("lm_head.weight") == nullptr);  // tied
  CHECK(one.parameter_count() == 258 * 64 + 2 * (2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 176) + 64);
  for (int world : {1, 2, 3, 4, 5, 7}) {
    const ModelLayout l(c, world);
    for (const auto& u : l.units) {
      CHECK(u.shard_numel * world == u.padded_numel);
      CHECK(u.padded_numel >= u.numel);
      CHECK(u.padded_numel - u.numel < kShardAlign * world);
      CHECK(u.shard_numel % kShardAlign == 0);
    }
  }
}

// model.norm_dtype = "fp32": the engine copies each unit's norm weights from the
// masters in pieces that lie in one rank's shard; placed by the plan, every
// element lands where norm_slots packs it, from whichever rank owns it.
TEST_CASE("norm weights in fp32: the copy plan places every norm element once, from its owner, at any world size") {
  ModelConfig c = tiny_deck().model.arch;
  c.qk_norm = true;   // four norms a layer (input, q, k, post) and the final one
  c.hidden_size = 72;  // norms that do not end on a shard's 64-element grain
  for (int world : {1, 2, 3, 7, 64, 1000}) {
    CAPTURE(world);
    const ModelLayout layout(c, world);
    int64_t split = 0;
    for (const Unit& u : layout.units) {
      const std::vector<NormSlot> slots = norm_slots(u);
      CHECK(slots.size() == size_t(u.kind == UnitKind::Layer ? 4 : u.kind == UnitKind::Head ? 1 : 0));
      std::vector<NormPiece> pieces;
      const int64_t share = norm_pieces(u, world, &pieces);
      // Each rank's gather part: its pieces back to back from 0, within the share.
      std::vector<std::vector<float>> sent(size_t(world), std::vector<float>(size_t(share), -1.0f));
      std::vector<int64_t> next(size_t(world), 0);
      for (const NormPiece& p : pieces) {
        REQUIRE(p.rank >= 0);
        REQUIRE(p.rank < world);
        CHECK(p.count > 0);
        CHECK(p.shard_offset >= 0);
        CHECK(p.shard_offset + p.count <= u.shard_numel);
        CHECK(p.send_offset == next[size_t(p.rank)]);
        next[size_t(p.rank)] += p.count;
        REQUIRE(p.send_offset + p.count <= share);
        for (int64_t i = 0; i < p.count; ++i)  // the master's element: its index in the unit
          sent[size_t(p.rank)][size_t(p.send_offset + i)] = float(p.rank * u.shard_numel + p.shard_offset + i);
      }
      std::vector<float> packed(size_t(norm_slot_floats(u)), -1.0f);
      for (const NormPiece& p : pieces)
        for (int64_t i = 0; i < p.count; ++i) {
          CHECK(packed[size_t(p.packed + i)] == -1.0f);  // placed once
          packed[size_t(p.packed + i)] = sent[size_t(p.rank)][size_t(p.send_offset + i)];
        }
      for (const NormSlot& slot : slots) {
        CHECK(slot.packed % kShardAlign == 0);
        for (int64_t i = 0; i < slot.param->numel; ++i)
          REQUIRE(packed[size_t(slot.packed + i)] == float(slot.param->offset + i));
      }
      split += int64_t(pieces.size()) - int64_t(slots.size());
    }
    if (world == 1000) CHECK(split > 0);  // shards of 64 elements cut the 72-element norms
  }
}

// model.residual_dtype = "fp32" on a GPU: the stream starts from the masters'
// embedding rows, which every rank builds from what its shard holds; the sum
// over the ranks (the engine's reduce-scatter) must be the rows exactly.
TEST_CASE("fp32 embedding rows: the ranks' parts sum to the masters' rows exactly, at any world size") {
  const int64_t V = 37, C = 24;
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> table(size_t(V * C));
  for (float& x : table) x = normal(gen);
  const std::vector<int32_t> ids = {3, 0, 36, 3, -1, 17, 5, 36};
  const int64_t n = int64_t(ids.size());
  for (int world : {1, 2, 3, 7, 64}) {
    CAPTURE(world);
    const int64_t shard = (V * C + world - 1) / world;  // the last shard padded
    std::vector<float> padded(size_t(shard * world), 0.0f);
    std::copy(table.begin(), table.end(), padded.begin());
    std::vector<float> sum(size_t(n * C), 0.0f), part(size_t(n * C));
    int nonzero_parts = 0;
    for (int r = 0; r < world; ++r) {
      owned_rows(part.data(), ids.data(), n, padded.data() + r * shard, r * shard, shard, C);
      bool any = false;
      for (size_t i = 0; i < sum.size(); ++i) {
        CHECK((sum[i] == 0.0f || part[i] == 0.0f));  // one rank holds each element
        sum[i] += part[i], any |= part[i] != 0.0f;
      }
      nonzero_parts += any;
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const float want = ids[size_t(t)] < 0 ? 0.0f : table[size_t(ids[size_t(t)] * C + c)];
        REQUIRE(std::memcmp(&sum[size_t(t * C + c)], &want, 4) == 0);
      }
    if (world > 1) CHECK(nonzero_parts > 1);  // the rows really came in parts
  }
}

// At world > 1 the rows travel in chunks of k tokens a rank (the parts buffer
// stays world x k x hidden): chunk by chunk, each rank's parts of the chunk's
// ids summed over the ranks (one reduce-scatter) give each rank its own rows.
TEST_CASE("fp32 embedding rows in chunks: every rank gets its own rows, whatever the chunk and batch lengths") {
  const int64_t V = 29, C = 8, M = 11;
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> table(size_t(V * C));
  for (float& x : table) x = normal(gen);
  for (int world : {2, 3, 5}) {
    const int64_t shard = (V * C + world - 1) / world;
    std::vector<float> padded(size_t(shard * world), 0.0f);
    std::copy(table.begin(), table.end(), padded.begin());
    std::vector<int32_t> all(size_t(world * M), -1);
    int64_t longest = 0;
    for (int q = 0; q < world; ++q) {  // batches of different lengths, one of them full
      const int64_t n = q == 1 ? M : (3 * q + 2) % M;
      longest = std::max(longest, n);
      for (int64_t t = 0; t < n; ++t) all[size_t(q * M + t)] = int32_t(gen() % V);
    }
    for (int64_t k : {int64_t(1), int64_t(3), int64_t(4), M}) {
      CAPTURE(world);
      CAPTURE(k);
      std::vector<int32_t> laid(size_t(world * M));
      const int64_t used = chunk_row_ids(all.data(), world, M, k, laid.data());
      CHECK(used == longest);
      std::vector<float> rows(size_t(world * M * C), -1.0f);  // each rank's stream buffer: M x C
      for (int64_t j = 0; j * k < used; ++j) {
        const int64_t kk = std::min(k, M - j * k), n = world * kk;
        std::vector<float> sum(size_t(n * C), 0.0f), part(size_t(n * C));
        for (int r = 0; r < world; ++r) {
          owned_rows(part.data(), laid.data() + j * world * k, n, padded.data() + r * shard, r * shard, shard, C);
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
        }
        for (int q = 0; q < world; ++q)  // the reduce-scatter: rank q's block of kk rows
          std::copy(sum.begin() + q * kk * C, sum.begin() + (q + 1) * kk * C, rows.begin() + (q * M + j * k) * C);
      }
      for (int q = 0; q < world; ++q)
        for (int64_t t = 0; t < M; ++t) {
          const int32_t id = all[size_t(q * M + t)];
          for (int64_t c = 0; c < C; ++c) {
            const float got = rows[size_t((q * M + t) * C + c)];
            if (t >= used) REQUIRE(got == -1.0f);  // past every batch: not written
            else REQUIRE(got == (id < 0 ? 0.0f : table[size_t(id * C + c)]));
          }
        }
    }
  }
  // The chunk size: one chunk while world x max_tokens x hidden fits kRowPartsBytes, then bounded by it.
  CHECK(fp32_row_chunks(1, 4096, 2048).count == 1);
  CHECK(fp32_row_chunks(1, 4096, 2048).part_floats == 0);
  CHECK(fp32_row_chunks(2, 4096, 2048).count == 1);
  const RowChunks big = fp32_row_chunks(8, 32768, 4096);
  CHECK(4 * big.part_floats <= kRowPartsBytes);
  CHECK(big.tokens == 512);
  CHECK(big.count == 64);
  // A staged Comm's buffers (one fp32 unit: 184,832 bytes for the tiny model at
  // world 2) bound the chunk below kRowPartsBytes: 1,024 tokens of hidden 64
  // need 524,288 bytes in one piece, so they go as 3 chunks of 361.
  const RowChunks staged = fp32_row_chunks(2, 1024, 64, 184832);
  CHECK(staged.tokens == 361);
  CHECK(staged.count == 3);
  CHECK(4 * staged.part_floats <= 184832);
  CHECK(fp32_row_chunks(2, 1024, 64).count == 1);
}

TEST_CASE("seeded init: every world size builds the same model, element by element") {
  const ModelConfig c = tiny_deck().model.arch;
  ShardedModel one(c, 0, 1);
  one.init_seeded(1234, 0.02);
  for (int world : {2, 3, 5}) {
    std::vector<std::vector<float>> units(one.layout.units.size());
    for (int r = 0; r < world; ++r) {
      ShardedModel part(c, r, world);
      part.init_seeded(1234, 0.02);
      for (size_t u = 0; u < units.size(); ++u)
        units[u].insert(units[u].end(), part.param[u].data(), part.param[u].data() + part.param[u].size());
    }
    for (size_t u = 0; u < units.size(); ++u)
      CHECK(std::memcmp(units[u].data(), one.param[u].data(), sizeof(float) * one.layout.units[u].numel) == 0);
  }
  // init_range (the name hashed once per range) is init_value element by element.
  int64_t checked = 0;
  for (size_t u = 0; u < one.layout.units.size(); ++u)
    for (const auto& s : one.segments(one.layout.units[u]))
      for (int64_t i = 0; i < s.count; i += 97, ++checked)
        REQUIRE(one.param[u][s.shard_offset + i] == init_value(1234, *s.param, s.param_begin + i, 0.02));
  CHECK(checked > 1000);
  ShardedModel other(c, 0, 1);
  other.init_seeded(1235, 0.02);
  CHECK(std::memcmp(other.param[0].data(), one.param[0].data(), 64 * sizeof(float)) != 0);
  // N(0, 0.02): check the spread of a large matrix
  double sumsq = 0;
  const auto& embed = one.param[0];
  for (int64_t i = 0; i < one.layout.embed().numel; ++i) sumsq += double(embed[i]) * embed[i];
  CHECK(std::sqrt(sumsq / double(one.layout.embed().numel)) == doctest::Approx(0.02).epsilon(0.03));
}

TEST_CASE("training the tiny deck lowers the loss; export then reload gives identical logits") {
  auto comm = make_self_comm();
  TrainSession session(tiny_deck({"run.max_steps=50"}), *comm);
  std::vector<double> losses;
  for (int s = 0; s < 50; ++s) losses.push_back(session.step(s).loss);
  const double last5 = (losses[45] + losses[46] + losses[47] + losses[48] + losses[49]) / 5;
  MESSAGE("tiny deck: loss " << losses[0] << " -> " << last5 << " (mean of the last 5)");
  CHECK(losses[0] > 5.0);  // about log(258) = 5.55 at init
  CHECK(last5 < losses[0] - 2.0);

  TempDir tmp;
  export_hf(session.model, *comm, tmp.path / "hf", "F32");
  CHECK(fs::exists(tmp.path / "hf" / "config.json"));
  CHECK(fs::exists(tmp.path / "hf" / "model.safetensors"));
  ShardedModel reloaded(read_hf_config(tmp.path / "hf"), 0, 1);
  reloaded.load_hf(SafetensorsReader(tmp.path / "hf"));
  MicroBatch micro;
  session.data->micro_batch(0, 0, 0, 1, micro);
  const TokenBatch b = token_batch(micro);
  std::vector<float> a(b.N * 258), c(b.N * 258);
  session.engine.forward_logits(b, a.data());
  Engine engine2(reloaded, *comm, engine_options_for(session.config));
  engine2.forward_logits(b, c.data());
  CHECK(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)) == 0);
}

TEST_CASE("eval: the held-out loss equals the training loss of the same rows and a host log-softmax of the logits") {
  auto comm = make_self_comm();
  // eval.path is the training file in file order and eval.rows one global batch: step 0's rows.
  TrainSession session(tiny_deck({"data.shuffle=false", "eval.path=inputs/data/tiny.h5", "eval.rows=8"}), *comm);
  REQUIRE(session.eval);
  CHECK(session.eval->rows() == 8);
  StepStats before;
  session.evaluate(before);
  CHECK(before.evaluated);

  // The same loss from the logits, summed in double on the host.
  double nll = 0;
  int64_t tokens = 0;
  std::vector<float> logits;
  MicroBatch micro;
  for (int a = 0; a < 4; ++a) {
    session.data->micro_batch(0, a, 0, 1, micro);
    const TokenBatch b = token_batch(micro);
    logits.resize(b.N * 258);
    session.engine.forward_logits(b, logits.data());
    for (int64_t i = 0; i < b.N; ++i) {
      if (b.targets[i] < 0 || b.weights[i] == 0) continue;
      const float* row = logits.data() + i * 258;
      double max = row[0], sum = 0;
      for (int v = 1; v < 258; ++v) max = std::max(max, double(row[v]));
      for (int v = 0; v < 258; ++v) sum += std::exp(double(row[v]) - max);
      nll += b.weights[i] * (std::log(sum) + max - row[b.targets[i]]);
      ++tokens;
    }
  }
  CHECK(before.eval_loss_tokens == tokens);
  CHECK(before.eval_loss == doctest::Approx(nll / double(tokens)).epsilon(1e-5));

  const StepStats trained = session.step(0);
  CHECK(trained.loss_tokens == before.eval_loss_tokens);
  CHECK(trained.loss == before.eval_loss);  // same rows, weights and arithmetic: bit for bit
  StepStats after;
  session.evaluate(after);
  CHECK(after.eval_loss < before.eval_loss);  // a step on exactly these rows lowers their loss
  CHECK(session.eval_due(50));                // at_end: after run.max_steps
  CHECK_FALSE(session.eval_due(10));

  // The whole file by default; an RL deck evaluates the same file with the same loss.
  TrainSession whole(tiny_deck({"eval.path=inputs/data/tiny.h5", "eval.interval=10"}), *comm);
  DataSpec in_order = data_spec_for(whole.config, 258);
  in_order.shuffle = false;
  CHECK(whole.eval->rows() == TokenDataset(in_order).rows_in_epoch(0));
  CHECK(whole.eval_due(10));
  CHECK(whole.eval_due(20));
  CHECK_FALSE(whole.eval_due(15));
  DeckResult rl = parse_deck("inputs/tiny-rl.toml", {"data.seq_len=64", "eval.path=inputs/data/tiny.h5",
                                                     "eval.rows=8", "model.max_position_embeddings=256",
                                                     "broadcast.backend=none"}, 1);
  for (const auto& e : rl.errors) MESSAGE(e);
  REQUIRE(rl.ok());
  TrainSession rl_session(rl.config, *comm);
  StepStats rl_eval;
  rl_session.evaluate(rl_eval);
  CHECK(rl_eval.eval_loss == before.eval_loss);

  CHECK_THROWS_WITH_AS(TrainSession(tiny_deck({"eval.path=inputs/data/tiny.h5", "eval.rows=100000"}), *comm),
                       doctest::Contains("eval.rows = 100000 but eval.path 'inputs/data/tiny.h5' packs into"),
                       Error);
}

TEST_CASE("a NaN loss skips the update, is counted, and max_bad_steps in a row aborts naming the step") {
  auto comm = make_self_comm();
  TrainSession session(tiny_deck({"run.max_bad_steps=3"}), *comm);
  session.step(0);
  const std::vector<float> before(session.model.param[1].data(), session.model.param[1].data() + 64);
  session.model.param[1][3] = NAN;  // a norm weight: every loss becomes NaN
  const StepStats bad = session.step(1);
  CHECK(bad.skipped);
  CHECK(std::isnan(bad.loss));
  CHECK(session.bad_steps_total == 1);
  CHECK(std::memcmp(before.data(), session.model.param[1].data(), 3 * sizeof(float)) == 0);  // no update
  CHECK(session.step(2).skipped);
  CHECK_THROWS_WITH_AS(session.step(3),
                       doctest::Contains("step 4: loss or gradient is NaN/Inf for 3 steps in a row "
                                         "(run.max_bad_steps = 3)"),
                       Error);
  session.model.param[1][3] = 1.0f;  // healthy again: the streak resets
  session.bad_steps_in_a_row = 0;
  CHECK_FALSE(session.step(4).skipped);
}

TEST_CASE("bad inputs get clear errors") {
  auto comm = make_self_comm();
  TempDir tmp;
  SUBCASE("an HF directory without weights") {
    fs::copy_file("tests/fixtures/llama-gqa-tied/config.json", tmp.path / "config.json");
    CHECK_THROWS_WITH_AS(SafetensorsReader{tmp.path}, doctest::Contains("no *.safetensors"), Error);
  }
  SUBCASE("weights whose shapes do not match config.json") {
    fs::copy_file("tests/fixtures/llama-gqa-tied/model.safetensors", tmp.path / "model.safetensors");
    ModelConfig wrong = read_hf_config("tests/fixtures/llama-gqa-tied");
    wrong.intermediate_size += 16;
    ShardedModel model(wrong, 0, 1);
    CHECK_THROWS_WITH_AS(model.load_hf(SafetensorsReader(tmp.path)),
                         doctest::Contains("tensor 'model.layers.0.mlp.gate_proj.weight' in"), Error);
    CHECK_THROWS_WITH_AS(model.load_hf(SafetensorsReader(tmp.path)),
                         doctest::Contains("has shape [160, 64] but config.json implies [176, 64]"), Error);
  }
  SUBCASE("weights with tensors the model does not use") {
    ModelConfig fewer = read_hf_config("tests/fixtures/llama-gqa-tied");
    fewer.num_layers = 1;
    ShardedModel model(fewer, 0, 1);
    CHECK_THROWS_WITH_AS(model.load_hf(SafetensorsReader("tests/fixtures/llama-gqa-tied")),
                         doctest::Contains("tensors this model does not use, first 'model.layers.1."), Error);
  }
  SUBCASE("token ids beyond the model's vocabulary") {
    CHECK_THROWS_WITH_AS(TrainSession(tiny_deck({"model.vocab_size=200"}), *comm),
                         doctest::Contains("but the model has vocab_size 200"), Error);
  }
  SUBCASE("seq_len longer than the HF model supports") {
    CHECK_THROWS_WITH_AS(
        TrainSession(tiny_deck({"model.hf=tests/fixtures/llama-gqa-tied", "data.seq_len=512"}), *comm),
        doctest::Contains("data.seq_len = 512 is larger than tests/fixtures/llama-gqa-tied/config.json's "
                          "max_position_embeddings = 256"),
        Error);
  }
  SUBCASE("a data file that does not exist") {
    CHECK_THROWS_WITH_AS(TrainSession(tiny_deck({"data.path=/nonexistent/x.h5"}), *comm),
                         doctest::Contains("/nonexistent/x.h5"), Error);
  }
  SUBCASE("forward: token ids outside the vocabulary, wrong dtype") {
    write_tokens_h5(tmp.path / "t.h5", {1, 2, 300, 4}, 2, 2);
    CHECK_THROWS_WITH_AS(read_token_rows(tmp.path / "t.h5", 258),
                         doctest::Contains("tokens[1][0] = 300 is outside the model's vocabulary [0, 258)"), Error);
    CHECK_THROWS_WITH_AS(read_token_rows(tmp.path / "none.h5", 258), doctest::Contains("none.h5: no such file"),
                         Error);
  }
}

TEST_CASE("shardlm forward matches the transformers logits of a one-document row") {
  TempDir tmp;
  const fs::path dir = "tests/fixtures/qwen3-qknorm", ref = dir / "reference.h5";
  const auto tokens = read_h5<int32_t>(ref, "tokens", H5T_NATIVE_INT32);
  const auto ref_logits = read_h5<float>(ref, "logits", H5T_NATIVE_FLOAT);
  // Row 1 of the fixture is a single document of 24 tokens.
  std::vector<int32_t> row1(tokens.begin() + 24, tokens.end());
  write_tokens_h5(tmp.path / "in.h5", row1, 1, 24);
  auto r = shardlm_test::run(shardlm_test::shardlm_bin() + " forward --hf " + dir.string() + " --tokens " +
                             (tmp.path / "in.h5").string() + " --out " + (tmp.path / "out.h5").string());
  CHECK(r.status == 0);
  CHECK(r.output.find("forward: 1 rows") != std::string::npos);
  const auto logits = read_h5<float>(tmp.path / "out.h5", "logits", H5T_NATIVE_FLOAT);
  REQUIRE(logits.size() == 24 * 258);
  CHECK(rel_error(logits.data(), ref_logits.data() + 24 * 258, logits.size()) < 1e-4);
  CHECK_FALSE(fs::exists(tmp.path / "out.h5.tmp"));
}

}  // TEST_SUITE
