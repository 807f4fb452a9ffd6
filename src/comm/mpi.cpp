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
  void mark_link() { link_ = true; }

  // bound_s > 0: the whole wait is bounded (a wait for the other side of an RL
  // job: data.rollout_timeout_s), however busy the ranks waited for are.
  // watch_peers false: the ranks waited for are not asked where they are (a
  // side still setting up, which answers nobody): only bound_s ends the wait.
  void wait(MPI_Request* request, const char* what, int64_t seq, double bound_s = 0, bool watch_peers = true) {
    if (g_collective_timeout_s <= 0) {
      MPI_CHECK(MPI_Wait(request, MPI_STATUS_IGNORE));
      return;
    }
    const InCollective in_collective;  // this clock bounds the wait, not the enclosing Activity's
    using clock = std::chrono::steady_clock;
    const auto first = clock::now();
    auto start = first;         // restarts while a rank waited for is busy and progressing
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
      answer_other_communicators(what);
      const double total_s = std::chrono::duration<double>(clock::now() - first).count();
      if (bound_s > 0 && total_s > bound_s)
        fatal(fmt("%s has waited %.1f s for the other side of the job, past data.rollout_timeout_s = %g: %s kept "
                  "working (it answered as busy) but did not arrive",
                  what, total_s, bound_s, rank_ == 0 ? "the inference ranks" : "the trainers"),
              hang_exit_code());
      if (watch_peers && waited_s > g_collective_timeout_s && peers_busy(what, seq, waited_s)) {
        start = clock::now();
        next_look_s = 0.01;
      }
    }
  }

  // While this rank waits in a collective here, the ranks that ask from its
  // other communicators hear that it is busy: a wait on the link (the two
  // sides of an RL job) is busy work for its own side, which waits on, and a
  // wait among one side's ranks is busy work as the other side sees it. Both
  // stay bounded: the link's waits by data.rollout_timeout_s, a side's own
  // collectives by their watch. (Within one side, a rank in a collective of
  // one communicator is never called busy on another: two ranks waiting on
  // each other there would wait forever.)
  void answer_other_communicators(const char* what) {
    for (CollectiveWatch* w : live_watches())
      if (w != this && (link_ || w->link_)) w->answer_queries(what, -1, true);
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

  // One round of "where are you?": every other rank asked, the answers
  // collected for a grace period. This rank is in collective `what` #seq, or
  // busy in `what` outside any collective (seq < 0).
  struct Round {
    std::vector<int> answered;
    std::vector<Answer> answer;
    int count = 1;    // ranks that answered, this one included
    double grace_s = 0;
  };
  Round ask_everyone(const char* what, int64_t seq) {
    const int64_t query_id = queries_.emplace_back(int64_t(queries_.size()) + 1);  // stable address for the sends
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request req;
      MPI_CHECK(MPI_Isend(&queries_.back(), 1, MPI_INT64_T, r, kQueryTag, comm_, &req));
      MPI_Request_free(&req);
    }
    // A grace period for the answers: a rank that is waiting answers within
    // milliseconds, a busy one at its next progress; one that is stopped, dead
    // or stuck never does. On the link, the other side answers at its progress
    // points (a decode step, a micro-batch), which may be seconds apart: it has
    // comm.timeout_s to answer.
    Round round;
    round.grace_s = link_ ? g_collective_timeout_s : std::min(10.0, std::max(1.0, 0.2 * g_collective_timeout_s));
    // A rank last heard busy answers at its next progress point: as on the link.
    last_busy_.resize(size_t(size_));
    for (const std::string& b : last_busy_)
      if (!b.empty()) round.grace_s = std::max(round.grace_s, g_collective_timeout_s);
    round.answered.assign(size_t(size_), 0);
    round.answer.assign(size_t(size_), Answer{});
    std::vector<int>& answered = round.answered;
    std::vector<Answer>& answer = round.answer;
    int& count = round.count;
    answered[size_t(rank_)] = 1;
    answer[size_t(rank_)].seq = seq;
    std::snprintf(answer[size_t(rank_)].what, sizeof(Answer::what), "%s", what);
    const auto start = std::chrono::steady_clock::now();
    while (count < size_ &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < round.grace_s) {
      answer_queries(what, seq, seq < 0);  // the others time out too and ask us
      if (seq >= 0) answer_other_communicators(what);
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
    for (int r = 0; r < size_; ++r)
      if (answered[size_t(r)] && r != rank_) last_busy_[size_t(r)] = answer[size_t(r)].seq < 0 ? answer[size_t(r)].what : "";
    return round;
  }

 public:
  // Outside any collective here (trainer rank 0 waiting for rollout files):
  // asks the other ranks where they are; any answer will do. One that gives
  // none within the grace period is stopped, dead or stuck: the job ends naming it.
  void expect_answers(const char* what, double waited_s) {
    const Round round = ask_everyone(what, -1);
    if (round.count == size_) return;
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r)
      if (!round.answered[size_t(r)]) missing.push_back(r);
    fatal(fmt("%s for %.1f s: rank%s %s gave no answer within %.1f s (stopped, dead, or stuck)", what, waited_s,
              missing.size() == 1 ? "" : "s", ranks_on_nodes(missing).c_str(), round.grace_s),
          hang_exit_code());
  }

 private:
  // Past the bound: asks every rank where it is. Returns true when every rank
  // answered and some are busy making progress (wait on); ends the job otherwise.
  bool peers_busy(const char* what, int64_t seq, double waited_s) {
    const Round round = ask_everyone(what, seq);
    const std::vector<int>& answered = round.answered;
    const std::vector<Answer>& answer = round.answer;
    const int count = round.count;
    const double grace_s = round.grace_s;
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
    std::string ahead, behind, mismatched, quiet;
    for (int r = 0; r < size_; ++r) {
      const int world = world_rank_[size_t(r)];
      const Answer& a = answer[size_t(r)];
      const std::string where = fmt("%d on %s%s in %s #%lld", world, world_rank_host(world), side_of(r).c_str(),
                                    a.what, (long long)a.seq);
      if (!answered[size_t(r)] && !last_busy_[size_t(r)].empty()) {  // it may be ending the job itself
        quiet += fmt("%s%d on %s%s, last heard busy in %s", quiet.empty() ? "" : ", ", world, world_rank_host(world),
                     side_of(r).c_str(), last_busy_[size_t(r)].c_str());
        continue;
      }
      if (!answered[size_t(r)]) {
        missing_ranks.push_back(r);
        continue;
      }
      switch (where_is_peer(what, seq, a.what, a.seq)) {
        case PeerPlace::Waiting: waiting_ranks.push_back(r); break;
        case PeerPlace::Mismatch: mismatched += (mismatched.empty() ? "" : ", ") + where; break;
        case PeerPlace::Ahead: ahead += (ahead.empty() ? "" : ", ") + where; break;
        case PeerPlace::Behind: behind += (behind.empty() ? "" : ", ") + where; break;
        case PeerPlace::Busy: behind += (behind.empty() ? "" : ", ") + where; break;  // busy, then not answering
      }
    }
    const std::string missing = ranks_on_nodes(missing_ranks), waiting = ranks_on_nodes(waiting_ranks);
    const char* stalled = link_ ? " (stopped, dead, or stuck: it has not answered for comm.timeout_s)"
                                : " (stopped, dead, or stuck outside any collective)";
    std::string message = fmt("collective %s (#%lld of a communicator of %d ranks) has not completed after %.1f s "
                              "(comm.timeout_s = %g): ", what, (long long)seq, size_, waited_s, g_collective_timeout_s);
    if (!missing.empty())
      message += fmt("rank%s %s did not arrive%s; ", missing.find(',') == std::string::npos ? "" : "s",
                     missing.c_str(), stalled);
    if (!quiet.empty()) message += "no answer since from rank " + quiet + "; ";
    if (!behind.empty()) message += "not there yet, in an earlier collective: rank " + behind + "; ";
    if (!ahead.empty()) message += "done with it and waiting in the next: rank " + ahead + "; ";
    if (!mismatched.empty()) message += "in a different collective of the same number (a mismatch): rank " + mismatched + "; ";
    message += "waiting in it: rank" + std::string(waiting.find(',') == std::string::npos ? " " : "s ") + waiting;
    fatal(message, hang_exit_code());
  }

  // "2, 3 on mn2, 5 on mn3": the world ranks of these ranks of the
  // communicator with the node each runs on (from runtime_init), a node named
  // once after its run of ranks; on the link, with the side each is on.
  std::string ranks_on_nodes(const std::vector<int>& ranks) const {
    std::string text;
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int world = world_rank_[size_t(ranks[i])];
      const char* host = world_rank_host(world);
      text += (i ? ", " : "") + std::to_string(world);
      if (i + 1 == ranks.size() || std::strcmp(host, world_rank_host(world_rank_[size_t(ranks[i + 1])])) != 0)
        text += fmt(" on %s", host);
      text += side_of(ranks[i]);
    }
    return text;
  }
  // The link's rank 0 is trainer rank 0, the others the inference ranks in order.
  std::string side_of(int r) const {
    if (!link_) return "";
    return r == 0 ? " (trainer rank 0)" : fmt(" (inference rank %d)", r - 1);
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  bool link_ = false;               // the communicator the two sides of an RL job meet on (mark_link_communicator)
  int64_t issued_ = 0;              // collectives started on this communicator, in the order every rank starts them
  std::vector<int> world_rank_;     // [rank of comm_] -> MPI_COMM_WORLD rank, for the message
  std::deque<Answer> answers_out_;  // buffers of answers in flight (stable addresses)
  std::deque<int64_t> queries_;     // buffers of queries sent, numbered from 1
  std::vector<std::string> last_busy_;  // [rank]: where it last answered busy ("": not busy, or not asked yet)
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

namespace {
MPI_Comm g_link = MPI_COMM_NULL;  // this rank's link communicator, once marked
}  // namespace

void mark_link_communicator(MPI_Comm link) {
  watch_of(link).mark_link();
  g_link = link;
}

void watch_other_side(const char* what, double waited_s) {
  if (g_link == MPI_COMM_NULL || g_collective_timeout_s <= 0) return;
  static double last_asked_s = -1;  // per wait: waited_s starts again from 0
  if (waited_s < last_asked_s) last_asked_s = 0;
  if (waited_s - last_asked_s < g_collective_timeout_s) return;
  last_asked_s = waited_s;
  watch_of(g_link).expect_answers(what, waited_s);
}

void wait_for_other_side(MPI_Comm link, MPI_Request* request, const char* what, double bound_s, bool watch_peers) {
  mark_link_communicator(link);
  CollectiveWatch& watch = watch_of(link);
  watch.wait(request, what, watch.next_seq(), bound_s, watch_peers);
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

void Comm::all_to_all_v_device(const void*, const int64_t*, const int64_t*, void*, const int64_t*, const int64_t*) {
  SHARDLM_FAIL("this communicator moves no device buffers: the exchange of expert parallelism's rows on the GPU "
               "runs on the device communicators (NCCL, staged MPI) only");
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
