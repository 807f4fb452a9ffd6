// state.cpp — the host placement of the training state, the choice of placement,
// and each placement's rows of the memory plan; see src/train/state.hpp.
#include "train/state.hpp"

#include <algorithm>
#include <cstdint>

#include "cpu/ops.hpp"
#include "shardlm/error.hpp"
#include "shardlm/watchdog.hpp"
#include "train/offload.hpp"

namespace shardlm {

void HostSnapshotGate::wait(int unit, int64_t update) {
  if (!active_.load() || update <= mark_.load()) return;
  auto ready = [&] { return !active_.load() || (unit >= 0 && copied_.load() > unit); };
  if (ready()) return;
  Activity waiting(unit >= 0 ? fmt("updating unit %d: waiting for the checkpoint snapshot to copy it", unit)
                             : std::string("updating: waiting for the checkpoint snapshot to copy the state"));
  wait_following(waiting, ready, copied_);
}

void HostShardReader::wait_done() {
  if (!reading_.load()) return;
  Activity waiting("waiting for the checkpoint writer to finish reading the host copy of the state");
  wait_following(waiting, [this] { return !reading_.load(); }, *progress_);
}

const char* placement_name(StatePlacement p) {
  switch (p) {
    case StatePlacement::Host: return "host";
    case StatePlacement::Device: return "device";
    case StatePlacement::Offload: return "offload";
  }
  return "?";
}

StatePlacement state_placement_for(const Config& c) {
  if (c.device.backend != "cuda") return StatePlacement::Host;
  if (!c.model.optim_cpu_offload) return StatePlacement::Device;
  return c.optim.name == "muon" ? StatePlacement::Host : StatePlacement::Offload;
}

bool offload_grads_on_device(const Config& c) {
  return state_placement_for(c) == StatePlacement::Offload && c.model.optim_offload_grads == "device";
}

// Device-resident state, and the offload pipeline with optim_offload_grads =
// "device", accumulate gradients in device shards only; the host ones would
// never be read (checkpoints hold no gradients): none are made.
bool host_grad_shards(StatePlacement placement, bool offload_device_grads) {
  return placement == StatePlacement::Host || (placement == StatePlacement::Offload && !offload_device_grads);
}

int offload_device_units(const Config& c) {
  return state_placement_for(c) == StatePlacement::Offload ? static_cast<int>(c.model.optim_gpu_units) : 0;
}

int64_t offload_device_unit_bytes(const ModelLayout& layout, int optim_states, int units) {
  int64_t bytes = 0;
  for (int u = 0; u < units; ++u) bytes += 4 * (1 + optim_states) * layout.units[size_t(u)].shard_numel;
  return bytes;
}

int offload_device_units_within(const ModelLayout& layout, int optim_states, int64_t budget_bytes) {
  const int all = static_cast<int>(layout.units.size());
  int units = 0;
  while (units < all && offload_device_unit_bytes(layout, optim_states, units + 1) <= budget_bytes) ++units;
  return units;
}

void plan_state_memory(MemoryPlan& plan, const EngineOptions& options, const ModelLayout& layout, int optim_states,
                       const Backend& backend) {
  const StatePlacement placement = options.state;
  const bool offload_device_grads = options.offload_device_grads;
  int64_t shards = 0, largest = 0;
  for (const auto& u : layout.units) shards += 4 * u.shard_numel, largest = std::max(largest, u.padded_numel);
  // The host shards exist in every placement: they are the state, or its mirror
  // for checkpoints (device), or the CPU optimizer's (offload).
  plan.param_shards += shards;
  plan.grad_shards += host_grad_shards(placement, offload_device_grads) ? shards : 0;
  plan.optim_state += shards * optim_states;
  switch (placement) {
    case StatePlacement::Host:
      // A device backend refreshes its bf16 copies through one fp32 staging unit.
      if (!backend.host_resident()) plan.workspace += 4 * largest;
      break;
    case StatePlacement::Device:
      plan.device_state += 2 * shards + shards * optim_states;  // masters, grads, moments
      break;
    case StatePlacement::Offload:
      plan.offload_buffers += OffloadPipeline::host_bytes(layout, offload_device_grads);
      if (options.offload_speculate)  // the copies of the offloaded units' state
        plan.offload_buffers += OffloadPipeline::speculation_bytes(layout, optim_states, options.offload_device_units);
      plan.device_grads += shards;  // fp32 accumulators of the micro-batches
      // The device units' masters and moments (their gradients are the accumulators).
      plan.device_state += offload_device_unit_bytes(layout, optim_states, options.offload_device_units);
      break;
  }
}

namespace {

// The CPU reference, and Muon under optim_cpu_offload on a GPU: masters,
// gradients and moments are the host shards; Optimizer::step updates them.
class HostState final : public TrainingState {
 public:
  HostState(ShardedModel& model, Optimizer* optimizer, Backend& backend)
      : model_(model), optimizer_(optimizer), backend_(backend) {
    sync_params();
  }
  StatePlacement placement() const override { return StatePlacement::Host; }

  void begin_step(int64_t) override {
    sync_params();  // the backend's parameter copies follow the fp32 masters
    model_.zero_grads();
  }
  // A backend that computes in host memory adds into the shard itself.
  float* direct_grad(int unit) override { return backend_.host_resident() ? model_.grad[unit].data() : nullptr; }
  const float* master_shard(int unit) override { return model_.param[unit].data(); }
  void add_reduced(int unit, const void* reduced, int64_t n, DType type) override {
    backend_.add_grad_to_host(model_.grad[unit].data(), reduced, n, type);
  }
  double grad_sumsq() override {
    double sumsq = 0.0;
    for (size_t u = 0; u < model_.layout.units.size(); ++u)
      sumsq += cpu::sum_squares(model_.grad[u].data(), model_.layout.units[u].shard_numel);
    return sumsq;
  }
  void update(double lr, float clip) override {
    SHARDLM_CHECK(optimizer_, "internal: an engine's own host state has no optimizer to update with");
    snapshot_gate.wait(-1, INT64_MAX);  // synchronous: always after the snapshot began; an async save's copy of the state (Muon's collective step updates all at once)
    optimizer_->step(lr, clip);
    ++param_version_;
  }
  void push() override {
    sync_params();
    ++param_version_;
  }

 private:
  // Refresh the backend's parameter shards from the fp32 masters (on the CPU
  // backend a pointer, no copy).
  void sync_params() {
    for (size_t u = 0; u < model_.layout.units.size(); ++u)
      backend_.set_param_shard(static_cast<int>(u), model_.param[u].data(), model_.layout.units[u].shard_numel);
  }

  ShardedModel& model_;
  Optimizer* optimizer_;  // null for an engine used without a session (forward passes, tests)
  Backend& backend_;
};

}  // namespace

std::unique_ptr<TrainingState> make_host_state(ShardedModel& model, Optimizer* optimizer, Backend& backend) {
  return std::make_unique<HostState>(model, optimizer, backend);
}

std::unique_ptr<TrainingState> make_training_state(const EngineOptions& options, ShardedModel& model,
                                                   Optimizer& optimizer, const OptimSection& optim, Backend& backend,
                                                   int cpu_threads) {
  switch (options.state) {
    case StatePlacement::Host: return make_host_state(model, &optimizer, backend);
    case StatePlacement::Device: {
      auto state = make_cuda_device_state(model, optimizer, optim, backend);
      state->push();
      return state;
    }
    case StatePlacement::Offload:
      return std::make_unique<OffloadState>(model, optimizer, optim, backend, cpu_threads, options.offload_device_grads,
                                            options.offload_device_units, options.offload_speculate);
  }
  SHARDLM_FAIL("internal: no training state for placement %d", static_cast<int>(options.state));
}

}  // namespace shardlm
