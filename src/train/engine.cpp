// engine.cpp — the sharded unit loop: gather, compute, release, reduce-scatter.
#include "train/engine.hpp"

#include <algorithm>
#include <cstring>
#include <tuple>

#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "shardlm/dtype.hpp"

namespace shardlm {
namespace {

int64_t max_padded(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.padded_numel);
  return n;
}
int64_t max_shard(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.shard_numel);
  return n;
}

// Gathered parameter slots: current + prefetch, plus the embedding that a tied
// head re-gathers; every unit when nothing is resharded after forward.
int param_slot_count(const ModelLayout& layout, bool reshard) {
  return reshard ? 3 : static_cast<int>(layout.units.size());
}
// Gradient slots: one being computed, one being reduced, plus the embedding's
// when the tied head writes into it long before the embedding's own backward.
int grad_slot_count() { return 3; }

// Gradients go straight into the host shards (CPU, one rank) or the device
// accumulators (device state or the offload pipeline, one rank); otherwise
// through full-unit slots that are reduced (world > 1) and handed over.
bool grad_slots_needed(int world, const Backend& backend, const EngineOptions& o) {
  return world > 1 || (!backend.host_resident() && !o.device_state && !o.offload_pipeline);
}

// model.reduce_dtype = "bf16": gradients cross the wire in bf16 (world > 1).
bool bf16_gradients(int world, const EngineOptions& o) { return o.reduce_bf16 && world > 1; }

}  // namespace

MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& o, int optim_states,
                       const Backend& backend) {
  // Every product below stays in int64 for sizes that pass this.
  if (std::string e = model_scale_error(config, o.max_tokens, o.chunk_tokens); !e.empty())
    SHARDLM_FAIL("memory plan: %s", e.c_str());
  const ModelLayout layout(config, world);
  MemoryPlan plan;
  plan.device = !backend.host_resident();
  for (const auto& u : layout.units) plan.param_shards += 4 * u.shard_numel;
  if (plan.device) plan.param_copies = plan.param_shards / 4 * backend.param_bytes();
  // Device-resident state, and offload with gradients on the device, accumulate
  // gradients on the device only: no host grad shards.
  plan.grad_shards = o.device_state || o.offload_device_grads ? 0 : plan.param_shards;
  plan.optim_state = plan.param_shards * optim_states;
  if (world > 1)
    plan.gathered += backend.param_bytes() * param_slot_count(layout, o.reshard_after_forward) * max_padded(layout);
  if (grad_slots_needed(world, backend, o)) {
    // One rank hands the whole unit over: no reduced slice to receive.
    plan.gathered += 4 * grad_slot_count() * (max_padded(layout) + (world > 1 ? max_shard(layout) : 0));
    if (bf16_gradients(world, o)) plan.gathered += 2 * grad_slot_count() * max_padded(layout);
  }
  if (o.offload_pipeline) {
    plan.offload_buffers = OffloadPipeline::host_bytes(layout, o.offload_device_grads);
    plan.device_grads = plan.param_shards;  // fp32 accumulators of the micro-batches
  }
  // Several ranks on one GPU: two pinned host buffers of one full fp32 unit each.
  if (plan.device && world > 1 && o.comm_backend == "mpi") plan.comm_staging = 2 * 4 * max_padded(layout);
  if (o.device_state) plan.device_state = 2 * plan.param_shards + plan.optim_state;  // masters, grads, moments
  plan.activations = backend.activation_bytes(config, o);
  plan.workspace = backend.workspace_bytes(config, o);
  // A device backend refreshes its bf16 copies through one fp32 staging unit
  // (the offload pipeline casts on the host instead).
  if (plan.device && !o.device_state && !o.offload_pipeline) plan.workspace += 4 * max_padded(layout);
  return plan;
}

std::string format_memory_plan(const MemoryPlan& p, int world) {
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  const char* where = p.device ? "GPU" : "host";
  std::string out = fmt("memory plan per rank (world %d)\n", world);
  const std::tuple<const char*, const char*, int64_t> rows[] = {
      {"parameter shards", "host", p.param_shards}, {"gradient shards", "host", p.grad_shards},
      {"optimizer state", "host", p.optim_state},   {"training state", "GPU", p.device_state},
      {"parameter copies", "GPU", p.param_copies},  {"gradient shards", "GPU", p.device_grads},
      {"gathered units", where, p.gathered},        {"activations", where, p.activations},
      {"workspace", where, p.workspace},            {"output staging", "host", p.host_workspace},
      {"comm staging", "host", p.comm_staging},     {"offload buffers", "host", p.offload_buffers},
      {"data reader", "host", p.data_reader},       {"ckpt snapshot", "host", p.checkpoint_snapshot}};
  for (const auto& [name, place, bytes] : rows)
    if (bytes > 0) out += fmt("  %-18s %-5s %12.3f MiB\n", name, place, mib(bytes));
  out += fmt("  %-18s %-5s %12.3f MiB\n", "total", "host", mib(p.host_total()));
  if (p.device) out += fmt("  %-18s %-5s %12.3f MiB\n", "total", "GPU", mib(p.device_total()));
  return out;
}

std::string plan_fit_error(const MemoryPlan& p, int ranks_on_node, const MachineMemory& host, int ranks_per_gpu,
                           int64_t gpu_bytes) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const char* levers = "more ranks over more nodes (the shards shrink with the world), model.activation_checkpointing = "
                       "\"full\", a smaller data.micro_batch or data.seq_len; `shardlm check DECK --world N` prints the "
                       "plan";
  // An async snapshot pool sized by default shrinks to the room there is (and stages saves).
  const double host_need = double(p.host_total() - p.checkpoint_snapshot_flexible) * ranks_on_node;
  if (host.bytes > 0 && host_need > double(host.bytes))
    return fmt("the memory plan needs %.2f GiB of host memory per rank x %d rank%s on this node = %.2f GiB, more than "
               "the %.2f GiB this machine has (%s): %s",
               double(p.host_total() - p.checkpoint_snapshot_flexible) / gib, ranks_on_node, ranks_on_node == 1 ? "" : "s", host_need / gib,
               double(host.bytes) / gib, host.source, levers);
  const double device_need = double(p.device_total()) * ranks_per_gpu;
  if (gpu_bytes > 0 && device_need > double(gpu_bytes))
    return fmt("the memory plan needs %.2f GiB of GPU memory per rank x %d rank%s on the GPU = %.2f GiB, more than its "
               "%.2f GiB: model.optim_cpu_offload = true, %s",
               double(p.device_total()) / gib, ranks_per_gpu, ranks_per_gpu == 1 ? "" : "s", device_need / gib,
               double(gpu_bytes) / gib, levers);
  return "";
}

Engine::Engine(ShardedModel& model, Comm& comm, const EngineOptions& options, std::unique_ptr<Backend> backend)
    : model_(model),
      comm_(comm),
      options_(options),
      backend_(std::move(backend)),
      config_(model.layout.config),
      sharded_(comm.size() > 1) {
  SHARDLM_CHECK(comm.size() == model.world, "the communicator has %d ranks but the model is sharded %d ways",
                comm.size(), model.world);
  const ModelLayout& layout = model.layout;
  SHARDLM_CHECK(!options.device_state || backend_->supports_device_state(),
                "device-resident training state needs a GPU backend");
  SHARDLM_CHECK(!options.reduce_bf16 || !backend_->host_resident(),
                "model.reduce_dtype = \"bf16\" needs a GPU backend (the CPU backend is the fp32 reference)");
  grad_slots_used_ = grad_slots_needed(comm.size(), *backend_, options);
  reduce_type_ = bf16_gradients(comm.size(), options) ? DType::BF16 : DType::F32;
  gather_type_ = backend_->param_bytes() == 2 ? DType::BF16 : DType::F32;
  slot_floats_ = max_padded(layout);
  recv_floats_ = max_shard(layout);
  if (sharded_) {
    param_slots_.resize(param_slot_count(layout, options.reshard_after_forward));
    for (auto& s : param_slots_) s.full = backend_->allocate(Mem::Gathered, backend_->param_bytes() * slot_floats_);
  }
  if (grad_slots_used_) {
    grad_slots_.resize(grad_slot_count());
    for (auto& s : grad_slots_) {
      s.full = static_cast<float*>(backend_->allocate(Mem::Gathered, 4 * slot_floats_));
      if (sharded_) s.recv = backend_->allocate(Mem::Gathered, 4 * recv_floats_);
      if (reduce_type_ == DType::BF16) s.full_bf16 = backend_->allocate(Mem::Gathered, 2 * slot_floats_);
    }
  }
  if (options.offload_pipeline) {
    SHARDLM_CHECK(backend_->supports_async_copies(), "model.optim_cpu_offload's pipeline needs a GPU backend");
    for (const auto& u : layout.units) {
      offload_grads_.push_back(static_cast<float*>(backend_->allocate(Mem::GradShard, 4 * u.shard_numel)));
      offload_copy_.push_back(-1);
    }
  }
  // A device backend gathers and reduces device buffers: NCCL, or MPI staged
  // through host memory; the host Comm keeps the small collectives.
  if (sharded_ && !backend_->host_resident())
    device_comm_ = make_device_comm(comm, options.comm_backend, backend_->stream(), 4 * slot_floats_,
                                    options.comm_timeout_s);
  unit_comm_ = device_comm_ ? device_comm_.get() : &comm_;
  backend_->attach_shards(layout);
  sync_params();
  backend_->prepare(config_, options);
}

void Engine::sync_params() {
  if (options_.device_state) return;  // the device update writes the bf16 copies itself
  if (options_.offload_pipeline) backend_->synchronize();  // no queued kernel still reads the old shards
  for (size_t u = 0; u < model_.layout.units.size(); ++u) {
    const int64_t n = model_.layout.units[u].shard_numel;
    const float* master = model_.param[u].data();
    if (!options_.offload_pipeline) {
      backend_->set_param_shard(static_cast<int>(u), master, n);
      continue;
    }
    // Offload: cast on the host (the same rounding as the pipeline's uploads) and
    // copy the bf16 shard up, so the GPU needs no fp32 staging unit.
    std::vector<uint16_t> bf16(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16_rne(master[i]);
    backend_->host_wait(backend_->copy_to_device(backend_->param_shard_for_upload(static_cast<int>(u)), bf16.data(),
                                                 2 * size_t(n)));
  }
}

Engine::~Engine() {
  for (auto& s : param_slots_) {
    s.request.wait();
    backend_->deallocate(Mem::Gathered, s.full, backend_->param_bytes() * slot_floats_);
  }
  for (auto& s : grad_slots_) {
    s.request.wait();
    backend_->deallocate(Mem::Gathered, s.full, 4 * slot_floats_);
    if (s.recv) backend_->deallocate(Mem::Gathered, s.recv, 4 * recv_floats_);
    if (s.full_bf16) backend_->deallocate(Mem::Gathered, s.full_bf16, 2 * slot_floats_);
  }
  // The device Comm's collectives are done before it goes, and the last copies
  // to the host have left the offload accumulators.
  backend_->synchronize();
  for (size_t u = 0; u < offload_grads_.size(); ++u)
    backend_->deallocate(Mem::GradShard, offload_grads_[u], 4 * model_.layout.units[u].shard_numel);
}

// ---------------------------------------------------------------- gathering

void Engine::prefetch(int unit) {
  if (!sharded_) return;
  for (auto& s : param_slots_)
    if (s.unit == unit) return;
  for (auto& s : param_slots_) {
    if (s.unit != -1) continue;
    s.unit = unit;
    if (offload_) offload_->param_ready(unit);
    // In the backend's own precision: fp32 on the CPU, bf16 on GPUs.
    s.request = unit_comm_->all_gather(backend_->param_shard(unit), s.full, model_.layout.units[unit].shard_numel,
                                       gather_type_);
    return;
  }
  // No free slot: the unit is gathered when it is needed instead.
}

const void* Engine::params(int unit) {
  if (offload_) offload_->param_ready(unit);
  if (!sharded_) return backend_->param_shard(unit);  // one rank: the shard is the whole unit
  prefetch(unit);
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      return s.full;
    }
  SHARDLM_FAIL("internal: no gather slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::gather_unit_bf16(int unit, void* device_out) {
  SHARDLM_CHECK(!backend_->host_resident() && gather_type_ == DType::BF16,
                "internal: gather_unit_bf16 needs a GPU backend (bf16 device parameter shards)");
  // optim_cpu_offload: the unit's shard is current only once its update has been uploaded.
  if (offload_) offload_->param_ready(unit);
  const Unit& u = model_.layout.units[unit];
  if (sharded_) unit_comm_->all_gather(backend_->param_shard(unit), device_out, u.shard_numel, DType::BF16).wait();
  else cuda_copy_async(device_out, backend_->param_shard(unit), 2 * u.shard_numel, backend_->stream());
}

void Engine::release(int unit) {
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      s.unit = -1;
    }
}

// ---------------------------------------------------------------- gradients

float* Engine::grads(int unit) {
  if (!grad_slots_used_) {  // accumulate straight into the shard
    if (options_.device_state) return backend_->state_grad(unit);
    return options_.offload_pipeline ? offload_grads_[unit] : model_.grad[unit].data();
  }
  for (auto& s : grad_slots_)
    if (s.unit == unit) return s.full;
  // Take the oldest slot in turn; a slot whose reduction started is finished first.
  for (size_t tries = 0; tries < grad_slots_.size(); ++tries) {
    GradSlot& s = grad_slots_[next_grad_slot_];
    next_grad_slot_ = (next_grad_slot_ + 1) % static_cast<int>(grad_slots_.size());
    if (s.unit != -1 && !s.reducing) continue;  // held (tied embedding), still being written
    if (s.unit != -1) finish_grad(s);
    s.unit = unit;
    backend_->zero(s.full, sizeof(float) * model_.layout.units[unit].padded_numel);
    return s.full;
  }
  SHARDLM_FAIL("internal: no gradient slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::reduce_grads(int unit) {
  if (!grad_slots_used_) {  // one rank: the accumulator is the shard
    if (offload_ && last_micro_batch_) hand_over(unit);
    return;
  }
  for (auto& s : grad_slots_)
    if (s.unit == unit) {
      s.reducing = true;
      const Unit& u = model_.layout.units[unit];
      const void* full = s.full;
      if (reduce_type_ == DType::BF16) {  // round once here, then half the bytes on the wire (or the link)
        backend_->cast_to_bf16(s.full_bf16, s.full, u.padded_numel);
        full = s.full_bf16;
      }
      if (sharded_) s.request = unit_comm_->reduce_scatter(full, s.recv, u.shard_numel, reduce_type_);
      return;
    }
}

void Engine::finish_grad(GradSlot& s) {
  s.request.wait();
  // One rank: the whole unit's gradient is the shard's.
  const void* reduced = sharded_ ? s.recv : reduce_type_ == DType::BF16 ? s.full_bf16 : s.full;
  const DType type = reduce_type_;
  const int64_t n = model_.layout.units[s.unit].shard_numel;
  if (options_.device_state) {
    backend_->accumulate(backend_->state_grad(s.unit), reduced, n, type);
  } else if (options_.offload_pipeline) {
    backend_->accumulate(offload_grads_[s.unit], reduced, n, type);
    if (last_micro_batch_) hand_over(s.unit);
  } else {
    backend_->add_grad_to_host(model_.grad[s.unit].data(), reduced, n, type);
  }
  s.unit = -1;
  s.reducing = false;
}

// Offload, the step's last micro-batch: `unit`'s accumulated gradient goes to
// the host behind the work queued so far.
void Engine::hand_over(int unit) {
  const int64_t n = model_.layout.units[unit].shard_numel;
  backend_->grad_sumsq_queue(unit, offload_grads_[unit], n);  // the clip norm, before the copy
  offload_copy_[unit] = offload_->grad_ready(unit, offload_grads_[unit], n);
}

double Engine::offload_grad_sumsq() {
  SHARDLM_CHECK(options_.offload_pipeline, "internal: offload_grad_sumsq without the offload pipeline");
  return backend_->grad_sumsq_read(static_cast<int>(model_.layout.units.size()));
}

// Offload at world > 1: finish a unit's reduction a unit after it started (it
// has had that unit's compute to finish), so that its copy to the host overlaps
// the next units' backward instead of waiting for the slot's reuse.
void Engine::hand_over_reduced(int unit) {
  if (!offload_ || !last_micro_batch_) return;
  for (auto& s : grad_slots_)
    if (s.unit != -1 && s.reducing && s.unit != unit) finish_grad(s);
}

void Engine::begin_offload_micro_batch() {
  SHARDLM_CHECK(offload_, "internal: model.optim_cpu_offload's engine has no offload pipeline attached");
  const OffloadPipeline::MicroBatch mb = offload_->next_micro_batch();
  last_micro_batch_ = mb.last;
  first_micro_batch_ = mb.first;
}

// Offload, the step's first micro-batch, after its forward: the accumulators
// start from zero once the last step's copies have left them. Every unit's
// params() has waited for its update by then, and with the gradients on the
// device each update waited for its own copy first.
void Engine::zero_offload_accumulators() {
  if (!first_micro_batch_) return;
  for (size_t u = 0; u < offload_grads_.size(); ++u) {
    if (offload_copy_[u] >= 0) backend_->compute_wait(offload_copy_[u]);
    offload_copy_[u] = -1;
    backend_->zero(offload_grads_[u], 4 * size_t(model_.layout.units[u].shard_numel));
  }
}

void Engine::finish_all_grads() {
  if (!grad_slots_used_) return;
  // In unit order, so the accumulation into each shard is the same every run.
  for (auto& s : grad_slots_)
    if (s.unit != -1) finish_grad(s);
}

// ---------------------------------------------------------------- forward / backward

const void* Engine::lm_head_weights() {
  const int head = static_cast<int>(model_.layout.units.size()) - 1;
  if (config_.tie_word_embeddings) return params(0);
  return param_at(*backend_, params(head), model_.layout.head().param("lm_head.weight").offset);
}

// forward: for u in units: gather(u) [prefetch u+1]; compute; release(u)
void Engine::forward(const TokenBatch& b, bool keep_for_backward) {
  const ModelLayout& layout = model_.layout;
  const bool release_after = !keep_for_backward || options_.reshard_after_forward;
  backend_->load_batch(b);
  prefetch(1);  // the first layer's gather overlaps the embedding lookup
  backend_->embed_forward(params(0));
  if (release_after) release(0);
  for (int l = 0; l < layout.num_layers(); ++l) {
    const int unit = 1 + l;
    const void* w = params(unit);
    prefetch(unit + 1);
    backend_->layer_forward(l, layout.units[unit], w);
    if (release_after) release(unit);
  }
}

LossStats Engine::forward_backward(const TokenBatch& b, float grad_scale) {
  const ModelLayout& layout = model_.layout;
  const int L = layout.num_layers(), head = L + 1;
  if (options_.offload_pipeline) begin_offload_micro_batch();
  forward(b, /*keep_for_backward=*/true);

  // loss: chunked lm-head + CE, whose backward gives d_x at the last layer's output
  const Unit& hu = layout.head();
  const int64_t norm_off = hu.param("model.norm.weight").offset;
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  if (options_.offload_pipeline) zero_offload_accumulators();
  float* hg = grads(head);
  float* lm_g = config_.tie_word_embeddings ? grads(0) : hg + hu.param("lm_head.weight").offset;
  const LossStats loss =
      backend_->head_loss_backward(param_at(*backend_, hw, norm_off), lm_w, hg + norm_off, lm_g, grad_scale);
  reduce_grads(head);
  release(head);
  if (config_.tie_word_embeddings && options_.reshard_after_forward) release(0);

  // backward: for u reversed: gather(u); grads; reduce_scatter -> grad shard; release(u)
  for (int l = L - 1; l >= 0; --l) {
    const int unit = 1 + l;
    const void* w = params(unit);
    prefetch(l > 0 ? unit - 1 : 0);
    backend_->layer_backward(l, layout.units[unit], w, grads(unit));
    reduce_grads(unit);
    hand_over_reduced(unit);
    release(unit);
  }
  backend_->embed_backward(grads(0));
  reduce_grads(0);
  release(0);
  finish_all_grads();
  return loss;
}

LossStats Engine::forward_loss(const TokenBatch& b) {
  const int head = model_.layout.num_layers() + 1;
  forward(b, /*keep_for_backward=*/false);
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  const LossStats loss =
      backend_->head_loss(param_at(*backend_, hw, model_.layout.head().param("model.norm.weight").offset), lm_w);
  release(head);
  release(0);
  return loss;
}

void Engine::forward_logits(const TokenBatch& b, float* logits) {
  const int head = model_.layout.num_layers() + 1;
  forward(b, /*keep_for_backward=*/false);
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  backend_->head_logits(param_at(*backend_, hw, model_.layout.head().param("model.norm.weight").offset), lm_w,
                        logits);
  release(head);
  release(0);
}

}  // namespace shardlm
