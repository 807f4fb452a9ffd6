// signals.cpp — the stop flag and its agreement (base/signals.hpp).
#include "base/signals.hpp"

#include <unistd.h>

#include <atomic>
#include <csignal>

#include "shardlm/comm.hpp"
#include "shardlm/runtime.hpp"  // MPI_CHECK

namespace shardlm {

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
std::atomic<int> g_run_dir_lost{0};  // set by the run.lock heartbeat thread
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_signal != 0) {  // a second interrupt: stop at once, as an unhandled SIGINT does
    static const char now[] = "\nshardlm: second interrupt: stopping now, without a checkpoint\n";
    (void)!write(STDERR_FILENO, now, sizeof now - 1);
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
    return;
  }
  if (sig == SIGINT) {  // someone at a terminal: say what happens next
    static const char later[] = "\nshardlm: interrupt: saving a checkpoint after this step, then exit 75 "
                                "(interrupt again to stop at once)\n";
    (void)!write(STDERR_FILENO, later, sizeof later - 1);
  }
  g_stop_signal = sig;
}
}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // MPI's and HDF5's system calls carry on
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

void restore_default_stop_signals() {
  for (int sig : {SIGUSR1, SIGTERM, SIGINT}) signal(sig, SIG_DFL);
  if (g_stop_signal != 0) raise(g_stop_signal);
}

bool stop_requested(MPI_Comm comm) {
  int mine[2] = {g_stop_signal, g_run_dir_lost.load()}, any[2] = {0, 0};
  MPI_Request request;  // watched: a rank that never arrives ends the job
  MPI_CHECK(MPI_Iallreduce(mine, any, 2, MPI_INT, MPI_MAX, comm, &request));
  wait_collective(comm, &request, "stop agreement");
  if (any[0] && !g_stop_signal) g_stop_signal = any[0];
  if (any[1]) g_run_dir_lost = 1;
  return any[0] != 0 || any[1] != 0;
}

bool stop_requested(Comm& trainers) {
  // One count per stop signal, ascending, so that the result is the MPI version's MAX.
  constexpr int kSignals[3] = {SIGINT, SIGUSR1, SIGTERM};
  int64_t seen[4];  // the three signals, then a lost run.lock
  for (int i = 0; i < 3; ++i) seen[i] = g_stop_signal == kSignals[i] ? 1 : 0;
  seen[3] = g_run_dir_lost.load();
  trainers.all_reduce_sum(seen, 4);
  int any = 0;
  for (int i = 0; i < 3; ++i)
    if (seen[i] > 0) any = kSignals[i];
  if (any && !g_stop_signal) g_stop_signal = any;
  if (seen[3] > 0) g_run_dir_lost = 1;
  return any != 0 || seen[3] > 0;
}

int stop_signal() { return g_stop_signal; }
void clear_stop_request() { g_stop_signal = 0, g_run_dir_lost = 0; }
void request_stop_run_dir_lost() { g_run_dir_lost = 1; }
bool run_dir_lost() { return g_run_dir_lost.load() != 0; }

}  // namespace shardlm
