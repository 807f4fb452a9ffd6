// gemm.cu — cuBLASLt GEMMs with row-major semantics and cached plans; the linear
// layer. See src/cuda/gemm.hpp.
#include "cuda/gemm.hpp"

#include <algorithm>
#include <cstring>

namespace shardlm::cuda {

uint32_t alignment_of(const void* p) {
  if (p == nullptr) return 256;
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

namespace {

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

template <class T>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value) {
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

}  // namespace

Gemm::Gemm(cudaStream_t stream, void* workspace, size_t workspace_bytes)
    : stream_(stream), workspace_(workspace), workspace_bytes_(workspace ? workspace_bytes : 0) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
}

Gemm::~Gemm() {
  // Destructors must not throw: statuses are ignored here.
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (handle_) cublasLtDestroy(handle_);
}

// cuBLASLt is column-major. The row-major C (M, N) is the column-major C^T (N, M)
// = op(B)^T op(A)^T, so the library's "A" is our B and its "B" is our A, with
// m = N, n = M, k = K; a row-major matrix with row stride ld is the column-major
// transpose with leading dimension ld, which is why no data moves.
Gemm::Plan& Gemm::plan(const Key& key, const void* bias) {
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;

  Plan p;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_lib_a = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_lib_b = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(p.op, CUBLASLT_MATMUL_DESC_TRANSA, op_lib_a);
  set_desc(p.op, CUBLASLT_MATMUL_DESC_TRANSB, op_lib_b);
  if (key.bias) {
    // Bias per row of the library's D (m = N rows): one value per output feature.
    set_desc(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, int32_t(CUDA_R_16BF));
    set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);  // the heuristic reads its alignment
  }
  // Library A = our B: stored (K, N) row-major = (N x K) column-major, or (N, K) when
  // trans_b = (K x N) column-major, transposed by the op.
  if (key.trans_b)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, key.K, key.N, key.ldb));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, key.N, key.K, key.ldb));
  if (key.trans_a)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, key.M, key.K, key.lda));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, key.K, key.M, key.lda));
  const cudaDataType_t ctype = key.out == GemmOut::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, ctype, key.N, key.M, key.ldc));
  if (key.batch > 1) {
    const auto batched = [&](cublasLtMatrixLayout_t l, int64_t stride) {
      const int32_t count = key.batch;
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                    sizeof(stride)));
    };
    batched(p.a, key.stride_b);  // library A = our B
    batched(p.b, key.stride_a);
    batched(p.c, key.stride_c);
  }

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  try {
    set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(workspace_bytes_));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found));
  } catch (...) {
    cublasLtMatmulPreferenceDestroy(pref);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  SHARDLM_CHECK(found > 0 && result.state == CUBLAS_STATUS_SUCCESS,
                "cuBLASLt has no algorithm for C(%lld, %lld) = op(A) op(B), K = %lld, "
                "trans_a %d trans_b %d, lda %lld ldb %lld ldc %lld, %s output%s",
                static_cast<long long>(key.M), static_cast<long long>(key.N),
                static_cast<long long>(key.K), int(key.trans_a), int(key.trans_b),
                static_cast<long long>(key.lda), static_cast<long long>(key.ldb),
                static_cast<long long>(key.ldc), key.out == GemmOut::BF16 ? "bf16" : "fp32",
                key.bias ? " with bias" : "");
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void Gemm::matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                  int64_t lda, const bf16* B, int64_t ldb, void* C, int64_t ldc, GemmOut out,
                  float alpha, float beta, const bf16* bias, const void* C_in) {
  SHARDLM_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M %lld N %lld K %lld",
                static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K));
  SHARDLM_CHECK(lda >= std::max<int64_t>(1, trans_a ? M : K), "gemm: lda %lld too small",
                static_cast<long long>(lda));
  SHARDLM_CHECK(ldb >= std::max<int64_t>(1, trans_b ? K : N), "gemm: ldb %lld too small",
                static_cast<long long>(ldb));
  SHARDLM_CHECK(ldc >= std::max<int64_t>(1, N), "gemm: ldc %lld too small",
                static_cast<long long>(ldc));
  SHARDLM_CHECK(bias == nullptr || out == GemmOut::BF16,
                "gemm: the bias epilogue is only used with a bf16 output");
  if (M == 0 || N == 0) return;
  const size_t esize = out == GemmOut::BF16 ? sizeof(bf16) : sizeof(float);
  if (C_in == nullptr || beta == 0.0f) C_in = C;
  if (K == 0) {  // C = beta C: only the cases training meets
    SHARDLM_CHECK(bias == nullptr && (beta == 0.0f || beta == 1.0f) && C_in == C,
                  "gemm: K = 0 supports only beta 0 or 1 without bias or a separate C_in");
    if (beta == 0.0f)
      CUDA_CHECK(cudaMemset2DAsync(C, size_t(ldc) * esize, 0, size_t(N) * esize, size_t(M), stream_));
    return;
  }
  const Key key{trans_a, trans_b, M, N, K, lda, ldb, ldc, out, bias != nullptr,
                alignment_of(A), alignment_of(B), std::min(alignment_of(C), alignment_of(C_in)),
                alignment_of(bias)};
  Plan& p = plan(key, bias);
  if (bias) set_desc(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, B, p.a, A, p.b, &beta, C_in, p.c, C, p.c,
                              &p.algo, workspace_, workspace_bytes_, stream_));
}

void Gemm::matmul_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const bf16* A,
                          int64_t lda, int64_t stride_a, const bf16* B, int64_t ldb, int64_t stride_b, void* C,
                          int64_t ldc, int64_t stride_c, int batch, GemmOut out) {
  SHARDLM_CHECK(M > 0 && N > 0 && K > 0 && batch >= 1 && lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) &&
                    ldc >= N && stride_c >= ldc * (M - 1) + N,
                "gemm: bad batched sizes M %lld N %lld K %lld lda %lld ldb %lld ldc %lld, %d products %lld apart",
                static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                static_cast<long long>(lda), static_cast<long long>(ldb), static_cast<long long>(ldc), batch,
                static_cast<long long>(stride_c));
  Key key{trans_a, trans_b, M, N, K, lda, ldb, ldc, out, false,
          alignment_of(A), alignment_of(B), alignment_of(C), alignment_of(nullptr)};
  key.batch = batch, key.stride_a = stride_a, key.stride_b = stride_b, key.stride_c = stride_c;
  // Every product's operands must keep the alignment the plan was asked for.
  const size_t esize = out == GemmOut::BF16 ? sizeof(bf16) : sizeof(float);
  key.align_a = std::min(key.align_a, alignment_of(reinterpret_cast<const void*>(stride_a * sizeof(bf16))));
  key.align_b = std::min(key.align_b, alignment_of(reinterpret_cast<const void*>(stride_b * sizeof(bf16))));
  key.align_c = std::min(key.align_c, alignment_of(reinterpret_cast<const void*>(stride_c * esize)));
  const float alpha = 1.0f, beta = 0.0f;
  Plan& p = plan(key, nullptr);
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, B, p.a, A, p.b, &beta, C, p.c, C, p.c, &p.algo, workspace_,
                              workspace_bytes_, stream_));
}

void linear_forward(Gemm& gemm, bf16* out, const bf16* inp, const bf16* weight,
                    const bf16* bias, int64_t N, int64_t IC, int64_t OC, const bf16* residual) {
  // out (N, OC) = inp (N, IC) @ weight (OC, IC)^T + bias [+ residual]
  gemm.matmul(false, true, N, OC, IC, inp, IC, weight, IC, out, OC, GemmOut::BF16, 1.0f,
              residual ? 1.0f : 0.0f, bias, residual);
}

size_t linear_backward_scratch_bytes(int64_t N, int64_t OC) { return bias_grad_scratch_bytes(N, OC); }

void linear_backward(Gemm& gemm, bf16* dinp, float* dweight, float* dbias, const bf16* dout,
                     const bf16* inp, const bf16* weight, int64_t N, int64_t IC, int64_t OC,
                     void* scratch, size_t scratch_bytes, Dinp dinp_mode) {
  // dinp (N, IC) [+]= dout (N, OC) @ weight (OC, IC)
  if (dinp != nullptr)
    gemm.matmul(false, false, N, IC, OC, dout, OC, weight, IC, dinp, IC, GemmOut::BF16, 1.0f,
                dinp_mode == Dinp::Accumulate ? 1.0f : 0.0f);
  // dweight (OC, IC) += dout^T (OC, N) @ inp (N, IC): the sum over tokens is GEMM's K,
  // accumulated in fp32 straight into the fp32 gradient buffer.
  gemm.matmul(true, false, OC, IC, N, dout, OC, inp, IC, dweight, IC, GemmOut::F32, 1.0f, 1.0f);
  if (dbias != nullptr) bias_grad(dbias, dout, N, OC, scratch, scratch_bytes, gemm.stream());
}

}  // namespace shardlm::cuda
