// op_timer.cu — per-operation device time from events (see op_timer.hpp).
#include "cuda/op_timer.hpp"

#include <cstdio>

#include "cuda/check.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cuda {

OpTimer::~OpTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

cudaEvent_t OpTimer::event(size_t i) {
  while (pool_.size() <= i) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  return pool_[i];
}

void OpTimer::begin() {
  SHARDLM_CHECK(!open_, "internal: OpTimer::begin inside an open span");
  pending_.clear();
  CUDA_CHECK(cudaEventRecord(event(0), stream_));
  open_ = true;
}

void OpTimer::mark(const char* op) {
  if (!open_) return;
  pending_.push_back(op);
  CUDA_CHECK(cudaEventRecord(event(pending_.size()), stream_));
}

void OpTimer::end() {
  if (!open_) return;
  open_ = false;
  if (pending_.empty()) return;
  CUDA_CHECK(cudaEventSynchronize(event(pending_.size())));
  for (size_t i = 0; i < pending_.size(); ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[i], pool_[i + 1]));
    Total* t = nullptr;
    for (Total& x : totals_)
      if (x.op == pending_[i]) t = &x;
    if (!t) t = &totals_.emplace_back(Total{pending_[i]});
    t->ms += ms;
    ++t->count;
  }
}

double OpTimer::total_ms() const {
  double sum = 0;
  for (const Total& t : totals_) sum += t.ms;
  return sum;
}

std::string OpTimer::report(int64_t per, const char* per_name) const {
  const double sum = total_ms();
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "  %-16s %10s %12s %8s %8s\n", "operation", "total ms", "ms per step", "share",
                "calls");
  out += line;
  for (const Total& t : totals_) {
    std::snprintf(line, sizeof line, "  %-16s %10.2f %12.4f %7.1f%% %8lld\n", t.op.c_str(), t.ms,
                  per > 0 ? t.ms / double(per) : 0.0, sum > 0 ? 100.0 * t.ms / sum : 0.0, (long long)t.count);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-16s %10.2f %12.4f   (%lld %s)\n", "sum", sum, per > 0 ? sum / double(per) : 0.0,
                (long long)per, per_name);
  out += line;
  return out;
}

}  // namespace shardlm::cuda
