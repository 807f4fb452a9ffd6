// checkpoint_signals.cpp — the stop flag and its agreement (checkpoint_signals.hpp).
#include "shardlm/checkpoint_signals.hpp"

#include <csignal>

#include "shardlm/runtime.hpp"  // MPI_CHECK

namespace shardlm {

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
}  // namespace

void install_stop_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // MPI's and HDF5's system calls carry on
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool stop_requested(MPI_Comm comm) {
  int mine = g_stop_signal, any = 0;
  MPI_CHECK(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm));
  if (any && !g_stop_signal) g_stop_signal = any;
  return any != 0;
}

int stop_signal() { return g_stop_signal; }
void clear_stop_request() { g_stop_signal = 0; }

}  // namespace shardlm
