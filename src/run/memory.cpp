// memory.cpp — aligned host allocation with per-category counters.
#include "shardlm/memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

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

}  // namespace shardlm
