// test_backend.cpp — the CUDA backend against the CPU reference and the
// transformers fixtures (build/test_gpu, run by `make test-gpu` on a GPU).
#include <doctest/doctest.h>

#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../test_util.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/engine.hpp"
#include "shardlm/h5util.hpp"
#include "shardlm/hf.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/shard.hpp"
#include "shardlm/train.hpp"

using namespace shardlm;
using shardlm_test::read_h5;
using shardlm_test::rel_error;
namespace fs = std::filesystem;

namespace {



Config deck(const char* path, std::vector<std::string> sets) {
  DeckResult r = parse_deck(path, sets, 1);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

struct GpuSetup {
  GpuSetup() {
    REQUIRE_MESSAGE(cuda_device_count() > 0, "no CUDA device: run the GPU suite on a GPU machine");
    cuda_set_device(0);
  }
};

std::vector<double> train_losses(Config c, int steps) {
  auto comm = make_self_comm();
  TrainSession s(c, *comm);
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) losses.push_back(s.step(i).loss);
  return losses;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA backend vs transformers fixtures: logits, loss, gradients within bf16 tolerance") {
  GpuSetup gpu;
  for (const std::string name : {"llama-gqa-tied", "qwen3-qknorm", "qwen2-bias"}) {
    CAPTURE(name);
    const fs::path dir = fs::path("tests/fixtures") / name, ref = dir / "reference.h5";
    auto comm = make_self_comm();
    ShardedModel model(read_hf_config(dir), 0, 1);
    model.load_hf(SafetensorsReader(dir));
    auto tokens = read_h5<int32_t>(ref, "tokens", H5T_NATIVE_INT32);
    auto targets = read_h5<int32_t>(ref, "targets", H5T_NATIVE_INT32);
    auto positions = read_h5<int32_t>(ref, "positions", H5T_NATIVE_INT32);
    auto weights = read_h5<float>(ref, "weights", H5T_NATIVE_FLOAT);
    auto local = read_h5<int32_t>(ref, "seq_ids", H5T_NATIVE_INT32);
    std::vector<int32_t> seq(local.size());
    for (size_t i = 0; i < local.size(); ++i) seq[i] = int32_t(1000 * (i / 24) + local[i]);
    TokenBatch b;
    b.N = int64_t(tokens.size());
    b.tokens = tokens.data(), b.targets = targets.data(), b.weights = weights.data();
    b.positions = positions.data(), b.seq_ids = seq.data();
    EngineOptions o;
    o.max_tokens = b.N;
    o.chunk_tokens = 10;
    Engine engine(model, *comm, o, make_cuda_backend());

    const auto ref_logits = read_h5<float>(ref, "logits", H5T_NATIVE_FLOAT);
    std::vector<float> logits(ref_logits.size(), NAN);
    engine.forward_logits(b, logits.data());
    const double logit_err = rel_error(logits.data(), ref_logits.data(), logits.size());
    MESSAGE(name << ": GPU logits relative error " << logit_err);
    CHECK(logit_err < 2e-2);

    double loss_tokens = 0;
    for (float w : weights) loss_tokens += w;
    model.zero_grads();
    const double loss = engine.forward_backward(b, float(1.0 / loss_tokens)).loss / loss_tokens;
    const double ref_loss = read_h5<double>(ref, "loss", H5T_NATIVE_DOUBLE)[0];
    MESSAGE(name << ": GPU loss " << loss << " vs " << ref_loss);
    CHECK(std::fabs(loss - ref_loss) / ref_loss < 1e-2);
    double worst = 0;
    for (const auto& [unit, p] : model.layout.all_params()) {
      const auto ref_grad = read_h5<float>(ref, "grads/" + p->name, H5T_NATIVE_FLOAT);
      const size_t ui = size_t(unit - model.layout.units.data());
      const double err = rel_error(model.grad[ui].data() + p->offset, ref_grad.data(), ref_grad.size());
      CHECK_MESSAGE(err < 5e-2, p->name << " gradient relative error " << err);
      worst = std::max(worst, err);
    }
    MESSAGE(name << ": GPU worst gradient relative error " << worst);
  }
}

TEST_CASE("tiny deck: 50 GPU steps follow the CPU losses within bf16 tolerance") {
  GpuSetup gpu;
  const auto cpu = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cpu"}), 50);
  const auto gpu_losses = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda"}), 50);
  double worst = 0;
  for (int i = 0; i < 50; ++i) worst = std::max(worst, std::fabs(gpu_losses[i] - cpu[i]) / cpu[i]);
  MESSAGE("tiny deck: worst relative loss difference GPU vs CPU over 50 steps " << worst << "; final "
          << gpu_losses.back() << " vs " << cpu.back());
  CHECK(worst < 3e-2);
  CHECK(gpu_losses.back() < gpu_losses.front() - 2.0);
}

TEST_CASE("GPU determinism: two runs give bit-identical losses; checkpointing changes nothing") {
  GpuSetup gpu;
  const auto a = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda", "run.deterministic=true"}), 10);
  const auto b = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda", "run.deterministic=true"}), 10);
  const auto c = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda", "model.activation_checkpointing=full"}), 10);
  for (int i = 0; i < 10; ++i) {
    CHECK(a[i] == b[i]);
    CHECK(a[i] == c[i]);
  }
}

TEST_CASE("optimizer state on the GPU vs offloaded to the host: same losses within bf16 tolerance") {
  GpuSetup gpu;
  const auto on_device = train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda"}), 30);
  const auto offload =
      train_losses(deck("inputs/tiny-sft.toml", {"device.backend=cuda", "model.optim_cpu_offload=true"}), 30);
  double worst = 0;
  for (int i = 0; i < 30; ++i) worst = std::max(worst, std::fabs(on_device[i] - offload[i]) / offload[i]);
  MESSAGE("device state vs optim_cpu_offload: worst relative loss difference over 30 steps " << worst);
  CHECK(on_device[0] == offload[0]);  // same first forward
  CHECK(worst < 1e-2);
}

}  // TEST_SUITE
