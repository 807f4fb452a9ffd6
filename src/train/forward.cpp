// forward.cpp — logits for token rows from an HF model directory.
#include "train/forward.hpp"

#include <cstdio>

#include "shardlm/comm.hpp"
#include "train/engine.hpp"
#include "shardlm/h5util.hpp"
#include "model/hf.hpp"
#include "train/shard.hpp"

namespace shardlm {

TokenRows read_token_rows(const std::filesystem::path& file, int64_t vocab_size) {
  h5::silence_error_stack();
  SHARDLM_CHECK(std::filesystem::exists(file), "%s: no such file", file.c_str());
  SHARDLM_CHECK(H5Fis_hdf5(file.c_str()) > 0, "%s: not an HDF5 file", file.c_str());
  h5::Handle f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  SHARDLM_CHECK(f.get() >= 0, "%s: cannot open (%s)", file.c_str(), h5::error_stack_message().c_str());
  SHARDLM_CHECK(H5Lexists(f, "tokens", H5P_DEFAULT) > 0, "%s: no dataset 'tokens' (expected int32 [B, T])",
                file.c_str());
  h5::Handle d(H5_CHECK(H5Dopen2(f, "tokens", H5P_DEFAULT)), H5Dclose);
  h5::Handle type(H5_CHECK(H5Dget_type(d)), H5Tclose);
  SHARDLM_CHECK(H5Tget_class(type) == H5T_INTEGER && H5Tget_size(type) == 4 && H5Tget_sign(type) == H5T_SGN_2,
                "%s: 'tokens' has dtype %s; expected int32", file.c_str(), h5::dtype_name(type).c_str());
  h5::Handle space(H5_CHECK(H5Dget_space(d)), H5Sclose);
  const int ndims = H5Sget_simple_extent_ndims(space);
  SHARDLM_CHECK(ndims == 2, "%s: 'tokens' has %d dimensions; expected 2 ([B, T])", file.c_str(), ndims);
  hsize_t dims[2];
  H5Sget_simple_extent_dims(space, dims, nullptr);
  TokenRows rows;
  rows.rows = static_cast<int64_t>(dims[0]);
  rows.cols = static_cast<int64_t>(dims[1]);
  SHARDLM_CHECK(rows.rows > 0 && rows.cols > 0, "%s: 'tokens' is empty", file.c_str());
  rows.tokens.resize(rows.rows * rows.cols);
  H5_CHECK(H5Dread(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, rows.tokens.data()));
  for (size_t i = 0; i < rows.tokens.size(); ++i)
    SHARDLM_CHECK(rows.tokens[i] >= 0 && rows.tokens[i] < vocab_size,
                  "%s: tokens[%lld][%lld] = %d is outside the model's vocabulary [0, %lld)", file.c_str(),
                  (long long)(i / rows.cols), (long long)(i % rows.cols), rows.tokens[i], (long long)vocab_size);
  return rows;
}

void write_logits(const std::filesystem::path& file, const std::vector<float>& logits, int64_t rows, int64_t cols,
                  int64_t vocab) {
  const std::filesystem::path tmp = file.string() + ".tmp";
  {
    h5::Handle f(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    SHARDLM_CHECK(f.get() >= 0, "%s: cannot create (%s)", tmp.c_str(), h5::error_stack_message().c_str());
    const hsize_t dims[3] = {hsize_t(rows), hsize_t(cols), hsize_t(vocab)};
    h5::Handle space(H5_CHECK(H5Screate_simple(3, dims, nullptr)), H5Sclose);
    h5::Handle d(H5_CHECK(H5Dcreate2(f, "logits", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)),
                 H5Dclose);
    H5_CHECK(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, logits.data()));
  }
  SHARDLM_CHECK(std::rename(tmp.c_str(), file.c_str()) == 0, "cannot rename %s to %s", tmp.c_str(), file.c_str());
}

int64_t forward_hf(const std::filesystem::path& hf_dir, const std::filesystem::path& tokens_file,
                   const std::filesystem::path& out_file) {
  const ModelConfig config = read_hf_config(hf_dir);
  const TokenRows in = read_token_rows(tokens_file, config.vocab_size);
  SHARDLM_CHECK(in.cols <= config.max_position_embeddings,
                "%s: rows of %lld tokens are longer than the model supports (max_position_embeddings = %lld)",
                tokens_file.c_str(), (long long)in.cols, (long long)config.max_position_embeddings);
  auto comm = make_self_comm();
  ShardedModel model(config, 0, 1);
  model.load_hf(SafetensorsReader(hf_dir));
  EngineOptions options;
  options.max_tokens = in.cols;
  Engine engine(model, *comm, options);

  std::vector<int32_t> positions(in.cols), seq_ids(in.cols, 0);
  for (int64_t t = 0; t < in.cols; ++t) positions[t] = static_cast<int32_t>(t);
  std::vector<float> logits(in.rows * in.cols * config.vocab_size);
  for (int64_t r = 0; r < in.rows; ++r) {
    TokenBatch b;
    b.N = in.cols;
    b.tokens = in.tokens.data() + r * in.cols;
    b.positions = positions.data();
    b.seq_ids = seq_ids.data();
    engine.forward_logits(b, logits.data() + r * in.cols * config.vocab_size);
  }
  write_logits(out_file, logits, in.rows, in.cols, config.vocab_size);
  return in.rows;
}

}  // namespace shardlm
