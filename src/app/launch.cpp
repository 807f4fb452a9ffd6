// launch.cpp — the deck as the job agrees on it, the trainers' runtime, the
// banner, and a run's ends before its first step (launch.hpp).
#include "app/launch.hpp"

#include <omp.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "app/run_start.hpp"
#include "base/signals.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/watchdog.hpp"

namespace shardlm {

namespace {

// What keeps this rank from starting in its part of an MPMD launch ("" = nothing).
// Checked with the deck, so the whole job stops together with exit 1 and one
// message, never a rank's abort that the others would read as a stop signal.
std::string launch_problem(const Runtime& rt, const std::string& command, const Config& c) {
  if (command == "receive" && rt.num_trainers == 0)
    return "`shardlm receive` needs trainer ranks in the same job: run it as the second app of an MPMD launch "
           "(mpirun -np N shardlm train DECK : -np 1 shardlm receive DECK; under Slurm jobs/slurm-rl.sbatch)";
  if (!rt.trainers_first)
    return "the `shardlm train` ranks must come first in an MPMD launch (world ranks 0..N-1), the receivers "
           "after them (srun --multi-prog: train on tasks 0-(N-1), receive on the rest)";
  if (command == "train" && rt.role != Role::Train)
    return fmt("this rank is in app %d of the MPMD launch, which receives: run `shardlm receive` or `shardlm "
               "generate` there, `shardlm train` in the first app", rt.appnum);
  if (command == "receive" && c.broadcast.backend == "none")
    return "receive: the deck has broadcast.backend = \"none\"; set \"nccl\" or \"filesystem\"";
  if (command == "generate") {
    if (c.loss.type != "rl")
      return "`shardlm generate DECK` samples rollouts for an RL job, and the deck has loss.type = \"" + c.loss.type +
             "\": set loss.type = \"rl\"";
    if (c.broadcast.backend == "none")
      return "`shardlm generate DECK` takes the trainers' weights from the broadcast, and the deck has "
             "broadcast.backend = \"none\": set \"nccl\" (MPI on the CPU backend) or \"filesystem\"";
    if (c.rollout.prompts.empty())
      return "`shardlm generate DECK` needs rollout.prompts: the prompt file to sample (tools/make_prompts.py; "
             "docs/rl.md)";
  }
  if (command == "train" && rt.num_receivers > 0 && c.broadcast.backend == "none")
    return fmt("this job has %d receiver rank%s but broadcast.backend = \"none\": set \"nccl\" or \"filesystem\", "
               "or launch the trainers alone", rt.num_receivers, rt.num_receivers == 1 ? "" : "s");
  return "";
}

}  // namespace

bool load_deck(const Runtime& rt, const CliArgs& args, int world, Config& config) {
  DeckResult deck = parse_deck(args.deck, args.overrides, world);
  if (deck.ok())
    if (const std::string problem = launch_problem(rt, args.command, deck.config); !problem.empty())
      deck.errors.push_back(problem);
  int bad = deck.ok() ? 0 : 1, any_bad = 0, first_bad = rt.world_size;
  int my_index = bad ? rt.world_rank : rt.world_size;
  MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  MPI_CHECK(MPI_Allreduce(&my_index, &first_bad, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (any_bad && rt.world_rank == first_bad) {
    std::fprintf(stderr, "shardlm: the deck has %zu error%s%s:\n", deck.errors.size(),
                 deck.errors.size() == 1 ? "" : "s",
                 rt.world_rank ? fmt(" (seen on rank %d)", rt.world_rank).c_str() : "");
    for (const auto& e : deck.errors) std::fprintf(stderr, "  %s\n", e.c_str());
    std::fflush(stderr);
  }
  config = deck.config;
  return !any_bad;
}

void inject_startup_faults() {
  maybe_inject_fault("startup");
  if (fault_armed("segv")) std::raise(SIGSEGV);  // tests: a crashing rank names itself
  if (fault_armed("null_call")) {                 // and says where it called a null function pointer
    void (*volatile null_function)() = nullptr;
    null_function();
  }
}

void set_up_trainer_runtime(Runtime& rt, Config& config) {
  set_collective_timeout(config.comm.timeout_s);  // the MPI Comm's watchdog (NCCL has its own)
  start_watchdog(config.comm.timeout_s);          // and everything else that can hang: I/O, HDF5, the writer
  select_device(rt, config.device.backend);
  config.device.backend = rt.backend;  // "auto" resolved: the session builds that backend
  config.comm.backend = select_comm(rt, config.comm.backend);
  if (rt.backend == "cuda") set_device_memory_limit(static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
  if (config.device.cpu_threads > 0) omp_set_num_threads(static_cast<int>(config.device.cpu_threads));
}

void print_banner(const Runtime& rt, const Config& config) {
  if (rt.world_rank != 0) return;
  std::printf("shardlm %s (%s) | %d rank%s: %d trainer%s, %d receiver%s | backend %s (built: %s) | device %s\n"
              "deck %s | run dir %s\n",
              shardlm_version(), shardlm_git_rev(), rt.world_size, rt.world_size == 1 ? "" : "s", rt.num_trainers,
              rt.num_trainers == 1 ? "" : "s", rt.num_receivers, rt.num_receivers == 1 ? "" : "s",
              rt.backend.c_str(), built_backends(), rt.device_name.c_str(), config.deck_path.c_str(),
              config.run.dir.c_str());
  if (rt.num_generators > 0)
    std::printf("inference: %d of the receivers run `shardlm generate` (sampling the rollouts)\n", rt.num_generators);
  std::printf("placement: %s\n", placement_summary(rt).c_str());
  std::fflush(stdout);
}

std::optional<int> end_before_first_step(const Runtime& rt, const Config& config, const ResumePoint& start,
                                         const RunDirLock* run_dir_lock, WeightBroadcaster& broadcaster,
                                         Comm& trainers) {
  if (start.step > 0 && start.step >= config.run.max_steps) {  // a finished run started again: say so, train nothing
    if (trainers.rank() == 0)
      std::printf("run already complete: %s is at step %lld and run.max_steps = %lld; nothing to train (raise "
                  "run.max_steps to go on, or set ckpt.resume = \"none\" to start over)\n",
                  start.path.c_str(), (long long)start.step, (long long)config.run.max_steps);
    broadcaster.finish(0);
    return 0;
  }
  if (stop_requested(rt.role_comm)) {  // signalled during setup: no step ran, the state on disk is already current
    if (run_dir_lost()) {  // run.lock taken by another run during setup: the directory is not ours
      report_run_dir_lost(rt, config, run_dir_lock, start.step);
      broadcaster.finish(kExitRunDirInUse);
      return kExitRunDirInUse;
    }
    if (trainers.rank() == 0)
      std::printf("stopped by signal %d during setup, before the first step: exit %d (requeue; nothing to save%s)\n",
                  stop_signal(), kExitRequeue,
                  start.step > 0 ? fmt(", %s is where the next start resumes", start.path.c_str()).c_str() : "");
    broadcaster.finish(kExitRequeue);
    return kExitRequeue;
  }
  return std::nullopt;
}

}  // namespace shardlm
