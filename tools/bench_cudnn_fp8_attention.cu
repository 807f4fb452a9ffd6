// bench_cudnn_fp8_attention.cu — cuDNN's fused attention with FP8 operands
// (e4m3, per-tensor scales) against bf16, forward and backward, at shardlm's
// training shapes: what decides whether FP8 attention pays in training.
//
//   make bench-cudnn-fp8-attention CUDNN_FRONTEND=/path/to/cudnn-frontend/include
//   build/bench_cudnn_fp8_attention [S ...]        default S: 4096 32768 131072
//
// The graphs come from NVIDIA's cudnn-frontend (header-only, MIT;
// github.com/NVIDIA/cudnn-frontend; not in Debian, so this tool is built only on
// request and shardlm itself writes its graphs against the backend API,
// src/cuda/sdpa_cudnn.cu). Each case is one document of S tokens (batch 1),
// causal, 32 query heads over 8 key/value heads, head dim 64 (the 1B shape) and
// 128 (the 8B shape), token-major (S, H, D) rows as shardlm keeps them. FP8:
// Q, K, V, O, dO and dQ, dK, dV in e4m3 with every scale 1 (the timing does not
// depend on the scale values); bf16: the same graphs in bf16. A graph cuDNN
// refuses is reported with cuDNN's reason. Times: the median of several
// executions, cudaEvent-timed; TFLOP/s with causal FLOPs (forward 2 S^2 H D,
// backward 2.5x that).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

// Values in [-1, 1) from a hash of the index, as bf16 or as e4m3 codes.
__device__ float hashed(int64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return static_cast<float>(x) / 4294967296.0f * 2.0f - 1.0f;
}
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(hashed(i, seed));
}
__global__ void fill_e4m3(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __nv_cvt_float_to_fp8(hashed(i, seed), __NV_SATFINITE, __NV_E4M3);
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill(void* p, int64_t n, bool fp8, uint32_t seed) {
  if (fp8) fill_e4m3<<<1024, 256>>>(static_cast<uint8_t*>(p), n, seed);
  else fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  CK(cudaGetLastError());
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;
using Pack = std::unordered_map<TensorPtr, void*>;

// One shape: (S, H, D) rows for q, o and their gradients, (S, KV, D) for k, v.
struct Shape {
  int64_t S, H, KV, D;
  std::vector<int64_t> q_dim() const { return {1, H, S, D}; }
  std::vector<int64_t> q_stride() const { return {S * H * D, D, H * D, 1}; }
  std::vector<int64_t> kv_dim() const { return {1, KV, S, D}; }
  std::vector<int64_t> kv_stride() const { return {S * KV * D, D, KV * D, 1}; }
  std::vector<int64_t> stats_dim() const { return {1, H, S, 1}; }
  std::vector<int64_t> stats_stride() const { return {H * S, S, 1, 1}; }
  double fwd_flops() const { return 2.0 * double(S) * double(S) * double(H) * double(D); }  // causal: half of 4 S^2 H D
};

// The graph's plan (heuristics mode A, the first that builds), or its refusal.
bool build(fe::graph::Graph& g, cudnnHandle_t handle, std::string* why) {
  auto check = [&](fe::error_object e, const char* step) {
    if (e.is_good()) return true;
    *why = std::string(step) + ": " + e.get_message();
    return false;
  };
  return check(g.validate(), "validate") && check(g.build_operation_graph(handle), "build_operation_graph") &&
         check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans") &&
         check(g.check_support(handle), "check_support") &&
         check(g.build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
}

// Median ms of `iters` executions (after one warm-up).
double time_graph(fe::graph::Graph& g, cudnnHandle_t handle, Pack& pack, int iters) {
  int64_t ws_bytes = 0;
  if (!g.get_workspace_size(ws_bytes).is_good()) return NAN;
  Buffer ws(static_cast<size_t>(ws_bytes));
  if (!g.execute(handle, pack, ws.p).is_good()) return NAN;
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a));
    if (!g.execute(handle, pack, ws.p).is_good()) return NAN;
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Result {
  double fwd_ms = NAN, bwd_ms = NAN;
  std::string fwd_why, bwd_why;
};

Result run_case(const Shape& s, bool fp8, cudnnHandle_t handle, int iters) {
  const fe::DataType_t io = fp8 ? fe::DataType_t::FP8_E4M3 : fe::DataType_t::BFLOAT16;
  const size_t esize = fp8 ? 1 : 2;
  const int64_t nq = s.S * s.H * s.D, nkv = s.S * s.KV * s.D;
  Buffer q(nq * esize), k(nkv * esize), v(nkv * esize), o(nq * esize), d_o(nq * esize), dq(nq * esize),
      dk(nkv * esize), dv(nkv * esize), stats(s.S * s.H * 4), scalars(32 * 4);
  fill(q.p, nq, fp8, 1);
  fill(k.p, nkv, fp8, 2);
  fill(v.p, nkv, fp8, 3);
  fill(d_o.p, nq, fp8, 4);
  const std::vector<float> ones(32, 1.0f);
  CK(cudaMemcpy(scalars.p, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
  float* scalar = static_cast<float*>(scalars.p);  // scalar + i: scale / descale i (1), or an amax out
  const float attn_scale = 1.0f / std::sqrt(float(s.D));
  Result r;

  auto declare = [&](fe::graph::Graph& g) {
    g.set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
  };
  auto tensor = [&](fe::graph::Graph& g, const char* name, std::vector<int64_t> dim, std::vector<int64_t> stride) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim(dim).set_stride(stride));
  };
  auto unit = [&](fe::graph::Graph& g, const char* name) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::FLOAT));
  };
  auto amax_out = [&](const TensorPtr& t) {
    t->set_output(true).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
  };

  // ---- forward (with the stats the backward reads)
  {
    fe::graph::Graph g;
    declare(g);
    auto Q = tensor(g, "Q", s.q_dim(), s.q_stride()), K = tensor(g, "K", s.kv_dim(), s.kv_stride()),
         V = tensor(g, "V", s.kv_dim(), s.kv_stride());
    Pack pack{{Q, q.p}, {K, k.p}, {V, v.p}};
    TensorPtr O, Stats;
    if (fp8) {
      auto dq_ = unit(g, "descale_q"), dk_ = unit(g, "descale_k"), dv_ = unit(g, "descale_v"), ds = unit(g, "descale_s"),
           ss = unit(g, "scale_s"), so = unit(g, "scale_o");
      auto opts = fe::graph::SDPA_fp8_attributes().set_name("sdpa_fp8").set_generate_stats(true).set_causal_mask(true)
                      .set_attn_scale(attn_scale);
      auto [o_, stats_, amax_s, amax_o] = g.sdpa_fp8(Q, K, V, dq_, dk_, dv_, ds, ss, so, opts);
      O = o_, Stats = stats_;
      amax_out(amax_s);
      amax_out(amax_o);
      int i = 0;
      for (const TensorPtr& t : {dq_, dk_, dv_, ds, ss, so}) pack[t] = scalar + i++;
      pack[amax_s] = scalar + 16;
      pack[amax_o] = scalar + 17;
    } else {
      auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_causal_mask(true)
                      .set_attn_scale(attn_scale);
      auto [o_, stats_] = g.sdpa(Q, K, V, opts);
      O = o_, Stats = stats_;
    }
    O->set_output(true).set_dim(s.q_dim()).set_stride(s.q_stride());
    Stats->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim(s.stats_dim()).set_stride(s.stats_stride());
    pack[O] = o.p;
    pack[Stats] = stats.p;
    if (build(g, handle, &r.fwd_why)) r.fwd_ms = time_graph(g, handle, pack, iters);
    if (std::isnan(r.fwd_ms) && r.fwd_why.empty()) r.fwd_why = "execute failed";
  }
  // ---- backward
  {
    fe::graph::Graph g;
    declare(g);
    auto Q = tensor(g, "Q", s.q_dim(), s.q_stride()), K = tensor(g, "K", s.kv_dim(), s.kv_stride()),
         V = tensor(g, "V", s.kv_dim(), s.kv_stride()), O = tensor(g, "O", s.q_dim(), s.q_stride()),
         dO = tensor(g, "dO", s.q_dim(), s.q_stride());
    auto Stats = g.tensor(fe::graph::Tensor_attributes().set_name("stats").set_dim(s.stats_dim())
                              .set_stride(s.stats_stride()).set_data_type(fe::DataType_t::FLOAT));
    Pack pack{{Q, q.p}, {K, k.p}, {V, v.p}, {O, o.p}, {dO, d_o.p}, {Stats, stats.p}};
    TensorPtr dQ, dK, dV;
    if (fp8) {
      std::vector<TensorPtr> s_;
      for (const char* n : {"descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp",
                            "scale_s", "scale_dq", "scale_dk", "scale_dv", "scale_dp"})
        s_.push_back(unit(g, n));
      auto opts = fe::graph::SDPA_fp8_backward_attributes().set_name("sdpa_fp8_backward").set_causal_mask(true)
                      .set_attn_scale(attn_scale);
      auto [dq_, dk_, dv_, amax_dq, amax_dk, amax_dv, amax_dp] = g.sdpa_fp8_backward(
          Q, K, V, O, dO, Stats, s_[0], s_[1], s_[2], s_[3], s_[4], s_[5], s_[6], s_[7], s_[8], s_[9], s_[10], s_[11],
          opts);
      dQ = dq_, dK = dk_, dV = dv_;
      int i = 0;
      for (const TensorPtr& t : s_) pack[t] = scalar + i++;
      i = 16;
      for (const TensorPtr& t : {amax_dq, amax_dk, amax_dv, amax_dp}) amax_out(t), pack[t] = scalar + i++;
    } else {
      auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_causal_mask(true)
                      .set_attn_scale(attn_scale);
      auto [dq_, dk_, dv_] = g.sdpa_backward(Q, K, V, O, dO, Stats, opts);
      dQ = dq_, dK = dk_, dV = dv_;
    }
    dQ->set_output(true).set_dim(s.q_dim()).set_stride(s.q_stride());
    dK->set_output(true).set_dim(s.kv_dim()).set_stride(s.kv_stride());
    dV->set_output(true).set_dim(s.kv_dim()).set_stride(s.kv_stride());
    pack[dQ] = dq.p;
    pack[dK] = dk.p;
    pack[dV] = dv.p;
    if (build(g, handle, &r.bwd_why)) r.bwd_ms = time_graph(g, handle, pack, iters);
    if (std::isnan(r.bwd_ms) && r.bwd_why.empty()) r.bwd_why = "execute failed";
  }
  return r;
}

std::string cell(double ms, double flops, const std::string& why) {
  if (std::isnan(ms)) return "refused (" + why + ")";
  char b[96];
  std::snprintf(b, sizeof b, "%9.3f ms %6.0f TFLOP/s", ms, flops / (ms * 1e-3) / 1e12);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> lengths;
  for (int i = 1; i < argc; ++i) lengths.push_back(std::atoll(argv[i]));
  if (lengths.empty()) lengths = {4096, 32768, 131072};
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) {
    std::fprintf(stderr, "cudnnCreate failed\n");
    return 1;
  }
  const size_t v = cudnnGetVersion();
  std::printf("%s, cuDNN %zu.%zu.%zu, cudnn-frontend %d.%d.%d; batch 1, causal, 32 q heads / 8 kv heads\n", prop.name,
              v / 10000, v / 100 % 100, v % 100, CUDNN_FRONTEND_MAJOR_VERSION, CUDNN_FRONTEND_MINOR_VERSION,
              CUDNN_FRONTEND_PATCH_VERSION);
  for (const int64_t D : {64, 128}) {
    for (const int64_t S : lengths) {
      const Shape s{S, 32, 8, D};
      const int iters = S >= 131072 ? 3 : S >= 32768 ? 5 : 20;
      const Result bf = run_case(s, false, handle, iters), f8 = run_case(s, true, handle, iters);
      const double f = s.fwd_flops();
      std::printf("D %3lld S %6lld  forward   bf16 %s | fp8 %s", (long long)D, (long long)S, cell(bf.fwd_ms, f, bf.fwd_why).c_str(),
                  cell(f8.fwd_ms, f, f8.fwd_why).c_str());
      if (!std::isnan(bf.fwd_ms) && !std::isnan(f8.fwd_ms)) std::printf(" | fp8 %.2fx", bf.fwd_ms / f8.fwd_ms);
      std::printf("\nD %3lld S %6lld  backward  bf16 %s | fp8 %s", (long long)D, (long long)S,
                  cell(bf.bwd_ms, 2.5 * f, bf.bwd_why).c_str(), cell(f8.bwd_ms, 2.5 * f, f8.bwd_why).c_str());
      if (!std::isnan(bf.bwd_ms) && !std::isnan(f8.bwd_ms)) std::printf(" | fp8 %.2fx", bf.bwd_ms / f8.bwd_ms);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  cudnnDestroy(handle);
  return 0;
}
