// newton_schulz.hpp — Muon's Newton–Schulz in bf16 on the GPU, as host code
// sees it: a factory for shardlm/orthogonalizer.hpp's Orthogonalizer and the bytes it holds.
//
// Owns: the GPU orthogonaliser (src/cuda/newton_schulz.cu) — its device buffers,
// stream, cuBLASLt plans and pinned staging — and the tolerances its tests hold it
// to against the host fp32 newton_schulz. No CUDA types: TrainSession (train.hpp),
// the memory plan (optim.cpp) and the doctest GPU suite include it; a CPU-only
// build links src/no_cuda.cpp, whose factory fails with a message and whose
// byte counts are 0.
// Must not know: MPI, the exchange, the deck, the model (MuonStep hands it whole
// matrices and says how large they get).
//
// The math is newton_schulz()'s (muon.cpp): X = G / (||G||_F + kNsEps) with the sum
// of squares in double on the device, then `steps` quintic iterations with the
// Gram matrix on the smaller side (A = X^T X when rows > cols). Matrix operands are
// bf16 with fp32 accumulation (cuBLASLt, CUBLAS_COMPUTE_32F, one cached plan per
// shape); X, A and b A + c A^2 are kept in bf16 between the products, as Keller
// Jordan's reference does: an fp32 X would take a cast per product and fp32
// outputs, for an update whose singular values only need to land in a band
// ([0.68, 1.14]) far wider than bf16's 2^-9 rounding. The output is X's bf16
// values widened to fp32 (exact).
//
// One call: G goes host -> pinned staging -> device in chunks (the host copy of a
// chunk overlaps the DMA of the previous one), the iterations run on the
// orthogonaliser's own stream, X comes back as bf16 (half the bytes) through the
// same staging and is widened into `out`; the call returns when `out` is written,
// so its time lands in the step's optimizer_s. Nothing is allocated per call.
#pragma once

#include <cstdint>
#include <memory>

#include "shardlm/orthogonalizer.hpp"

namespace shardlm {

// ||gpu - ref|| / ||ref|| against the host fp32 newton_schulz, on Gaussian
// matrices. A CPU emulation of the bf16 roundings (each product's operands and
// output rounded to bf16, fp32 sums) measured 1.7e-3 (0 steps: X's rounding
// alone), 2.4e-3 (1 step) and 0.9e-2 .. 1.6e-2 (5 steps) over the 1B shapes and
// 37x91 / 91x37; the bounds leave about 2x. An indexing or transpose error is O(1).
constexpr double kNsBf16Tol0 = 4e-3, kNsBf16Tol1 = 5e-3, kNsBf16Tol5 = 3e-2;
// The fp32 iteration already lands on the band's edges (singular values down to
// 0.6819, kNsBandLow = 0.68); bf16 moves them by up to 0.004 (emulated: 0.678 ..
// 1.139 on matrices 24x64 .. 176x64). The GPU's singular values are held to
// [kNsBandLow - slack, kNsBandHigh + slack], and each to p^5(sigma / ||G||_F)
// within kNsBf16SigmaTol (emulated worst 1.7e-2 over 20 seeds of 24x64 and 64x24).
constexpr double kNsBf16BandSlack = 0.01, kNsBf16SigmaTol = 3e-2;

// What make_cuda_orthogonalizer(capacity) allocates, as Mem::Workspace. Device: the
// fp32 input (which also holds the next X in bf16 once the input is consumed), X
// in bf16, the Gram matrix and its polynomial in bf16, the cuBLASLt workspace and
// the norm's scratch. Pinned host: two staging chunks of at most 4 Mi floats.
// Zeros for an empty capacity (a rank that owns no matrix) and in a CPU-only build.
NsWorkspaceBytes cuda_newton_schulz_bytes(const NsCapacity& capacity);

// An orthogonaliser on the current CUDA device for matrices up to `capacity`;
// orthogonalize() throws for a larger one. Its name() is "cuda bf16".
std::unique_ptr<Orthogonalizer> make_cuda_orthogonalizer(const NsCapacity& capacity);

}  // namespace shardlm
