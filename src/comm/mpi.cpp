// mpi.cpp — Comm over MPI for host buffers.
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/comm.hpp"
#include "cpu/ops.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/watchdog.hpp"

namespace shardlm {

namespace {
double g_collective_timeout_s = 0;  // comm.timeout_s; 0: plain MPI_Wait
}  // namespace

void set_collective_timeout(double seconds) { g_collective_timeout_s = seconds > 0 ? seconds : 0; }

// The watchdog of one MPI Comm's collectives. Waiting is MPI_Test in a loop
// (the main thread: MPI is FUNNELED), which also answers the other ranks'
// "where are you?" queries. Past comm.timeout_s the waiting rank queries every
// rank of the communicator and gives them a grace period to answer. A rank
// busy in an Activity that is making progress (watchdog.hpp) answers "busy":
// the clock restarts and the wait goes on. Otherwise the job ends, naming the
// ranks that never arrived and where the others are. Queries and answers are
// point-to-point messages on the same communicator with their own tags (they
// never match a collective), sent only once something has already taken long.
class CollectiveWatch;
std::vector<CollectiveWatch*>& live_watches() {  // every MPI Comm's watch, for answer_collective_queries
  static std::vector<CollectiveWatch*> watches;
  return watches;
}

class CollectiveWatch {
 public:
  explicit CollectiveWatch(MPI_Comm comm) : comm_(comm) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MPI_Group mine, world;
    MPI_CHECK(MPI_Comm_group(comm_, &mine));
    MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world));
    std::vector<int> ranks(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) ranks[size_t(i)] = i;
    world_rank_.resize(size_t(size_));
    MPI_CHECK(MPI_Group_translate_ranks(mine, size_, ranks.data(), world, world_rank_.data()));
    MPI_CHECK(MPI_Group_free(&mine));
    MPI_CHECK(MPI_Group_free(&world));
    live_watches().push_back(this);
  }
  ~CollectiveWatch() { std::erase(live_watches(), this); }
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;
  int64_t next_seq() { return ++issued_; }

  void wait(MPI_Request* request, const char* what, int64_t seq) {
    if (g_collective_timeout_s <= 0) {
      MPI_CHECK(MPI_Wait(request, MPI_STATUS_IGNORE));
      return;
    }
    const InCollective in_collective;  // this clock bounds the wait, not the enclosing Activity's
    using clock = std::chrono::steady_clock;
    auto start = clock::now();  // restarts while a rank waited for is busy and progressing
    double next_look_s = 0.01;  // answer queries and check the clock's verdict every 10 ms
    for (int64_t polls = 0;; ++polls) {
      int done = 0;
      MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (polls < 64) continue;  // most collectives finish here, at MPI_Wait's latency
      // Yield the core to the ranks being waited for (4 ranks on 2 cores), as
      // MPI_Wait does when oversubscribed; past a second, sleep between polls.
      const double waited_s = std::chrono::duration<double>(clock::now() - start).count();
      if (waited_s < 1.0) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(500));
      if (waited_s < next_look_s) continue;
      next_look_s = waited_s + 0.01;
      answer_queries(what, seq, false);
      if (waited_s > g_collective_timeout_s && peers_busy(what, seq, waited_s)) {
        start = clock::now();
        next_look_s = 0.01;
      }
    }
  }

  // Tell every rank that asked where this rank is: waiting in collective
  // `what` #seq, or (busy) working in activity `what` outside any collective.
  void answer_queries(const char* what, int64_t seq, bool busy) {
    for (;;) {
      int flag = 0;
      MPI_Status status;
      MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, comm_, &flag, &status));
      if (!flag) return;
      int64_t query_id = 0;
      MPI_CHECK(MPI_Recv(&query_id, 1, MPI_INT64_T, status.MPI_SOURCE, kQueryTag, comm_, MPI_STATUS_IGNORE));
      Answer& a = answers_out_.emplace_back();
      a.query_id = query_id;
      a.seq = busy ? -1 : seq;
      std::snprintf(a.what, sizeof a.what, "%s", what);
      MPI_Request r;  // never waited for: at most one per query, and queries are rare
      MPI_CHECK(MPI_Isend(&a, sizeof(Answer), MPI_BYTE, status.MPI_SOURCE, kAnswerTag, comm_, &r));
      MPI_Request_free(&r);
    }
  }

 private:
  static constexpr int kQueryTag = 0x5d17, kAnswerTag = 0x5d18;
  // seq -1: busy outside any collective, in activity `what`. query_id: the
  // query answered (an answer that comes after its round ended is ignored).
  struct Answer { int64_t query_id; int64_t seq; char what[96]; };

  // Past the bound: asks every rank where it is. Returns true when every rank
  // answered and some are busy making progress (wait on); ends the job otherwise.
  bool peers_busy(const char* what, int64_t seq, double waited_s) {
    const int64_t query_id = queries_.emplace_back(int64_t(queries_.size()) + 1);  // stable address for the sends
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request req;
      MPI_CHECK(MPI_Isend(&queries_.back(), 1, MPI_INT64_T, r, kQueryTag, comm_, &req));
      MPI_Request_free(&req);
    }
    // A grace period for the answers: a rank that is waiting answers within
    // milliseconds, a busy one at its next progress; one that is stopped, dead
    // or stuck never does.
    const double grace_s = std::min(10.0, std::max(1.0, 0.2 * g_collective_timeout_s));
    std::vector<int> answered(size_t(size_), 0);
    std::vector<Answer> answer(static_cast<size_t>(size_));
    answered[size_t(rank_)] = 1;
    answer[size_t(rank_)].seq = seq;
    std::snprintf(answer[size_t(rank_)].what, sizeof(Answer::what), "%s", what);
    const auto start = std::chrono::steady_clock::now();
    int count = 1;
    while (count < size_ && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < grace_s) {
      answer_queries(what, seq, false);  // the others time out too and ask us
      int flag = 0;
      MPI_Status status;
      MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, comm_, &flag, &status));
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      Answer a{};
      MPI_CHECK(MPI_Recv(&a, sizeof(Answer), MPI_BYTE, status.MPI_SOURCE, kAnswerTag, comm_, MPI_STATUS_IGNORE));
      a.what[sizeof(a.what) - 1] = '\0';
      if (a.query_id != query_id) continue;  // a late answer to an earlier round
      if (!answered[size_t(status.MPI_SOURCE)]) ++count;
      answered[size_t(status.MPI_SOURCE)] = 1;
      answer[size_t(status.MPI_SOURCE)] = a;
    }
    bool any_busy = false;
    for (int r = 0; r < size_; ++r) any_busy |= answered[size_t(r)] && answer[size_t(r)].seq == -1;
    if (count == size_ && any_busy) return true;  // everyone is alive; the busy ones are working
    // One line for the job: the lowest rank waiting in this collective reports;
    // the others give it time to abort the job and report only if it did not.
    for (int r = 0; r < rank_; ++r)
      if (answered[size_t(r)] && answer[size_t(r)].seq == seq) {
        const auto deferred = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - deferred).count() < grace_s + 5) {
          answer_queries(what, seq, false);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        break;
      }
    // Where the others are. A rank in a later collective has finished this one
    // (a collective can complete on one rank before another: the root of a
    // broadcast, a ring's early finishers) and waits for the laggards there;
    // one in an earlier collective has not reached this one yet; only a rank in
    // a different collective with the same number called something else.
    std::vector<int> missing_ranks, waiting_ranks;
    std::string ahead, behind, mismatched;
    for (int r = 0; r < size_; ++r) {
      const int world = world_rank_[size_t(r)];
      const Answer& a = answer[size_t(r)];
      const std::string where = fmt("%d on %s in %s #%lld", world, world_rank_host(world), a.what, (long long)a.seq);
      if (!answered[size_t(r)]) {
        missing_ranks.push_back(world);
        continue;
      }
      switch (where_is_peer(what, seq, a.what, a.seq)) {
        case PeerPlace::Waiting: waiting_ranks.push_back(world); break;
        case PeerPlace::Mismatch: mismatched += (mismatched.empty() ? "" : ", ") + where; break;
        case PeerPlace::Ahead: ahead += (ahead.empty() ? "" : ", ") + where; break;
        case PeerPlace::Behind: behind += (behind.empty() ? "" : ", ") + where; break;
        case PeerPlace::Busy: behind += (behind.empty() ? "" : ", ") + where; break;  // busy, then not answering
      }
    }
    const std::string missing = ranks_on_nodes(missing_ranks), waiting = ranks_on_nodes(waiting_ranks);
    std::string message = fmt("collective %s (#%lld of a communicator of %d ranks) has not completed after %.1f s "
                              "(comm.timeout_s = %g): ", what, (long long)seq, size_, waited_s, g_collective_timeout_s);
    if (!missing.empty())
      message += fmt("rank%s %s did not arrive (stopped, dead, or stuck outside any collective); ",
                     missing.find(',') == std::string::npos ? "" : "s", missing.c_str());
    if (!behind.empty()) message += "not there yet, in an earlier collective: rank " + behind + "; ";
    if (!ahead.empty()) message += "done with it and waiting in the next: rank " + ahead + "; ";
    if (!mismatched.empty()) message += "in a different collective of the same number (a mismatch): rank " + mismatched + "; ";
    message += "waiting in it: rank" + std::string(waiting.find(',') == std::string::npos ? " " : "s ") + waiting;
    fatal(message, hang_exit_code());
  }

  // "2, 3 on mn2, 5 on mn3": world ranks with the node each runs on (from
  // runtime_init), a node named once after its run of ranks.
  static std::string ranks_on_nodes(const std::vector<int>& world_ranks) {
    std::string text;
    for (size_t i = 0; i < world_ranks.size(); ++i) {
      const char* host = world_rank_host(world_ranks[i]);
      text += (i ? ", " : "") + std::to_string(world_ranks[i]);
      if (i + 1 == world_ranks.size() || std::strcmp(host, world_rank_host(world_ranks[i + 1])) != 0)
        text += fmt(" on %s", host);
    }
    return text;
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  int64_t issued_ = 0;              // collectives started on this communicator, in the order every rank starts them
  std::vector<int> world_rank_;     // [rank of comm_] -> MPI_COMM_WORLD rank, for the message
  std::deque<Answer> answers_out_;  // buffers of answers in flight (stable addresses)
  std::deque<int64_t> queries_;     // buffers of queries sent, numbered from 1
};

PeerPlace where_is_peer(const char* what, int64_t seq, const char* their_what, int64_t their_seq) {
  if (their_seq < 0) return PeerPlace::Busy;
  if (their_seq == seq) return std::strcmp(their_what, what) == 0 ? PeerPlace::Waiting : PeerPlace::Mismatch;
  return their_seq > seq ? PeerPlace::Ahead : PeerPlace::Behind;
}

// The watch of a communicator, cached on it as an MPI attribute (freed with
// it): every collective on one communicator, through a Comm or
// wait_collective, is numbered by one watch, in the order all ranks issue them.
CollectiveWatch& watch_of(MPI_Comm comm) {
  static int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    MPI_CHECK(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN,
                                     [](MPI_Comm, int, void* watch, void*) {
                                       delete static_cast<CollectiveWatch*>(watch);
                                       return MPI_SUCCESS;
                                     },
                                     &k, nullptr));
    return k;
  }();
  void* cached = nullptr;
  int found = 0;
  MPI_CHECK(MPI_Comm_get_attr(comm, keyval, &cached, &found));
  if (found) return *static_cast<CollectiveWatch*>(cached);
  auto* watch = new CollectiveWatch(comm);
  MPI_CHECK(MPI_Comm_set_attr(comm, keyval, watch));
  return *watch;
}

void wait_collective(MPI_Comm comm, MPI_Request* request, const char* what) {
  CollectiveWatch& watch = watch_of(comm);
  watch.wait(request, what, watch.next_seq());
}

void answer_collective_queries(const char* busy_in) {
  if (g_collective_timeout_s <= 0) return;
  for (CollectiveWatch* watch : live_watches()) watch->answer_queries(busy_in, -1, true);
}

void CommRequest::wait() {
  for (MPI_Request* r : {&request_, &request2_}) {
    if (*r == MPI_REQUEST_NULL) continue;
    if (watch_) watch_->wait(r, what_, seq_);
    else MPI_CHECK(MPI_Wait(r, MPI_STATUS_IGNORE));
  }
  if (owner_) owner_->complete(ticket_);
  owner_ = nullptr;
}

CommRequest Comm::ring_exchange(const void*, void*, int64_t) {
  SHARDLM_FAIL("this communicator has no point-to-point ring: context parallelism (model.context_parallel > 1) "
               "runs on the MPI communicator and the device communicators only");
}

std::unique_ptr<Comm> Comm::split(int, int) {
  SHARDLM_FAIL("this communicator cannot be split: context parallelism's groups (model.context_parallel > 1) are "
               "split from the MPI communicator");
}

namespace {

// The ring's messages: their own tag, never matched by the watch's queries.
constexpr int kRingTag = 0x5c01;

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
  // `owned`: the communicator was made by split() and is freed with this Comm.
  explicit MpiComm(MPI_Comm comm, bool owned = false) : comm_(comm), owned_(owned), watch_(&watch_of(comm)) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    for (auto* v : {&send_counts_, &send_displs_, &recv_counts_, &recv_displs_}) v->resize(size_);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  CommRequest ring_exchange(const void* send, void* recv, int64_t bytes) override {
    // SHARDLM_FAULT=ring_stop@R: rank R stops itself (SIGSTOP) at its third
    // exchange, mid-ring, as a frozen node would, for the watchdog's test.
    static int exchanges = 0;
    if (++exchanges == 3 && fault_armed("ring_stop")) raise(SIGSTOP);
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    MPI_Request s, r;
    // Receive posted first: the message lands in place instead of in MPI's buffers.
    MPI_CHECK(MPI_Irecv(recv, as_count(bytes), MPI_BYTE, prev, kRingTag, comm_, &r));
    MPI_CHECK(MPI_Isend(send, as_count(bytes), MPI_BYTE, next, kRingTag, comm_, &s));
    return CommRequest(r, s, watch_, "ring_exchange", watch_->next_seq());
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm part;
    MPI_CHECK(MPI_Comm_split(comm_, color, key, &part));
    return std::make_unique<MpiComm>(part, /*owned=*/true);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  using Comm::all_gather;
  using Comm::reduce_scatter;
  CommRequest all_gather(const void* shard, void* full, int64_t count, DType t) override {
    MPI_Request r;
    MPI_CHECK(MPI_Iallgather(shard, as_count(count), mpi_type(t), full, as_count(count), mpi_type(t), comm_, &r));
    return CommRequest(r, watch_, "all_gather", watch_->next_seq());
  }
  CommRequest reduce_scatter(const void* full, void* shard, int64_t count, DType t) override {
    MPI_Request r;
    MPI_CHECK(MPI_Ireduce_scatter_block(full, shard, as_count(count), mpi_type(t),
                                        t == DType::F32 ? MPI_SUM : bf16_sum_op(), comm_, &r));
    return CommRequest(r, watch_, "reduce_scatter", watch_->next_seq());
  }
  CommRequest broadcast(void* buf, int64_t count, DType t, int root) override {
    MPI_Request r;
    MPI_CHECK(MPI_Ibcast(buf, as_count(count), mpi_type(t), root, comm_, &r));
    return CommRequest(r, watch_, "broadcast", watch_->next_seq());
  }
  // The blocking ones: started non-blocking, so that the watchdog can wait.
  void all_reduce_sum(double* values, int64_t count) override {
    // SHARDLM_FAULT=mpi_stop@R: rank R stops itself (SIGSTOP) at its first
    // all-reduce, as a frozen node would, for the watchdog's test.
    static bool stopped = false;
    if (!stopped && fault_armed("mpi_stop")) stopped = true, raise(SIGSTOP);
    if (fault_armed("mpi_kill")) raise(SIGKILL);
    MPI_Request r;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, values, as_count(count), MPI_DOUBLE, MPI_SUM, comm_, &r));
    watch_->wait(&r, "all_reduce_sum", watch_->next_seq());
  }
  void all_reduce_sum(int64_t* values, int64_t count) override {
    MPI_Request r;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, values, as_count(count), MPI_INT64_T, MPI_SUM, comm_, &r));
    watch_->wait(&r, "all_reduce_sum", watch_->next_seq());
  }
  void broadcast(void* bytes, int64_t count, int root) override {
    MPI_Request r;
    MPI_CHECK(MPI_Ibcast(bytes, as_count(count), MPI_BYTE, root, comm_, &r));
    watch_->wait(&r, "broadcast", watch_->next_seq());
  }
  void barrier() override {
    MPI_Request r;
    MPI_CHECK(MPI_Ibarrier(comm_, &r));
    watch_->wait(&r, "barrier", watch_->next_seq());
  }
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
    MPI_Request r;
    MPI_CHECK(MPI_Ialltoallv(send, send_counts_.data(), send_displs_.data(), MPI_FLOAT, recv, recv_counts_.data(),
                             recv_displs_.data(), MPI_FLOAT, comm_, &r));
    watch_->wait(&r, "all_to_all_v", watch_->next_seq());
  }

 private:
  MPI_Comm comm_;
  bool owned_ = false;
  CollectiveWatch* watch_;  // the communicator's (watch_of): shared with wait_collective
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
  CommRequest ring_exchange(const void* send, void* recv, int64_t bytes) override {
    if (recv != send) std::memcpy(recv, send, size_t(bytes));
    return {};
  }
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SelfComm>(); }
};

}  // namespace

std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(); }

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm) { return std::make_unique<MpiComm>(comm); }

}  // namespace shardlm
