// optim.cpp — AdamW / SGD on shards, lr schedule, global grad norm.
#include "shardlm/optim.hpp"

#include <cmath>
#include <cstring>

#include "shardlm/cpu_ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

double lr_at(const SchedSection& s, double peak, int64_t max_steps, int64_t step) {
  if (s.warmup > 0 && step < s.warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  if (s.name == "constant") return peak;
  const int64_t after = step - s.warmup;
  if (s.name == "linear") {
    const int64_t decay = s.decay > 0 ? s.decay : max_steps - s.warmup;
    const int64_t start = max_steps - decay;
    if (step < start || decay <= 0) return peak;
    const double frac = std::min(1.0, static_cast<double>(step - start + 1) / static_cast<double>(decay));
    return peak + (s.min_lr - peak) * frac;
  }
  // cosine from peak (first step after warmup) to min_lr (last step)
  const int64_t span = max_steps - s.warmup - 1;
  if (span <= 0) return peak;
  const double frac = std::min(1.0, static_cast<double>(after) / static_cast<double>(span));
  return s.min_lr + 0.5 * (peak - s.min_lr) * (1.0 + std::cos(M_PI * frac));
}

Optimizer::Optimizer(const OptimSection& config, ShardedModel& model) : config_(config), model_(model) {
  state_.resize(states());
  for (auto& s : state_)
    for (const auto& u : model.layout.units) {
      s.emplace_back(Mem::OptimState, u.shard_numel);
      std::memset(s.back().data(), 0, s.back().bytes());
    }
}

int Optimizer::states() const {
  if (config_.name == "adamw") return 2;
  return config_.momentum > 0 ? 1 : 0;
}

void Optimizer::step(double lr, float grad_scale) {
  ++step_;
  const double b1 = config_.beta1, b2 = config_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step_));
  const float eps = static_cast<float>(config_.eps);
  for (size_t ui = 0; ui < model_.layout.units.size(); ++ui) {
    float* p = model_.param[ui].data();
    const float* g = model_.grad[ui].data();
    for (const auto& seg : model_.segments(model_.layout.units[ui])) {
      const float wd = seg.param->weight_decay() ? static_cast<float>(config_.weight_decay) : 0.0f;
      const int64_t o = seg.shard_offset, n = seg.count;
      if (config_.name == "adamw") {
        float* m = state_[0][ui].data() + o;
        float* v = state_[1][ui].data() + o;
        const float lr_f = static_cast<float>(lr), b1f = static_cast<float>(b1), b2f = static_cast<float>(b2);
        const float step_size = static_cast<float>(lr / bc1), inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          const float gi = g[o + i] * grad_scale;
          float* pi = p + o + i;
          m[i] = b1f * m[i] + (1.0f - b1f) * gi;
          v[i] = b2f * v[i] + (1.0f - b2f) * gi * gi;
          *pi -= lr_f * wd * *pi;  // decoupled weight decay
          *pi -= step_size * m[i] / (std::sqrt(v[i]) * inv_bc2_sqrt + eps);
        }
      } else {  // sgd
        const float lr_f = static_cast<float>(lr), mu = static_cast<float>(config_.momentum);
        float* buf = states() ? state_[0][ui].data() + o : nullptr;
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          float d = g[o + i] * grad_scale + wd * p[o + i];
          if (buf) d = buf[i] = mu * buf[i] + d;
          p[o + i] -= lr_f * d;
        }
      }
    }
  }
}

double global_grad_norm(const ShardedModel& model, Comm& comm) {
  double sumsq = 0.0;
  for (size_t ui = 0; ui < model.layout.units.size(); ++ui)
    sumsq += cpu::sum_squares(model.grad[ui].data(), model.layout.units[ui].shard_numel);
  comm.all_reduce_sum(&sumsq, 1);
  return std::sqrt(sumsq);
}

bool grads_finite(double global_norm) { return std::isfinite(global_norm); }

}  // namespace shardlm
