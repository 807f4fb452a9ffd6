// test_muon.cpp — Muon on one rank: Newton–Schulz against a float64 reference and
// its singular-value band, a whole Muon + AdamW step against a float64 reference,
// the owner assignment and the exchange plans of every rank at several world
// sizes (built without MPI; tests/mpi/test_muon.cpp runs them).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../muon_util.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/memory.hpp"
#include "train/muon.hpp"
#include "train/optim.hpp"
#include "train/shard.hpp"

using namespace shardlm;
using namespace shardlm_test;

namespace {

// Keller Jordan's zeropower_via_newtonschulz5, literally (transpose when tall), in double.
Mat ns_reference(const Mat& G, int64_t rows, int64_t cols, int steps) {
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = rows > cols;
  Mat X = tall ? transpose(G, rows, cols) : G;
  const int64_t r = tall ? cols : rows, n = tall ? rows : cols;
  double sumsq = 0;
  for (double x : X) sumsq += x * x;
  const double inv = 1.0 / (std::sqrt(sumsq) + 1e-7);
  for (double& x : X) x *= inv;
  for (int s = 0; s < steps; ++s) {
    const Mat A = matmul(X, transpose(X, r, n), r, n, r);  // (r, r)
    const Mat AA = matmul(A, A, r, r, r);
    Mat B(A.size());
    for (size_t i = 0; i < A.size(); ++i) B[i] = b * A[i] + c * AA[i];
    const Mat BX = matmul(B, X, r, r, n);
    for (size_t i = 0; i < X.size(); ++i) X[i] = a * X[i] + BX[i];
  }
  return tall ? transpose(X, r, n) : X;
}

std::vector<float> run_ns(const std::vector<float>& G, int64_t rows, int64_t cols, int steps) {
  std::vector<float> out(G.size()), ws(static_cast<size_t>(newton_schulz_workspace_numel(rows, cols)));
  newton_schulz(out.data(), G.data(), rows, cols, steps, ws.data());
  return out;
}

ModelConfig llama_1b() {  // Llama-3.2-1B's shape
  ModelConfig c;
  c.arch = "llama";
  c.vocab_size = 128256;
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_layers = 16;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 64;
  c.max_position_embeddings = 131072;
  c.tie_word_embeddings = true;
  return c;
}

ModelConfig tiny_arch() {  // inputs/tiny-sft.toml's model
  ModelConfig c;
  c.arch = "llama";
  c.vocab_size = 258;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 256;
  c.tie_word_embeddings = true;
  return c;
}

}  // namespace

TEST_SUITE("muon") {

TEST_CASE("Newton–Schulz matches a float64 reference (wide, tall, square; 0, 1 and 5 steps)") {
  std::mt19937_64 rng(5);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{24, 40}, {56, 20}, {32, 32}, {1, 17}}) {
    const std::vector<float> G = gaussian_floats(size_t(rows * cols), rng, 0.03f);
    for (int steps : {0, 1, 5}) {
      CAPTURE(rows);
      CAPTURE(cols);
      CAPTURE(steps);
      const std::vector<float> out = run_ns(G, rows, cols, steps);
      const Mat ref = ns_reference(Mat(G.begin(), G.end()), rows, cols, steps);
      const double err = rel_diff(Mat(out.begin(), out.end()), ref);
      CHECK(err < 2e-5);
      // in place (out aliases G) gives the same bits
      std::vector<float> inplace = G, ws(size_t(newton_schulz_workspace_numel(rows, cols)));
      newton_schulz(inplace.data(), inplace.data(), rows, cols, steps, ws.data());
      CHECK(inplace == out);
    }
  }
}

TEST_CASE("Newton–Schulz: each singular value s becomes p^5(s / ||G||_F), inside the documented band") {
  // G = U diag(s) V^T with s / ||s|| spread over [0.012, 0.6]: the iteration acts
  // on each singular value alone, so the output's are p(p(p(p(p(x))))).
  std::mt19937_64 rng(17);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{24, 64}, {64, 24}}) {
    CAPTURE(rows);
    const int64_t k = std::min(rows, cols);
    std::vector<double> s(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) s[i] = std::exp(std::log(0.02) * double(k - 1 - i) / double(k - 1));  // 0.02 .. 1
    const double fro = std::sqrt(std::inner_product(s.begin(), s.end(), s.begin(), 0.0));
    const std::vector<float> G = with_spectrum(s, rows, cols, rng);
    const std::vector<double> in = singular_values(G, rows, cols);
    CHECK(in.front() / fro == doctest::Approx(0.02 / fro).epsilon(1e-4));  // the eigen-solver sees the spectrum built
    CHECK(in.front() / fro < 0.02);                                          // well outside the band before ...
    const std::vector<double> out = singular_values(run_ns(G, rows, cols, 5), rows, cols);
    double worst = 0, lo = 1e9, hi = 0;
    std::vector<double> expect(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) expect[i] = ns_scalar(s[i] / (fro + 1e-7), 5);
    std::sort(expect.begin(), expect.end());
    for (int64_t i = 0; i < k; ++i) {
      worst = std::max(worst, std::fabs(out[i] - expect[i]));
      lo = std::min(lo, out[i]);
      hi = std::max(hi, out[i]);
    }
    MESSAGE(rows << "x" << cols << ": singular values after 5 steps in [" << lo << ", " << hi
                  << "], worst |s - p^5(x)| " << worst);
    CHECK(worst < 1e-3);
    CHECK(lo >= kNsBandLow);  // ... and inside it after
    CHECK(hi <= kNsBandHigh);
  }
  // A Gaussian matrix of the tiny model's MLP shapes (sigma / ||G|| about 0.03 .. 0.25).
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{176, 64}, {64, 176}}) {
    const std::vector<double> sv = singular_values(run_ns(gaussian_floats(size_t(rows * cols), rng), rows, cols, 5),
                                                   rows, cols);
    MESSAGE(rows << "x" << cols << " Gaussian: [" << sv.front() << ", " << sv.back() << "]");
    CHECK(sv.front() >= kNsBandLow);
    CHECK(sv.back() <= kNsBandHigh);
  }
}

TEST_CASE("the update scale gives RMS 0.2 for an orthogonal matrix of any shape") {
  std::mt19937_64 rng(3);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{16, 48}, {48, 16}, {32, 32}}) {
    const int64_t k = std::min(rows, cols);
    const Mat Q = orthonormal_columns(std::max(rows, cols), k, rng);  // semi-orthogonal: all singular values 1
    double sumsq = 0;
    for (double q : Q) sumsq += q * q;
    const double rms = std::sqrt(sumsq / double(rows * cols)) * muon_update_scale(rows, cols);
    CHECK(rms == doctest::Approx(0.2).epsilon(1e-12));
  }
  CHECK(muon_update_scale(64, 176) == doctest::Approx(0.2 * std::sqrt(176.0)));
}

TEST_CASE("a Muon + AdamW step on a small model matches a float64 reference, parameter by parameter") {
  ModelConfig c;
  c.arch = "qwen2";
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.intermediate_size = 80;  // gate/up (80, 32) tall, down (32, 80) wide
  c.num_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;            // q (32, 32), k/v (16, 32)
  c.max_position_embeddings = 32;
  c.attention_bias = true;   // biases: AdamW, no decay
  c.tie_word_embeddings = false;  // lm_head: a matrix, but AdamW's
  ShardedModel model(c, 0, 1);
  model.init_seeded(3, 0.1);

  OptimSection o;
  o.name = "muon";
  o.lr = 0.02;
  o.weight_decay = 0.1;
  o.muon_momentum = 0.9;
  o.ns_steps = 5;
  o.adamw_lr = 0.005;
  o.adamw_weight_decay = 0.05;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-8;
  Optimizer opt(o, model);
  REQUIRE(opt.states() == 2);

  struct Ref {
    const Unit* unit;
    const ParamInfo* param;
    Mat p, m, v;
  };
  std::vector<Ref> refs;
  for (const auto& [unit, p] : model.layout.all_params()) {
    const size_t ui = size_t(unit - model.layout.units.data());
    const float* w = model.param[ui].data() + p->offset;
    refs.push_back({unit, p, Mat(w, w + p->numel), Mat(size_t(p->numel), 0.0), Mat(size_t(p->numel), 0.0)});
  }
  const std::vector<Ref> start = refs;
  std::mt19937_64 rng(23);
  const float grad_scale = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    const double lr = o.lr * (1.0 - 0.2 * step);  // a schedule: the AdamW group must follow it
    for (size_t ui = 0; ui < model.layout.units.size(); ++ui) {
      const auto g = gaussian_floats(size_t(model.layout.units[ui].shard_numel), rng, 0.01f);
      std::copy(g.begin(), g.end(), model.grad[ui].data());
    }
    opt.step(lr, grad_scale);
    for (Ref& r : refs) {
      const size_t ui = size_t(r.unit - model.layout.units.data());
      const float* gf = model.grad[ui].data() + r.param->offset;
      Mat g(size_t(r.param->numel));
      for (size_t i = 0; i < g.size(); ++i) g[i] = double(gf[i]) * grad_scale;
      if (is_muon_param(*r.unit, *r.param)) {
        const int64_t rows = r.param->shape[0], cols = r.param->shape[1];
        Mat d(g.size());
        for (size_t i = 0; i < g.size(); ++i) {
          r.m[i] = o.muon_momentum * r.m[i] + g[i];
          d[i] = g[i] + o.muon_momentum * r.m[i];
        }
        const Mat O = ns_reference(d, rows, cols, 5);
        const double scale = 0.2 * std::sqrt(double(std::max(rows, cols)));
        for (size_t i = 0; i < g.size(); ++i) r.p[i] = r.p[i] - lr * o.weight_decay * r.p[i] - lr * scale * O[i];
      } else {
        const double alr = lr * o.adamw_lr / o.lr;
        const double wd = r.param->weight_decay() ? o.adamw_weight_decay : 0.0;
        const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
        for (size_t i = 0; i < g.size(); ++i) {
          r.m[i] = o.beta1 * r.m[i] + (1 - o.beta1) * g[i];
          r.v[i] = o.beta2 * r.v[i] + (1 - o.beta2) * g[i] * g[i];
          r.p[i] -= alr * wd * r.p[i];
          r.p[i] -= alr / bc1 * r.m[i] / (std::sqrt(r.v[i]) / std::sqrt(bc2) + o.eps);
        }
      }
    }
  }

  int muon_params = 0, adamw_params = 0;
  for (size_t k = 0; k < refs.size(); ++k) {
    const Ref& r = refs[k];
    const size_t ui = size_t(r.unit - model.layout.units.data());
    CAPTURE(r.param->name);
    const float* w = model.param[ui].data() + r.param->offset;
    Mat change(size_t(r.param->numel)), ref_change(change.size());
    for (size_t i = 0; i < change.size(); ++i) {
      change[i] = double(w[i]) - start[k].p[i];
      ref_change[i] = r.p[i] - start[k].p[i];
    }
    const double err = rel_diff(change, ref_change);
    const float* m0 = opt.state(0)[ui].data() + r.param->offset;
    const float* m1 = opt.state(1)[ui].data() + r.param->offset;
    const double state_err = rel_diff(Mat(m0, m0 + r.param->numel), r.m);
    if (is_muon_param(*r.unit, *r.param)) {
      ++muon_params;
      MESSAGE(r.param->name << ": Muon, relative error of the 3-step change " << err);
      CHECK(err < 1e-4);
      CHECK(state_err < 1e-6);  // state 0 is the momentum buffer ...
      CHECK(std::all_of(m1, m1 + r.param->numel, [](float x) { return x == 0.0f; }));  // ... and state 1 unused
      CHECK(opt.state_name(0, *r.unit, *r.param) == "momentum_buffer");
      CHECK(opt.state_name(1, *r.unit, *r.param).empty());
    } else {
      ++adamw_params;
      CHECK(err < 1e-5);
      CHECK(state_err < 1e-5);
      CHECK(rel_diff(Mat(m1, m1 + r.param->numel), r.v) < 1e-5);
      CHECK(opt.state_name(0, *r.unit, *r.param) == "exp_avg");
      CHECK(opt.state_name(1, *r.unit, *r.param) == "exp_avg_sq");
    }
  }
  CHECK(muon_params == 7);   // q k v o gate up down
  CHECK(adamw_params == 8);   // embed, 2 layer norms, 3 biases, final norm, lm_head
  CHECK(muon_params + adamw_params == int(model.layout.all_params().size()));
  CHECK(opt.steps_taken() == 3);
}

TEST_CASE("AdamW and SGD state names and counts are unchanged") {
  ModelConfig c = tiny_arch();
  ShardedModel model(c, 0, 1);
  OptimSection o;
  Optimizer adamw(o, model);
  CHECK(adamw.states() == 2);
  CHECK(adamw.state_name(0) == "exp_avg");
  CHECK(adamw.state_name(1) == "exp_avg_sq");
  CHECK(adamw.state_name(0, model.layout.layer(0), model.layout.layer(0).param("self_attn.q_proj.weight")) ==
        "exp_avg");
  o.name = "sgd";
  CHECK(Optimizer(o, model).states() == 0);
  o.momentum = 0.9;
  Optimizer sgd(o, model);
  CHECK(sgd.states() == 1);
  CHECK(sgd.state_name(0) == "momentum_buffer");
  CHECK(optimizer_states(o) == 1);
  o.name = "muon";
  CHECK(optimizer_states(o) == 2);
  ShardedModel two(c, 0, 2);
  CHECK_THROWS_WITH_AS(Optimizer(o, two), doctest::Contains("construct the Optimizer with the trainers' Comm"),
                       std::exception);
}

TEST_CASE("Muon's memory: two state arrays like AdamW, and the workspace the plan names") {
  const ModelConfig c = tiny_arch();
  ShardedModel model(c, 0, 1);
  OptimSection o;
  o.name = "muon";
  const MemCounters before = host_memory();
  Optimizer opt(o, model);
  const MemCounters after = host_memory();
  int64_t shard_bytes = 0;
  for (const auto& u : model.layout.units) shard_bytes += 4 * u.shard_numel;
  CHECK(after.current[int(Mem::OptimState)] - before.current[int(Mem::OptimState)] == 2 * shard_bytes);
  const int64_t workspace = after.current[int(Mem::Workspace)] - before.current[int(Mem::Workspace)];
  CHECK(workspace == optimizer_workspace_bytes(o, model.layout));
  CHECK(workspace == 4 * opt.muon()->plan().workspace_numel);
  CHECK(workspace > 0);
  o.name = "adamw";
  CHECK(optimizer_workspace_bytes(o, model.layout) == 0);
}

TEST_CASE("owners: one per hidden matrix, balanced by size, the same every time") {
  for (const ModelConfig& c : {tiny_arch(), llama_1b()}) {
    for (int world : {1, 2, 3, 4, 8}) {
      CAPTURE(world);
      const ModelLayout layout(c, world);
      const auto owners = assign_muon_owners(layout, world);
      REQUIRE(owners.size() == size_t(7 * c.num_layers));
      std::vector<int64_t> load(size_t(world), 0);
      int64_t largest = 0;
      for (const auto& m : owners) {
        const std::string& n = m.param->name;
        CHECK(n.find("model.layers.") == 0);
        CHECK(n.substr(n.size() - 7) == ".weight");
        CHECK(n.find("layernorm") == std::string::npos);
        CHECK(m.owner >= 0);
        CHECK(m.owner < world);
        CHECK(m.rows * m.cols == m.param->numel);
        load[size_t(m.owner)] += m.param->numel;
        largest = std::max(largest, m.param->numel);
      }
      const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
      CHECK(*hi - *lo <= largest);  // greedy onto the least loaded: within one matrix of even
      const auto again = assign_muon_owners(layout, world);
      for (size_t i = 0; i < owners.size(); ++i) CHECK(again[i].owner == owners[i].owner);
      if (c.num_layers == 16 && world == 8) {
        std::string s;
        for (int64_t l : load) s += std::to_string(l) + " ";
        MESSAGE("Llama-3.2-1B shape, world 8: Muon elements per owner " << s);
        CHECK(double(*hi) / double(*lo) < 1.1);
      }
    }
  }
  // The rest is AdamW's: embeddings, norms, and an untied lm_head (a Matrix outside the layers).
  ModelConfig untied = tiny_arch();
  untied.tie_word_embeddings = false;
  const ModelLayout l(untied, 1);
  CHECK_FALSE(is_muon_param(l.head(), l.head().param("lm_head.weight")));
  CHECK_FALSE(is_muon_param(l.embed(), l.embed().param("model.embed_tokens.weight")));
  CHECK_FALSE(is_muon_param(l.layer(0), l.layer(0).param("input_layernorm.weight")));
  CHECK(is_muon_param(l.layer(0), l.layer(0).param("mlp.down_proj.weight")));
}

TEST_CASE("exchange plans: pairwise consistent, every element reaches its owner once; traffic per step") {
  for (const ModelConfig& c : {tiny_arch(), llama_1b()}) {
    for (int world : {1, 2, 3, 4, 8}) {
      CAPTURE(world);
      const ModelLayout layout(c, world);
      const auto matrices = assign_muon_owners(layout, world);
      std::vector<MuonExchangePlan> plans;
      for (int r = 0; r < world; ++r) plans.push_back(plan_muon_exchange(layout, matrices, r, world));
      int64_t most_sent = 0, most_ws = 0, muon_numel = 0, largest = 0;
      for (const auto& m : matrices) {
        muon_numel += m.param->numel;
        largest = std::max(largest, m.param->numel);
      }
      for (size_t ui = 0; ui < layout.units.size(); ++ui) {
        std::vector<int64_t> covered(matrices.size(), 0);
        for (int r = 0; r < world; ++r) {
          const MuonUnitPlan& pr = plans[size_t(r)].units[ui];
          REQUIRE(pr.has_matrices == (layout.units[ui].kind == UnitKind::Layer));
          if (!pr.has_matrices) continue;
          for (int o = 0; o < world; ++o) CHECK(pr.send_counts[size_t(o)] == plans[size_t(o)].units[ui].recv_counts[size_t(r)]);
          for (const auto& piece : pr.recv) {
            const MuonMatrix& m = matrices[size_t(piece.matrix)];
            CHECK(m.owner == r);
            CHECK(piece.matrix_offset >= 0);
            CHECK(piece.matrix_offset + piece.count <= m.param->numel);
            covered[size_t(piece.matrix)] += piece.count;
          }
          for (const auto& piece : pr.send) {  // a holder's piece is that element range of its shard
            const MuonMatrix& m = matrices[size_t(piece.matrix)];
            CHECK(r * layout.units[ui].shard_numel + piece.shard_offset == m.param->offset + piece.matrix_offset);
          }
        }
        for (size_t k = 0; k < matrices.size(); ++k)
          if (matrices[k].unit == int(ui)) CHECK(covered[k] == matrices[k].param->numel);
      }
      for (const auto& p : plans) {
        most_sent = std::max(most_sent, p.floats_sent_per_step);
        most_ws = std::max(most_ws, p.workspace_numel);
      }
      CHECK(most_ws == muon_workspace_numel(layout, world));
      if (world == 1) CHECK(most_sent == 0);
      // Each rank's slices go out and come back, minus what it owns itself: at most
      // 2 (N - 1) / N^2 M plus the imbalance of one matrix each way.
      if (world > 1) CHECK(most_sent <= 2 * (muon_numel / world + largest));
      MESSAGE(std::string(c.num_layers == 16 ? "Llama-3.2-1B" : "tiny") << " world " << world << ": Muon matrices " << muon_numel
                  << " elements; most floats sent per rank per step " << most_sent << " ("
                  << double(most_sent) * 4 / 1048576 << " MiB), received the same; workspace " << most_ws
                  << " floats");
    }
  }
}

// Delegates to the host newton_schulz and records the shape of every call.
class RecordingOrthogonalizer final : public Orthogonalizer {
 public:
  RecordingOrthogonalizer(const NsCapacity& capacity, std::vector<std::pair<int64_t, int64_t>>& calls)
      : calls_(calls), workspace_(Mem::Workspace, capacity.numel + 2 * capacity.gram_side * capacity.gram_side) {}
  const char* name() const override { return "recording"; }
  void orthogonalize(float* out, const float* G, int64_t rows, int64_t cols, int steps) override {
    calls_.emplace_back(rows, cols);
    REQUIRE(newton_schulz_workspace_numel(rows, cols) <= workspace_.size());
    newton_schulz(out, G, rows, cols, steps, workspace_.data());
  }

 private:
  std::vector<std::pair<int64_t, int64_t>>& calls_;
  Buffer<float> workspace_;  // 64-byte aligned like MuonStep's, so BLAS takes the same path
};

TEST_CASE("an Orthogonalizer takes the host Newton–Schulz's place: every owned matrix at its shape, same bits") {
  const ModelConfig c = tiny_arch();
  OptimSection o;
  o.name = "muon";
  o.lr = 0.01;
  std::vector<std::pair<int64_t, int64_t>> calls;
  NsCapacity capacity;
  std::vector<std::pair<int64_t, int64_t>> matrix_shapes;
  auto train = [&](bool replace) {
    ShardedModel model(c, 0, 1);
    model.init_seeded(3, 0.1);
    Optimizer opt(o, model);
    CHECK(std::string(opt.muon()->orthogonalizer_name()) == "host fp32");
    capacity = opt.muon()->ns_capacity();
    matrix_shapes.clear();
    for (const auto& m : opt.muon()->matrices()) matrix_shapes.emplace_back(m.rows, m.cols);
    if (replace) {
      opt.muon()->set_orthogonalizer(std::make_unique<RecordingOrthogonalizer>(capacity, calls));
      CHECK(std::string(opt.muon()->orthogonalizer_name()) == "recording");
    }
    std::mt19937_64 rng(11);
    for (int step = 0; step < 2; ++step) {
      for (size_t ui = 0; ui < model.layout.units.size(); ++ui) {
        const auto g = gaussian_floats(size_t(model.layout.units[ui].shard_numel), rng, 0.01f);
        std::copy(g.begin(), g.end(), model.grad[ui].data());
      }
      opt.step(o.lr, 1.0f);
    }
    if (replace) {
      opt.muon()->set_orthogonalizer(nullptr);
      CHECK(std::string(opt.muon()->orthogonalizer_name()) == "host fp32");
    }
    std::vector<float> params;
    for (auto& p : model.param) params.insert(params.end(), p.data(), p.data() + p.size());
    return params;
  };
  const std::vector<float> host = train(false);
  const std::vector<float> replaced = train(true);
  CHECK(host == replaced);  // MuonStep hands it the same matrices and uses what it returns
  REQUIRE(calls.size() == 2 * matrix_shapes.size());  // each matrix once per step, in table order
  CHECK(matrix_shapes.size() == size_t(7 * c.num_layers));
  for (size_t i = 0; i < calls.size(); ++i) CHECK(calls[i] == matrix_shapes[i % matrix_shapes.size()]);
  CHECK(capacity.numel == 176 * 64);  // gate/up (176, 64), down (64, 176)
  CHECK(capacity.gram_side == 64);

  // The 1B shape: every rank at world 8 owns an MLP matrix (8192 x 2048 elements, Gram side 2048).
  const ModelLayout layout(llama_1b(), 8);
  const auto owners = assign_muon_owners(layout, 8);
  for (int r = 0; r < 8; ++r) {
    const NsCapacity cap = muon_ns_capacity(owners, r);
    CHECK(cap.numel == 8192 * 2048);
    CHECK(cap.gram_side == 2048);
  }
  CHECK(muon_ns_capacity(owners, -1).numel == 8192 * 2048);
  // No GPU Newton–Schulz off the CUDA backend, or for another optimizer.
  CHECK(optimizer_gpu_workspace_bytes(o, layout, false).device == 0);
  CHECK(optimizer_gpu_workspace_bytes(o, layout, false).pinned_host == 0);
  o.name = "adamw";
  CHECK(optimizer_gpu_workspace_bytes(o, layout, true).device == 0);
}

}  // TEST_SUITE
