// signals.hpp — the stop request a job scheduler sends, and the exit
// codes the job scripts act on.
//
// Owns: the signal handlers (SIGUSR1, SIGTERM, SIGINT set a flag; a second SIGINT
// ends the process; nothing else happens in a handler), the agreement of all trainer ranks on that flag at the end of
// a step, and the exit codes of `shardlm train`. Knows MPI (one all-reduce);
// knows nothing about checkpoint files, the model or the training loop: the
// Checkpointer asks stop_requested() at the end of every step and saves.
#pragma once

#include <mpi.h>

namespace shardlm {

class Comm;

// Exit codes of `shardlm train` (sysexits.h): the job scripts requeue on 75.
constexpr int kExitRequeue = 75;           // EX_TEMPFAIL: stopped by SIGUSR1/SIGTERM/SIGINT, checkpoint saved
constexpr int kExitCheckpointFailed = 74;  // EX_IOERR: a save failed and ckpt.on_error = "stop"

// SIGUSR1, SIGTERM and SIGINT set a flag; a second SIGINT ends the process at once
// (the handler only writes one line to stderr and sets the flag).
void install_stop_signal_handlers();
// The default actions back (a program that does not read the flag); a stop
// signal already seen is raised again, so it ends the process as it would have.
void restore_default_stop_signals();
// Collective: true on every rank when any rank has seen a stop signal.
bool stop_requested(MPI_Comm trainers);
// The same through the trainers' Comm, whose all-reduce is watched (comm.timeout_s):
// the training loop asks every step, and a rank that never arrives (its node cut
// off) must end the job, not hang it in a plain MPI_Allreduce.
bool stop_requested(Comm& trainers);
int stop_signal();                  // the signal seen (0 = none), for the log
void clear_stop_request();          // tests

// A stop that is no signal: trainer rank 0's run.lock heartbeat found the lock
// taken by another run (run_dir.hpp). Safe from any thread; stop_requested()
// then returns true on every rank and run_dir_lost() says why. The run must
// neither save nor write in run.dir any more: it exits kExitRunDirInUse.
void request_stop_run_dir_lost();
bool run_dir_lost();                // after stop_requested(): on every rank

}  // namespace shardlm
