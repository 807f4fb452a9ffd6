// bench_moe_gemm.cu — how fast a layer of experts' GEMMs run, each way cuBLAS
// offers to run them, against one dense GEMM of the same FLOPs (the rate the
// experts' products could reach if they were one matrix).
//
//   build/bench_moe_gemm [N C E K Im]
//
// Defaults: the Qwen3-30B-A3B shape at 4096 tokens (2048 128 8 768). Each token
// picks K distinct experts uniformly (seeded): about N K / E rows an expert. The
// products are src/cuda/moe.cu's: gate and up (rows x Im x C each, or one rows x
// 2 Im x C against the two stacked), down (rows x C x Im), the weight gradients
// (Im x C x rows, fp32 C, beta 1) and the rows' gradient (rows x C x Im). Ways:
//   grouped   cublasGemmGroupedBatchedEx_64, one launch for every expert's product
//   loop      cublasGemmEx an expert at a time
//   batched   cublasGemmStridedBatchedEx with every expert padded to the largest count
//   dense     one GEMM of all R rows (the ceiling)
// Row-major C (M, N) = op(A) op(B) mapped onto column-major cuBLAS as gemm.cu
// does. Median of 9 timed repeats after 3 warm-ups, in TFLOP/s of the real rows.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)
#define BK(x)                                                                                   \
  do {                                                                                          \
    cublasStatus_t s_ = (x);                                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(s_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

using bf16 = __nv_bfloat16;

namespace {

struct Product {
  int64_t M, N, K;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  void* C;
  int64_t ldc;
};

cublasHandle_t handle;
void** dev_ptrs;

// Row-major C = op(A) op(B): column-major C^T = op(B)^T op(A)^T.
void grouped(bool ta, bool tb, const std::vector<Product>& ps, float beta, cudaDataType_t ctype) {
  std::vector<int64_t> m, n, k, lda, ldb, ldc, size;
  std::vector<cublasOperation_t> oa, ob;
  std::vector<float> alpha, betas;
  std::vector<const void*> ptrs;
  for (const Product& p : ps) {
    if (p.M == 0) continue;
    m.push_back(p.N), n.push_back(p.M), k.push_back(p.K);
    oa.push_back(tb ? CUBLAS_OP_T : CUBLAS_OP_N), ob.push_back(ta ? CUBLAS_OP_T : CUBLAS_OP_N);
    lda.push_back(p.ldb), ldb.push_back(p.lda), ldc.push_back(p.ldc);
    alpha.push_back(1), betas.push_back(beta), size.push_back(1);
  }
  const size_t cnt = m.size();
  for (const Product& p : ps) if (p.M) ptrs.push_back(p.B);
  for (const Product& p : ps) if (p.M) ptrs.push_back(p.A);
  for (const Product& p : ps) if (p.M) ptrs.push_back(p.C);
  CK(cudaMemcpyAsync(dev_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, 0));
  BK(cublasGemmGroupedBatchedEx_64(handle, oa.data(), ob.data(), m.data(), n.data(), k.data(), alpha.data(),
                                   (const void* const*)dev_ptrs, CUDA_R_16BF, lda.data(),
                                   (const void* const*)(dev_ptrs + cnt), CUDA_R_16BF, ldb.data(), betas.data(),
                                   dev_ptrs + 2 * cnt, ctype, ldc.data(), int64_t(cnt), size.data(),
                                   CUBLAS_COMPUTE_32F));
}

void one(bool ta, bool tb, const Product& p, float beta, cudaDataType_t ctype) {
  if (p.M == 0) return;
  const float alpha = 1;
  BK(cublasGemmEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(p.N), int(p.M),
                  int(p.K), &alpha, p.B, CUDA_R_16BF, int(p.ldb), p.A, CUDA_R_16BF, int(p.lda), &beta, p.C, ctype,
                  int(p.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void strided(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, int64_t sa,
             const void* B, int64_t ldb, int64_t sb, void* C, int64_t ldc, int64_t sc, int64_t batch, float beta,
             cudaDataType_t ctype) {
  const float alpha = 1;
  BK(cublasGemmStridedBatchedEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(N),
                                int(M), int(K), &alpha, B, CUDA_R_16BF, int(ldb), sb, A, CUDA_R_16BF, int(lda), sa,
                                &beta, C, ctype, int(ldc), sc, int(batch), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

double median_ms(const std::function<void()>& f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < 9; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void* dalloc(size_t bytes) {
  void* p;
  CK(cudaMalloc(&p, bytes));
  CK(cudaMemset(p, 0, bytes));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? atoll(argv[1]) : 4096, C = argc > 2 ? atoll(argv[2]) : 2048,
                E = argc > 3 ? atoll(argv[3]) : 128, K = argc > 4 ? atoll(argv[4]) : 8,
                Im = argc > 5 ? atoll(argv[5]) : 768, R = N * K;
  std::mt19937_64 rng(7);
  std::vector<int64_t> count(E, 0);
  std::vector<int64_t> ids(E);
  for (int64_t n = 0; n < N; ++n) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t j = 0; j < K; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, E - 1);
      std::swap(ids[j], ids[pick(rng)]);
      ++count[ids[j]];
    }
  }
  std::vector<int64_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + count[e];
  const int64_t most = *std::max_element(count.begin(), count.end());
  std::printf("N %lld C %lld E %lld K %lld Im %lld: %lld rows, %lld to %lld an expert\n", (long long)N, (long long)C,
              (long long)E, (long long)K, (long long)Im, (long long)R,
              (long long)*std::min_element(count.begin(), count.end()), (long long)most);

  BK(cublasCreate(&handle));
  size_t ws = 64 << 20;
  BK(cublasSetWorkspace(handle, dalloc(ws), ws));
  dev_ptrs = static_cast<void**>(dalloc(3 * 2 * E * sizeof(void*)));
  auto* rows = static_cast<bf16*>(dalloc(2 * size_t(E * most) * C));  // padded for the strided way
  auto* wg = static_cast<bf16*>(dalloc(2 * size_t(E) * 2 * Im * C));   // gate | up stacked: (E, 2 Im, C)
  auto* wd = static_cast<bf16*>(dalloc(2 * size_t(E) * C * Im));
  auto* gu = static_cast<bf16*>(dalloc(2 * size_t(E * most) * 2 * Im));
  auto* h = static_cast<bf16*>(dalloc(2 * size_t(E * most) * Im));
  auto* y = static_cast<bf16*>(dalloc(2 * size_t(E * most) * C));
  auto* g32 = static_cast<float*>(dalloc(4 * size_t(E) * 2 * Im * C));

  auto report = [&](const char* what, double flops, double ms) {
    std::printf("  %-58s %8.3f ms  %6.1f TFLOP/s\n", what, ms, flops / ms / 1e9);
  };
  const double f_gu = 2.0 * R * 2 * Im * C, f_down = 2.0 * R * C * Im;

  std::printf("gate|up forward (R x 2Im x C)\n");
  {
    std::vector<Product> two, stacked;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = count[e], o = off[e];
      two.push_back({m, Im, C, rows + o * C, C, wg + e * 2 * Im * C, C, gu + o * 2 * Im, 2 * Im});
      two.push_back({m, Im, C, rows + o * C, C, wg + e * 2 * Im * C + Im * C, C, gu + o * 2 * Im + Im, 2 * Im});
      stacked.push_back({m, 2 * Im, C, rows + o * C, C, wg + e * 2 * Im * C, C, gu + o * 2 * Im, 2 * Im});
    }
    report("grouped, gate and up apart (2E products, as moe.cu)", f_gu,
           median_ms([&] { grouped(false, true, two, 0, CUDA_R_16BF); }));
    report("grouped, gate|up stacked (E products)", f_gu,
           median_ms([&] { grouped(false, true, stacked, 0, CUDA_R_16BF); }));
    report("loop, gate|up stacked", f_gu,
           median_ms([&] { for (auto& p : stacked) one(false, true, p, 0, CUDA_R_16BF); }));
    report("strided batched, padded to the largest expert", f_gu, median_ms([&] {
             strided(false, true, most, 2 * Im, C, rows, C, most * C, wg, C, 2 * Im * C, gu, 2 * Im, most * 2 * Im,
                     E, 0, CUDA_R_16BF);
           }));
    report("dense (one GEMM of R rows)", f_gu, median_ms([&] {
             one(false, true, {R, 2 * Im, C, rows, C, wg, C, gu, 2 * Im}, 0, CUDA_R_16BF);
           }));
  }
  std::printf("down forward (R x C x Im)\n");
  {
    std::vector<Product> ps;
    for (int64_t e = 0; e < E; ++e)
      ps.push_back({count[e], C, Im, h + off[e] * Im, Im, wd + e * C * Im, Im, y + off[e] * C, C});
    report("grouped", f_down, median_ms([&] { grouped(false, true, ps, 0, CUDA_R_16BF); }));
    report("loop", f_down, median_ms([&] { for (auto& p : ps) one(false, true, p, 0, CUDA_R_16BF); }));
    report("dense", f_down, median_ms([&] { one(false, true, {R, C, Im, h, Im, wd, Im, y, C}, 0, CUDA_R_16BF); }));
  }
  std::printf("rows' gradient from gate|up (R x C x 2Im)\n");
  {
    std::vector<Product> two, stacked;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = count[e], o = off[e];
      two.push_back({m, C, Im, gu + o * 2 * Im, 2 * Im, wg + e * 2 * Im * C, C, rows + o * C, C});
      stacked.push_back({m, C, 2 * Im, gu + o * 2 * Im, 2 * Im, wg + e * 2 * Im * C, C, rows + o * C, C});
    }
    report("grouped, gate then up with beta 1 (two launches, as moe.cu)", f_gu, median_ms([&] {
             grouped(false, false, two, 0, CUDA_R_16BF);
             grouped(false, false, two, 1, CUDA_R_16BF);
           }));
    report("grouped, stacked (K = 2 Im, one launch)", f_gu,
           median_ms([&] { grouped(false, false, stacked, 0, CUDA_R_16BF); }));
    report("dense", f_gu, median_ms([&] { one(false, false, {R, C, 2 * Im, gu, 2 * Im, wg, C, rows, C}, 0,
                                              CUDA_R_16BF); }));
  }
  std::printf("weight gradients of gate|up (2Im x C x rows), fp32 C, beta 1\n");
  {
    std::vector<Product> two, stacked;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = count[e], o = off[e];
      two.push_back({Im, C, m, gu + o * 2 * Im, 2 * Im, rows + o * C, C, g32 + e * 2 * Im * C, C});
      two.push_back({Im, C, m, gu + o * 2 * Im + Im, 2 * Im, rows + o * C, C, g32 + e * 2 * Im * C + Im * C, C});
      stacked.push_back({2 * Im, C, m, gu + o * 2 * Im, 2 * Im, rows + o * C, C, g32 + e * 2 * Im * C, C});
    }
    report("grouped, gate and up apart (2E products)", f_gu,
           median_ms([&] { grouped(true, false, two, 1, CUDA_R_32F); }));
    report("grouped, stacked (E products)", f_gu, median_ms([&] { grouped(true, false, stacked, 1, CUDA_R_32F); }));
    report("loop, stacked", f_gu, median_ms([&] { for (auto& p : stacked) one(true, false, p, 1, CUDA_R_32F); }));
    report("dense (R rows into one fp32 matrix)", f_gu, median_ms([&] {
             one(true, false, {2 * Im, C, R, gu, 2 * Im, rows, C, g32, C}, 1, CUDA_R_32F);
           }));
  }
  std::printf("weight gradients of down (C x Im x rows), fp32 C, beta 1\n");
  {
    std::vector<Product> ps;
    for (int64_t e = 0; e < E; ++e)
      ps.push_back({C, Im, count[e], y + off[e] * C, C, h + off[e] * Im, Im, g32 + e * C * Im, Im});
    report("grouped", f_down, median_ms([&] { grouped(true, false, ps, 1, CUDA_R_32F); }));
    report("dense", f_down, median_ms([&] { one(true, false, {C, Im, R, y, C, h, Im, g32, Im}, 1, CUDA_R_32F); }));
  }
  return 0;
}
