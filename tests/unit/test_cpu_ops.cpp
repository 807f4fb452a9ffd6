// test_cpu_ops.cpp — CPU reference kernels: finite-difference gradient checks in
// double, forward checks against naive formulas, and thread-count determinism.
#include <doctest/doctest.h>

#include "fd_util.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/ops.hpp"
#include "shardlm/error.hpp"

namespace {

namespace cpu = shardlm::cpu;
using shardlm_test::Vec;
using shardlm_test::kExactTol, shardlm_test::kFdEps, shardlm_test::kFdTol;
using shardlm_test::max_abs, shardlm_test::randn, shardlm_test::rel_err, shardlm_test::sz;

double dotv(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t e = 0; e < a.size(); ++e) s += a[e] * b[e];
  return s;
}

Vec minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t e = 0; e < a.size(); ++e) d[e] = a[e] - b[e];
  return d;
}

// Central-difference gradient of loss() with respect to x (perturbed in place).
template <class F>
Vec fd_grad(Vec& x, F&& loss) {
  Vec g(x.size());
  for (size_t e = 0; e < x.size(); ++e) {
    const double x0 = x[e];
    x[e] = x0 + kFdEps;
    const double lp = loss();
    x[e] = x0 - kFdEps;
    const double lm = loss();
    x[e] = x0;
    g[e] = (lp - lm) / (2 * kFdEps);
  }
  return g;
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();

// Naive O(N^2) masked-softmax attention in double; the mask straight from the
// definition: same seq_id and j <= i.
void naive_attention(Vec& out, Vec& lse, const Vec& q, const Vec& k, const Vec& v,
                     const std::vector<int32_t>& seq, int64_t N, int64_t H, int64_t KV,
                     int64_t D) {
  out.assign(sz(N * H * D), 0.0);
  lse.assign(sz(N * H), 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / KV);
      Vec s(sz(N), -INFINITY);
      double m = -INFINITY;
      for (int64_t j = 0; j < N; ++j) {
        if (seq[sz(j)] != seq[sz(i)] || j > i) continue;
        double d = 0;
        for (int64_t c = 0; c < D; ++c) d += q[sz((i * H + h) * D + c)] * k[sz((j * KV + g) * D + c)];
        s[sz(j)] = d * scale;
        m = std::max(m, s[sz(j)]);
      }
      double z = 0;
      for (int64_t j = 0; j < N; ++j) z += std::exp(s[sz(j)] - m);
      lse[sz(i * H + h)] = m + std::log(z);
      for (int64_t j = 0; j < N; ++j) {
        const double p = std::exp(s[sz(j)] - m) / z;
        for (int64_t c = 0; c < D; ++c)
          out[sz((i * H + h) * D + c)] += p * v[sz((j * KV + g) * D + c)];
      }
    }
}

// Two packed rows of 8 tokens: row 0 holds documents 0 (5 tokens) and 1 (3);
// row 1 holds documents 2 (6) and 3 (2).
const std::vector<int32_t> kSeq = {0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3};

// Runs fn with `threads` OpenMP threads (and as many OpenBLAS threads, capped).
template <class F>
void with_threads(int threads, F&& fn) {
  const int omp_before = omp_get_max_threads();
  const int blas_before = openblas_get_num_threads();
  omp_set_num_threads(threads);
  openblas_set_num_threads(std::min(threads, 2));
  fn();
  omp_set_num_threads(omp_before);
  openblas_set_num_threads(blas_before);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_SUITE("cpu_ops") {

TEST_CASE("gemm: all transpose combinations with padded leading dims match a naive loop") {
  std::mt19937_64 rng(1);
  const int64_t M = 5, N = 7, K = 3, pad = 2;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
      const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
      const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
      Vec A = randn(sz(a_rows * lda), rng), B = randn(sz(b_rows * ldb), rng);
      Vec C = randn(sz(M * ldc), rng);
      Vec expect = C;
      const double alpha = 0.7, beta = -1.3;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t p = 0; p < K; ++p)
            s += (ta ? A[sz(p * lda + i)] : A[sz(i * lda + p)]) *
                 (tb ? B[sz(j * ldb + p)] : B[sz(p * ldb + j)]);
          expect[sz(i * ldc + j)] = alpha * s + beta * C[sz(i * ldc + j)];
        }
      cpu::gemm<double>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
      CHECK(rel_err(C, expect) < kExactTol);
    }
  Vec A(6), B(6), C(4);
  CHECK_THROWS_AS(cpu::gemm<double>(false, false, 2, 2, 3, 1.0, A.data(), 2, B.data(), 2, 0.0,
                                    C.data(), 2),
                  shardlm::Error);  // lda 2 < K 3
}

TEST_CASE("linear: forward matches naive; dinp overwritten, dweight/dbias accumulated, FD") {
  std::mt19937_64 rng(2);
  const int64_t N = 6, IC = 5, OC = 4;
  Vec x = randn(sz(N * IC), rng), W = randn(sz(OC * IC), rng), b = randn(sz(OC), rng);
  Vec g = randn(sz(N * OC), rng);  // upstream gradient
  Vec y(sz(N * OC));
  cpu::linear_forward<double>(y.data(), x.data(), W.data(), b.data(), N, IC, OC);
  Vec expect(sz(N * OC));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t o = 0; o < OC; ++o) {
      double s = b[sz(o)];
      for (int64_t c = 0; c < IC; ++c) s += x[sz(t * IC + c)] * W[sz(o * IC + c)];
      expect[sz(t * OC + o)] = s;
    }
  CHECK(rel_err(y, expect) < kExactTol);

  auto loss = [&] {
    cpu::linear_forward<double>(y.data(), x.data(), W.data(), b.data(), N, IC, OC);
    return dotv(g, y);
  };
  Vec dx(sz(N * IC), kNaN);  // overwritten: NaNs must not survive
  Vec dW0 = randn(sz(OC * IC), rng), db0 = randn(sz(OC), rng);
  Vec dW = dW0, db = db0;
  cpu::linear_backward<double>(dx.data(), dW.data(), db.data(), g.data(), x.data(), W.data(), N, IC, OC);
  CHECK(rel_err(dx, fd_grad(x, loss)) < kFdTol);
  CHECK(rel_err(minus(dW, dW0), fd_grad(W, loss)) < kFdTol);
  CHECK(rel_err(minus(db, db0), fd_grad(b, loss)) < kFdTol);

  // No bias: forward is x W^T, backward leaves the (absent) bias alone.
  cpu::linear_forward<double>(y.data(), x.data(), W.data(), nullptr, N, IC, OC);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t o = 0; o < OC; ++o) expect[sz(t * OC + o)] -= b[sz(o)];
  CHECK(rel_err(y, expect) < kExactTol);
}

TEST_CASE("embedding: forward gathers rows; backward accumulates repeated ids; FD") {
  std::mt19937_64 rng(3);
  const int64_t N = 7, V = 5, C = 3;
  const std::vector<int32_t> ids = {4, 1, 1, 0, 4, 4, 2};
  Vec table = randn(sz(V * C), rng), g = randn(sz(N * C), rng), out(sz(N * C));
  cpu::embedding_forward<double>(out.data(), ids.data(), table.data(), N, V, C);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c)
      REQUIRE(out[sz(t * C + c)] == table[sz(ids[sz(t)] * C + c)]);

  auto loss = [&] {
    cpu::embedding_forward<double>(out.data(), ids.data(), table.data(), N, V, C);
    return dotv(g, out);
  };
  Vec dtable0 = randn(sz(V * C), rng), dtable = dtable0;
  cpu::embedding_backward<double>(dtable.data(), g.data(), ids.data(), N, V, C);
  const Vec numeric = fd_grad(table, loss);
  CHECK(rel_err(minus(dtable, dtable0), numeric) < kFdTol);
  // Row 3 is never used: its gradient stays exactly what it was.
  for (int64_t c = 0; c < C; ++c) CHECK(dtable[sz(3 * C + c)] == dtable0[sz(3 * C + c)]);

  const std::vector<int32_t> bad = {0, 5};
  CHECK_THROWS_WITH_AS(cpu::embedding_forward<double>(out.data(), bad.data(), table.data(), 2, V, C),
                       doctest::Contains("outside the vocabulary"), shardlm::Error);
}

TEST_CASE("rmsnorm: matches HF formula; per-head rows; dx overwritten, dw accumulated, FD") {
  std::mt19937_64 rng(4);
  // Qwen3 q-norm shape: (N, heads, head_dim) normalised as (N*heads, head_dim) rows.
  const int64_t N = 3, heads = 2, C = 8, rows = N * heads;
  const double eps = 1e-6;
  Vec x = randn(sz(rows * C), rng, 2.0), w = randn(sz(C), rng), g = randn(sz(rows * C), rng);
  Vec y(sz(rows * C)), rstd(sz(rows));
  cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), rows, C, eps);
  Vec expect(sz(rows * C));
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[sz(r * C + c)] * x[sz(r * C + c)] / double(C);
    for (int64_t c = 0; c < C; ++c)
      expect[sz(r * C + c)] = w[sz(c)] * (x[sz(r * C + c)] / std::sqrt(ms + eps));
    CHECK(std::abs(rstd[sz(r)] - 1 / std::sqrt(ms + eps)) < 1e-12 * rstd[sz(r)]);
  }
  CHECK(rel_err(y, expect) < kExactTol);

  auto loss = [&] {
    cpu::rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), rows, C, eps);
    return dotv(g, y);
  };
  loss();
  Vec dx(sz(rows * C), kNaN), dw0 = randn(sz(C), rng), dw = dw0;
  cpu::rmsnorm_backward<double>(dx.data(), dw.data(), g.data(), x.data(), w.data(), rstd.data(), rows, C);
  CHECK(rel_err(dx, fd_grad(x, loss)) < kFdTol);
  CHECK(rel_err(minus(dw, dw0), fd_grad(w, loss)) < kFdTol);
}

TEST_CASE("rope: default inv_freq and llama3 scaling match hand-computed values") {
  const Vec plain = cpu::rope_inv_freq(8, 10000.0, shardlm::RopeScaling{});
  REQUIRE(plain.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(plain[sz(i)] == doctest::Approx(std::pow(10000.0, -i / 4.0)).epsilon(1e-15));

  // Llama 3.1: D = 128, theta = 5e5, factor 8, low 1, high 4, original context 8192.
  // Values from HF's formula evaluated independently in float64 (Python):
  // high band i <= 28 unchanged, medium 29..34 interpolated, low i >= 35 divided by 8.
  shardlm::RopeScaling s;
  s.type = "llama3";
  s.factor = 8.0;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = 8192;
  const Vec f = cpu::rope_inv_freq(128, 500000.0, s);
  REQUIRE(f.size() == 64);
  const std::pair<int, double> expect[] = {
      {0, 1.0},
      {20, 0.016560440080994446},
      {28, 0.0032114459947525913},
      {29, 0.002166570763503359},
      {31, 0.0008567514129196321},
      {34, 0.00017850781276799638},
      {35, 9.556212353964683e-05},
      {63, 3.068925988914511e-07},
  };
  for (auto [i, value] : expect) {
    CAPTURE(i);
    CHECK(std::abs(f[sz(i)] - value) <= 1e-13 * value);
  }
  s.type = "yarn";
  CHECK_THROWS_WITH_AS(cpu::rope_inv_freq(128, 500000.0, s), doctest::Contains("not supported"),
                       shardlm::Error);
}

TEST_CASE("rope: forward matches the rotate_half formula; backward is its transpose (FD)") {
  std::mt19937_64 rng(5);
  const int64_t N = 5, heads = 3, D = 8, half = D / 2;
  const std::vector<int32_t> pos = {0, 1, 2, 0, 7};  // packed: two documents
  shardlm::RopeScaling s;
  s.type = "llama3";
  s.factor = 4.0;
  s.original_max_position_embeddings = 16;  // small context so all three bands occur
  const Vec inv = cpu::rope_inv_freq(D, 100.0, s);
  Vec x = randn(sz(N * heads * D), rng), g = randn(sz(N * heads * D), rng);
  Vec y = x;
  cpu::rope_forward<double>(y.data(), pos.data(), inv.data(), N, heads, D);
  Vec expect(x.size());
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = d % half;
        const double a = pos[sz(t)] * inv[sz(i)];
        const double* xh = &x[sz((t * heads + h) * D)];
        const double rot = d < half ? -xh[d + half] : xh[d - half];  // rotate_half
        expect[sz((t * heads + h) * D + d)] = xh[d] * std::cos(a) + rot * std::sin(a);
      }
  CHECK(rel_err(y, expect) < kExactTol);

  auto loss = [&] {
    y = x;
    cpu::rope_forward<double>(y.data(), pos.data(), inv.data(), N, heads, D);
    return dotv(g, y);
  };
  Vec dx = g;
  cpu::rope_backward<double>(dx.data(), pos.data(), inv.data(), N, heads, D);
  CHECK(rel_err(dx, fd_grad(x, loss)) < kFdTol);
}

TEST_CASE("rope: float computes the angle in float32 like HF") {
  // pos * inv_freq rounded to float differs from the exact angle by ~4e-4 rad here;
  // the float kernel must follow the float32 angle, not the exact one.
  const int32_t pos = 100003;
  const double inv_d = 0.1;
  float x[2] = {1.0f, 0.0f};
  cpu::rope_forward<float>(x, &pos, &inv_d, 1, 1, 2);
  const float angle_f = float(pos) * float(inv_d);
  const double angle_exact = pos * inv_d;
  REQUIRE(std::abs(std::cos(double(angle_f)) - std::cos(angle_exact)) > 1e-4);
  CHECK(std::abs(double(x[0]) - std::cos(double(angle_f))) < 1e-6);
  CHECK(std::abs(double(x[1]) - std::sin(double(angle_f))) < 1e-6);
}

TEST_CASE("swiglu: forward matches silu(gate) * up; dgate, dup overwritten, FD") {
  std::mt19937_64 rng(6);
  const int64_t n = 40;
  Vec gate = randn(sz(n), rng, 3.0), up = randn(sz(n), rng), g = randn(sz(n), rng);
  Vec h(sz(n));
  cpu::swiglu_forward<double>(h.data(), gate.data(), up.data(), n);
  for (int64_t e = 0; e < n; ++e) {
    const double a = gate[sz(e)];
    CHECK(std::abs(h[sz(e)] - a / (1 + std::exp(-a)) * up[sz(e)]) < 1e-14);
  }
  auto loss = [&] {
    cpu::swiglu_forward<double>(h.data(), gate.data(), up.data(), n);
    return dotv(g, h);
  };
  Vec dgate(sz(n), kNaN), dup(sz(n), kNaN);
  cpu::swiglu_backward<double>(dgate.data(), dup.data(), g.data(), gate.data(), up.data(), n);
  CHECK(rel_err(dgate, fd_grad(gate, loss)) < kFdTol);
  CHECK(rel_err(dup, fd_grad(up, loss)) < kFdTol);
}

TEST_CASE("attention: packed documents, GQA 4/2 match naive masked softmax; FD for q, k, v") {
  std::mt19937_64 rng(7);
  const int64_t N = int64_t(kSeq.size()), H = 4, KV = 2, D = 8;
  Vec q = randn(sz(N * H * D), rng), k = randn(sz(N * KV * D), rng);
  Vec v = randn(sz(N * KV * D), rng), g = randn(sz(N * H * D), rng);
  Vec out(sz(N * H * D)), lse(sz(N * H)), out_ref, lse_ref;
  cpu::attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), kSeq.data(), N, H, KV, D);
  naive_attention(out_ref, lse_ref, q, k, v, kSeq, N, H, KV, D);
  CHECK(rel_err(out, out_ref) < kExactTol);
  CHECK(rel_err(lse, lse_ref) < kExactTol);
  // The first token of each document sees only itself: out = v of its kv head.
  for (int64_t c = 0; c < D; ++c) CHECK(out[sz((5 * H + 3) * D + c)] == doctest::Approx(v[sz((5 * KV + 1) * D + c)]).epsilon(1e-14));

  auto loss = [&] {
    cpu::attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), kSeq.data(), N, H, KV, D);
    return dotv(g, out);
  };
  loss();
  Vec dq(q.size(), kNaN), dk(k.size(), kNaN), dv(v.size(), kNaN);
  cpu::attention_backward<double>(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(), v.data(),
                                  out.data(), lse.data(), kSeq.data(), N, H, KV, D);
  CHECK(rel_err(dq, fd_grad(q, loss)) < kFdTol);
  CHECK(rel_err(dk, fd_grad(k, loss)) < kFdTol);
  CHECK(rel_err(dv, fd_grad(v, loss)) < kFdTol);
}

TEST_CASE("attention: no token attends across documents or to the future") {
  std::mt19937_64 rng(8);
  const int64_t N = int64_t(kSeq.size()), H = 4, KV = 2, D = 8;
  Vec q = randn(sz(N * H * D), rng), k = randn(sz(N * KV * D), rng);
  Vec v = randn(sz(N * KV * D), rng), dout = randn(sz(N * H * D), rng);
  auto run = [&](Vec& out, Vec& dq, Vec& dk, Vec& dv) {
    Vec lse(sz(N * H));
    out.assign(q.size(), 0);
    dq.assign(q.size(), 0);
    dk.assign(k.size(), 0);
    dv.assign(v.size(), 0);
    cpu::attention_forward<double>(out.data(), lse.data(), q.data(), k.data(), v.data(), kSeq.data(), N, H, KV, D);
    cpu::attention_backward<double>(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                    v.data(), out.data(), lse.data(), kSeq.data(), N, H, KV, D);
  };
  Vec out0, dq0, dk0, dv0, out1, dq1, dk1, dv1;
  run(out0, dq0, dk0, dv0);
  // Perturb token 2 of document 0 (tokens 0..4): q, k, v and its upstream gradient.
  const int64_t t = 2;
  for (int64_t c = 0; c < H * D; ++c) { q[sz(t * H * D + c)] += 0.5; dout[sz(t * H * D + c)] -= 0.7; }
  for (int64_t c = 0; c < KV * D; ++c) { k[sz(t * KV * D + c)] += 0.5; v[sz(t * KV * D + c)] -= 0.5; }
  run(out1, dq1, dk1, dv1);
  auto rows_equal = [](const Vec& a, const Vec& b, int64_t r0, int64_t r1, int64_t width) {
    return std::memcmp(&a[sz(r0 * width)], &b[sz(r0 * width)], sz((r1 - r0) * width) * sizeof(double)) == 0;
  };
  // Documents 1..3 (tokens 5..15): forward and all gradients bit-identical.
  CHECK(rows_equal(out0, out1, 5, N, H * D));
  CHECK(rows_equal(dq0, dq1, 5, N, H * D));
  CHECK(rows_equal(dk0, dk1, 5, N, KV * D));
  CHECK(rows_equal(dv0, dv1, 5, N, KV * D));
  // Causality inside document 0: tokens 0, 1 do not see token 2.
  CHECK(rows_equal(out0, out1, 0, t, H * D));
  CHECK(rows_equal(dq0, dq1, 0, t, H * D));
  // ...and the perturbation did reach token 2 onwards (the test can fail).
  CHECK_FALSE(rows_equal(out0, out1, t, 5, H * D));
}

TEST_CASE("cross_entropy: loss and dlogits match naive; ignored rows zero; FD; stable") {
  std::mt19937_64 rng(9);
  const int64_t n = 6, V = 7;
  const std::vector<int32_t> targets = {3, -100, 0, 6, 2, 5};
  const Vec weights = {1.0, 1.0, 0.5, 0.0, 2.0, 1.0};  // row 1 ignored, row 3 weight 0
  const double grad_scale = 0.37;
  Vec logits = randn(sz(n * V), rng, 2.0);

  double expect_loss = 0;
  Vec expect_grad(sz(n * V), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    if (targets[sz(r)] < 0 || weights[sz(r)] == 0) continue;
    double z = 0;
    for (int64_t c = 0; c < V; ++c) z += std::exp(logits[sz(r * V + c)]);
    expect_loss += weights[sz(r)] * (std::log(z) - logits[sz(r * V + targets[sz(r)])]);
    for (int64_t c = 0; c < V; ++c)
      expect_grad[sz(r * V + c)] = weights[sz(r)] * grad_scale *
          (std::exp(logits[sz(r * V + c)]) / z - (c == targets[sz(r)] ? 1.0 : 0.0));
  }
  auto loss = [&] {
    Vec work = logits;
    return cpu::cross_entropy_forward_backward<double>(work.data(), targets.data(), weights.data(),
                                                       grad_scale, n, V);
  };
  Vec dlogits = logits;
  const double got = cpu::cross_entropy_forward_backward<double>(dlogits.data(), targets.data(), weights.data(),
                                                                 grad_scale, n, V);
  CHECK(std::abs(got - expect_loss) < 1e-12 * expect_loss);
  CHECK(rel_err(dlogits, expect_grad) < kExactTol);
  for (int64_t c = 0; c < V; ++c) {
    CHECK(dlogits[sz(1 * V + c)] == 0.0);
    CHECK(dlogits[sz(3 * V + c)] == 0.0);
  }
  Vec numeric = fd_grad(logits, loss);
  for (double& e : numeric) e *= grad_scale;
  CHECK(rel_err(dlogits, numeric) < kFdTol);

  // Logits of 1e4 (exp overflows without the max shift): same loss as shifted logits.
  Vec big = logits, dbig;
  for (double& e : big) e += 1e4;
  dbig = big;
  const double got_big = cpu::cross_entropy_forward_backward<double>(dbig.data(), targets.data(), weights.data(),
                                                                     grad_scale, n, V);
  CHECK(std::isfinite(got_big));
  CHECK(std::abs(got_big - expect_loss) < 1e-9 * expect_loss);
  CHECK(rel_err(dbig, expect_grad) < 1e-9);

  // Float path, no weights (nullptr = 1): agrees with double to float precision.
  std::vector<float> lf(logits.begin(), logits.end());
  Vec ld = logits;
  const double loss_f = cpu::cross_entropy_forward_backward<float>(lf.data(), targets.data(), nullptr, 1.0f, n, V);
  const double loss_d = cpu::cross_entropy_forward_backward<double>(ld.data(), targets.data(), nullptr, 1.0, n, V);
  CHECK(std::abs(loss_f - loss_d) < 1e-5 * loss_d);
  CHECK(rel_err(Vec(lf.begin(), lf.end()), ld) < 1e-5);

  const std::vector<int32_t> bad = {7};
  Vec one_row(sz(V), 0.0);
  CHECK_THROWS_WITH_AS(cpu::cross_entropy_forward_backward<double>(one_row.data(), bad.data(), nullptr, 1.0, 1, V),
                       doctest::Contains("outside the vocabulary"), shardlm::Error);
}

TEST_CASE("helpers: add, accumulate, scale, sum_squares") {
  std::mt19937_64 rng(10);
  const int64_t n = 100003;  // above the parallel threshold, not a multiple of the blocks
  Vec a = randn(sz(n), rng), b = randn(sz(n), rng), out(sz(n));
  cpu::add<double>(out.data(), a.data(), b.data(), n);
  CHECK(out[12345] == a[12345] + b[12345]);
  Vec y = a;
  cpu::accumulate<double>(y.data(), b.data(), n);
  CHECK(same_bits(y, out));
  cpu::scale<double>(y.data(), -2.0, n);
  CHECK(y[n - 1] == -2.0 * out[sz(n - 1)]);
  double naive = 0;
  for (double e : a) naive += e * e;
  CHECK(std::abs(cpu::sum_squares<double>(a.data(), n) - naive) < 1e-12 * naive);
  CHECK(cpu::sum_squares<double>(a.data(), 0) == 0.0);
}

TEST_CASE("determinism: float results are bit-identical for 1 and 4 threads") {
  std::mt19937_64 rng(11);
  // Attention: 3 documents of 40, 30, 26 tokens, GQA 4/2, D = 16.
  const int64_t N = 96, H = 4, KV = 2, D = 16;
  std::vector<int32_t> seq(sz(N));
  for (int64_t t = 0; t < N; ++t) seq[sz(t)] = t < 40 ? 0 : t < 70 ? 1 : 2;
  auto q = randn<float>(sz(N * H * D), rng), k = randn<float>(sz(N * KV * D), rng);
  auto v = randn<float>(sz(N * KV * D), rng), dout = randn<float>(sz(N * H * D), rng);
  // Linear big enough for OpenBLAS to use its threads; RMSNorm, embedding, CE.
  const int64_t T = 256, IC = 192, OC = 160, V = 50;
  auto x = randn<float>(sz(T * IC), rng), W = randn<float>(sz(OC * IC), rng);
  auto bias = randn<float>(sz(OC), rng), dy = randn<float>(sz(T * OC), rng);
  auto w_norm = randn<float>(sz(IC), rng);
  std::vector<int32_t> ids(sz(T)), targets(sz(T));
  for (int64_t t = 0; t < T; ++t) { ids[sz(t)] = int32_t((t * 7) % V); targets[sz(t)] = int32_t((t * 13) % OC); }

  struct Result {
    std::vector<float> out, lse, dq, dk, dv, y, dx, dW, db, norm_dx, norm_dw, dtable, dlogits;
    double ce_loss = 0, sumsq = 0;
  };
  auto compute = [&] {
    Result r;
    r.out.resize(q.size()); r.lse.resize(sz(N * H));
    r.dq.resize(q.size()); r.dk.resize(k.size()); r.dv.resize(v.size());
    cpu::attention_forward<float>(r.out.data(), r.lse.data(), q.data(), k.data(), v.data(), seq.data(), N, H, KV, D);
    cpu::attention_backward<float>(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                   r.out.data(), r.lse.data(), seq.data(), N, H, KV, D);
    r.y.resize(sz(T * OC)); r.dx.resize(x.size()); r.dW.assign(W.size(), 0.f); r.db.assign(sz(OC), 0.f);
    cpu::linear_forward<float>(r.y.data(), x.data(), W.data(), bias.data(), T, IC, OC);
    cpu::linear_backward<float>(r.dx.data(), r.dW.data(), r.db.data(), dy.data(), x.data(), W.data(), T, IC, OC);
    std::vector<float> normed(x.size()), rstd(sz(T));
    r.norm_dx.resize(x.size()); r.norm_dw.assign(sz(IC), 0.f);
    cpu::rmsnorm_forward<float>(normed.data(), rstd.data(), x.data(), w_norm.data(), T, IC, 1e-6);
    cpu::rmsnorm_backward<float>(r.norm_dx.data(), r.norm_dw.data(), x.data(), x.data(), w_norm.data(), rstd.data(), T, IC);
    r.dtable.assign(sz(V * IC), 0.f);
    cpu::embedding_backward<float>(r.dtable.data(), x.data(), ids.data(), T, V, IC);
    r.dlogits = r.y;
    r.ce_loss = cpu::cross_entropy_forward_backward<float>(r.dlogits.data(), targets.data(), nullptr, 1.0f / T, T, OC);
    r.sumsq = cpu::sum_squares<float>(r.dW.data(), int64_t(r.dW.size()));
    return r;
  };
  Result one, many;
  with_threads(1, [&] { one = compute(); });
  with_threads(4, [&] { many = compute(); });
  CHECK(same_bits(one.out, many.out));
  CHECK(same_bits(one.lse, many.lse));
  CHECK(same_bits(one.dq, many.dq));
  CHECK(same_bits(one.dk, many.dk));
  CHECK(same_bits(one.dv, many.dv));
  CHECK(same_bits(one.y, many.y));
  CHECK(same_bits(one.dx, many.dx));
  CHECK(same_bits(one.dW, many.dW));
  CHECK(same_bits(one.db, many.db));
  CHECK(same_bits(one.norm_dx, many.norm_dx));
  CHECK(same_bits(one.norm_dw, many.norm_dw));
  CHECK(same_bits(one.dtable, many.dtable));
  CHECK(same_bits(one.dlogits, many.dlogits));
  CHECK(one.ce_loss == many.ce_loss);
  CHECK(one.sumsq == many.sumsq);

  // The float attention is the double one to float precision (guards the float path).
  Vec qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end()), outd, lsed;
  naive_attention(outd, lsed, qd, kd, vd, seq, N, H, KV, D);
  CHECK(rel_err(Vec(one.out.begin(), one.out.end()), outd) < 1e-5);
}

}  // TEST_SUITE
