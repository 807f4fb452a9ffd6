// comm_mpi.cpp — Comm over MPI for host buffers.
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/cpu_ops.hpp"
#include "shardlm/hf.hpp"  // the one bf16 <-> fp32 conversion
#include "shardlm/runtime.hpp"

namespace shardlm {

void CommRequest::wait() {
  if (request_ != MPI_REQUEST_NULL) MPI_CHECK(MPI_Wait(&request_, MPI_STATUS_IGNORE));
  if (owner_) owner_->complete(ticket_);
  owner_ = nullptr;
}

namespace {

// MPI has no bf16 type: the elements travel as 16-bit integers and this op sums
// them in fp32, rounding once per combination (as a ring of bf16 hops would).
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = f32_to_bf16_rne(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

MPI_Op bf16_sum_op() {
  static MPI_Op op = [] {
    MPI_Op o;
    MPI_CHECK(MPI_Op_create(&bf16_sum, /*commute=*/1, &o));
    return o;
  }();
  return op;
}

MPI_Datatype mpi_type(DType t) { return t == DType::F32 ? MPI_FLOAT : MPI_UINT16_T; }

// n floats from src to dst for all_to_all_v's own block: all threads when the
// ranges are apart (Muon's exchange moves whole matrices), memmove otherwise.
void copy_block(float* dst, const float* src, int64_t n) {
  if (n <= 0 || dst == src) return;
  if (dst + n <= src || src + n <= dst) cpu::copy(dst, src, n);
  else std::memmove(dst, src, sizeof(float) * size_t(n));
}

int as_count(int64_t n) {
  SHARDLM_CHECK(n >= 0 && n <= INT_MAX, "a collective of %lld elements exceeds MPI's int count", (long long)n);
  return static_cast<int>(n);
}

class MpiComm final : public Comm {
 public:
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    for (auto* v : {&send_counts_, &send_displs_, &recv_counts_, &recv_displs_}) v->resize(size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void* shard, void* full, int64_t count, DType t) override {
    MPI_Request r;
    MPI_CHECK(MPI_Iallgather(shard, as_count(count), mpi_type(t), full, as_count(count), mpi_type(t), comm_, &r));
    return CommRequest(r);
  }
  CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType t) override {
    MPI_Request r;
    MPI_CHECK(MPI_Ireduce_scatter_block(full, shard, as_count(count), mpi_type(t),
                                        t == DType::F32 ? MPI_SUM : bf16_sum_op(), comm_, &r));
    return CommRequest(r);
  }
  CommRequest broadcast(void* buf, int64_t count, DType t, int root) override {
    MPI_Request r;
    MPI_CHECK(MPI_Ibcast(buf, as_count(count), mpi_type(t), root, comm_, &r));
    return CommRequest(r);
  }
  void all_reduce_sum(double* values, int64_t count) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, as_count(count), MPI_DOUBLE, MPI_SUM, comm_));
  }
  void all_reduce_sum(int64_t* values, int64_t count) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, as_count(count), MPI_INT64_T, MPI_SUM, comm_));
  }
  void broadcast(void* bytes, int64_t count, int root) override {
    MPI_CHECK(MPI_Bcast(bytes, as_count(count), MPI_BYTE, root, comm_));
  }
  void barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }
  void all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                    const int64_t* recv_counts, const int64_t* recv_displs) override {
    for (int p = 0; p < size_; ++p) {
      send_counts_[p] = as_count(send_counts[p]);
      send_displs_[p] = as_count(send_displs[p]);
      recv_counts_[p] = as_count(recv_counts[p]);
      recv_displs_[p] = as_count(recv_displs[p]);
    }
    // This rank's own block (all of it at world 1) is a local copy: on every
    // thread here rather than one memcpy inside MPI.
    const int64_t own = send_counts[rank_];
    SHARDLM_CHECK(own == recv_counts[rank_], "internal: all_to_all_v sends %lld elements to itself but expects %lld",
                  (long long)own, (long long)recv_counts[rank_]);
    copy_block(recv + recv_displs[rank_], send + send_displs[rank_], own);
    send_counts_[rank_] = recv_counts_[rank_] = 0;
    MPI_CHECK(MPI_Alltoallv(send, send_counts_.data(), send_displs_.data(), MPI_FLOAT, recv, recv_counts_.data(),
                            recv_displs_.data(), MPI_FLOAT, comm_));
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  // MPI's int counts for all_to_all_v, sized once (the step allocates nothing).
  std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;
};

class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void* shard, void* full, int64_t count, DType t) override {
    if (full != shard) std::memcpy(full, shard, dtype_bytes(t) * count);
    return {};
  }
  CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType t) override {
    if (full != shard) std::memcpy(shard, full, dtype_bytes(t) * count);
    return {};
  }
  CommRequest broadcast(void*, int64_t, DType, int) override { return {}; }
  void all_reduce_sum(double*, int64_t) override {}
  void all_reduce_sum(int64_t*, int64_t) override {}
  void broadcast(void*, int64_t, int) override {}
  void barrier() override {}
  void all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                    const int64_t*, const int64_t* recv_displs) override {
    copy_block(recv + recv_displs[0], send + send_displs[0], send_counts[0]);
  }
};

}  // namespace

std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(); }

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm) { return std::make_unique<MpiComm>(comm); }

}  // namespace shardlm
