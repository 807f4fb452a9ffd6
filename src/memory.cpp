// memory.cpp — aligned host allocation with per-category counters.
#include "shardlm/memory.hpp"

#include <algorithm>
#include <cstdlib>

#include "shardlm/error.hpp"

namespace shardlm {
namespace {
MemCounters g_counters;
}

const char* mem_name(Mem m) {
  switch (m) {
    case Mem::ParamShard: return "param shards";
    case Mem::GradShard: return "grad shards";
    case Mem::OptimState: return "optimizer state";
    case Mem::Gathered: return "gathered units";
    case Mem::Activations: return "activations";
    case Mem::Workspace: return "workspace";
    case Mem::Data: return "data";
    case Mem::kCount: break;
  }
  return "?";
}

void* mem_alloc(Mem category, size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  SHARDLM_CHECK(p, "out of host memory allocating %zu bytes for %s", bytes, mem_name(category));
  const int c = static_cast<int>(category);
  g_counters.current[c] += static_cast<int64_t>(bytes);
  g_counters.total_current += static_cast<int64_t>(bytes);
  if (g_counters.current[c] > g_counters.peak[c]) g_counters.peak[c] = g_counters.current[c];
  if (g_counters.total_current > g_counters.total_peak) g_counters.total_peak = g_counters.total_current;
  return p;
}

void mem_free(Mem category, void* ptr, size_t bytes) {
  std::free(ptr);
  const int c = static_cast<int>(category);
  g_counters.current[c] -= static_cast<int64_t>(bytes);
  g_counters.total_current -= static_cast<int64_t>(bytes);
}

MemCounters host_memory() { return g_counters; }

namespace {
MemCounters g_device;
}

void device_mem_track(Mem category, int64_t delta) {
  const int c = static_cast<int>(category);
  g_device.current[c] += delta;
  g_device.total_current += delta;
  g_device.peak[c] = std::max(g_device.peak[c], g_device.current[c]);
  g_device.total_peak = std::max(g_device.total_peak, g_device.total_current);
}

MemCounters device_memory() { return g_device; }

void reset_host_peaks() {
  g_counters.peak = g_counters.current;
  g_counters.total_peak = g_counters.total_current;
}

}  // namespace shardlm
