// bench_gemm_algos.cu — how fast each of cuBLASLt's candidate algorithms runs a
// decode step's GEMMs (a few rows against a whole weight matrix: memory-bound), and
// which one the heuristic puts first. The question it answers: would timing the
// candidates (autotuning) beat the heuristic's first choice at these shapes?
//
//   build/bench_gemm_algos [M] [hidden intermediate q_dim kv_dim vocab]
//
// Defaults: M = 64 rows, the 1B Llama shape (2048 8192 2048 512 128256). The GEMMs
// are the decoder's (src/infer/decoder_cuda.cu): q|k|v, o, gate|up, down (+ the
// residual as C), the lm-head (fp32 out). Row-major C (M, N) = A (M, K) W (N, K)^T,
// mapped onto column-major cuBLASLt as src/cuda/gemm.cu does. Each candidate runs
// as a CUDA graph of 20 launches cycling through enough weight copies (>= 256 MiB)
// that, as in a real step, the weights come from HBM and not from L2; the median
// of 7 replays is reported with the bytes it moved per second.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)
#define LK(x)                                                                                         \
  do {                                                                                                \
    cublasStatus_t s_ = (x);                                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasLtGetStatusString(s_)); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace {

struct Shape {
  const char* name;
  long N, K;
  bool f32_out, residual;
  int parts = 1;  // > 1: K cut into that many parts, one batched GEMM, fp32 parts out
};

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffff) / 65536.0f - 0.5f) * 0.05f);
  }
}

// An algorithm's configuration attribute, or -1 where this cuBLASLt does not report it.
int attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t a) {
  int32_t v = 0;
  size_t written = 0;
  return cublasLtMatmulAlgoConfigGetAttribute(&algo, a, &v, sizeof(v), &written) == CUBLAS_STATUS_SUCCESS ? int(v)
                                                                                                          : -1;
}

}  // namespace

int main(int argc, char** argv) {
  const long M = argc > 1 ? std::atol(argv[1]) : 64;
  const long C = argc > 2 ? std::atol(argv[2]) : 2048, I = argc > 3 ? std::atol(argv[3]) : 8192;
  const long HD = argc > 4 ? std::atol(argv[4]) : 2048, KVD = argc > 5 ? std::atol(argv[5]) : 512;
  const long V = argc > 6 ? std::atol(argv[6]) : 128256;
  const Shape shapes[] = {{"q|k|v", HD + 2 * KVD, C, false, false},
                          {"o", C, HD, false, false},
                          {"gate|up", 2 * I, C, false, false},
                          {"down + residual", C, I, false, true},
                          {"down in 2 K-parts (batched, fp32)", C, I, true, false, 2},
                          {"down in 4 K-parts (batched, fp32)", C, I, true, false, 4},
                          {"down in 8 K-parts (batched, fp32)", C, I, true, false, 8},
                          {"lm-head (fp32 out)", V, C, true, false}};
  const size_t workspace_bytes = size_t(32) << 20;
  void* workspace;
  CK(cudaMalloc(&workspace, workspace_bytes));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasLtHandle_t lt;
  LK(cublasLtCreate(&lt));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf("M = %ld rows; weights cycled through copies so they come from HBM\n", M);

  for (const Shape& s : shapes) {
    const size_t wbytes = size_t(s.N) * s.K * 2;
    const int copies = int(std::max<size_t>(1, (size_t(256) << 20) / wbytes + 1));
    std::vector<__nv_bfloat16*> w(copies);
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&w[c], wbytes));
      fill<<<1024, 256, 0, stream>>>(w[c], size_t(s.N) * s.K, 17u + c);
    }
    __nv_bfloat16 *a, *cin;
    void* out;
    const size_t osize = s.f32_out ? 4 : 2;
    CK(cudaMalloc(&a, size_t(M) * s.K * 2));
    CK(cudaMalloc(&cin, size_t(M) * s.N * 2));
    CK(cudaMalloc(&out, size_t(M) * s.N * osize * s.parts));
    fill<<<256, 256, 0, stream>>>(a, size_t(M) * s.K, 3u);
    fill<<<256, 256, 0, stream>>>(cin, size_t(M) * s.N, 5u);

    // Library A = W (K x N column-major, transposed), library B = A (K x M), D (N x M).
    cublasLtMatmulDesc_t op;
    LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
    cublasLtMatrixLayout_t la, lb, lc, ld;
    const long kp = s.K / s.parts;  // each product's K; the rows keep their full length
    LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, kp, s.N, s.K));
    LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, kp, M, s.K));
    LK(cublasLtMatrixLayoutCreate(&lc, s.f32_out ? CUDA_R_32F : CUDA_R_16BF, s.N, M, s.N));
    LK(cublasLtMatrixLayoutCreate(&ld, s.f32_out ? CUDA_R_32F : CUDA_R_16BF, s.N, M, s.N));
    if (s.parts > 1) {
      const int32_t count = s.parts;
      const int64_t stride_k = kp, stride_c = int64_t(M) * s.N;
      for (cublasLtMatrixLayout_t l : {la, lb, lc, ld})
        LK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      for (cublasLtMatrixLayout_t l : {la, lb})
        LK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_k,
                                            sizeof(stride_k)));
      for (cublasLtMatrixLayout_t l : {lc, ld})
        LK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_c,
                                            sizeof(stride_c)));
    }
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    constexpr int kWant = 32;
    cublasLtMatmulHeuristicResult_t res[kWant];
    int found = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, ld, pref, kWant, res, &found));
    const float alpha = 1.0f, beta = s.residual ? 1.0f : 0.0f;
    const double bytes = double(wbytes) + double(M) * s.K * 2 + double(M) * s.N * osize * (s.residual ? 2 : s.parts);
    std::printf("\n%s: N %ld K %ld, %.1f MB a call, floor %.2f us at 4.8 TB/s; %d candidates\n", s.name, s.N, s.K,
                bytes / 1e6, bytes / 4.8e12 * 1e6, found);
    std::printf("  #  algo tile stages splitK red  cluster   us      TB/s\n");
    double first = 0, best = 1e30;
    int best_i = -1;
    for (int i = 0; i < found; ++i) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
      cudaGraph_t g;
      cudaGraphExec_t ge;
      bool ok = true;
      CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int r = 0; r < 20 && ok; ++r)
        ok = cublasLtMatmul(lt, op, &alpha, w[r % copies], la, a, lb, &beta, s.residual ? cin : out, lc, out, ld,
                            &res[i].algo, workspace, workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
      CK(cudaStreamEndCapture(stream, &g));
      if (!ok) {
        cudaGraphDestroy(g);
        std::printf("  %2d  (launch refused)\n", i);
        continue;
      }
      CK(cudaGraphInstantiate(&ge, g, 0));
      std::vector<float> ms;
      for (int rep = 0; rep < 9; ++rep) {
        CK(cudaEventRecord(e0, stream));
        CK(cudaGraphLaunch(ge, stream));
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        float x;
        CK(cudaEventElapsedTime(&x, e0, e1));
        if (rep >= 2) ms.push_back(x);
      }
      std::sort(ms.begin(), ms.end());
      const double us = ms[ms.size() / 2] * 1e3 / 20;
      const cublasLtMatmulAlgo_t& al = res[i].algo;
      std::printf("  %2d %5d %4d %6d %6d %3d %8d %7.2f %7.2f\n", i, attr(al, CUBLASLT_ALGO_CONFIG_ID),
                  attr(al, CUBLASLT_ALGO_CONFIG_TILE_ID), attr(al, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  attr(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), attr(al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                  attr(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), us, bytes / (us * 1e-6) / 1e12);
      if (i == 0) first = us;
      if (us < best) best = us, best_i = i;
      cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
    }
    std::printf("  heuristic's first %.2f us, fastest #%d %.2f us (%.0f%% of the first)\n", first, best_i, best,
                100.0 * best / first);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    for (auto* p : w) CK(cudaFree(p));
    CK(cudaFree(a));
    CK(cudaFree(cin));
    CK(cudaFree(out));
  }
  return 0;
}
