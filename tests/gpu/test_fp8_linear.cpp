// test_fp8_linear.cpp — model.fp8's projection on the GPU (cuda::Fp8Linear,
// cuBLASLt FP8) against the CPU emulation (cpu::Fp8Linear) on the same
// bf16-exact inputs: forward, dinp, dweight and dbias, both modes, and bitwise
// reruns (build/test_gpu, run by `make test-gpu`; `build/test_gpu -tc='fp8 linear*' -s`).
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/fp8_linear.hpp"
#include "cuda/fp8_linear.hpp"
#include "cuda/gemm.hpp"
#include "cuda/ops.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"

using namespace shardlm;

namespace {

#define TEST_CUDA(call) REQUIRE((call) == cudaSuccess)

// n values of magnitudes over several binades, rounded to bf16 (what both sides read).
std::vector<float> bf16_values(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-6, 3);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16_rne(std::ldexp(u(gen), e(gen))));
  return v;
}

// A device copy of host values as bf16 (T = uint16_t) or fp32; freed at scope end.
template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceArray(size_t count) : n(count) {
    TEST_CUDA(cudaMalloc(&ptr, n * sizeof(T)));
    TEST_CUDA(cudaMemset(ptr, 0, n * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<float>& host) : DeviceArray(host.size()) {
    std::vector<T> tmp(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (sizeof(T) == 2) tmp[i] = f32_to_bf16_rne(host[i]);
      else tmp[i] = host[i];
    }
    TEST_CUDA(cudaMemcpy(ptr, tmp.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<float> host() const {
    std::vector<T> tmp(n);
    REQUIRE(cudaMemcpy(tmp.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (sizeof(T) == 2) out[i] = bf16_to_f32(tmp[i]);
      else out[i] = tmp[i];
    }
    return out;
  }
  cuda::bf16* bf() const { return reinterpret_cast<cuda::bf16*>(ptr); }
};

// max |got - want| / max |want|.
double rel_max(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(double(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return err / scale;
}

}  // namespace

TEST_SUITE("gpu") {

// model.fp8_weight_cache: a weight's codes made once per parameter version give
// the uncached GEMMs' bits; while the version holds they are reused (shown by
// changing the weight behind the cache's back), and a new version remakes them.
TEST_CASE("fp8 linear: the weight cache gives the uncached bits and is kept until the parameters' version changes") {
  REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
  cuda_set_device(0);
  const int64_t N = 256, IC = 192, OC = 128;  // OC x IC: the gate and up weights' shape below
  ModelConfig c;
  c.hidden_size = IC, c.intermediate_size = OC, c.num_heads = 1, c.num_kv_heads = 1, c.head_dim = 16;
  c.num_layers = 2;
  const int slot = 1 * cuda::Fp8Linear::kWeights + cuda::Fp8Linear::Up;  // layer 1's up projection
  const std::vector<float> x = bf16_values(N * IC, 11), w = bf16_values(OC * IC, 12), w2 = bf16_values(OC * IC, 13);
  const std::vector<float> dy = bf16_values(N * OC, 14), dw0(size_t(OC * IC), 0.0f);
  cudaStream_t stream = nullptr;
  TEST_CUDA(cudaStreamCreate(&stream));
  const size_t workspace_bytes = size_t(32) << 20;
  DeviceArray<uint8_t> workspace(workspace_bytes);
  const cuda::Fp8Linear::Sizes s = cuda::Fp8Linear::sizes(c, N, /*cache=*/true);
  CHECK(s.cache_code_bytes >= 2 * c.num_layers * (4 * 16 * 192 + 2 * 128 * 192 + 192 * 128));
  DeviceArray<uint8_t> a_codes(size_t(s.a_code_bytes)), b_codes(size_t(s.b_code_bytes)), x_codes(size_t(s.x_code_bytes));
  DeviceArray<float> a_scales(size_t(3 * s.scale_count)), b_scales(size_t(3 * s.scale_count)),
      x_scales(size_t(3 * s.scale_count));
  DeviceArray<uint8_t> cache_codes(size_t(s.cache_code_bytes));
  DeviceArray<float> cache_scales(size_t(s.cache_scale_count));
  const size_t bias_scratch_bytes = cuda::bias_grad_scratch_bytes(N, OC);
  DeviceArray<uint8_t> bias_scratch(bias_scratch_bytes);
  const DeviceArray<uint16_t> d_x(x), d_dy(dy);
  DeviceArray<uint16_t> d_w(w);
  const DeviceArray<uint16_t> d_w2(w2);
  for (Fp8Mode mode : {Fp8Mode::Tensorwise, Fp8Mode::Rowwise}) {
    CAPTURE(fp8_mode_name(mode));
    const cuda::Fp8Linear::Buffers plain_buffers{a_codes.ptr, b_codes.ptr, a_scales.ptr, b_scales.ptr, x_codes.ptr,
                                                 x_scales.ptr};
    cuda::Fp8Linear::Buffers cached_buffers = plain_buffers;
    cached_buffers.cache_codes = cache_codes.ptr, cached_buffers.cache_scales = cache_scales.ptr;
    cuda::Fp8Linear plain(mode, plain_buffers, stream, workspace.ptr, workspace_bytes);
    cuda::Fp8Linear cached(mode, cached_buffers, stream, workspace.ptr, workspace_bytes, c, c.num_layers);
    cached.set_params_version(0);
    auto forward = [&](cuda::Fp8Linear& f, const DeviceArray<uint16_t>& weight, int sl) {
      DeviceArray<uint16_t> y(size_t(N * OC));
      f.forward(y.bf(), OC, d_x.bf(), weight.bf(), nullptr, N, IC, OC, nullptr, false, sl);
      TEST_CUDA(cudaStreamSynchronize(stream));
      return y.host();
    };
    auto dinp = [&](cuda::Fp8Linear& f, const DeviceArray<uint16_t>& weight, int sl) {
      DeviceArray<uint16_t> dx(size_t(N * IC));
      DeviceArray<float> dw(dw0);
      f.backward(dx.bf(), false, dw.ptr, nullptr, d_dy.bf(), OC, d_x.bf(), weight.bf(), N, IC, OC, bias_scratch.ptr,
                 bias_scratch_bytes, false, sl);
      TEST_CUDA(cudaStreamSynchronize(stream));
      return dx.host();
    };
    const std::vector<float> y = forward(plain, d_w, -1), dx = dinp(plain, d_w, -1);
    CHECK(forward(cached, d_w, slot) == y);  // made now
    CHECK(forward(cached, d_w, slot) == y);  // from the cache
    CHECK(dinp(cached, d_w, slot) == dx);
    CHECK(dinp(cached, d_w, slot) == dx);
    // Another weight at the same version: the cache still answers with w's codes.
    const std::vector<float> y2 = forward(plain, d_w2, -1), dx2 = dinp(plain, d_w2, -1);
    CHECK(y2 != y);
    CHECK(forward(cached, d_w2, slot) == y);
    CHECK(dinp(cached, d_w2, slot) == dx);
    // A new version: remade from the weight given.
    cached.set_params_version(1);
    CHECK(forward(cached, d_w2, slot) == y2);
    CHECK(dinp(cached, d_w2, slot) == dx2);
    cached.set_params_version(1);  // the same version again: kept
    CHECK(forward(cached, d_w, slot) == y2);
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("fp8 linear: cuBLASLt FP8 forward and backward equal the CPU emulation to bf16 / fp32 rounding") {
  REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
  cuda_set_device(0);
  const int64_t N = 256, IC = 192, OC = 128;
  ModelConfig c;
  c.hidden_size = IC, c.intermediate_size = OC, c.num_heads = 1, c.num_kv_heads = 1, c.head_dim = 16;
  const std::vector<float> x = bf16_values(N * IC, 1), w = bf16_values(OC * IC, 2), dy = bf16_values(N * OC, 3);
  const std::vector<float> bias = bf16_values(OC, 4);
  const std::vector<float> dw0(size_t(OC * IC), 0.25f), db0(size_t(OC), 0.5f);  // += targets start non-zero

  cudaStream_t stream = nullptr;
  TEST_CUDA(cudaStreamCreate(&stream));
  const size_t workspace_bytes = size_t(32) << 20;
  DeviceArray<uint8_t> workspace(workspace_bytes);
  const cuda::Fp8Linear::Sizes s = cuda::Fp8Linear::sizes(c, N);
  DeviceArray<uint8_t> a_codes(size_t(s.a_code_bytes)), b_codes(size_t(s.b_code_bytes)), x_codes(size_t(s.x_code_bytes));
  DeviceArray<float> a_scales(size_t(3 * s.scale_count)), b_scales(size_t(3 * s.scale_count)),
      x_scales(size_t(3 * s.scale_count));
  const size_t bias_scratch_bytes = cuda::bias_grad_scratch_bytes(N, OC);
  DeviceArray<uint8_t> bias_scratch(bias_scratch_bytes);
  const DeviceArray<uint16_t> d_x(x), d_w(w), d_dy(dy), d_bias(bias);

  for (Fp8Mode mode : {Fp8Mode::Tensorwise, Fp8Mode::Rowwise}) {
    const std::string name = fp8_mode_name(mode);
    CAPTURE(name);
    cpu::Fp8Linear ref(mode);
    std::vector<cpu::BufferRow> rows;
    ref.add_rows(c, N, rows);
    cpu::allocate_rows(rows);
    std::vector<float> y(size_t(N * OC)), dx(size_t(N * IC)), dw = dw0, db = db0;
    ref.forward(y.data(), x.data(), w.data(), bias.data(), N, IC, OC);
    ref.backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), N, IC, OC);

    cuda::Fp8Linear gpu(mode, {a_codes.ptr, b_codes.ptr, a_scales.ptr, b_scales.ptr, x_codes.ptr, x_scales.ptr},
                        stream, workspace.ptr, workspace_bytes);
    DeviceArray<uint16_t> g_y(size_t(N * OC)), g_y2(size_t(N * OC)), g_dx(size_t(N * IC));
    DeviceArray<float> g_dw(dw0), g_db(db0);
    gpu.forward(g_y.bf(), OC, d_x.bf(), d_w.bf(), d_bias.bf(), N, IC, OC);
    gpu.forward(g_y2.bf(), OC, d_x.bf(), d_w.bf(), d_bias.bf(), N, IC, OC);
    gpu.backward(g_dx.bf(), false, g_dw.ptr, g_db.ptr, d_dy.bf(), OC, d_x.bf(), d_w.bf(), N, IC, OC, bias_scratch.ptr,
                 bias_scratch_bytes);
    TEST_CUDA(cudaStreamSynchronize(stream));

    // The codes and scales are equal (the kernels are the emulation's bit for bit,
    // tests/gpu/test_fp8.cu); what differs is the accumulation order and the bf16 output.
    const double e_y = rel_max(g_y.host(), y), e_dx = rel_max(g_dx.host(), dx);
    std::vector<float> gpu_dw = g_dw.host(), gpu_db = g_db.host();
    for (size_t i = 0; i < gpu_dw.size(); ++i) gpu_dw[i] -= dw0[i], dw[i] -= dw0[i];  // the accumulated part
    for (size_t i = 0; i < gpu_db.size(); ++i) gpu_db[i] -= db0[i], db[i] -= db0[i];
    const double e_dw = rel_max(gpu_dw, dw), e_db = rel_max(gpu_db, db);
    MESSAGE(name << ": relative error y " << e_y << ", dinp " << e_dx << ", dweight " << e_dw << ", dbias " << e_db);
    CHECK(e_y < 1e-2);   // bf16 output: 2^-9 relative, plus accumulation order
    CHECK(e_dx < 1e-2);
    CHECK(e_dw < 1e-3);  // fp32 out: Hopper's FP8 MMA adds with ~14 bits (test_fp8.cu); 4.1e-4 to 4.7e-4 measured
    CHECK(e_db < 1e-5);
    CHECK(g_y.host() == g_y2.host());  // deterministic

    if (mode == Fp8Mode::Tensorwise) {
      // dout's plain and transposed codes from one read (t_codes, the default
      // where there is room): the same codes, so dinp and dweight bit for bit.
      const cuda::Fp8Linear::Sizes s1 = cuda::Fp8Linear::sizes(c, N, false, /*one_pass=*/true);
      REQUIRE(s1.t_code_bytes == s.a_code_bytes);
      DeviceArray<uint8_t> t_codes(size_t(s1.t_code_bytes));
      cuda::Fp8Linear one(mode, {a_codes.ptr, b_codes.ptr, a_scales.ptr, b_scales.ptr, x_codes.ptr, x_scales.ptr,
                                 t_codes.ptr},
                          stream, workspace.ptr, workspace_bytes);
      DeviceArray<uint16_t> o_dx(size_t(N * IC));
      DeviceArray<float> o_dw(dw0), o_db(db0);
      one.backward(o_dx.bf(), false, o_dw.ptr, o_db.ptr, d_dy.bf(), OC, d_x.bf(), d_w.bf(), N, IC, OC,
                   bias_scratch.ptr, bias_scratch_bytes);
      TEST_CUDA(cudaStreamSynchronize(stream));
      CHECK(o_dx.host() == g_dx.host());
      CHECK(o_dw.host() == g_dw.host());
      CHECK(o_db.host() == g_db.host());
    }

    // The accumulating forms (beta = 1 onto a bf16 C): the down projection's
    // residual, and k's and v's dinp added to q's.
    std::vector<float> y_plain(size_t(N * OC));
    ref.forward(y_plain.data(), x.data(), w.data(), nullptr, N, IC, OC);
    const std::vector<float> residual = bf16_values(N * OC, 5), dx_before = bf16_values(N * IC, 6);
    DeviceArray<uint16_t> g_res(residual), g_dx_acc(dx_before);
    DeviceArray<float> g_dw2(dw0);
    gpu.forward(g_res.bf(), OC, d_x.bf(), d_w.bf(), nullptr, N, IC, OC, /*residual=*/g_res.bf());
    gpu.backward(g_dx_acc.bf(), /*accumulate_dinp=*/true, g_dw2.ptr, nullptr, d_dy.bf(), OC, d_x.bf(), d_w.bf(), N, IC,
                 OC, bias_scratch.ptr, bias_scratch_bytes);
    TEST_CUDA(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < y_plain.size(); ++i) y_plain[i] += residual[i];
    std::vector<float> dx_sum = dx;
    for (size_t i = 0; i < dx_sum.size(); ++i) dx_sum[i] += dx_before[i];
    const double e_res = rel_max(g_res.host(), y_plain), e_acc = rel_max(g_dx_acc.host(), dx_sum);
    MESSAGE(name << ": relative error y + residual " << e_res << ", dinp accumulated " << e_acc);
    CHECK(e_res < 1e-2);
    CHECK(e_acc < 1e-2);

    // The same results, bit for bit, by the shortcuts the backend takes: the
    // input's codes reused (same_input, forward and backward: q, k, v; gate,
    // up); dout read in place as a column block of a wider matrix (dgate, dup
    // inside dgate|dup). The residual read from another buffer (the GEMM's C_in,
    // the down projection's x_mid) is cuBLASLt's out-of-place epilogue, another
    // kernel than the in-place one (measured: not bit-equal): the reference's
    // tolerance, and deterministic.
    const DeviceArray<uint16_t> g_res_src(residual);
    DeviceArray<uint16_t> g_res2(size_t(N * OC)), g_res3(size_t(N * OC)), g_y3(size_t(N * OC));
    gpu.forward(g_res2.bf(), OC, d_x.bf(), d_w.bf(), nullptr, N, IC, OC, /*residual=*/g_res_src.bf());
    gpu.forward(g_res3.bf(), OC, d_x.bf(), d_w.bf(), nullptr, N, IC, OC, /*residual=*/g_res_src.bf());
    gpu.forward(g_y3.bf(), OC, d_x.bf(), d_w.bf(), d_bias.bf(), N, IC, OC, nullptr, /*same_input=*/true);
    std::vector<float> wide_dy(size_t(N * 2 * OC), 0.0f);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < OC; ++j) wide_dy[size_t(r * 2 * OC + OC + j)] = dy[size_t(r * OC + j)];
    const DeviceArray<uint16_t> d_wide_dy(wide_dy);
    DeviceArray<uint16_t> g_dx2(size_t(N * IC)), g_dx3(size_t(N * IC));
    DeviceArray<float> g_dw3(dw0), g_dw4(dw0), g_dw5(dw0);
    gpu.backward(g_dx2.bf(), false, g_dw3.ptr, nullptr, d_dy.bf(), OC, d_x.bf(), d_w.bf(), N, IC, OC,
                 bias_scratch.ptr, bias_scratch_bytes);
    gpu.backward(g_dx3.bf(), false, g_dw4.ptr, nullptr, d_wide_dy.bf() + OC, 2 * OC, d_x.bf(), d_w.bf(), N, IC, OC,
                 bias_scratch.ptr, bias_scratch_bytes, /*same_input=*/true);
    gpu.backward(nullptr, false, g_dw5.ptr, nullptr, d_dy.bf(), OC, d_x.bf(), d_w.bf(), N, IC, OC, bias_scratch.ptr,
                 bias_scratch_bytes, /*same_input=*/true);  // dweight alone: dout's scales from its own amax
    TEST_CUDA(cudaStreamSynchronize(stream));
    const double e_res2 = rel_max(g_res2.host(), y_plain);
    MESSAGE(name << ": relative error y + residual from another buffer " << e_res2);
    CHECK(e_res2 < 1e-2);
    CHECK(g_res3.host() == g_res2.host());
    CHECK(g_y3.host() == g_y.host());
    CHECK(g_dx2.host() == g_dx.host());
    CHECK(g_dx3.host() == g_dx.host());
    const std::vector<float> dw_alone = g_dw3.host();
    CHECK(g_dw4.host() == dw_alone);
    CHECK(g_dw5.host() == dw_alone);
  }
  cudaStreamDestroy(stream);
}

}  // TEST_SUITE
