// runtime.cpp — MPI bootstrap, roles, device choice, fatal errors.
#include "shardlm/runtime.hpp"

#include <dlfcn.h>
#include <execinfo.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardlm/cuda.hpp"

namespace shardlm {
namespace {
int g_world_rank = -1;
int g_world_size = 0;
char g_host[256] = "?";
// What the rank is in the job ("trainer rank 0 of 2, ", "inference rank 0 of 1, "),
// once the roles are split: the crash line names it.
char g_role_text[64] = "";

// What each world rank reported about itself at runtime_init (every rank holds
// the whole table): messages name a rank's node, the banner shows the placement.
struct RankPlacement {
  char host[64];
  int local_rank, local_size, num_nodes;
};
std::vector<RankPlacement> g_placement;
uint64_t g_job_id = 0;        // runtime_init: world rank 0's draw, the same on every rank
int g_job_generators = 0;     // runtime_init: the job's `shardlm generate` ranks
}  // namespace

#ifndef SHARDLM_VERSION
#define SHARDLM_VERSION "0.0.0"
#endif
#ifndef SHARDLM_GIT_REV
#define SHARDLM_GIT_REV "unknown"
#endif

const char* built_backends() { return cuda_built() ? "cpu+cuda" : "cpu"; }
const char* shardlm_version() { return SHARDLM_VERSION; }
const char* shardlm_git_rev() { return SHARDLM_GIT_REV; }

Runtime runtime_init(int* argc, char*** argv, Role role) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // Installed first, Open MPI leaves them in place: a crash inside the
    // library's start-up then says so (and where) in shardlm's words.
    gethostname(g_host, sizeof(g_host) - 1);
    install_crash_reporters();
    if (fault_armed("segv_init")) std::raise(SIGSEGV);  // tests: the line a crash in MPI_Init_thread writes
    int provided = 0;
    // FUNNELED: only the main thread calls MPI; OpenMP threads compute.
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      std::fprintf(stderr, "shardlm: error: MPI_Init_thread failed\n");
      std::exit(1);
    }
  }
  // Errors come back as codes that MPI_CHECK turns into one clear message.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);

  Runtime rt;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rt.world_rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &rt.world_size));
  g_world_rank = rt.world_rank;
  g_world_size = rt.world_size;
  gethostname(g_host, sizeof(g_host) - 1);
  rt.hostname = g_host;
  install_crash_reporters();

  MPI_Comm node_comm;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rt.world_rank, MPI_INFO_NULL, &node_comm));
  MPI_CHECK(MPI_Comm_rank(node_comm, &rt.local_rank));
  MPI_CHECK(MPI_Comm_size(node_comm, &rt.local_size));
  MPI_CHECK(MPI_Comm_free(&node_comm));
  const int node_leader = rt.local_rank == 0;
  MPI_CHECK(MPI_Allreduce(&node_leader, &rt.num_nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  RankPlacement mine{};
  std::snprintf(mine.host, sizeof mine.host, "%s", g_host);
  mine.local_rank = rt.local_rank;
  mine.local_size = rt.local_size;
  mine.num_nodes = rt.num_nodes;
  g_placement.resize(static_cast<size_t>(rt.world_size));
  MPI_CHECK(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, g_placement.data(), sizeof mine, MPI_BYTE, MPI_COMM_WORLD));

  int* appnum = nullptr;
  int has_appnum = 0;
  MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &has_appnum));
  rt.appnum = (has_appnum && appnum) ? *appnum : 0;
  rt.role = rt.appnum == 0 && role == Role::Train ? Role::Train
            : role == Role::Generate                ? Role::Generate
                                                    : Role::Receive;

  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(rt.role), rt.world_rank, &rt.role_comm));
  MPI_Comm_set_errhandler(rt.role_comm, MPI_ERRORS_RETURN);
  MPI_CHECK(MPI_Comm_rank(rt.role_comm, &rt.rank));
  MPI_CHECK(MPI_Comm_size(rt.role_comm, &rt.size));
  int is_trainer = rt.role == Role::Train;
  MPI_CHECK(MPI_Allreduce(&is_trainer, &rt.num_trainers, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  rt.num_receivers = rt.world_size - rt.num_trainers;
  int is_generator = rt.role == Role::Generate;
  MPI_CHECK(MPI_Allreduce(&is_generator, &rt.num_generators, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  // The job's identity, drawn once by world rank 0 (every app of an MPMD launch
  // shares MPI_COMM_WORLD): the inference ranks stamp it on their rollout files
  // and the trainers take only files with it, never an earlier job's.
  if (rt.world_rank == 0) {
    std::random_device entropy;
    rt.job_id = (uint64_t(entropy()) << 32 | uint64_t(entropy())) ^ uint64_t(std::time(nullptr)) * 0x9E3779B97F4A7C15ull;
    if (rt.job_id == 0) rt.job_id = 1;  // 0 means "no job" in a rollout file's reader
  }
  MPI_CHECK(MPI_Bcast(&rt.job_id, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  g_job_id = rt.job_id;
  g_job_generators = rt.num_generators;
  // Trainer rank 0 must be world rank 0 (it owns the run dir and the banner): under
  // srun --multi-prog the order is the user's, so it is checked (main's launch check).
  int last_trainer = is_trainer ? rt.world_rank : -1, first_receiver = is_trainer ? rt.world_size : rt.world_rank;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &last_trainer, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &first_receiver, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  rt.trainers_first = last_trainer < first_receiver;
  // A rank that crashes from here on says which role it had: in an MPMD job
  // "rank 3 of 4" alone leaves the reader to count the apps.
  std::snprintf(g_role_text, sizeof g_role_text, "%s rank %d of %d, ",
                rt.role == Role::Train ? "trainer" : rt.role == Role::Generate ? "inference" : "receiver", rt.rank,
                rt.size);
  install_crash_reporters();

  // The broadcast communicator: trainer rank 0 first (rank 0 in it), then receivers.
  const bool joins = rt.role != Role::Train || rt.rank == 0;
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, joins ? 0 : MPI_UNDEFINED, rt.world_rank, &rt.broadcast_comm));
  if (rt.num_receivers == 0 && rt.broadcast_comm != MPI_COMM_NULL) MPI_CHECK(MPI_Comm_free(&rt.broadcast_comm));
  // Where the two sides of the job meet: their waits for each other are watched there (comm.hpp).
  if (rt.broadcast_comm != MPI_COMM_NULL) mark_link_communicator(rt.broadcast_comm);
  return rt;
}

uint64_t job_id() { return g_job_id; }
int job_generators() { return g_job_generators; }

const char* world_rank_host(int world_rank) {
  if (world_rank < 0 || static_cast<size_t>(world_rank) >= g_placement.size()) return "?";
  return g_placement[size_t(world_rank)].host;
}

std::string placement_summary(const Runtime& rt) {
  std::vector<std::string> hosts;  // in order of first appearance
  std::vector<std::string> ranks, locals;
  int fewest = rt.num_nodes, most = rt.num_nodes;
  for (size_t r = 0; r < g_placement.size(); ++r) {
    const RankPlacement& p = g_placement[r];
    fewest = std::min(fewest, p.num_nodes);
    most = std::max(most, p.num_nodes);
    size_t h = std::find(hosts.begin(), hosts.end(), p.host) - hosts.begin();
    if (h == hosts.size()) hosts.emplace_back(p.host), ranks.emplace_back(), locals.emplace_back();
    ranks[h] += (ranks[h].empty() ? "" : ",") + std::to_string(r);
    locals[h] += (locals[h].empty() ? "" : ",") + std::to_string(p.local_rank);
  }
  std::string line = fmt("%d rank%s on %d node%s", rt.world_size, rt.world_size == 1 ? "" : "s", rt.num_nodes,
                         rt.num_nodes == 1 ? "" : "s");
  if (fewest != most) line += fmt(" (the ranks count %d to %d nodes)", fewest, most);
  if (hosts.size() != size_t(most)) line += fmt(" (%zu host names)", hosts.size());
  const size_t shown = std::min<size_t>(hosts.size(), 16);
  for (size_t h = 0; h < shown; ++h)
    line += fmt(" | %s: ranks %s local %s", hosts[h].c_str(), ranks[h].c_str(), locals[h].c_str());
  if (shown < hosts.size()) line += fmt(" | %zu more nodes", hosts.size() - shown);
  return line;
}

void runtime_finalize(Runtime& rt) {
  if (rt.broadcast_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.broadcast_comm);
  if (rt.role_comm != MPI_COMM_NULL) MPI_Comm_free(&rt.role_comm);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void select_device(Runtime& rt, const std::string& requested) {
  const int ndev = cuda_device_count();
  if (requested == "cpu" || (requested == "auto" && ndev == 0)) {
    rt.backend = "cpu";
    rt.device = -1;
    rt.device_name = "cpu";
    return;
  }
  SHARDLM_CHECK(cuda_built(), "device.backend = \"cuda\" but this shardlm was built without CUDA "
                              "(rebuild with nvcc on the PATH or CUDA=1)");
  SHARDLM_CHECK(ndev > 0, "device.backend = \"cuda\" but no CUDA device is visible on %s", rt.hostname.c_str());
  rt.backend = "cuda";
  rt.device = ndev == 1 ? 0 : rt.local_rank % ndev;
  cuda_set_device(rt.device);
  rt.device_name = cuda_device_name(rt.device);
}

namespace {

// True on every rank of `comm` when two of its ranks are bound to one GPU (same
// node, same device ordinal): NCCL refuses two ranks of a communicator on one
// device. Ranks on the CPU backend bind none. Collective over `comm`.
bool ranks_share_a_gpu(const Runtime& rt, MPI_Comm comm) {
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 1;
  MPI_CHECK(MPI_Comm_size(node, &node_size));
  const int mine = rt.backend == "cuda" ? rt.device : -1;
  std::vector<int> devices(static_cast<size_t>(node_size));
  MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, devices.data(), 1, MPI_INT, node));
  MPI_CHECK(MPI_Comm_free(&node));
  std::sort(devices.begin(), devices.end());
  int shared = 0;
  for (size_t i = 1; i < devices.size(); ++i) shared |= devices[i] >= 0 && devices[i] == devices[i - 1];
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &shared, 1, MPI_INT, MPI_MAX, comm));
  return shared != 0;
}

}  // namespace

std::string select_comm(const Runtime& rt, const std::string& requested) {
  // Only the training ranks count: receivers of an MPMD launch on the same
  // node may share the trainers' GPUs without making the unit loop's NCCL fail.
  const bool shared = ranks_share_a_gpu(rt, rt.role_comm);
  if (rt.backend != "cuda") {
    SHARDLM_CHECK(requested != "nccl", "comm.backend = \"nccl\" but this run is on the CPU backend (NCCL moves "
                                       "device memory only); use comm.backend = \"mpi\" or \"auto\"");
    return "mpi";
  }
  if (requested == "nccl")
    SHARDLM_CHECK(!shared, "comm.backend = \"nccl\" but %d ranks on %s share %d GPU%s, and NCCL refuses two ranks "
                           "on one GPU: launch one rank per GPU, or set comm.backend = \"mpi\" (staged through host "
                           "memory)",
                  rt.local_size, rt.hostname.c_str(), cuda_device_count(), cuda_device_count() == 1 ? "" : "s");
  if (requested == "auto") return shared ? "mpi" : "nccl";
  return requested;
}

std::string select_broadcast_comm(const Runtime& rt) {
  SHARDLM_CHECK(rt.broadcast_comm != MPI_COMM_NULL, "internal: select_broadcast_comm on a rank outside the "
                                                    "broadcast communicator");
  if (!ranks_share_a_gpu(rt, rt.broadcast_comm)) return "nccl";
  // Ranks sharing a GPU: device to device through CUDA IPC when all of them are
  // on one node that shows them one GPU (the RL job on one GPU: 0.030 s a 1B
  // broadcast against 0.398 s staged, measured on an H200: docs/benchmarks.md),
  // or SHARDLM_BROADCAST_IPC=1 on every rank (all on one node); staged through
  // host memory otherwise, or with SHARDLM_BROADCAST_IPC=0.
  const char* env = std::getenv("SHARDLM_BROADCAST_IPC");
  int ipc = env && *env ? (std::string(env) == "1" ? 1 : 0) : (cuda_device_count() == 1 ? 1 : 0);
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(rt.broadcast_comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 1, size = 1;
  MPI_CHECK(MPI_Comm_size(node, &node_size));
  MPI_CHECK(MPI_Comm_free(&node));
  MPI_CHECK(MPI_Comm_size(rt.broadcast_comm, &size));
  if (node_size != size) ipc = 0;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ipc, 1, MPI_INT, MPI_MIN, rt.broadcast_comm));
  return ipc ? "ipc" : "mpi";
}

namespace {

// The line a crashing rank writes before it dies: formatted once here, since
// a signal handler may only write(2) (async-signal-safe).
char g_crash_line[NSIG][640];  // room for the role, a 255-byte host name and the reason

// "0x7f12... (libmca_btl_tcp.so+0x1a2b)": where an address lies. dladdr is not
// async-signal-safe in general, but the process is about to die of the signal
// and the line is worth more than the risk (Open MPI's handler does the same).
int format_site(char* out, size_t n, uintptr_t address) {
  Dl_info info{};
  if (address != 0 && dladdr(reinterpret_cast<void*>(address), &info) && info.dli_fname) {
    const char* base = std::strrchr(info.dli_fname, '/');
    return std::snprintf(out, n, "0x%lx (%s+0x%lx)", static_cast<unsigned long>(address),
                         base ? base + 1 : info.dli_fname,
                         static_cast<unsigned long>(address - reinterpret_cast<uintptr_t>(info.dli_fbase)));
  }
  return std::snprintf(out, n, "0x%lx", static_cast<unsigned long>(address));
}

extern "C" void on_crash_signal(int sig, siginfo_t* info, void* context) {
  if (sig > 0 && sig < NSIG) (void)!write(STDERR_FILENO, g_crash_line[sig], std::strlen(g_crash_line[sig]));
  // Where: the faulting instruction and, when the rank jumped to address 0 (a
  // call through a null function pointer, where no backtrace can start), the
  // return address the call left on the stack; then the frames glibc finds.
  char where[512];
  int len = std::snprintf(where, sizeof where, "shardlm:   at pc ");
#if defined(__x86_64__) && defined(REG_RIP)
  const auto* uc = static_cast<const ucontext_t*>(context);
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  len += format_site(where + len, sizeof where - size_t(len), pc);
  if (pc == 0) {
    len += std::snprintf(where + len, sizeof where - size_t(len), ", called from ");
    len += format_site(where + len, sizeof where - size_t(len),
                       *reinterpret_cast<const uintptr_t*>(uc->uc_mcontext.gregs[REG_RSP]));
  }
#else
  (void)context;
  len += std::snprintf(where + len, sizeof where - size_t(len), "?");
#endif
  if (sig == SIGSEGV || sig == SIGBUS)
    len += std::snprintf(where + len, sizeof where - size_t(len), ", fault address %p",
                         info ? info->si_addr : nullptr);
  len = std::min(len, int(sizeof where) - 2);
  where[len++] = '\n';
  (void)!write(STDERR_FILENO, where, size_t(len));
  void* frames[32];
  backtrace_symbols_fd(frames, backtrace(frames, 32), STDERR_FILENO);
  signal(sig, SIG_DFL);  // die of it as before: the launcher and Slurm see the signal
  raise(sig);
}

}  // namespace

void install_crash_reporters() {
  const struct { int sig; const char* name; const char* why; } kCrashes[] = {
      {SIGSEGV, "SIGSEGV", "a crash: invalid memory access"},
      {SIGBUS, "SIGBUS", "a crash: bad memory access (a truncated mmapped file, a failing disk or node)"},
      {SIGFPE, "SIGFPE", "a crash: arithmetic fault"},
      {SIGILL, "SIGILL", "a crash: illegal instruction (a binary built for another CPU?)"},
      {SIGABRT, "SIGABRT", "aborted (a failed assertion or std::terminate)"},
  };
  void* warm[1];
  (void)backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (const auto& c : kCrashes) {
    if (g_world_rank < 0)  // before MPI_Init_thread returns: the rank is not known yet
      std::snprintf(g_crash_line[c.sig], sizeof g_crash_line[c.sig],
                    "shardlm: a rank (%s, pid %d) died of signal %d (%s) inside MPI_Init_thread, before shardlm's "
                    "first MPI call (the MPI library crashed while the ranks wired up): %s\n",
                    g_host, static_cast<int>(getpid()), c.sig, c.name, c.why);
    else
      std::snprintf(g_crash_line[c.sig], sizeof g_crash_line[c.sig],
                    "shardlm: rank %d of %d (%s%s, pid %d) died of signal %d (%s): %s\n", g_world_rank,
                    g_world_size, g_role_text, g_host, static_cast<int>(getpid()), c.sig, c.name, c.why);
    struct sigaction sa {};
    sa.sa_sigaction = on_crash_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER;
    sigaction(c.sig, &sa, nullptr);
  }
}

void fatal(const std::string& message, int exit_code) {
  if (g_world_rank >= 0)
    std::fprintf(stderr, "shardlm: error on rank %d of %d (%s): %s\n", g_world_rank, g_world_size, g_host,
                 message.c_str());
  else
    std::fprintf(stderr, "shardlm: error: %s\n", message.c_str());
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && g_world_size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

void mpi_failed(const char* call, int status, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(status, text, &len);
  fatal(fmt("%s failed at %s:%d: %s", call, file, line, text));
}

bool fault_armed(const char* point) {
  const char* spec = std::getenv("SHARDLM_FAULT");
  if (!spec) return false;
  const char* at = std::strchr(spec, '@');
  if (!at || std::strncmp(spec, point, static_cast<size_t>(at - spec)) != 0 || std::strlen(point) != size_t(at - spec))
    return false;
  return std::atoi(at + 1) == std::max(g_world_rank, 0);  // a process without MPI is rank 0
}

void hold_for_test(int64_t steps_done) {
  // "N:FILE[,N:FILE...]": after step N, wait until FILE exists. Parsed once.
  static const std::vector<std::pair<int64_t, std::string>> holds = [] {
    std::vector<std::pair<int64_t, std::string>> out;
    const char* spec = std::getenv("SHARDLM_TEST_HOLD");
    std::string entry;
    for (std::istringstream in(spec ? spec : ""); std::getline(in, entry, ',');)
      if (const size_t colon = entry.find(':'); colon != std::string::npos && colon + 1 < entry.size())
        out.emplace_back(std::atoll(entry.c_str()), entry.substr(colon + 1));
    return out;
  }();
  const auto hold = std::find_if(holds.begin(), holds.end(), [&](const auto& h) { return h.first == steps_done; });
  if (hold == holds.end()) return;
  const std::string& file = hold->second;
  if (g_world_rank <= 0) {
    std::printf("test hold: after step %lld until %s exists (SHARDLM_TEST_HOLD)\n", (long long)steps_done, file.c_str());
    std::fflush(stdout);
  }
  while (access(file.c_str(), F_OK) != 0) usleep(50 * 1000);
}

void maybe_inject_fault(const char* point) {
  if (fault_armed(point)) fatal(fmt("injected fault '%s' (SHARDLM_FAULT=%s)", point, std::getenv("SHARDLM_FAULT")));
}

}  // namespace shardlm
