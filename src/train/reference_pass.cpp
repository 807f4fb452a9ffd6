// reference_pass.cpp — the frozen starting weights and their logprobs; see
// src/train/reference_pass.hpp.
#include "train/reference_pass.hpp"

#include <algorithm>
#include <chrono>

#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/error.hpp"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;

bool with_reference(bool rl, const RlLossParams& params) { return rl && params.ref_kl_coef > 0; }

class NoReferencePass final : public ReferencePass {
 public:
  double run(StepSource&, int64_t, const StepPlan&) override { return 0.0; }
  TokenBatch attach(int64_t, int64_t, const TokenBatch& micro) const override { return micro; }
};

class FrozenReferencePass final : public ReferencePass {
 public:
  // The copy is the model's shards as they are now: the starting weights, in
  // fp32 host memory. A GPU backend computes from bf16 copies of them in device
  // memory, made at the first pass.
  FrozenReferencePass(Engine& engine, const ShardedModel& model) : engine_(engine) {
    for (const Buffer<float>& shard : model.param) {
      Buffer<float>& copy = frozen_.emplace_back(Mem::ParamShard, shard.size());
      std::copy_n(shard.data(), shard.size(), copy.data());
    }
    if (engine.backend().host_resident()) {
      for (const Buffer<float>& copy : frozen_) weights_.shards.push_back(copy.data());
      return;
    }
    for (const Buffer<float>& copy : frozen_) weights_.masters.push_back(copy.data());
  }

  ~FrozenReferencePass() override {
    Backend& backend = engine_.backend();
    for (size_t u = 0; u < device_.size(); ++u)
      backend.deallocate(Mem::ParamShard, device_[u], 2 * frozen_[u].size());
  }

  // Every micro-batch the step's updates train on, forward only at the frozen
  // weights: the logprob of each target as the loss forms the trainer's own
  // (the same kernel), so with unchanged weights the two are the same bits.
  double run(StepSource& source, int64_t step, const StepPlan& plan) override {
    const auto t0 = Clock::now();
    if (!engine_.backend().host_resident() && device_.empty()) upload();
    logprobs_.resize(plan.parts.size());
    for (size_t k = 0; k < plan.parts.size(); ++k) {
      logprobs_[k].resize(size_t(plan.parts[k].micro_batches));
      for (int64_t a = 0; a < plan.parts[k].micro_batches; ++a) {
        const TokenBatch micro = source.micro_batch(step, int64_t(k), a);
        std::vector<float>& out = logprobs_[k][size_t(a)];
        out.resize(size_t(micro.N));  // capacity kept from earlier steps
        engine_.forward_token_logprobs(micro, out.data(), &weights_);
      }
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }

  TokenBatch attach(int64_t part, int64_t index, const TokenBatch& micro) const override {
    const std::vector<float>& lp = logprobs_.at(size_t(part)).at(size_t(index));
    SHARDLM_CHECK(int64_t(lp.size()) == micro.N, "internal: reference logprobs of %zu tokens for a micro-batch of %lld",
                  lp.size(), (long long)micro.N);
    TokenBatch b = micro;
    b.ref_logprobs = lp.data();
    return b;
  }

 private:
  // A GPU backend's parameters are bf16 in device memory: frozen_ rounded to
  // nearest even, as the training state rounds its masters.
  void upload() {
    Backend& backend = engine_.backend();
    std::vector<uint16_t> bf16;
    for (const Buffer<float>& copy : frozen_) {
      const size_t n = copy.size();
      bf16.resize(n);
      for (size_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16_rne(copy.data()[i]);
      void* dev = device_.emplace_back(backend.allocate(Mem::ParamShard, 2 * n));
      cuda_copy_async(dev, bf16.data(), int64_t(2 * n), backend.stream());
      backend.synchronize();  // bf16 is reused for the next unit
      weights_.shards.push_back(dev);
    }
  }

  Engine& engine_;
  std::vector<Buffer<float>> frozen_;  // per unit: (shard_numel) the starting weights, this rank's shard
  std::vector<void*> device_;          // GPU: per unit, frozen_ in bf16, device memory
  OtherWeights weights_;               // what the engine reads: frozen_ (CPU), or device_ and frozen_ (GPU)
  std::vector<std::vector<std::vector<float>>> logprobs_;  // [part][micro-batch] (N) the reference's logprobs
};

}  // namespace

std::unique_ptr<ReferencePass> make_reference_pass(bool rl, const RlLossParams& params, Engine& engine,
                                                   const ShardedModel& model) {
  if (!with_reference(rl, params)) return std::make_unique<NoReferencePass>();
  return std::make_unique<FrozenReferencePass>(engine, model);
}

int64_t reference_weights_bytes(const EngineOptions& o, const ModelLayout& layout) {
  if (!with_reference(o.rl, o.rl_params)) return 0;
  int64_t bytes = 0;
  for (const Unit& u : layout.units) bytes += u.shard_numel * 4;
  return bytes;
}

int64_t reference_copies_bytes(const EngineOptions& o, const ModelLayout& layout, const Backend& backend) {
  if (!with_reference(o.rl, o.rl_params) || backend.host_resident()) return 0;
  int64_t bytes = 0;
  for (const Unit& u : layout.units) bytes += u.shard_numel * backend.param_bytes();
  return bytes;
}

}  // namespace shardlm
