// runtime.hpp — the process's place in the job: MPI ranks, node-local rank, role
// (trainer or receiver in an MPMD launch), device, and the one way to die.
//
// Owns: MPI initialisation and finalisation, the role and broadcast
// communicators, device selection, fatal(). MPI is the only bootstrap: no
// environment-variable rendezvous, no TCP store. Knows nothing about the deck,
// the model or the data.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

#include "shardlm/error.hpp"

#define MPI_CHECK(call)                                                              \
  do {                                                                               \
    int mpi_status_ = (call);                                                        \
    if (mpi_status_ != MPI_SUCCESS) ::shardlm::mpi_failed(#call, mpi_status_, __FILE__, __LINE__); \
  } while (0)

namespace shardlm {

// Train: `shardlm train`. Receive: `shardlm receive` (or any subcommand in app
// 1+ of an MPMD launch other than generate). Generate: `shardlm generate`, the
// inference ranks of an RL job (standalone sampling when there are no trainers).
enum class Role { Train, Receive, Generate };

struct Runtime {
  int world_rank = 0, world_size = 1;   // MPI_COMM_WORLD
  int local_rank = 0, local_size = 1;   // ranks on this node (MPI_COMM_TYPE_SHARED)
  int num_nodes = 1;                    // nodes of the job: MPI_COMM_TYPE_SHARED groups of MPI_COMM_WORLD
  int appnum = 0;                       // MPI_APPNUM: 0 trains, 1 receives
  Role role = Role::Train;
  MPI_Comm role_comm = MPI_COMM_NULL;   // the ranks of this role; for trainers, the training ranks
  int rank = 0, size = 1;               // within role_comm
  int num_trainers = 1, num_receivers = 0;  // receivers: every rank that is not a trainer
  int num_generators = 0;               // of the receivers, those running `shardlm generate`
  uint64_t job_id = 0;                  // random, drawn by world rank 0 at runtime_init, the same on every rank
  bool trainers_first = true;           // the trainers are world ranks 0..num_trainers-1 (else a launch error)
  MPI_Comm broadcast_comm = MPI_COMM_NULL;  // trainer rank 0 + every receiver; NULL elsewhere
  std::string hostname;
  std::string backend = "cpu";          // "cpu" | "cuda", after select_device()
  int device = -1;                      // CUDA device ordinal, -1 on the CPU backend
  std::string device_name = "cpu";
};

// MPI_Init and everything derived from MPI_COMM_WORLD. Works as a singleton,
// under mpirun and under srun --mpi=pmix. `role` is what this process's
// subcommand does; a process of app 1 or later of an mpirun MPMD launch
// (MPI_APPNUM) receives as well. Slurm's PMIx gives every task MPI_APPNUM 0, so
// under `srun --multi-prog` the subcommand alone decides.
Runtime runtime_init(int* argc, char*** argv, Role role = Role::Train);
void runtime_finalize(Runtime& rt);

// Decide the backend ("auto" | "cpu" | "cuda") and bind the GPU from the local
// rank: ndev == 1 ? 0 : local_rank % ndev. Throws Error when cuda is asked for
// and cannot be had.
void select_device(Runtime& rt, const std::string& requested);

// The unit loop's communicator after select_device ("auto" | "mpi" | "nccl"):
// the CPU backend uses MPI; GPUs use NCCL when no two training ranks of a node
// are bound to one GPU, else MPI staged through host memory (NCCL refuses two
// ranks on one GPU). Collective over the role communicator, so every rank gets
// the same answer. Throws Error for "nccl" where it cannot work.
std::string select_comm(const Runtime& rt, const std::string& requested);
// The device communicator of the GPU weight broadcast, by the same rule over
// rt.broadcast_comm (trainer rank 0 + the receivers, each after select_device):
// "nccl" when no two of them share a GPU, else "mpi" (staged through host
// memory; e.g. a trainer and a receiver on one GPU). Collective over
// rt.broadcast_comm.
std::string select_broadcast_comm(const Runtime& rt);

// The job's id (Runtime::job_id) and its `shardlm generate` ranks, as
// runtime_init found them (0 and 0 before it): the trainers' rollout source
// takes only files of its own job when the job makes them.
uint64_t job_id();
int job_generators();

// The host of a world rank, as that rank named itself at runtime_init ("?" before
// it or out of range): error messages name the node of a rank.
const char* world_rank_host(int world_rank);
// Where the ranks run, as each reported it at runtime_init (host, local rank,
// local size, node count), one line for the job's log:
// "4 ranks on 2 nodes | mn1: ranks 0,1 local 0,1 | mn2: ranks 2,3 local 0,1".
std::string placement_summary(const Runtime& rt);

// The only exit for an unrecoverable error on one rank: one message naming the
// rank, host and cause on stderr, then MPI_Abort of the whole job (never a hang).
// The job's exit code is `exit_code` (1 unless a watchdog says otherwise: watchdog.hpp).
[[noreturn]] void fatal(const std::string& message, int exit_code = 1);
// A rank that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes one
// line naming its rank, host and pid and the signal, then where (the faulting
// pc, and the caller when it jumped to address 0, as library+offset; the frames
// glibc finds), before it dies of it. runtime_init installs them before
// MPI_Init_thread (Open MPI keeps a handler it finds: a crash in the library's
// start-up says so) and again once the rank and role are known. SIGKILL cannot
// be caught: the launcher names it.
void install_crash_reporters();
[[noreturn]] void mpi_failed(const char* call, int status, const char* file, int line);

// Fault injection for the tests that prove a failing rank aborts the job:
// SHARDLM_FAULT="<point>@<world rank>" makes that rank fail at that point.
void maybe_inject_fault(const char* point);
// True when SHARDLM_FAULT names `point` for this rank (faults that are not a
// plain failure: "nccl_stall" makes the NCCL communicator's first collective wait
// behind a 30 s kernel, so its watchdog's timeout can be tested).
bool fault_armed(const char* point);
// Tests: SHARDLM_TEST_HOLD="<step>:<file>[,<step>:<file>...]" holds every rank
// at the end of that step, between two steps' collectives, until the file
// exists (world rank 0 says so first). tests/scripts/test_multinode.sh cuts a
// node's network there, with no collective and no checkpoint write under way;
// tests/scripts/test_slurm.sh signals a held job. Nothing otherwise.
void hold_for_test(int64_t steps_done);

// Built-in backends of this binary ("cpu" or "cpu+cuda").
const char* built_backends();
// This binary's version (VERSION file) and git revision, set by the Makefile.
const char* shardlm_version();
const char* shardlm_git_rev();

}  // namespace shardlm
