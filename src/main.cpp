// main.cpp — shardlm's entry point and the solver loop, top to bottom.
//
// runtime -> config -> (model, shards, init) -> for step: batch, forward,
// loss, backward, clip, optimizer (session.step), eval, metrics, broadcast,
// checkpoint (the Checkpointer decides: save, go on or stop). Each phase is one
// call; a phase that grows past a screen lives in its own file (the reports in
// app/report.cpp, the memory plan in app/plan.cpp).
#include <omp.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>

#include "broadcast/broadcast.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/async.hpp"
#include "config/cli.hpp"
#include "infer/command.hpp"
#include "infer/rollout.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "train/forward.hpp"
#include "model/tokenizer_files.hpp"
#include "shardlm/memory.hpp"
#include "app/metrics.hpp"
#include "app/plan.hpp"
#include "app/report.hpp"
#include "base/run_dir.hpp"
#include "app/run_start.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/watchdog.hpp"
#include "train/train.hpp"

using namespace shardlm;

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

// Every rank parses the deck; the job agrees on whether it is valid, and the
// lowest rank that found errors prints them. Returns false when the deck is bad.
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

int cmd_check(const Runtime& rt, const CliArgs& args) {
  Config config;
  const int world = args.world > 0 ? args.world : rt.num_trainers;
  if (!load_deck(rt, args, world, config)) return 1;
  if (rt.world_rank == 0) check_report(config, args.deck, world);
  return 0;
}

// `shardlm generate DECK` beside the trainers: the RL job's inference ranks
// (src/infer/rollout.hpp). Stop signals as for the receiver: the trainers decide.
int cmd_inference_role(Runtime& rt, const CliArgs& args) {
  install_stop_signal_handlers();
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  if (config.device.cpu_threads > 0) omp_set_num_threads(static_cast<int>(config.device.cpu_threads));
  // The sampler's backend, as the trainers resolve theirs ("auto": cuda when a GPU is there).
  select_device(rt, config.device.backend);
  return run_inference_role(config, rt);
}

int cmd_receive(Runtime& rt, const CliArgs& args) {
  // Slurm (--signal=USR1@T) and mpirun signal every task: the receiver takes
  // the same stop signals as the trainers and exits with their decision.
  install_stop_signal_handlers();
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  start_watchdog(config.comm.timeout_s);  // the filesystem path's reads and fsyncs are watched like the trainers'
  const auto out = args.options.count("out") ? args.options.at("out") : std::string();
  return run_receiver(config, rt, out);
}

// `shardlm generate ...`: standalone sampling; each rank takes a share of the prompts (src/infer/command.hpp).
int cmd_generate(const CliArgs& args) {
  if (args.inference_role) {
    std::fprintf(stderr, "shardlm generate: error: `shardlm generate DECK` is the inference role of an RL job and "
                         "needs trainer ranks in the same job: mpirun -np T shardlm train DECK : -np G shardlm generate "
                         "DECK (for standalone sampling: shardlm generate --deck DECK --prompts FILE --out FILE)\n");
    return 1;
  }
  GenerateArgs g;
  try {
    g = parse_generate_args(args.options, args.deck, args.overrides);
  } catch (const Error& e) {
    std::fprintf(stderr, "shardlm generate: error: %s\n", e.what());
    return 1;
  }
  return run_generate(g, MPI_COMM_WORLD);
}

// `shardlm inspect CKPT`: what a checkpoint holds, every checksum verified; exit 1 when damaged.
int cmd_inspect(const CliArgs& args) { return inspect_checkpoint(args.options.at("checkpoint"), MPI_COMM_WORLD, stdout); }

// `shardlm export CKPT --out DIR [--dtype bf16|fp32]`: an HF model directory from a checkpoint.
int cmd_export(const CliArgs& args) {
  const std::string dtype = args.options.count("dtype") ? args.options.at("dtype") : "bf16";
  export_checkpoint(args.options.at("checkpoint"), args.options.at("out"), dtype, MPI_COMM_WORLD);
  return 0;
}

// run.export_dir: the final weights as an HF model directory, with model.hf's tokenizer files.
void export_final_weights(const Config& config, TrainSession& session, Comm& comm) {
  session.pull_state();
  export_hf(session.model, comm, config.run.export_dir, config.run.export_dtype == "bf16" ? "BF16" : "F32");
  if (comm.rank() == 0)
    std::printf("exported the final weights to %s (%s)\n", config.run.export_dir.c_str(),
                copy_tokenizer_files(config.model.hf, config.run.export_dir).c_str());
}

int cmd_train(Runtime& rt, const CliArgs& args) {
  // SIGUSR1/SIGTERM/SIGINT set a flag from the very start: a stop during setup
  // (the run-dir lock, the session build: minutes at 8B) ends the run cleanly
  // below, with run.lock released, instead of killing the process.
  install_stop_signal_handlers();
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  maybe_inject_fault("startup");
  if (fault_armed("segv")) std::raise(SIGSEGV);  // tests: a crashing rank names itself
  if (fault_armed("null_call")) {                 // and says where it called a null function pointer
    void (*volatile null_function)() = nullptr;
    null_function();
  }
  set_collective_timeout(config.comm.timeout_s);  // the MPI Comm's watchdog (NCCL has its own)
  start_watchdog(config.comm.timeout_s);          // and everything else that can hang: I/O, HDF5, the writer
  select_device(rt, config.device.backend);
  config.device.backend = rt.backend;  // "auto" resolved: the session builds that backend
  config.comm.backend = select_comm(rt, config.comm.backend);
  if (rt.backend == "cuda") set_device_memory_limit(static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
  if (config.device.cpu_threads > 0) omp_set_num_threads(static_cast<int>(config.device.cpu_threads));
  // model.optim_gpu_state_gib: which units keep their state on the GPU
  const std::string offload_split = resolve_offload_split(rt, config);
  refuse_plan_over_machine(rt, config);
  print_banner(rt, config);
  if (rt.world_rank == 0 && !offload_split.empty()) std::printf("%s", offload_split.c_str());
  bool in_use = false;
  bool checkpoints_refused = false;
  const std::unique_ptr<RunDirLock> run_dir_lock =
      open_run_dir(rt, config, &in_use, &checkpoints_refused);  // held until return
  if (in_use) return kExitRunDirInUse;
  if (checkpoints_refused) return kExitCheckpointFailed;
  print_deck_echo(rt, config);
  auto comm = make_mpi_comm(rt.role_comm);
  WeightBroadcaster broadcaster(config, rt, *comm);

  // model, shards, init; data; optimizer; engine
  const auto t_setup = std::chrono::steady_clock::now();
  TrainSession session(config, *comm);
  const double setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_setup).count();
  setup_report(config, session, setup_s);
  // MFU against dense bf16 peak: 989 TFLOP/s for an H100 SXM (DESIGN.md); none on the CPU.
  const double peak_flops = rt.backend == "cuda" ? 989e12 : 0.0;

  // init from a checkpoint (ckpt.resume: latest | none | a file); SIGUSR1/SIGTERM/SIGINT stop after a step
  const ResumePoint start = resume(session, rt.role_comm);
  if (start.step > 0 && start.step >= config.run.max_steps) {  // a finished run started again: say so, train nothing
    if (comm->rank() == 0)
      std::printf("run already complete: %s is at step %lld and run.max_steps = %lld; nothing to train (raise "
                  "run.max_steps to go on, or set ckpt.resume = \"none\" to start over)\n",
                  start.path.c_str(), (long long)start.step, (long long)config.run.max_steps);
    broadcaster.finish(0);
    return 0;
  }
  if (stop_requested(rt.role_comm)) {  // signalled during setup: no step ran, the state on disk is already current
    if (run_dir_lost()) {  // run.lock taken by another run during setup: the directory is not ours
      report_run_dir_lost(rt, config, run_dir_lock.get(), start.step);
      broadcaster.finish(kExitRunDirInUse);
      return kExitRunDirInUse;
    }
    if (comm->rank() == 0)
      std::printf("stopped by signal %d during setup, before the first step: exit %d (requeue; nothing to save%s)\n",
                  stop_signal(), kExitRequeue,
                  start.step > 0 ? fmt(", %s is where the next start resumes", start.path.c_str()).c_str() : "");
    broadcaster.finish(kExitRequeue);
    return kExitRequeue;
  }
  broadcaster.start(session, start.step);  // the inference ranks' first weights, when the job has any
  Metrics metrics(config, comm->rank() == 0, describe_start(rt, config, start),
                  flops_per_token(session.model.layout, config.data.seq_len), peak_flops);

  // The Checkpointer decides at the end of every step: a save due or
  // signalled, a background save finished, what a failed one means
  // (ckpt.on_error); with ckpt.async a save copies the state and a background
  // writer finishes the file while training goes on.
  Checkpointer checkpointer(session, rt.role_comm);
  int64_t tokens_seen = start.tokens_seen, steps_done = start.step;
  for (int64_t step = start.step; step < config.run.max_steps; ++step) {
    StepStats stats = session.step(step);  // batch, forward, loss, backward, clip, optimizer
    if (session.eval_due(step + 1)) session.evaluate(stats);  // held-out loss, forward only
    metrics.log(stats);
    tokens_seen += stats.tokens;
    steps_done = step + 1;
    if (broadcaster.due(steps_done)) broadcaster.send(session, steps_done);  // host paths pull the state themselves
    const StepEnd end = checkpointer.after_step(steps_done, tokens_seen);  // saves if due or signalled
    hold_for_test(steps_done);  // SHARDLM_TEST_HOLD only (tests/scripts/test_multinode.sh)
    if (end.stop) break;  // signalled (exit 75), or a failed save under ckpt.on_error = "stop" (exit 74)
  }
  const RunEnd run_end = checkpointer.finish();  // the last save, waited for
  broadcaster.finish(run_end.exit_code);
  if (run_end.exit_code == kExitRunDirInUse) {  // run.lock taken mid-run: nothing more is written in run.dir
    report_run_dir_lost(rt, config, run_dir_lock.get(), steps_done);
    return kExitRunDirInUse;
  }
  if (!run_end.stopped) {
    if (!config.run.export_dir.empty()) export_final_weights(config, session, *comm);
    end_of_run_report(rt, config, session, broadcaster, metrics, start.step, run_end, steps_done);
  }
  metrics.end(run_end.status(), run_end.exit_code, steps_done);
  if (run_end.exit_code == 0 && rt.world_rank == 0) std::printf("done: outputs in %s\n", config.run.dir.c_str());
  return run_end.exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CliArgs args;
  try {
    args = parse_cli(argc, argv);
  } catch (const Error& e) {
    std::fprintf(stderr, "shardlm: %s", e.what());
    return 2;
  }
  if (args.command == "help") return std::printf("%s", usage()), 0;
  if (args.command == "version") return std::printf("shardlm %s (%s) backends: %s\n", shardlm_version(), shardlm_git_rev(), built_backends()), 0;

  if (args.command == "forward") {
    try {
      const int64_t rows = forward_hf(args.options["hf"], args.options["tokens"], args.options["out"]);
      std::printf("forward: %lld rows -> %s\n", (long long)rows, args.options["out"].c_str());
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardlm: error: %s\n", e.what());
      return 1;
    }
  }

  Runtime rt = runtime_init(&argc, &argv,
                            args.command == "receive"    ? Role::Receive
                            : args.command == "generate" ? Role::Generate
                                                         : Role::Train);
  int rc = 1;
  try {
    rc = args.command == "check" ? cmd_check(rt, args)
         : args.command == "receive" ? cmd_receive(rt, args)
         : args.command == "inspect" ? cmd_inspect(args)
         : args.command == "export"  ? cmd_export(args)
         : args.command == "generate" && rt.num_trainers > 0 ? cmd_inference_role(rt, args)
         : args.command == "generate" ? cmd_generate(args)
                                     : cmd_train(rt, args);
  } catch (const std::exception& e) {
    fatal(e.what());  // one message naming the rank, then MPI_Abort: never a hang
  }
  runtime_finalize(rt);
  return rc;
}
