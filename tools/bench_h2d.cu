// bench_h2d.cu — why the offload pipeline's uploads (host to device) measured a
// third of its downloads (docs/benchmarks.md, "Offload": 16.9 vs 55 GB/s on the
// H200 machine). A standalone microbenchmark of the link, no shardlm code:
// each case copies the same bytes in chunks the size of one unit's bf16 shard
// and prints the device-timed bandwidth.
//
//   h2d-pinned      host to device from cudaMallocHost memory, alone
//   h2d-registered  the same from malloc'd memory page-locked by cudaHostRegister
//                   (what the pipeline's upload slots are)
//   h2d-pageable    the same from plain malloc'd memory (staged by the driver)
//   h2d-wc          the same from write-combined pinned memory (cudaHostAllocWriteCombined:
//                   not cached by the CPU, whose bf16 casts only write it; a
//                   candidate for the upload slots), alone and beside the host loop
//   d2h-registered  device to host into registered memory, alone (the gradients' way)
//   h2d+d2h         both directions at once on two streams (gradients going down
//                   while parameters go up)
//   h2d+host-T      host to device while T OpenMP threads stream through host
//                   memory as the CPU AdamW does (read g, m, v, p; write m, v, p),
//                   for T = 1, half and all of the cores; also prints the host
//                   loop's own GB/s alone and during the copies
//   h2d+d2h+host-T  both directions and the host loop: the pipeline's situation
//   pipe-cached-T   the pipeline's own pattern: T threads write a chunk (one
//   pipe-nt-T       unit's bf16 cast) into one of two registered slots, its
//                   upload is queued, the next chunk is written into the other
//                   slot meanwhile; the uploads' device time. cached: plain
//                   stores (the CPU AdamW's, which leave the lines dirty in the
//                   CPU's caches for the DMA engine to snoop); nt: non-temporal
//                   stores (straight to memory)
//
// Build and run on the GPU machine (the Makefile's bench target, or by hand):
//   nvcc -O2 -std=c++17 -Xcompiler -fopenmp tools/bench_h2d.cu -o build/bench_h2d
//   build/bench_h2d [--chunk-mib 436] [--total-gib 8] [--host-gib 4] [--threads N]
//   numactl --cpunodebind=0 --membind=0 build/bench_h2d   (the GPU's NUMA node;
//   `nvidia-smi topo -m` names it): a host buffer on the other socket is a cause
//   of its own, worth running both ways.
#include <cuda_runtime.h>
#include <emmintrin.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CUDA_CHECK(call)                                                                                 \
  do {                                                                                                   \
    cudaError_t e_ = (call);                                                                             \
    if (e_ != cudaSuccess) {                                                                             \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));        \
      std::exit(1);                                                                                      \
    }                                                                                                    \
  } while (0)

namespace {

struct Options {
  size_t chunk_bytes = size_t(436) << 20;  // one Llama-8B decoder layer's bf16 shard at world 1
  size_t total_bytes = size_t(8) << 30;    // per measured case
  size_t host_bytes = size_t(4) << 30;     // per array of the host loop (4 arrays)
  int threads = 0;                         // all cores (omp_get_max_threads) unless given
};

// A host loop with AdamW's memory traffic: four fp32 arrays read, three written.
class HostLoop {
 public:
  explicit HostLoop(size_t bytes_per_array) : n_(bytes_per_array / 4) {
    for (auto* a : {&g_, &m_, &v_, &p_}) {
      a->resize(n_);
#pragma omp parallel for schedule(static)
      for (size_t i = 0; i < n_; ++i) (*a)[i] = 1e-3f * float(i % 1000);  // first touch by the team
    }
  }
  // Runs on its own thread with `threads` OpenMP threads until stop(); returns GB/s.
  void start(int threads) {
    stop_.store(false);
    passes_ = 0;
    worker_ = std::thread([this, threads] {
      omp_set_num_threads(threads);
      const auto t0 = std::chrono::steady_clock::now();
      while (!stop_.load()) {
        pass();
        ++passes_;
      }
      seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  double stop() {
    stop_.store(true);
    worker_.join();
    return double(passes_) * 7.0 * 4.0 * double(n_) / seconds_ / 1e9;  // 4 reads + 3 writes per element
  }

 private:
  void pass() {
    float *g = g_.data(), *m = m_.data(), *v = v_.data(), *p = p_.data();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n_; ++i) {
      const float mi = 0.9f * m[i] + 0.1f * g[i];
      const float vi = 0.999f * v[i] + 0.001f * g[i] * g[i];
      m[i] = mi;
      v[i] = vi;
      p[i] -= 1e-4f * mi / (vi + 1e-8f);
    }
  }
  size_t n_;
  std::vector<float> g_, m_, v_, p_;
  std::atomic<bool> stop_{false};
  std::thread worker_;
  int64_t passes_ = 0;
  double seconds_ = 1;
};

// total bytes in chunks from `host` (chunk_bytes, reused) to `dev` on `stream`,
// device-timed; returns GB/s.
struct Stream {
  cudaStream_t s;
  cudaEvent_t start, done;
  Stream() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&done));
  }
  void issue(void* dst, const void* src, const Options& o, cudaMemcpyKind kind) {
    CUDA_CHECK(cudaEventRecord(start, s));
    for (size_t at = 0; at < o.total_bytes; at += o.chunk_bytes)
      CUDA_CHECK(cudaMemcpyAsync(dst, src, std::min(o.chunk_bytes, o.total_bytes - at), kind, s));
    CUDA_CHECK(cudaEventRecord(done, s));
  }
  double gbps(const Options& o) {
    CUDA_CHECK(cudaEventSynchronize(done));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, done));
    return double(o.total_bytes) / (1e-3 * ms) / 1e9;
  }
};

// Fills `bytes` of dst (16-byte aligned) with T threads: plain stores, or
// non-temporal ones that bypass the caches.
void host_write(char* dst, size_t bytes, int threads, bool non_temporal, int value) {
  const int64_t n = int64_t(bytes / 16);
  const __m128i x = _mm_set1_epi8(char(value));
  if (non_temporal) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + i, x);
    _mm_sfence();
  } else {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) _mm_store_si128(reinterpret_cast<__m128i*>(dst) + i, x);
  }
}

// The pipeline's pattern (see the header): returns the uploads' GB/s, device-timed
// copy by copy, and the host's write GB/s in `write_gbps`.
double pipelined(void* dev, char* const slot[2], const Options& o, int threads, bool non_temporal,
                 cudaStream_t s, double* write_gbps) {
  cudaEvent_t start[2], done[2];
  for (int k = 0; k < 2; ++k) {
    CUDA_CHECK(cudaEventCreate(&start[k]));
    CUDA_CHECK(cudaEventCreate(&done[k]));
  }
  const int64_t count = int64_t(o.total_bytes / o.chunk_bytes);
  double copy_s = 0, write_s = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int k = int(i % 2);
    if (i >= 2) {  // the slot's last upload is done: time it, then write over it
      CUDA_CHECK(cudaEventSynchronize(done[k]));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start[k], done[k]));
      copy_s += 1e-3 * ms;
    }
    const auto t0 = std::chrono::steady_clock::now();
    host_write(slot[k], o.chunk_bytes, threads, non_temporal, int(i));
    write_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CUDA_CHECK(cudaEventRecord(start[k], s));
    CUDA_CHECK(cudaMemcpyAsync(dev, slot[k], o.chunk_bytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(done[k], s));
  }
  for (int64_t i = std::max<int64_t>(0, count - 2); i < count; ++i) {
    const int k = int(i % 2);
    CUDA_CHECK(cudaEventSynchronize(done[k]));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start[k], done[k]));
    copy_s += 1e-3 * ms;
  }
  for (int k = 0; k < 2; ++k) {
    CUDA_CHECK(cudaEventDestroy(start[k]));
    CUDA_CHECK(cudaEventDestroy(done[k]));
  }
  *write_gbps = double(count) * double(o.chunk_bytes) / write_s / 1e9;
  return double(count) * double(o.chunk_bytes) / copy_s / 1e9;
}

void line(const std::string& name, double gbps, const std::string& note = "") {
  std::printf("%-22s %7.1f GB/s%s%s\n", name.c_str(), gbps, note.empty() ? "" : "  ", note.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const double v = std::atof(argv[i + 1]);
    if (a == "--chunk-mib") o.chunk_bytes = size_t(v * 1048576.0);
    else if (a == "--total-gib") o.total_bytes = size_t(v * 1073741824.0);
    else if (a == "--host-gib") o.host_bytes = size_t(v * 1073741824.0);
    else if (a == "--threads") o.threads = int(v);
    else {
      std::fprintf(stderr, "usage: %s [--chunk-mib M] [--total-gib G] [--host-gib G] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  const int cores = o.threads > 0 ? o.threads : omp_get_max_threads();
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("GPU %s (PCI %04x:%02x:%02x), async engines %d; chunk %.0f MiB, %.1f GiB per case; %d host threads\n",
              prop.name, prop.pciDomainID, prop.pciBusID, prop.pciDeviceID, prop.asyncEngineCount,
              double(o.chunk_bytes) / 1048576.0, double(o.total_bytes) / 1073741824.0, cores);

  void *dev_up = nullptr, *dev_down = nullptr, *pinned = nullptr, *write_combined = nullptr;
  CUDA_CHECK(cudaMalloc(&dev_up, o.chunk_bytes));
  CUDA_CHECK(cudaMalloc(&dev_down, o.chunk_bytes));
  CUDA_CHECK(cudaMallocHost(&pinned, o.chunk_bytes));
  CUDA_CHECK(cudaHostAlloc(&write_combined, o.chunk_bytes, cudaHostAllocWriteCombined));
  std::memset(write_combined, 1, o.chunk_bytes);
  std::vector<char> registered_up(o.chunk_bytes, 1), registered_down(o.chunk_bytes, 1), pageable(o.chunk_bytes, 1);
  CUDA_CHECK(cudaHostRegister(registered_up.data(), o.chunk_bytes, cudaHostRegisterDefault));
  CUDA_CHECK(cudaHostRegister(registered_down.data(), o.chunk_bytes, cudaHostRegisterDefault));
  std::memset(pinned, 1, o.chunk_bytes);
  Stream up, down;
  // Warm-up: the first copies pay for the driver's mappings.
  up.issue(dev_up, registered_up.data(), o, cudaMemcpyHostToDevice);
  up.gbps(o);

  up.issue(dev_up, pinned, o, cudaMemcpyHostToDevice);
  line("h2d-pinned", up.gbps(o));
  up.issue(dev_up, registered_up.data(), o, cudaMemcpyHostToDevice);
  line("h2d-registered", up.gbps(o));
  up.issue(dev_up, pageable.data(), o, cudaMemcpyHostToDevice);
  line("h2d-pageable", up.gbps(o));
  up.issue(dev_up, write_combined, o, cudaMemcpyHostToDevice);
  line("h2d-wc", up.gbps(o));
  down.issue(registered_down.data(), dev_down, o, cudaMemcpyDeviceToHost);
  line("d2h-registered", down.gbps(o));
  up.issue(dev_up, registered_up.data(), o, cudaMemcpyHostToDevice);
  down.issue(registered_down.data(), dev_down, o, cudaMemcpyDeviceToHost);
  const double both_up = up.gbps(o), both_down = down.gbps(o);
  line("h2d+d2h", both_up, "(h2d; d2h " + std::to_string(int(both_down + 0.5)) + " GB/s)");

  HostLoop host(o.host_bytes);
  std::vector<int> team = {1, std::max(1, cores / 2), cores};
  for (int t : team) {
    host.start(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const double alone = host.stop();
    host.start(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the loop at speed before the copies
    up.issue(dev_up, registered_up.data(), o, cudaMemcpyHostToDevice);
    const double h2d = up.gbps(o);
    const double during = host.stop();
    char note[128];
    std::snprintf(note, sizeof note, "(host loop %.1f GB/s alone, %.1f during)", alone, during);
    line("h2d+host-" + std::to_string(t), h2d, note);

    host.start(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    up.issue(dev_up, registered_up.data(), o, cudaMemcpyHostToDevice);
    down.issue(registered_down.data(), dev_down, o, cudaMemcpyDeviceToHost);
    const double u = up.gbps(o), d = down.gbps(o);
    const double during2 = host.stop();
    std::snprintf(note, sizeof note, "(d2h %.1f GB/s; host loop %.1f GB/s)", d, during2);
    line("h2d+d2h+host-" + std::to_string(t), u, note);

    host.start(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    up.issue(dev_up, write_combined, o, cudaMemcpyHostToDevice);
    const double wc = up.gbps(o);
    std::snprintf(note, sizeof note, "(host loop %.1f GB/s)", host.stop());
    line("h2d-wc+host-" + std::to_string(t), wc, note);
  }
  // The pipeline's pattern: two registered slots (registered_up and a second).
  std::vector<char> second(o.chunk_bytes + 64, 1);
  char* second_slot = second.data() + (64 - reinterpret_cast<uintptr_t>(second.data()) % 64) % 64;
  CUDA_CHECK(cudaHostRegister(second_slot, o.chunk_bytes, cudaHostRegisterDefault));
  char* const slots[2] = {registered_up.data(), second_slot};
  for (int t : team)
    for (const bool nt : {false, true}) {
      double wr = 0;
      const double gbps = pipelined(dev_up, slots, o, t, nt, up.s, &wr);
      char note[96];
      std::snprintf(note, sizeof note, "(the host wrote the slots at %.1f GB/s)", wr);
      line(std::string(nt ? "pipe-nt-" : "pipe-cached-") + std::to_string(t), gbps, note);
    }
  CUDA_CHECK(cudaHostUnregister(second_slot));
  CUDA_CHECK(cudaHostUnregister(registered_up.data()));
  CUDA_CHECK(cudaHostUnregister(registered_down.data()));
  CUDA_CHECK(cudaFreeHost(pinned));
  CUDA_CHECK(cudaFreeHost(write_combined));
  CUDA_CHECK(cudaFree(dev_up));
  CUDA_CHECK(cudaFree(dev_down));
  return 0;
}
