// bench_cpu_adamw.cpp — time the host AdamW (src/cpu/adamw.hpp) on one flat fp32 shard,
// per ISA, bf16 copy on/off and thread count, next to this host's memory
// bandwidth from a STREAM-style triad at the same thread count.
//
//   make bench-cpu-adamw && build/bench_cpu_adamw [--params 256M] [--threads 1,2,4]
//        [--isa scalar,avx2,avx512] [--bf16 no|yes|both] [--steps 10] [--triad-numel N]
//
// Bytes per parameter and step: p, g, m, v read (16) and p, m, v written (12), plus
// 2 for the bf16 copy: the minimum traffic, so GB/s against the triad's says how
// close the update runs to the memory system's limit. The triad a[i] = b[i] + s*c[i]
// on doubles counts 24 bytes per element (STREAM's convention). The triad also
// reads each line of a before overwriting it (write-allocate), uncounted; AdamW
// writes only lines it has just read, so it has no such hidden traffic and its
// pct column can pass 100 on a host where that extra read costs. Every array is first touched by the threads that
// later use it, with the same static schedule, so pages sit on their NUMA node.
// Each time is the median of --steps runs after two warm-up runs.
// Output: '#' comment lines and one table; every row starts with its impl name
// (shardlm | triad), the format tools/bench_torch_adamw.py prints too.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cpu/adamw.hpp"

namespace cpu = shardlm::cpu;

namespace {

struct Options {
  int64_t params = int64_t(256) << 20;
  int64_t triad_numel = 0;  // 0: max(params, 32Mi) doubles, well past any LLC
  std::vector<int> threads;
  std::vector<cpu::CpuIsa> isas;
  std::vector<bool> bf16 = {false, true};
  int steps = 10;
  bool isa_given = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_cpu_adamw: %s\n"
               "usage: bench_cpu_adamw [--params N[K|M|G]] [--threads 1,2,4] [--isa scalar,avx2,avx512]\n"
               "                       [--bf16 no|yes|both] [--steps N] [--triad-numel N[K|M|G]]\n"
               "  K, M, G are binary (2^10, 2^20, 2^30); defaults: 256M parameters, threads\n"
               "  1, 2, 4, ... up to every core, every ISA this CPU runs, bf16 both, 10 steps\n",
               why);
  std::exit(2);
}

int64_t parse_count(const std::string& s) {
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  double scale = 1;
  if (*end == 'K' || *end == 'k') scale = 1 << 10, ++end;
  else if (*end == 'M' || *end == 'm') scale = 1 << 20, ++end;
  else if (*end == 'G' || *end == 'g') scale = double(1 << 30), ++end;
  if (end == s.c_str() || *end != '\0' || x < 0) usage(("not a count: " + s).c_str());
  return static_cast<int64_t>(x * scale);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("time the host AdamW");
    if (i + 1 >= argc) usage(("missing value after " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--params") {
      o.params = parse_count(value);
    } else if (flag == "--triad-numel") {
      o.triad_numel = parse_count(value);
    } else if (flag == "--steps") {
      o.steps = static_cast<int>(parse_count(value));
    } else if (flag == "--threads") {
      for (const auto& t : split(value)) o.threads.push_back(static_cast<int>(parse_count(t)));
    } else if (flag == "--isa") {
      o.isa_given = true;
      for (const auto& name : split(value)) {
        const cpu::CpuIsa isa = cpu::resolve_isa(name.c_str());
        if (name != cpu::isa_name(isa)) {
          std::fprintf(stderr, "# --isa %s: not available on this CPU, skipped\n", name.c_str());
          continue;
        }
        o.isas.push_back(isa);
      }
    } else if (flag == "--bf16") {
      if (value == "no") o.bf16 = {false};
      else if (value == "yes") o.bf16 = {true};
      else if (value == "both") o.bf16 = {false, true};
      else usage("--bf16 takes no, yes or both");
    } else {
      usage(("unknown option " + flag).c_str());
    }
  }
  if (o.params < 1 || o.steps < 1) usage("--params and --steps must be at least 1");
  if (o.threads.empty()) {
    const int cores = omp_get_num_procs();
    for (int t = 1; t < cores; t *= 2) o.threads.push_back(t);
    o.threads.push_back(cores);
  }
  for (int t : o.threads)
    if (t < 1) usage("thread counts must be at least 1");
  if (o.isa_given && o.isas.empty()) usage("none of the --isa names runs on this CPU");
  if (o.isas.empty())
    for (cpu::CpuIsa isa : {cpu::CpuIsa::scalar, cpu::CpuIsa::avx2, cpu::CpuIsa::avx512})
      if (cpu::isa_supported(isa)) o.isas.push_back(isa);
  if (o.triad_numel == 0) o.triad_numel = std::max(o.params, int64_t(32) << 20);
  return o;
}

// Uninitialised, 64-byte aligned: the first write (by the benchmark's threads)
// decides which NUMA node each page lands on.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
std::unique_ptr<T[], FreeDeleter> alloc_untouched(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
  if (!p) {
    std::fprintf(stderr, "bench_cpu_adamw: cannot allocate %zu bytes\n", bytes);
    std::exit(1);
  }
  return std::unique_ptr<T[], FreeDeleter>(p);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median seconds of `runs` calls of fn after two warm-up calls.
template <class F>
double median_s(int runs, F&& fn) {
  fn();
  fn();
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const double t0 = now_s();
    fn();
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return runs % 2 ? t[runs / 2] : 0.5 * (t[runs / 2 - 1] + t[runs / 2]);
}

// A value in [-1, 1) from the element index: cheap, deterministic, not constant.
float hashed(int64_t i, uint64_t salt) {
  uint64_t x = (static_cast<uint64_t>(i) + salt) * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t(1) << 23)) * (1.0f / float(1 << 23));
}

// restrict: without it every store could alias the other arrays and the loop
// would not vectorise (measured: half the bandwidth on one core).
void triad(double* __restrict a, const double* __restrict b, const double* __restrict c, double s, int64_t n,
           int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

double triad_gbps(int64_t n, int threads, int runs) {
  // (n) fp64 each.
  auto a = alloc_untouched<double>(n), b = alloc_untouched<double>(n), c = alloc_untouched<double>(n);
  double *pa = a.get(), *pb = b.get(), *pc = c.get();
  // The triad's own schedule, so each thread first-touches the pages it streams.
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) pa[i] = 0.0, pb[i] = 1.0, pc[i] = 2.0;
  const double t = median_s(runs, [&] { triad(pa, pb, pc, 3.0, n, threads); });
  // Read back one element so the triad cannot be optimised away.
  if (pa[n / 2] != 7.0) std::fprintf(stderr, "# triad check failed: %g\n", pa[n / 2]);
  return 24.0 * double(n) / t / 1e9;
}

void row(const char* impl, const char* isa, const char* bf16, int threads, int64_t numel, double ms,
         double bytes_per_elem, double triad) {
  const double s = ms / 1e3;
  const double gbps = bytes_per_elem * double(numel) / s / 1e9;
  std::printf("%-16s %-8s %-4s %7d %11lld %10.3f %9.3f %8.1f %10.1f %7.1f\n", impl, isa, bf16, threads,
              static_cast<long long>(numel), ms, double(numel) / s / 1e9, gbps, triad, 100.0 * gbps / triad);
  std::fflush(stdout);
}

// One step of every ISA on the first min(n, 1Mi) elements of the same state must
// give the same bits (the unit tests' property, rechecked on this host's CPU).
bool isas_agree(const Options& o) {
  const int64_t n = std::min<int64_t>(o.params, 1 << 20);
  const cpu::AdamWConsts k = cpu::adamw_consts(1e-3, 0.9, 0.95, 1e-8, 3);
  std::vector<float> ref_p, ref_m, ref_v;
  std::vector<uint16_t> ref_b;
  bool agree = true;
  for (cpu::CpuIsa isa : o.isas) {
    std::vector<float> p(n), g(n), m(n), v(n);
    std::vector<uint16_t> b(n);
    for (int64_t i = 0; i < n; ++i) p[i] = hashed(i, 1), g[i] = 0.01f * hashed(i, 2), m[i] = 1e-3f * hashed(i, 3);
    for (int64_t i = 0; i < n; ++i) v[i] = 1e-6f * hashed(i, 4) * hashed(i, 4);
    cpu::adamw_step_isa(isa, p.data(), b.data(), g.data(), m.data(), v.data(), n, 0.5f, 0.1f, k);
    if (ref_p.empty()) {
      ref_p = p, ref_m = m, ref_v = v, ref_b = b;
    } else {
      agree = agree && p == ref_p && m == ref_m && v == ref_v && b == ref_b;
    }
  }
  return agree;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf("# bench_cpu_adamw: params=%lld steps=%d cores=%d best_isa=%s default_isa=%s triad_numel=%lld\n",
              static_cast<long long>(o.params), o.steps, omp_get_num_procs(), cpu::isa_name(cpu::best_isa()),
              cpu::adamw_isa(), static_cast<long long>(o.triad_numel));
  std::printf("# bytes/param: 28 (p,g,m,v read; p,m,v written), 30 with the bf16 copy; triad 24/element\n");
  std::printf("# ms_step: median of %d after 2 warm-up; pct: GB_s / triad_GB_s at the same thread count\n", o.steps);
  std::printf("# the triad's write-allocate read of a is not counted (STREAM's rule), AdamW has none: pct may pass 100\n");
  std::printf("%-16s %-8s %-4s %7s %11s %10s %9s %8s %10s %7s\n", "impl", "isa", "bf16", "threads", "params",
              "ms_step", "Gparam_s", "GB_s", "triad_GB_s", "pct");
  const int64_t n = o.params;
  const cpu::AdamWConsts k = cpu::adamw_consts(1e-3, 0.9, 0.95, 1e-8, 10);
  for (int threads : o.threads) {
    const double triad = triad_gbps(o.triad_numel, threads, o.steps);
    row("triad", "-", "-", threads, o.triad_numel, 24.0 * double(o.triad_numel) / triad / 1e6, 24.0, triad);

    // (n) fp32 each: parameters, gradients, first and second moments; (n) bf16 bits.
    auto p = alloc_untouched<float>(n), g = alloc_untouched<float>(n);
    auto m = alloc_untouched<float>(n), v = alloc_untouched<float>(n);
    auto p_bf16 = alloc_untouched<uint16_t>(n);
    const int64_t blocks = (n + cpu::kAdamWBlock - 1) / cpu::kAdamWBlock;
    // adamw_step's schedule: static over kAdamWBlock blocks.
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t i = blk * cpu::kAdamWBlock; i < std::min(n, (blk + 1) * cpu::kAdamWBlock); ++i) {
        p[i] = hashed(i, 1), g[i] = 0.01f * hashed(i, 2), m[i] = 0.0f, v[i] = 0.0f, p_bf16[i] = 0;
      }
    for (cpu::CpuIsa isa : o.isas)
      for (bool bf16 : o.bf16) {
        const double t = median_s(o.steps, [&] {
          cpu::adamw_step_isa(isa, p.get(), bf16 ? p_bf16.get() : nullptr, g.get(), m.get(), v.get(), n, 1.0f,
                              0.1f, k, threads);
        });
        row("shardlm", cpu::isa_name(isa), bf16 ? "yes" : "no", threads, n, t * 1e3, bf16 ? 30.0 : 28.0, triad);
      }
  }
  std::printf("# check: ISA paths agree bitwise on one step: %s\n", isas_agree(o) ? "yes" : "NO");
  return 0;
}
