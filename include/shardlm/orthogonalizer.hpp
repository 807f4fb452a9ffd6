// orthogonalizer.hpp — the interface Muon's step calls for Newton–Schulz on a
// device: train/muon.hpp's MuonStep drives it, cuda/newton_schulz.hpp implements
// it. Declared here, below both, so that the CUDA kernels know nothing of the
// optimizer. Must not know: MPI, the deck, the model.
#pragma once

#include <cstdint>

namespace shardlm {

// Keller Jordan's quintic: X <- a X + b (X X^T) X + c (X X^T)^2 X. Five steps take
// every singular value of a Frobenius-normalised matrix in [0.01, 1] into
// [0.6818, 1.1344] (see kNsBand*): not exactly 1, but fast to reach and enough.
constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f;
constexpr double kNsBandLow = 0.68, kNsBandHigh = 1.14;  // 5 steps, input sigma/||G||_F in [0.01, 1]
constexpr float kNsEps = 1e-7f;                         // X = G / (||G||_F + eps)

// What MuonStep calls in place of the host newton_schulz: the CUDA backend's bf16
// one on the owner's GPU (cuda/newton_schulz.hpp). Same contract: out (rows, cols)
// <- `steps` quintic iterations on G / (||G||_F + kNsEps), fp32 row-major in host
// memory, out may alias G; the matrix must fit the capacity it was made for.
class Orthogonalizer {
 public:
  virtual ~Orthogonalizer() = default;
  virtual const char* name() const = 0;
  virtual void orthogonalize(float* out, const float* G, int64_t rows, int64_t cols, int steps) = 0;
};

// The largest matrix (elements) and the largest Gram side (min(rows, cols)) an
// orthogonaliser must take: what it sizes its buffers from, once.
struct NsCapacity {
  int64_t numel = 0;
  int64_t gram_side = 0;
};
// What an orthogonaliser of some capacity holds beyond MuonStep's host buffers.
struct NsWorkspaceBytes {
  int64_t device = 0;       // counted in device_memory()
  int64_t pinned_host = 0;  // counted in host_memory()
};

}  // namespace shardlm
