// offload.cpp — the optim_cpu_offload pipeline; see include/shardlm/offload.hpp.
#include "shardlm/offload.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "shardlm/cpu_ops.hpp"
#include "shardlm/error.hpp"
#include "shardlm/hf.hpp"
#include "shardlm/runtime.hpp"

namespace shardlm {
namespace {

constexpr int kLandingBuffers = 2;  // micro-batches after the first land here, then are added

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t max_shard_numel(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units) n = std::max(n, u.shard_numel);
  return n;
}

}  // namespace

int64_t OffloadPipeline::host_bytes(const ModelLayout& layout) {
  int64_t shards = 0;
  for (const auto& u : layout.units) shards += u.shard_numel;
  return 2 * shards + kLandingBuffers * 4 * max_shard_numel(layout);
}

OffloadPipeline::OffloadPipeline(ShardedModel& model, Optimizer& optimizer, Backend& backend, int cpu_threads)
    : model_(model),
      optimizer_(optimizer),
      backend_(backend),
      units_(static_cast<int>(model.layout.units.size())),
      cpu_threads_(cpu_threads) {
  SHARDLM_CHECK(backend.supports_async_copies(), "model.optim_cpu_offload needs a GPU backend (this one is %s)",
                backend.name());
  // Gradients land straight in the fp32 grad shards (the first micro-batch) or
  // in the landing buffers; the bf16 shards go up from pinned memory. Pinning
  // makes those copies asynchronous DMA that overlaps compute.
  auto pin = [&](void* p, size_t bytes) {
    timing_.pin_wanted_bytes += static_cast<int64_t>(bytes);
    if (!backend_.pin_host(p, bytes)) return;
    pinned_.push_back(p);
    timing_.pinned_bytes += static_cast<int64_t>(bytes);
  };
  for (int u = 0; u < units_; ++u) {
    const int64_t n = model.layout.units[u].shard_numel;
    bf16_.emplace_back(Mem::Workspace, n);
    std::memset(bf16_.back().data(), 0, bf16_.back().bytes());  // the padding no update writes
    pin(bf16_.back().data(), bf16_.back().bytes());
    pin(model.grad[u].data(), model.grad[u].bytes());
  }
  for (int i = 0; i < kLandingBuffers; ++i) {
    landing_.emplace_back(Mem::Workspace, max_shard_numel(model.layout));
    pin(landing_.back().data(), landing_.back().bytes());
  }
  arrivals_.assign(units_, 0);
  waited_.assign(units_, true);
  landing_free_.assign(kLandingBuffers, true);
  sumsq_.assign(units_, 0.0);
  upload_.assign(units_, -1);
  updating_.assign(units_, false);
  worker_ = std::thread([this] { run(); });
}

OffloadPipeline::~OffloadPipeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
  backend_.synchronize();
  for (void* p : pinned_) backend_.unpin_host(p);
}

void OffloadPipeline::push(const Task& t) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(t);
  }
  changed_.notify_all();
}

void OffloadPipeline::begin_step(int64_t micro_batches) {
  micro_batches_ = micro_batches;
  std::fill(arrivals_.begin(), arrivals_.end(), 0);
}

int64_t OffloadPipeline::grad_ready(int unit, const void* src, int64_t n, DType type) {
  SHARDLM_CHECK(n == model_.layout.units[unit].shard_numel, "internal: gradient of %lld elements for a %lld shard",
                (long long)n, (long long)model_.layout.units[unit].shard_numel);
  Task t;
  t.unit = unit;
  t.type = type;
  t.first = arrivals_[unit] == 0;
  t.last = ++arrivals_[unit] == micro_batches_;
  if (t.first && type == DType::F32) {
    t.ticket = backend_.copy_to_host(model_.grad[unit].data(), src, 4 * size_t(n));
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return std::find(landing_free_.begin(), landing_free_.end(), true) != landing_free_.end(); });
    t.landing = static_cast<int>(std::find(landing_free_.begin(), landing_free_.end(), true) - landing_free_.begin());
    landing_free_[t.landing] = false;
    lock.unlock();
    t.ticket = backend_.copy_to_host(landing_[t.landing].data(), src, dtype_bytes(type) * size_t(n));
  }
  push(t);
  return t.ticket;
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
  if (ticket >= 0) backend_.compute_wait(ticket);
  waited_[unit] = true;
}

double OffloadPipeline::grad_sumsq() {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return sumsq_done_ == units_; });
  timing_.norm_wait_s += seconds_since(t0);
  sumsq_done_ = 0;
  double total = 0;
  for (double s : sumsq_) total += s;  // unit order: the same sum every run
  return total;
}

void OffloadPipeline::update(double lr, float clip) {
  optimizer_.begin_step();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::fill(updating_.begin(), updating_.end(), true);
  }
  std::fill(waited_.begin(), waited_.end(), false);
  Task t;
  t.kind = Task::Update;
  t.lr = lr;
  t.clip = clip;
  push(t);
}

OffloadPipeline::Timing OffloadPipeline::timing() {
  std::lock_guard<std::mutex> lock(mutex_);
  return timing_;
}

std::string OffloadPipeline::summary() {
  const Timing t = timing();
  const Backend::CopyTotals c = backend_.copy_totals();
  const double per = t.updates > 0 ? 1e3 / double(t.updates) : 0.0;  // ms per update from seconds
  auto gbps = [](double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; };
  return fmt("offload: per update %.1f ms CPU update + upload issue, %.1f ms gradient landing (worker); forward "
             "waited %.1f ms for updates, backward %.1f ms for the norm; pinned %.2f of %.2f GiB; copies to the "
             "host %.2f GB per update at %.1f GB/s, to the device %.2f GB at %.1f GB/s",
             t.update_s * per, t.land_s * per, t.param_wait_s * per, t.norm_wait_s * per,
             double(t.pinned_bytes) / 1073741824.0, double(t.pin_wanted_bytes) / 1073741824.0,
             c.to_host_bytes * per * 1e-12, gbps(c.to_host_bytes, c.to_host_s), c.to_device_bytes * per * 1e-12,
             gbps(c.to_device_bytes, c.to_device_s));
}

void OffloadPipeline::finish() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

// ---------------------------------------------------------------- worker

void OffloadPipeline::run() {
  backend_.bind_thread();
  // The worker's OpenMP team (this thread's setting only): device.cpu_threads,
  // else one core fewer than the default, left to the thread that issues GPU work.
  omp_set_num_threads(cpu_threads_ > 0 ? cpu_threads_ : std::max(1, omp_get_max_threads() - 1));
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
      if (t.kind == Task::Grad) {
        land(t);
      } else {
        for (int u = 0; u < units_; ++u) update_unit(u, t.lr, t.clip);  // forward order: the embedding first
      }
    } catch (const std::exception& e) {
      fatal(fmt("optim_cpu_offload worker: %s", e.what()));
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
      (t.kind == Task::Grad ? timing_.land_s : timing_.update_s) += seconds_since(t0);
      timing_.updates += t.kind == Task::Update;
    }
    changed_.notify_all();
  }
}

// One gradient arrival: wait for its copy, add it into the grad shard unless it
// landed there itself, and on the step's last micro-batch take the shard's sum
// of squares (the clip norm needs every unit's before any update).
void OffloadPipeline::land(const Task& t) {
  backend_.host_wait(t.ticket);
  float* grad = model_.grad[t.unit].data();
  const int64_t n = model_.layout.units[t.unit].shard_numel;
  if (t.landing >= 0) {
    const float* f32 = landing_[t.landing].data();
    const auto* b16 = reinterpret_cast<const uint16_t*>(f32);
    if (t.type == DType::F32) {
      cpu::accumulate(grad, f32, n);  // not first: a first fp32 gradient lands in place
    } else if (t.first) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) grad[i] = bf16_to_f32(b16[i]);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) grad[i] += bf16_to_f32(b16[i]);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    landing_free_[t.landing] = true;
  }
  if (t.last) {
    const double s = cpu::sum_squares(grad, n);
    std::lock_guard<std::mutex> lock(mutex_);
    sumsq_[t.unit] = s;
    ++sumsq_done_;
  }
  changed_.notify_all();
}

void OffloadPipeline::update_unit(int unit, double lr, float clip) {
  int64_t previous = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    previous = upload_[unit];
  }
  if (previous >= 0) backend_.host_wait(previous);  // the last upload has left bf16_[unit] (long since)
  optimizer_.step_unit(unit, lr, clip, bf16_[unit].data());
  const int64_t ticket = backend_.copy_to_device(backend_.param_shard_for_upload(unit), bf16_[unit].data(),
                                                 bf16_[unit].bytes());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    upload_[unit] = ticket;
    updating_[unit] = false;
  }
  changed_.notify_all();
}

}  // namespace shardlm
