// main.cpp — shardlm's entry point and the solver loop, top to bottom.
//
// runtime -> config -> (model, shards, init) -> for step: batch, forward,
// loss, backward, clip, optimizer (session.step), eval, metrics, broadcast,
// checkpoint (the Checkpointer decides: save, go on or stop). Each phase is one
// call; a phase that grows past a screen lives in its own file (the deck, the
// runtime and the ends before the first step in app/launch.cpp, the reports in
// app/report.cpp, the memory plan in app/plan.cpp).
#include <omp.h>

#include <chrono>
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
#include "app/launch.hpp"
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
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  if (config.device.cpu_threads > 0) omp_set_num_threads(static_cast<int>(config.device.cpu_threads));
  // Its waits for the trainers and for each other are watched (shardlm/comm.hpp).
  set_collective_timeout(config.comm.timeout_s);
  start_watchdog(config.comm.timeout_s);
  // The sampler's backend, as the trainers resolve theirs ("auto": cuda when a GPU is there).
  select_device(rt, config.device.backend);
  return run_inference_role(config, rt);
}

int cmd_receive(Runtime& rt, const CliArgs& args) {
  // Slurm (--signal=USR1@T) and mpirun signal every task: the receiver takes
  // the same stop signals as the trainers (handlers from main's start) and
  // exits with their decision.
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  set_collective_timeout(config.comm.timeout_s);  // its waits for the trainers (shardlm/comm.hpp)
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
  // SIGUSR1/SIGTERM/SIGINT set a flag from main's start: a stop during setup
  // (MPI's start-up, the run-dir lock, the session build: minutes at 8B) ends
  // the run cleanly below, with run.lock released, instead of killing the process.
  // config: the deck, agreed by the whole job; runtime: watchdogs, device, communicators
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  inject_startup_faults();             // tests only (SHARDLM_FAULT)
  set_up_trainer_runtime(rt, config);  // device.backend "auto" resolved
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
  // a finished run started again, or a stop signalled during setup: no step to run
  if (const auto exit_code = end_before_first_step(rt, config, start, run_dir_lock.get(), broadcaster, *comm))
    return *exit_code;
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

  // A job's ranks take stop signals as a stop from their first instruction on:
  // MPI's start-up takes a fraction of a second, and Slurm or mpirun may signal
  // a task that is still in it (the flag is read once the run is set up).
  const bool job_command = args.command == "train" || args.command == "receive" || args.command == "generate";
  if (job_command) install_stop_signal_handlers();
  Runtime rt = runtime_init(&argc, &argv,
                            args.command == "receive"    ? Role::Receive
                            : args.command == "generate" ? Role::Generate
                                                         : Role::Train);
  // `generate` without trainers samples standalone: a stop signal ends it as it
  // would any program (one seen during start-up is delivered now).
  if (args.command == "generate" && rt.num_trainers == 0) restore_default_stop_signals();
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
