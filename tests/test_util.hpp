// test_util.hpp — helpers the model tests share: read an HDF5 dataset, compare
// tensors by relative L2 error, a tiny model of experts.
#pragma once

#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "shardlm/h5util.hpp"
#include "shardlm/model_config.hpp"

namespace shardlm_test {

// A tiny qwen3_moe: 2 layers of `experts` experts (16 wide), 2 a token,
// hidden 32, the chosen experts' weights renormalised.
inline shardlm::ModelConfig tiny_experts(int64_t experts) {
  shardlm::ModelConfig c;
  c.arch = "qwen3_moe";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 64;
  c.qk_norm = true;
  c.rms_norm_eps = 1e-6;
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.norm_topk_prob = true;
  return c;
}

template <class T>
std::vector<T> read_h5(const std::filesystem::path& file, const std::string& name, hid_t mem_type) {
  using shardlm::h5::Handle;
  Handle f(H5_CHECK(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)), H5Fclose);
  Handle d(H5_CHECK(H5Dopen2(f, name.c_str(), H5P_DEFAULT)), H5Dclose);
  Handle space(H5_CHECK(H5Dget_space(d)), H5Sclose);
  std::vector<T> out(H5Sget_simple_extent_npoints(space));
  H5_CHECK(H5Dread(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()));
  return out;
}

// ‖a − b‖ / ‖b‖; infinite when a holds a NaN or Inf.
inline double rel_error(const float* a, const float* b, size_t n) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(ref), 1e-30);
}

}  // namespace shardlm_test
