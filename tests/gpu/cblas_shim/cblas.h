// cblas.h (GPU test shim) — the two CBLAS entry points src/cpu/ops.cpp calls, so the
// GPU test binary links the CPU reference kernels without any BLAS library (the GPU
// machine may have none). Found before the system <cblas.h> through
// -Itests/gpu/cblas_shim; implemented as plain loops in tests/gpu/test_cuda_ops.cu.
// Only the GPU test uses this: the real build links OpenBLAS.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };
typedef enum CBLAS_ORDER CBLAS_ORDER;
typedef enum CBLAS_TRANSPOSE CBLAS_TRANSPOSE;

void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int M,
                 int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc);
void cblas_dgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int M,
                 int N, int K, double alpha, const double* A, int lda, const double* B,
                 int ldb, double beta, double* C, int ldc);

#ifdef __cplusplus
}
#endif
