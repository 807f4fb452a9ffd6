// kernel_trace.cpp — a CUPTI activity tracer loaded into any CUDA program through
// the driver's injection hook, for tools/profile_step.py: every kernel, memcpy and
// memset the program runs, with its device start and end times, as one CSV.
//
//   bash tools/kernel_trace.sh                       # builds build-gpu/libkernel_trace.so
//   CUDA_INJECTION64_PATH=$PWD/build-gpu/libkernel_trace.so KERNEL_TRACE_OUT=trace.csv \
//       build/shardlm train DECK ...
//
// Unlike Nsight Compute, nothing is serialised or replayed: the program runs at
// its own speed (CUPTI's activity records cost about a microsecond a launch), so
// the gaps between kernels and the clocks under sustained load are the real ones.
// The CSV is written when the program exits normally (atexit), by the process
// that ran GPU work (a helper process that only initialised CUDA writes nothing).
//
// Columns: kind (kernel | memcpy | memset), start_ns, end_ns (device timestamps),
// stream, correlation id, name (demangled kernel name; for copies the direction
// and the bytes).
#include <cupti.h>
#include <cxxabi.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;

struct Row {
  const char* kind;
  uint64_t start, end;
  uint32_t stream, correlation;
  std::string name;
};

std::mutex rows_mutex;
std::vector<Row> rows;

void check(CUptiResult r, const char* call) {
  if (r == CUPTI_SUCCESS) return;
  const char* why = nullptr;
  cuptiGetResultString(r, &why);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", call, why ? why : "unknown CUPTI error");
  std::exit(1);
}

std::string demangled(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  return out;
}

const char* copy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    default: return "other";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Row> got;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        got.push_back({"kernel", k->start, k->end, k->streamId, k->correlationId, demangled(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        got.push_back({"memcpy", m->start, m->end, m->streamId, m->correlationId,
                       std::string(copy_kind(m->copyKind)) + " " + std::to_string(m->bytes)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        got.push_back({"memset", m->start, m->end, m->streamId, m->correlationId, std::to_string(m->bytes)});
        break;
      }
      default: break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(rows_mutex);
  for (auto& r : got) rows.push_back(std::move(r));
}

void write_rows() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(rows_mutex);
  // A process that ran nothing on the GPU (one that only initialised CUDA, such as
  // a helper the program starts) must not overwrite the trace of one that did.
  if (rows.empty()) return;
  const char* path = std::getenv("KERNEL_TRACE_OUT");
  if (!path) path = "kernel_trace.csv";
  std::FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s: %s\n", path, std::strerror(errno));
    return;
  }
  std::fprintf(f, "kind,start_ns,end_ns,stream,correlation,name\n");
  for (const Row& r : rows) {
    std::string name = r.name;
    for (char& c : name)
      if (c == '"') c = '\'';
    std::fprintf(f, "%s,%llu,%llu,%u,%u,\"%s\"\n", r.kind, (unsigned long long)r.start, (unsigned long long)r.end,
                 r.stream, r.correlation, name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu records in %s\n", rows.size(), path);
}

}  // namespace

// The CUDA driver calls this once, at the first CUDA call of a process started
// with CUDA_INJECTION64_PATH naming this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  std::atexit(write_rows);
  return 1;
}
