// test_moe.cpp — the CPU mixture-of-experts kernels (cpu/moe.hpp): routing
// against its definition, the experts' forward against a naive per-token sum,
// the aux loss against transformers' load_balancing_loss_func written out here
// (one-hot means over every layer's rows), and every gradient against central
// differences in double, with and without norm_topk_prob.
#include <doctest/doctest.h>

#include "fd_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/moe.hpp"
#include "cpu/ops.hpp"

namespace {

namespace cpu = shardlm::cpu;
using shardlm_test::Vec;
using shardlm_test::kExactTol, shardlm_test::kFdEps, shardlm_test::kFdTol;
using shardlm_test::randn, shardlm_test::rel_err, shardlm_test::sz;

// A routing's buffers, owned.
struct Routed {
  Vec probs, weight;
  std::vector<int32_t> expert, slot, row;
  std::vector<int64_t> offsets;
  cpu::MoeRouting<double> r;
  Routed(int64_t N, int64_t E, int64_t K)
      : probs(sz(N * E)), weight(sz(N * K)), expert(sz(N * K)), slot(sz(N * K)), row(sz(N * K)), offsets(sz(E + 1)) {
    r = {probs.data(), expert.data(), weight.data(), offsets.data(), slot.data(), row.data()};
  }
  Routed(const Routed&) = delete;  // r points into this one's vectors
};

double silu(double g) { return g / (1 + std::exp(-g)); }

// One block's sizes and parameters, and the scalar it is checked through:
// loss = sum(out * G) + beta * aux(this block's rows).
struct Block {
  int64_t N = 7, C = 6, I = 5, E = 5, K = 2;
  bool norm_topk = true;
  double beta = 0.3;
  Vec x, router, w_gate, w_up, w_down, G;
  std::vector<int32_t> forced;  // (N, K) router replay's experts; empty: the top-k

  explicit Block(std::mt19937_64& rng, bool norm) : norm_topk(norm) {
    x = randn(sz(N * C), rng);
    router = randn(sz(E * C), rng, 0.8);
    w_gate = randn(sz(E * I * C), rng, 0.5);
    w_up = randn(sz(E * I * C), rng, 0.5);
    w_down = randn(sz(E * C * I), rng, 0.5);
    G = randn(sz(N * C), rng);
  }

  double loss() const;
  // The chosen experts of every token: the finite differences must not move them.
  std::vector<int32_t> choices() const;
};

// The block's forward on b's parameters, with everything the backward reads:
// the router's logits, the routing, the experts' saved rows, the output and
// the aux loss's counts over these N rows.
struct Forward {
  Vec logits, out, xs, gate, up, h, y, counts, sums;
  Routed rt;
  explicit Forward(const Block& b)
      : logits(sz(b.N * b.E)), out(sz(b.N * b.C)), xs(sz(b.N * b.K * b.C)), gate(sz(b.N * b.K * b.I)), up(gate.size()),
        h(gate.size()), y(xs.size()), counts(sz(b.E)), sums(sz(b.E)), rt(b.N, b.E, b.K) {
    cpu::linear_forward(logits.data(), b.x.data(), b.router.data(), static_cast<const double*>(nullptr), b.N, b.C,
                        b.E);
    cpu::moe_route(rt.r, logits.data(), b.N, b.E, b.K, b.norm_topk, b.forced.empty() ? nullptr : b.forced.data());
    cpu::moe_experts_forward(out.data(), xs.data(), gate.data(), up.data(), h.data(), y.data(), b.x.data(), rt.r,
                             b.w_gate.data(), b.w_up.data(), b.w_down.data(), b.N, b.C, b.I, b.E, b.K);
    cpu::moe_aux_counts(counts.data(), sums.data(), rt.r, b.N, b.E, b.K);
  }
};

double Block::loss() const {
  const Forward f(*this);
  double l = beta * cpu::moe_aux_loss(f.counts.data(), f.sums.data(), N, E);
  for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * G[i];
  return l;
}

std::vector<int32_t> Block::choices() const { return Forward(*this).rt.expert; }

// Central differences of b.loss() in every entry of `param`.
Vec numeric(Block& b, Vec& param) {
  const std::vector<int32_t> chosen = b.choices();
  Vec g(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const double keep = param[i];
    param[i] = keep + kFdEps;
    const double up = b.loss();
    REQUIRE(b.choices() == chosen);
    param[i] = keep - kFdEps;
    const double down = b.loss();
    REQUIRE(b.choices() == chosen);
    param[i] = keep;
    g[i] = (up - down) / (2 * kFdEps);
  }
  return g;
}

}  // namespace

TEST_CASE("moe routing: softmax, top-k in probability order (the lower index among equals), renormalised weights, "
          "tokens grouped by expert in token order") {
  const int64_t N = 3, E = 4, K = 2;
  // Token 1's experts 1 and 3 tie: the lower index comes first.
  const Vec logits = {0.5, 2.0, -1.0, 1.0,  0.0, 1.5, 0.2, 1.5,  3.0, -2.0, 0.1, 0.0};
  for (bool norm : {true, false}) {
    CAPTURE(norm);
    Routed rt(N, E, K);
    cpu::moe_route(rt.r, logits.data(), N, E, K, norm);
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0, top = *std::max_element(logits.begin() + n * E, logits.begin() + (n + 1) * E);
      for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[sz(n * E + e)] - top);
      for (int64_t e = 0; e < E; ++e)
        CHECK(std::abs(rt.probs[sz(n * E + e)] - std::exp(logits[sz(n * E + e)] - top) / sum) < kExactTol);
    }
    CHECK(rt.expert == std::vector<int32_t>{1, 3, 1, 3, 0, 2});
    for (int64_t n = 0; n < N; ++n) {
      const double p0 = rt.probs[sz(n * E + rt.expert[sz(n * K)])], p1 = rt.probs[sz(n * E + rt.expert[sz(n * K + 1)])];
      CHECK(std::abs(rt.weight[sz(n * K)] - (norm ? p0 / (p0 + p1) : p0)) < kExactTol);
      CHECK(std::abs(rt.weight[sz(n * K + 1)] - (norm ? p1 / (p0 + p1) : p1)) < kExactTol);
    }
    // Expert 0: token 2's first choice; 1: tokens 0, 1; 2: token 2; 3: tokens 0, 1.
    CHECK(rt.offsets == std::vector<int64_t>{0, 1, 3, 4, 6});
    CHECK(rt.slot == std::vector<int32_t>{4, 0, 2, 5, 1, 3});
    for (int32_t s = 0; s < int32_t(N * K); ++s) CHECK(rt.slot[sz(rt.row[sz(s)])] == s);
  }
}

TEST_CASE("moe routing replay: forced = its own top-k gives the same bits; other forced experts are taken in "
          "their order, weighted by the router's own probabilities (renormalised with norm_topk); a row marked -1 "
          "takes the top-k") {
  std::mt19937_64 rng(21);
  const int64_t N = 6, E = 5, K = 2, stride = 3 * K;  // the forced rows sit in a wider (N, layers K) table
  const Vec logits = randn(sz(N * E), rng, 1.5);
  for (bool norm : {true, false}) {
    CAPTURE(norm);
    Routed own(N, E, K);
    cpu::moe_route(own.r, logits.data(), N, E, K, norm);
    std::vector<int32_t> table(sz(N * stride), 99);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < K; ++j) table[sz(n * stride + K + j)] = own.expert[sz(n * K + j)];
    Routed same(N, E, K);
    cpu::moe_route(same.r, logits.data(), N, E, K, norm, table.data() + K, stride);
    CHECK(same.expert == own.expert);
    CHECK(std::memcmp(same.weight.data(), own.weight.data(), own.weight.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(same.probs.data(), own.probs.data(), own.probs.size() * sizeof(double)) == 0);
    CHECK(same.offsets == own.offsets);
    CHECK(same.slot == own.slot);
    CHECK(same.row == own.row);

    // Forced: each token's two least probable experts, the least first; token 4 unrecorded (-1).
    std::vector<int32_t> low(sz(N * K));
    for (int64_t n = 0; n < N; ++n) {
      std::vector<int32_t> order(sz(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return own.probs[sz(n * E + a)] < own.probs[sz(n * E + b)]; });
      low[sz(n * K)] = order[0], low[sz(n * K + 1)] = order[1];
    }
    low[sz(4 * K)] = -1, low[sz(4 * K + 1)] = -1;
    Routed forced(N, E, K);
    cpu::moe_route(forced.r, logits.data(), N, E, K, norm, low.data());
    for (int64_t n = 0; n < N; ++n) {
      CAPTURE(n);
      if (n == 4) {
        CHECK(forced.expert[sz(n * K)] == own.expert[sz(n * K)]);
        CHECK(forced.expert[sz(n * K + 1)] == own.expert[sz(n * K + 1)]);
        continue;
      }
      const int32_t a = low[sz(n * K)], b = low[sz(n * K + 1)];
      CHECK(forced.expert[sz(n * K)] == a);
      CHECK(forced.expert[sz(n * K + 1)] == b);
      CHECK(a != own.expert[sz(n * K)]);
      const double pa = own.probs[sz(n * E + a)], pb = own.probs[sz(n * E + b)];
      CHECK(std::abs(forced.weight[sz(n * K)] - (norm ? pa / (pa + pb) : pa)) < kExactTol);
      CHECK(std::abs(forced.weight[sz(n * K + 1)] - (norm ? pb / (pa + pb) : pb)) < kExactTol);
    }
    for (int32_t s = 0; s < int32_t(N * K); ++s) {
      CHECK(forced.slot[sz(forced.row[sz(s)])] == s);
      const int64_t r = forced.row[sz(s)];
      const int32_t e = forced.expert[sz(s)];
      CHECK((r >= forced.offsets[sz(e)] && r < forced.offsets[sz(e + 1)]));
    }
  }
}

TEST_CASE("moe experts: the block's output equals each token's weighted sum of its experts' SwiGLU, computed naively") {
  std::mt19937_64 rng(11);
  Block b(rng, true);
  const int64_t N = b.N, C = b.C, I = b.I, K = b.K;
  const Forward f(b);
  const Routed& rt = f.rt;
  Vec want(f.out.size(), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = rt.expert[sz(n * K + j)];
      Vec hid(sz(I));
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < C; ++c) {
          g += b.w_gate[sz((e * I + i) * C + c)] * b.x[sz(n * C + c)];
          u += b.w_up[sz((e * I + i) * C + c)] * b.x[sz(n * C + c)];
        }
        hid[sz(i)] = silu(g) * u;
      }
      for (int64_t c = 0; c < C; ++c) {
        double d = 0;
        for (int64_t i = 0; i < I; ++i) d += b.w_down[sz((e * C + c) * I + i)] * hid[sz(i)];
        want[sz(n * C + c)] += rt.weight[sz(n * K + j)] * d;
      }
    }
  CHECK(rel_err(f.out, want) < kExactTol);
}

TEST_CASE("moe aux loss = transformers' load_balancing_loss_func over two layers' rows: E * sum over (k, e) of the "
          "one-hot mean times the mean probability") {
  std::mt19937_64 rng(5);
  const int64_t N = 9, E = 6, K = 2, L = 2;
  Vec counts(sz(E)), sums(sz(E));
  std::vector<Vec> probs;
  std::vector<std::vector<int32_t>> chosen;
  for (int64_t l = 0; l < L; ++l) {
    const Vec logits = randn(sz(N * E), rng, 2.0);
    Routed rt(N, E, K);
    cpu::moe_route(rt.r, logits.data(), N, E, K, true);
    cpu::moe_aux_counts(counts.data(), sums.data(), rt.r, N, E, K);
    probs.push_back(rt.probs);
    chosen.push_back(rt.expert);
  }
  // tokens_per_expert (K, E) = mean over the L N rows of one_hot(selected); router_prob_per_expert (E) = mean of
  // the softmax; loss = E * sum(tokens_per_expert * router_prob_per_expert).
  const double rows = double(L * N);
  double want = 0;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t e = 0; e < E; ++e) {
      double hot = 0, prob = 0;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t n = 0; n < N; ++n) {
          hot += chosen[sz(l)][sz(n * K + k)] == e;
          prob += probs[sz(l)][sz(n * E + e)];
        }
      want += (hot / rows) * (prob / rows);
    }
  want *= double(E);
  const double got = cpu::moe_aux_loss(counts.data(), sums.data(), L * N, E);
  MESSAGE("aux loss " << got << " (K = 2 when perfectly balanced)");
  CHECK(std::abs(got - want) < kExactTol);
}

TEST_CASE("moe backward: the input, router and experts' gradients, and the aux loss's, equal central differences "
          "(norm_topk_prob on and off)") {
  for (bool norm : {true, false}) {
    CAPTURE(norm);
    std::mt19937_64 rng(norm ? 3 : 4);
    Block b(rng, norm);
    const int64_t N = b.N, C = b.C, I = b.I, E = b.E, K = b.K;
    const Forward f(b);  // saving what the backward reads
    const Routed& rt = f.rt;
    Vec dx(sz(N * C)), dweight(sz(N * K)), dw_gate(b.w_gate.size()), dw_up(b.w_up.size()), dw_down(b.w_down.size()),
        dy(f.xs.size()), dh(f.gate.size()), dgate(f.gate.size()), dup(f.gate.size()), dxs(f.xs.size());
    cpu::moe_experts_backward(dx.data(), dweight.data(), dw_gate.data(), dw_up.data(), dw_down.data(), dy.data(),
                              dh.data(), dgate.data(), dup.data(), dxs.data(), b.G.data(), f.xs.data(), f.gate.data(),
                              f.up.data(), f.h.data(), f.y.data(), rt.r, b.w_gate.data(), b.w_up.data(),
                              b.w_down.data(), N, C, I, E, K);
    Vec dprobs(sz(N * E)), dlogits(sz(N * E)), dx_router(sz(N * C)), drouter(b.router.size());
    cpu::moe_aux_backward(dprobs.data(), f.counts.data(), N, N, E, b.beta);
    cpu::moe_route_backward(dlogits.data(), dweight.data(), dprobs.data(), rt.r, N, E, K, norm);
    cpu::linear_backward(dx_router.data(), drouter.data(), static_cast<double*>(nullptr), dlogits.data(), b.x.data(),
                         b.router.data(), N, C, E);
    for (size_t i = 0; i < dx.size(); ++i) dx[i] += dx_router[i];

    CHECK(rel_err(dx, numeric(b, b.x)) < kFdTol);
    CHECK(rel_err(drouter, numeric(b, b.router)) < kFdTol);
    CHECK(rel_err(dw_gate, numeric(b, b.w_gate)) < kFdTol);
    CHECK(rel_err(dw_up, numeric(b, b.w_up)) < kFdTol);
    CHECK(rel_err(dw_down, numeric(b, b.w_down)) < kFdTol);
    // Every expert had rows, so every expert's weights were checked.
    for (int64_t e = 0; e < E; ++e) CHECK(rt.offsets[sz(e + 1)] > rt.offsets[sz(e)]);
  }
}

TEST_CASE("moe backward under router replay: with forced experts (not the top-k) the router's and the input's "
          "gradients through the replayed experts' own probabilities equal central differences") {
  for (bool norm : {true, false}) {
    CAPTURE(norm);
    std::mt19937_64 rng(norm ? 5 : 6);
    Block b(rng, norm);
    const int64_t N = b.N, C = b.C, I = b.I, E = b.E, K = b.K;
    // Each token's experts: the top-k shifted by one (e -> (e + 2) mod E), so most are not its own choice.
    const std::vector<int32_t> own = b.choices();
    b.forced.resize(own.size());
    int64_t differ = 0;
    for (size_t i = 0; i < own.size(); ++i) b.forced[i] = int32_t((own[i] + 2) % E);
    for (int64_t n = 0; n < N; ++n) differ += b.forced[sz(n * K)] != own[sz(n * K)];
    REQUIRE(differ == N);
    const Forward f(b);
    CHECK(f.rt.expert == b.forced);
    Vec dx(sz(N * C)), dweight(sz(N * K)), dw_gate(b.w_gate.size()), dw_up(b.w_up.size()), dw_down(b.w_down.size()),
        dy(f.xs.size()), dh(f.gate.size()), dgate(f.gate.size()), dup(f.gate.size()), dxs(f.xs.size());
    cpu::moe_experts_backward(dx.data(), dweight.data(), dw_gate.data(), dw_up.data(), dw_down.data(), dy.data(),
                              dh.data(), dgate.data(), dup.data(), dxs.data(), b.G.data(), f.xs.data(), f.gate.data(),
                              f.up.data(), f.h.data(), f.y.data(), f.rt.r, b.w_gate.data(), b.w_up.data(),
                              b.w_down.data(), N, C, I, E, K);
    Vec dprobs(sz(N * E)), dlogits(sz(N * E)), dx_router(sz(N * C)), drouter(b.router.size());
    cpu::moe_aux_backward(dprobs.data(), f.counts.data(), N, N, E, b.beta);
    cpu::moe_route_backward(dlogits.data(), dweight.data(), dprobs.data(), f.rt.r, N, E, K, norm);
    cpu::linear_backward(dx_router.data(), drouter.data(), static_cast<double*>(nullptr), dlogits.data(), b.x.data(),
                         b.router.data(), N, C, E);
    for (size_t i = 0; i < dx.size(); ++i) dx[i] += dx_router[i];
    double router_norm = 0;
    for (double g : drouter) router_norm += g * g;
    CHECK(router_norm > 1e-6);  // the router has a gradient through the replayed experts
    CHECK(rel_err(drouter, numeric(b, b.router)) < kFdTol);
    CHECK(rel_err(dx, numeric(b, b.x)) < kFdTol);
    CHECK(rel_err(dw_gate, numeric(b, b.w_gate)) < kFdTol);
  }
}
