// offload.cpp — the optim_cpu_offload pipeline; see src/train/offload.hpp.
#include "train/offload.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "shardlm/cuda.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/error.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Pinned bf16 buffers the updated shards go up from, in turn: the update of
// one unit fills the next while the last one's upload is still in flight.
constexpr int kUploadSlots = 2;
// With the gradients on the device, two pinned fp32 landing buffers as well: unit
// u + 1's gradient lands in one while unit u's update reads the other.
constexpr int kLandingBuffers = 2;

int64_t max_shard_numel(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.shard_numel);
  return n;
}

// Elements of a shard that hold parameters: the segments are contiguous from the
// shard's start (parameters are packed in their unit); the rest is padding,
// which stays zero on the device and is never uploaded.
int64_t covered_numel(const ShardedModel& model, int unit) {
  int64_t end = 0;
  for (const auto& s : model.segments(model.layout.units[unit])) end = std::max(end, s.shard_offset + s.count);
  return end;
}

}  // namespace

int64_t OffloadPipeline::host_bytes(const ModelLayout& layout, bool device_grads) {
  return (kUploadSlots * 2 + (device_grads ? kLandingBuffers * 4 : 0)) * max_shard_numel(layout);
}

int64_t OffloadPipeline::speculation_bytes(const ModelLayout& layout, int optim_states, int first_offloaded) {
  int64_t bytes = 0;
  for (size_t u = size_t(first_offloaded); u < layout.units.size(); ++u)
    bytes += 4 * (1 + optim_states) * layout.units[u].shard_numel;
  return bytes;
}

OffloadPipeline::OffloadPipeline(ShardedModel& model, Optimizer& optimizer, OffloadDevice& device,
                                 std::vector<void*> device_shards, int cpu_threads, bool device_grads,
                                 HostSnapshotGate* gate, int first_offloaded, bool speculative)
    : model_(model),
      optimizer_(optimizer),
      device_(device),
      device_shards_(std::move(device_shards)),
      units_(static_cast<int>(model.layout.units.size())),
      first_offloaded_(first_offloaded),
      cpu_threads_(cpu_threads),
      device_grads_(device_grads),
      gate_(gate) {
  unit_updates_.assign(size_t(units_), 0);
  SHARDLM_CHECK(int(device_shards_.size()) == units_, "internal: %zu device shards for %d units",
                device_shards_.size(), units_);
  SHARDLM_CHECK(first_offloaded_ >= 0 && first_offloaded_ <= units_, "internal: unit %d offloaded first of %d",
                first_offloaded_, units_);
  // Gradients land straight in the fp32 grad shards (or the landing buffers), the
  // bf16 shards go up from pinned memory: pinning makes those copies DMA that
  // overlaps compute.
  auto pin = [&](void* p, size_t bytes) {
    timing_.pin_wanted_bytes += static_cast<int64_t>(bytes);
    if (!device_.pin_host(p, bytes)) return;
    pinned_.push_back(p);
    timing_.pinned_bytes += static_cast<int64_t>(bytes);
  };
  if (device_grads_) {
    for (int i = 0; i < kLandingBuffers; ++i) {
      landing_.emplace_back(Mem::Workspace, max_shard_numel(model.layout));
      pin(landing_.back().data(), landing_.back().bytes());
    }
  } else {
    for (int u = first_offloaded_; u < units_; ++u) {
      SHARDLM_CHECK(model.grad[u].size() == model.layout.units[u].shard_numel,
                    "internal: the offload pipeline needs host gradient shards (or optim_offload_grads = device)");
      pin(model.grad[u].data(), model.grad[u].bytes());
    }
  }
  for (int i = 0; i < kUploadSlots; ++i) {
    slots_.emplace_back(Mem::Workspace, max_shard_numel(model.layout));
    pin(slots_.back().data(), slots_.back().bytes());
  }
  kept_.resize(size_t(units_));
  if (speculative)
    for (int u = first_offloaded_; u < units_; ++u)
      kept_[size_t(u)] = Buffer<float>(Mem::Workspace, (1 + optimizer.states()) * model.layout.units[u].shard_numel);
  slot_upload_.assign(kUploadSlots, -1);
  for (int u = 0; u < units_; ++u) upload_numel_.push_back(covered_numel(model_, u));
  waited_.assign(units_, true);
  grad_copy_.assign(units_, -1);
  grad_src_.assign(units_, nullptr);
  upload_.assign(units_, -1);
  updating_.assign(units_, 0);
  worker_ = std::thread([this] { run(); });
}

OffloadPipeline::~OffloadPipeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
  device_.synchronize();
  for (void* p : pinned_) device_.unpin_host(p);
}

void OffloadPipeline::push(const Task& t) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(t);
  }
  changed_.notify_all();
}

void OffloadPipeline::begin_step(int64_t micro_batches) {
  SHARDLM_CHECK(micro_batches >= 1, "internal: a step of %lld micro-batches", (long long)micro_batches);
  micro_batches_ = micro_batches;
  micro_batch_ = 0;
  landed_ = 0;
}

OffloadPipeline::MicroBatch OffloadPipeline::next_micro_batch() {
  SHARDLM_CHECK(micro_batch_ < micro_batches_, "internal: micro-batch %lld of a %lld-micro-batch step",
                (long long)micro_batch_ + 1, (long long)micro_batches_);
  const int64_t a = micro_batch_++;
  return {a == 0, a + 1 == micro_batches_};
}

int64_t OffloadPipeline::grad_ready(int unit, const float* src, int64_t n) {
  SHARDLM_CHECK(n == model_.layout.units[unit].shard_numel, "internal: gradient of %lld elements for a %lld shard",
                (long long)n, (long long)model_.layout.units[unit].shard_numel);
  SHARDLM_CHECK(micro_batch_ == micro_batches_ && landed_ < units_,
                "internal: unit %d's gradient handed over before the step's last micro-batch", unit);
  SHARDLM_CHECK(unit >= first_offloaded_, "internal: unit %d's gradient handed over, but its state is on the device",
                unit);
  ++landed_;
  int64_t ticket = -1;
  if (!device_grads_) ticket = device_.copy_to_host(model_.grad[unit].data(), src, 4 * size_t(n));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (device_grads_) grad_src_[unit] = src;  // copied by the worker, just before the unit's update
    else grad_copy_[unit] = ticket;
    if (speculating_) ++updating_[unit];  // the next forward waits for this update (and any redo)
  }
  if (speculating_) {  // nothing reads the unit's shard in this step any more: update it now
    waited_[unit] = false;
    Task t = speculation_;
    t.kind = Task::Speculate;
    t.unit = unit;
    push(t);
  }
  return ticket;
}

// Gradients on the device: unit's step gradient into its landing buffer (the
// worker, one unit ahead of the update; the buffer's last reader was the update
// of unit - 2, finished). The copy is ordered after the work on the compute
// stream so far; the next step's forward, already running there, leaves the
// accumulators alone until every unit's update is done (Engine::forward_backward).
void OffloadPipeline::issue_grad_copy(int unit) {
  const float* src = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    src = grad_src_[unit];
  }
  SHARDLM_CHECK(src, "internal: unit %d's gradient was not handed over", unit);
  const int64_t n = model_.layout.units[unit].shard_numel;
  const int64_t ticket = device_.copy_to_host(landing_[unit % kLandingBuffers].data(), src, 4 * size_t(n));
  std::lock_guard<std::mutex> lock(mutex_);
  grad_copy_[unit] = ticket;
}

void OffloadPipeline::param_ready(int unit) {
  if (waited_[unit]) return;
  int64_t ticket = -1;
  {
    const auto t0 = Clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !updating_[unit]; });
    ticket = upload_[unit];
    timing_.param_wait_s += seconds_since(t0);
  }
  if (ticket >= 0) device_.compute_wait(ticket);
  waited_[unit] = true;
}

void OffloadPipeline::update(double lr, float clip) {
  SHARDLM_CHECK(landed_ == units_ - first_offloaded_, "internal: update with %d of %d units' gradients handed over",
                landed_, units_ - first_offloaded_);
  Task t;
  if (speculating_) {
    speculating_ = false;
    t = speculation_;
    // Bit for bit the exact path: the speculated units took lr and a clip
    // factor of exactly 1 (a gradient times 1.0f is the gradient).
    t.kind = clip == 1.0f && lr == speculation_.lr ? Task::Accept : Task::Redo;
    if (t.kind == Task::Accept) {
      push(t);
      return;
    }
    ++redone_steps_;
  } else {
    optimizer_.begin_step();
    t.kind = Task::Update;
    t.number = ++updates_asked_;
    t.step = optimizer_.steps_taken();
  }
  t.lr = lr;
  t.clip = clip;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int u = first_offloaded_; u < units_; ++u) ++updating_[size_t(u)];
  }
  std::fill(waited_.begin() + first_offloaded_, waited_.end(), false);
  push(t);
}

void OffloadPipeline::speculate(double lr) {
  SHARDLM_CHECK(!kept_.empty() && (first_offloaded_ == units_ || kept_[size_t(units_ - 1)].size() > 0),
                "internal: speculate() on a pipeline built without copies of the state");
  SHARDLM_CHECK(!speculating_ && landed_ == 0, "internal: speculate() after %d units were handed over", landed_);
  optimizer_.begin_step();
  speculation_ = Task{};
  speculation_.lr = lr;
  speculation_.number = ++updates_asked_;
  speculation_.step = optimizer_.steps_taken();
  speculating_ = true;
}

void OffloadPipeline::discard() {
  if (!speculating_) return;
  SHARDLM_CHECK(landed_ == units_ - first_offloaded_, "internal: discard with %d of %d units' gradients handed over",
                landed_, units_ - first_offloaded_);
  speculating_ = false;
  ++redone_steps_;
  optimizer_.set_steps_taken(speculation_.step - 1);  // the worker's updates carry their own step number
  Task t = speculation_;
  t.kind = Task::Discard;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int u = first_offloaded_; u < units_; ++u) ++updating_[size_t(u)];
  }
  std::fill(waited_.begin() + first_offloaded_, waited_.end(), false);
  push(t);
}

OffloadPipeline::Timing OffloadPipeline::timing() {
  std::lock_guard<std::mutex> lock(mutex_);
  return timing_;
}

std::string OffloadPipeline::summary() {
  const Timing t = timing();
  const OffloadDevice::Totals c = device_.totals();
  const double per = t.updates > 0 ? 1e3 / double(t.updates) : 0.0;  // ms per update from seconds
  auto gbps = [](double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; };
  return fmt("offload: per update %.1f ms CPU update + upload issue (worker; %.1f ms of it waiting for gradient "
             "copies); forward waited %.1f ms for updates (the GPU stood still %.1f ms of it); pinned %.2f of %.2f "
             "GiB; copies to the host %.2f GB per update at %.1f GB/s, to the device %.2f GB at %.1f GB/s",
             t.update_s * per, t.grad_wait_s * per, t.param_wait_s * per, c.compute_stall_s * per,
             double(t.pinned_bytes) / 1073741824.0, double(t.pin_wanted_bytes) / 1073741824.0,
             c.to_host_bytes * per * 1e-12, gbps(c.to_host_bytes, c.to_host_s), c.to_device_bytes * per * 1e-12,
             gbps(c.to_device_bytes, c.to_device_s));
}

void OffloadPipeline::wait_unit_updated(int unit, int64_t mark) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return unit_updates_[size_t(unit)] >= mark; });
}

void OffloadPipeline::finish() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

// ---------------------------------------------------------------- worker

void OffloadPipeline::run() {
  device_.bind_thread();
  // The worker's OpenMP team (this thread's setting only): device.cpu_threads,
  // else OpenMP's default, the team that first touched the host shards (NUMA).
  // The worker runs only between backward and the next forward, while the
  // GPU-issuing thread mostly waits for it, so they do not compete for cores.
  omp_set_num_threads(cpu_threads_ > 0 ? cpu_threads_ : omp_get_max_threads());
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      t = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    const auto t0 = Clock::now();
    try {
      switch (t.kind) {
        case Task::Update:
        case Task::Redo:
          for (int u = first_offloaded_; u < units_; ++u) update_unit(u, t);  // forward order
          break;
        case Task::Speculate: update_unit(t.unit, t); break;
        case Task::Accept: {  // after every Speculate task of the step (FIFO)
          std::lock_guard<std::mutex> lock(mutex_);
          for (int u = first_offloaded_; u < units_; ++u) ++unit_updates_[size_t(u)];
          break;
        }
        case Task::Discard:
          for (int u = first_offloaded_; u < units_; ++u) discard_unit(u, t);
          break;
      }
    } catch (const std::exception& e) {
      fatal(fmt("optim_cpu_offload worker: %s", e.what()));
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
      timing_.update_s += seconds_since(t0);
      timing_.updates += t.kind != Task::Speculate;  // one per step
    }
    changed_.notify_all();
  }
}

int OffloadPipeline::next_slot() {
  // The worker alone uses the slots (no lock): the slot's last upload has left it.
  const int slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kUploadSlots;
  if (slot_upload_[slot] >= 0) device_.host_wait(slot_upload_[slot]);
  return slot;
}

void OffloadPipeline::keep_state(int unit, bool restore) {
  const int64_t n = model_.layout.units[unit].shard_numel;
  float* kept = kept_[size_t(unit)].data();
  for (int a = 0; a <= optimizer_.states(); ++a) {
    float* live = a == 0 ? model_.param[unit].data() : optimizer_.state(a - 1)[unit].data();
    float* dst = restore ? live : kept + a * n;
    const float* src = restore ? kept + a * n : live;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n; c += (1 << 16)) std::memcpy(dst + c, src + c, 4 * size_t(std::min<int64_t>(n - c, 1 << 16)));
  }
}

void OffloadPipeline::update_unit(int unit, const Task& t) {
  const bool speculative = t.kind == Task::Speculate;
  if (device_grads_) {  // one unit ahead, except under the backward, where the units come one by one
    if (speculative || unit == first_offloaded_) issue_grad_copy(unit);
    if (!speculative && unit + 1 < units_) issue_grad_copy(unit + 1);
  }
  int64_t grad = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    grad = grad_copy_[unit];
  }
  const auto t0 = Clock::now();
  device_.host_wait(grad);  // the step's gradient has landed in the grad shard
  const double waited = seconds_since(t0);
  const int slot = next_slot();
  uint16_t* bf16 = slots_[slot].data();
  // An async save still copying this unit's state as of update number gate
  // mark (updates up to the mark are what it waits for, so they never wait).
  if (gate_) gate_->wait(unit, t.number);
  if (speculative) keep_state(unit, /*restore=*/false);
  if (t.kind == Task::Redo) keep_state(unit, /*restore=*/true);
  optimizer_.step_unit(unit, t.lr, t.clip, bf16, device_grads_ ? landing_[unit % kLandingBuffers].data() : nullptr,
                       t.step);
  const int64_t n = upload_numel_[unit];
  const int64_t ticket =
      n > 0 ? device_.copy_to_device(device_shards_[unit], bf16, 2 * size_t(n)) : -1;
  slot_upload_[slot] = ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    upload_[unit] = ticket;
    // A speculative update is final only once the step stands (Accept); the
    // next forward cannot start before update() decides anyway.
    --updating_[unit];
    if (!speculative) ++unit_updates_[size_t(unit)];
    timing_.grad_wait_s += waited;
  }
  changed_.notify_all();
}

// A skipped step after its speculative updates: the unit's state as it was,
// and its bf16 shard cast from it (the same rounding as push()) uploaded again.
void OffloadPipeline::discard_unit(int unit, const Task& t) {
  const int slot = next_slot();
  uint16_t* bf16 = slots_[slot].data();
  if (gate_) gate_->wait(unit, t.number);
  keep_state(unit, /*restore=*/true);
  const int64_t n = upload_numel_[unit];
  const float* master = model_.param[unit].data();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16_rne(master[i]);
  const int64_t ticket = n > 0 ? device_.copy_to_device(device_shards_[unit], bf16, 2 * size_t(n)) : -1;
  slot_upload_[slot] = ticket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    upload_[unit] = ticket;
    --updating_[unit];
    ++unit_updates_[size_t(unit)];
  }
  changed_.notify_all();
}

// ---------------------------------------------------------------- the state

OffloadState::OffloadState(ShardedModel& model, Optimizer& optimizer, const OptimSection& optim, Backend& backend,
                           int cpu_threads, bool device_grads, int device_units, bool speculative)
    : model_(model), optimizer_(optimizer), backend_(backend), first_offloaded_(device_units), speculative_(speculative) {
  const int units = static_cast<int>(model.layout.units.size());
  SHARDLM_CHECK(device_units >= 0 && device_units <= units, "internal: %d device units of %d", device_units, units);
  device_ = make_cuda_offload_device(backend.stream(), units);
  std::vector<void*> shards;
  for (int u = 0; u < units; ++u) {
    const int64_t n = model.layout.units[u].shard_numel;
    accumulators_.push_back(static_cast<float*>(backend.allocate(Mem::GradShard, 4 * n)));
    accumulator_copy_.push_back(-1);
    shards.push_back(backend.param_shard_mut(u));
  }
  if (device_units > 0) device_units_ = make_cuda_device_units(model, optimizer, optim, backend, device_units, accumulators_);
  pipeline_ = std::make_unique<OffloadPipeline>(model, optimizer, *device_, std::move(shards), cpu_threads, device_grads,
                                                &snapshot_gate, first_offloaded_, speculative);
  push();
}

OffloadState::~OffloadState() {
  pipeline_.reset();  // the worker is done with the accumulators and the copies
  // The device Comm's collectives are done before it goes, and the last copies
  // to the host have left the accumulators.
  backend_.synchronize();
  device_units_.reset();
  for (size_t u = 0; u < accumulators_.size(); ++u)
    backend_.deallocate(Mem::GradShard, accumulators_[u], 4 * model_.layout.units[u].shard_numel);
}

void OffloadState::begin_micro_batch() {
  const OffloadPipeline::MicroBatch mb = pipeline_->next_micro_batch();
  last_micro_batch_ = mb.last;
  first_micro_batch_ = mb.first;
}

// The step's first micro-batch, after its forward: the accumulators start from
// zero once the last step's copies have left them. Every unit's param_ready()
// has waited for its update by then, and with the gradients on the device each
// update waited for its own copy first. The device units' updates read theirs
// on the compute stream, before this.
void OffloadState::after_forward() {
  if (!first_micro_batch_) return;
  for (size_t u = 0; u < accumulators_.size(); ++u) {
    if (accumulator_copy_[u] >= 0) device_->compute_wait(accumulator_copy_[u]);
    accumulator_copy_[u] = -1;
    backend_.zero(accumulators_[u], 4 * size_t(model_.layout.units[u].shard_numel));
  }
}

void OffloadState::add_reduced(int unit, const void* reduced, int64_t n, DType type) {
  backend_.accumulate(accumulators_[unit], reduced, n, type);
}

// The step's last micro-batch: `unit`'s accumulated gradient goes into the
// clip norm and, offloaded, to the host behind the work queued so far.
void OffloadState::unit_done(int unit) {
  if (!last_micro_batch_) return;
  const int64_t n = model_.layout.units[unit].shard_numel;
  device_->queue_sumsq(unit, accumulators_[unit], n);  // the clip norm, before the copy
  if (unit >= first_offloaded_) accumulator_copy_[unit] = pipeline_->grad_ready(unit, accumulators_[unit], n);
}

double OffloadState::grad_sumsq() { return device_->read_sumsq(static_cast<int>(accumulators_.size())); }

// The pipeline counts the step (and starts the offloaded units); the device
// units' updates then go on the compute stream ahead of the next forward,
// which reaches them first.
void OffloadState::update(double lr, float clip) {
  pipeline_->update(lr, clip);
  if (device_units_) device_units_->update(optimizer_.steps_taken(), lr, clip);
  ++param_version_;
}

// The device units' masters on the GPU; the offloaded ones' in host memory,
// final for this step once param_ready(unit) has returned (the worker updates
// the unit again only after the next backward has handed its gradient over).
const float* OffloadState::master_shard(int unit) {
  return unit < first_offloaded_ ? device_units_->master(unit) : model_.param[unit].data();
}

// The host masters are final once the worker is idle and the device units'
// mirrors are downloaded. An async save's copier may still be reading those
// mirrors (snapshot_mark below filled them): it is let through them first.
void OffloadState::pull() {
  pipeline_->finish();
  if (!device_units_) return;
  snapshot_gate.wait(first_offloaded_ - 1, INT64_MAX);
  device_units_->pull();
}

// An async save: the device units' mirrors are filled now (their next update
// changes only the device copy), the offloaded units' are waited for per unit
// by the copier.
int64_t OffloadState::snapshot_mark() {
  if (device_units_) device_units_->pull();
  return pipeline_->updates_asked();
}

void OffloadState::wait_unit_updated(int unit, int64_t mark) {
  if (unit >= first_offloaded_) pipeline_->wait_unit_updated(unit, mark);
}

std::string OffloadState::summary() {
  const int units = static_cast<int>(accumulators_.size());
  if (!device_units_) return pipeline_->summary();
  return fmt("%s; optimizer state of units 0..%d on the GPU, %d of %d offloaded", pipeline_->summary().c_str(),
             first_offloaded_ - 1, units - first_offloaded_, units);
}

// The host masters changed outside the pipeline (start-up, a load): the device
// units upload theirs and cast them on the GPU; the offloaded ones are cast on
// the host (the same rounding as the pipeline's uploads) and their bf16
// shards copied up, so the GPU needs no fp32 staging unit.
void OffloadState::push() {
  device_->synchronize();  // no queued kernel still reads the old shards
  if (device_units_) device_units_->push();
  for (size_t u = size_t(first_offloaded_); u < model_.layout.units.size(); ++u) {
    const int64_t n = model_.layout.units[u].shard_numel;
    const float* master = model_.param[u].data();
    std::vector<uint16_t> bf16(n);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16_rne(master[i]);
    device_->host_wait(device_->copy_to_device(backend_.param_shard_mut(static_cast<int>(u)), bf16.data(), 2 * size_t(n)));
  }
  ++param_version_;
}

}  // namespace shardlm
