// memory.cpp — aligned host allocation with per-category counters.
#include "shardlm/memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <tuple>

#include "shardlm/error.hpp"

namespace shardlm {
namespace {
MemCounters g_counters;  // host
MemCounters g_device;
int64_t g_device_limit = 0;  // device.memory_limit_gib in bytes; 0: none

void track(MemCounters& m, Mem category, int64_t delta) {
  const int c = static_cast<int>(category);
  m.current[c] += delta;
  m.total_current += delta;
  m.peak[c] = std::max(m.peak[c], m.current[c]);
  m.total_peak = std::max(m.total_peak, m.total_current);
}
}  // namespace

const char* mem_name(Mem m) {
  switch (m) {
    case Mem::ParamShard: return "param shards";
    case Mem::GradShard: return "grad shards";
    case Mem::OptimState: return "optimizer state";
    case Mem::Gathered: return "gathered units";
    case Mem::Activations: return "activations";
    case Mem::Workspace: return "workspace";
    case Mem::Data: return "data";
    case Mem::Snapshot: return "checkpoint snapshot";
    case Mem::kCount: break;
  }
  return "?";
}

void* mem_alloc(Mem category, size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  SHARDLM_CHECK(p, "out of host memory allocating %zu bytes for %s", bytes, mem_name(category));
  track(g_counters, category, static_cast<int64_t>(bytes));
  return p;
}

void mem_free(Mem category, void* ptr, size_t bytes) {
  std::free(ptr);
  track(g_counters, category, -static_cast<int64_t>(bytes));
}

MemCounters host_memory() { return g_counters; }

void host_mem_track(Mem category, int64_t delta) { track(g_counters, category, delta); }

void device_mem_track(Mem category, int64_t delta) { track(g_device, category, delta); }

void set_device_memory_limit(int64_t bytes) { g_device_limit = std::max<int64_t>(bytes, 0); }

void device_mem_admit(Mem category, int64_t bytes) {
  if (g_device_limit <= 0 || g_device.total_current + bytes <= g_device_limit) return;
  constexpr double mib = 1024.0 * 1024.0;
  SHARDLM_FAIL("device.memory_limit_gib = %g: allocating %.1f MiB for %s would hold %.1f MiB of GPU memory, over "
               "the limit of %.1f MiB (`shardlm check DECK` prints the plan; optim_cpu_offload, activation "
               "checkpointing or more ranks make it smaller)",
               double(g_device_limit) / (1024.0 * mib), double(bytes) / mib, mem_name(category),
               double(g_device.total_current + bytes) / mib, double(g_device_limit) / mib);
}

MemCounters device_memory() { return g_device; }

namespace {
// A cgroup limit file's value in bytes; 0 for "max", absent or unreadable.
int64_t cgroup_limit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  return end && *end == '\0' && v > 0 ? v : 0;
}
}  // namespace

MachineMemory machine_host_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  MachineMemory m{pages > 0 && page > 0 ? int64_t(pages) * page : 0, "MemTotal"};
  // v2, then v1 (whose "no limit" is a huge number, larger than MemTotal).
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"})
    if (const int64_t limit = cgroup_limit(path); limit > 0 && (m.bytes == 0 || limit < m.bytes)) {
      m = {limit, "cgroup memory limit"};
      break;
    }
  return m;
}

void reset_host_peaks() {
  g_counters.peak = g_counters.current;
  g_counters.total_peak = g_counters.total_current;
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
      {"data reader", "host", p.data_reader},       {"ckpt snapshot", "host", p.checkpoint_snapshot},
      {"reference weights", "host", p.reference_weights}, {"reference copies", "GPU", p.reference_copies}};
  for (const auto& [name, place, bytes] : rows)
    if (bytes > 0) out += fmt("  %-18s %-5s %12.3f MiB\n", name, place, mib(bytes));
  out += fmt("  %-18s %-5s %12.3f MiB\n", "total", "host", mib(p.host_total()));
  if (p.device) out += fmt("  %-18s %-5s %12.3f MiB\n", "total", "GPU", mib(p.device_total()));
  if (p.checkpoint_device_snapshot > 0)
    out += fmt("  %-18s %-5s %12.3f MiB  (taken where the GPU has room after the total; not in it)\n", "ckpt snapshot",
               "GPU", mib(p.checkpoint_device_snapshot));
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
  if (gpu_bytes > 0 && device_need > double(gpu_bytes)) {
    const std::string stream =
        p.fp32_stream > 0 ? fmt("model.residual_dtype = \"bf16\" (%.2f GiB less per rank), ", double(p.fp32_stream) / gib)
                          : std::string();
    return fmt("the memory plan needs %.2f GiB of GPU memory per rank x %d rank%s on the GPU = %.2f GiB, more than its "
               "%.2f GiB: model.optim_cpu_offload = true, %s%s",
               double(p.device_total()) / gib, ranks_per_gpu, ranks_per_gpu == 1 ? "" : "s", device_need / gib,
               double(gpu_bytes) / gib, stream.c_str(), levers);
  }
  return "";
}

}  // namespace shardlm
