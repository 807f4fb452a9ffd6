// main.cpp — shardlm's entry point and the solver loop, top to bottom.
//
// runtime -> config -> (model, shards, init) -> for step: batch, forward,
// loss, backward, clip, optimizer, metrics, checkpoint. Each phase is one call;
// a phase that grows past a screen lives in its own file.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "shardlm/broadcast.hpp"
#include "shardlm/checkpoint.hpp"
#include "shardlm/checkpoint_async.hpp"
#include "shardlm/cli.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/engine.hpp"
#include "shardlm/forward.hpp"
#include "shardlm/hf.hpp"
#include "shardlm/memory.hpp"
#include "shardlm/metrics.hpp"
#include "shardlm/run_dir.hpp"
#include "shardlm/run_start.hpp"
#include "shardlm/runtime.hpp"
#include "shardlm/train.hpp"

namespace fs = std::filesystem;
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
    return fmt("this rank is in app %d of the MPMD launch, which receives: run `shardlm receive` there, "
               "`shardlm train` in the first app", rt.appnum);
  if (command == "receive" && c.broadcast.backend == "none")
    return "receive: the deck has broadcast.backend = \"none\"; set \"nccl\" or \"filesystem\"";
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
  std::printf("placement: %s\n", placement_summary(rt).c_str());
  std::fflush(stdout);
}

// The whole per-rank plan of a run: the engine's (shards, units, activations)
// plus what the optimizer, the broadcast and the export add on top.
MemoryPlan run_memory_plan(const Config& config, const ModelLayout& layout, const Backend& backend) {
  MemoryPlan plan = plan_memory(layout.config, layout.world, engine_options_for(config),
                                optimizer_states(config.optim), backend);
  plan.host_workspace += output_workspace_bytes(config, layout) + optimizer_workspace_bytes(config.optim, layout);
  const NsWorkspaceBytes gpu_ns = optimizer_gpu_workspace_bytes(config.optim, layout, config.device.backend == "cuda");
  plan.workspace += gpu_ns.device;
  plan.host_workspace += gpu_ns.pinned_host;
  plan.workspace += broadcast_device_bytes(config, layout);  // one gathered bf16 unit while broadcasting (GPU)
  plan.checkpoint_snapshot = checkpoint_snapshot_bytes(config, layout);  // ckpt.async on host state
  plan.checkpoint_snapshot_flexible = plan.checkpoint_snapshot - checkpoint_snapshot_floor(config, layout);
  return plan;
}

// What the token readers of a deck hold per rank (data.hpp's DataMemory): the
// files' document index, two epochs' orders, the prefetched micro-batch.
// Opens the files for their sizes; a file that cannot be opened is named and
// left out of the plan (the run itself will report it).
int64_t data_reader_bytes(const Config& config, int64_t vocab_size, std::string* note) {
  int64_t bytes = 0;
  try {
    if (config.loss.type == "sft") {
      bytes += TokenDataset(data_spec_for(config, vocab_size)).memory().total();
    }
    if (!config.eval.path.empty()) bytes += EvalSet(config, vocab_size).data().memory().total();
  } catch (const Error& e) {
    if (note) *note = fmt("data reader: not planned: %s\n", e.what());
  }
  return bytes;
}

// The plan of this run against this node's memory, before anything large is
// built: every process of the node holds its host plan at once, and the ranks
// bound to one GPU share its memory (or device.memory_limit_gib when lower).
void refuse_plan_over_machine(const Runtime& rt, const Config& config) {
  const ModelLayout layout(model_config_for(config), rt.num_trainers);
  const bool cuda = rt.backend == "cuda";
  const MemoryPlan plan = run_memory_plan(config, layout, cuda ? *make_cuda_backend() : *make_cpu_backend());
  int64_t gpu_bytes = 0;
  int ranks_per_gpu = 1;
  if (cuda) {
    gpu_bytes = cuda_device_memory_bytes(rt.device);
    if (config.device.memory_limit_gib > 0)
      gpu_bytes = std::min<int64_t>(gpu_bytes, static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
    const int ndev = std::max(cuda_device_count(), 1);
    ranks_per_gpu = (rt.local_size + ndev - 1) / ndev;
  }
  const std::string e = plan_fit_error(plan, rt.local_size, machine_host_memory(), ranks_per_gpu, gpu_bytes);
  SHARDLM_CHECK(e.empty(), "%s: %s", config.deck_path.c_str(), e.c_str());
}

int cmd_check(const Runtime& rt, const CliArgs& args) {
  Config config;
  const int world = args.world > 0 ? args.world : rt.num_trainers;
  if (!load_deck(rt, args, world, config)) return 1;
  if (rt.world_rank == 0) {
    const ModelConfig arch = model_config_for(config);
    const ModelLayout layout(arch, world);
    // The data as train opens it, before the deck is called valid: the token
    // files, or the rollout directory and its first file.
    std::string data_lines;
    if (config.loss.type == "sft") {
      for (const std::string& path : config.data.path) {
        validate_token_file(path, arch.vocab_size);
        data_lines += fmt("data: %s is a token file for vocab_size %lld\n", path.c_str(), (long long)arch.vocab_size);
      }
    } else {
      validate_rollout_dir(config.data.rollout_dir);
      const std::string first = rollout_path(config.data.rollout_dir, 0);
      if (std::filesystem::exists(first)) read_rollouts(first, arch.vocab_size);
      data_lines += fmt("data: rollouts from %s/step_<N>.h5 (%s)\n", config.data.rollout_dir.c_str(),
                  std::filesystem::exists(first) ? "step_0.h5 read and valid"
                  : std::filesystem::is_directory(config.data.rollout_dir) ? "step_0.h5 not there yet"
                                                                          : "the directory does not exist yet");
    }
    // The plan of the backend this deck asks for; "auto" plans the CPU backend.
    const bool cuda = config.device.backend == "cuda";
    MemoryPlan plan = run_memory_plan(config, layout, cuda ? *make_cuda_backend() : *make_cpu_backend());
    std::string data_note;
    plan.data_reader = data_reader_bytes(config, arch.vocab_size, &data_note);
    std::printf("%s: valid for %d training rank%s\n\n%s\nmodel: %s, %lld parameters (%lld in matmuls)\n%s",
                args.deck.c_str(), world, world == 1 ? "" : "s", resolved_deck(config).c_str(), arch.arch.c_str(),
                (long long)layout.parameter_count(), (long long)layout.matmul_parameter_count(),
                format_memory_plan(plan, world).c_str());
    std::printf("%s%s", data_note.c_str(), data_lines.c_str());
    if (saves_async(config)) {  // what a background save holds and, staged, costs
      const double mib = 1024.0 * 1024.0;
      const int64_t state = checkpoint_state_bytes(config, layout);
      if (cuda && !config.model.optim_cpu_offload)
        std::printf("ckpt.async: the snapshot is the host mirror of the GPU state (pinned at start-up): no more host "
                    "memory\n");
      else if (plan.checkpoint_snapshot < state)
        std::printf("ckpt.async: the snapshot pool holds %.3f of the %.3f MiB state per rank: each save is staged "
                    "and blocks the loop for the write of the other %.3f MiB (~%.1f s at 1 GB/s)\n",
                    double(plan.checkpoint_snapshot) / mib, double(state) / mib,
                    double(state - plan.checkpoint_snapshot) / mib, double(state - plan.checkpoint_snapshot) / 1e9);
    }
    // One rank against this machine: the nodes that run the deck may differ.
    const MachineMemory host = machine_host_memory();
    const std::string fit = plan_fit_error(plan, 1, host, 1, 0);
    std::printf("this machine: %.2f GiB of host memory (%s); %s\n", double(host.bytes) / 1073741824.0, host.source,
                fit.empty() ? "one rank's plan fits" : ("one rank's plan does not fit: " + fit).c_str());
    if (plan.checkpoint_snapshot_flexible > 0 && host.bytes > 0) {
      // The default pool takes at most half of what the host has left (checkpoint_async.cpp).
      const int64_t left = host.bytes - (plan.host_total() - plan.checkpoint_snapshot);
      const int64_t pool = std::max(plan.checkpoint_snapshot - plan.checkpoint_snapshot_flexible, left / 2);
      if (pool < plan.checkpoint_snapshot)
        std::printf("ckpt.async: here the snapshot pool would take %.3f of the %.3f MiB state (half of what the rest "
                    "of the plan leaves): each save staged, the loop waiting for the write of the other %.3f MiB "
                    "(~%.1f s at 1 GB/s); ckpt.async_host_gib bounds it, ckpt.async = false saves synchronously\n",
                    double(pool) / 1048576.0, double(plan.checkpoint_snapshot) / 1048576.0,
                    double(plan.checkpoint_snapshot - pool) / 1048576.0,
                    double(plan.checkpoint_snapshot - pool) / 1e9);
    }
    if (cuda && config.model.optim_cpu_offload) {  // what the lever buys, against the state on the GPU
      Config on_gpu = config;
      on_gpu.model.optim_cpu_offload = false;
      const MemoryPlan without = run_memory_plan(on_gpu, layout, *make_cuda_backend());
      const double mib = 1024.0 * 1024.0;
      std::printf("optim_cpu_offload: %.3f MiB less GPU memory per rank (%.3f MiB with the state on the GPU), "
                  "%.3f MiB more host memory\n",
                  double(without.device_total() - plan.device_total()) / mib, double(without.device_total()) / mib,
                  double(plan.host_total() - without.host_total()) / mib);
    }
    std::fflush(stdout);
  }
  return 0;
}

int cmd_receive(Runtime& rt, const CliArgs& args) {
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  const auto out = args.options.count("out") ? args.options.at("out") : std::string();
  run_receiver(config, rt, out);
  return 0;
}

// `shardlm inspect CKPT`: what a checkpoint holds, every checksum verified; exit 1 when damaged.
int cmd_inspect(const CliArgs& args) { return inspect_checkpoint(args.options.at("checkpoint"), MPI_COMM_WORLD, stdout); }

// `shardlm export CKPT --out DIR [--dtype bf16|fp32]`: an HF model directory from a checkpoint.
int cmd_export(const CliArgs& args) {
  const std::string dtype = args.options.count("dtype") ? args.options.at("dtype") : "bf16";
  export_checkpoint(args.options.at("checkpoint"), args.options.at("out"), dtype, MPI_COMM_WORLD);
  return 0;
}

int cmd_train(Runtime& rt, const CliArgs& args) {
  Config config;
  if (!load_deck(rt, args, rt.num_trainers, config)) return 1;
  maybe_inject_fault("startup");
  set_collective_timeout(config.comm.timeout_s);  // the MPI Comm's watchdog (NCCL has its own)
  select_device(rt, config.device.backend);
  config.device.backend = rt.backend;  // "auto" resolved: the session builds that backend
  config.comm.backend = select_comm(rt, config.comm.backend);
  if (rt.backend == "cuda") set_device_memory_limit(static_cast<int64_t>(config.device.memory_limit_gib * 1073741824.0));
  if (config.device.cpu_threads > 0) omp_set_num_threads(static_cast<int>(config.device.cpu_threads));
  refuse_plan_over_machine(rt, config);
  print_banner(rt, config);
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
  // MFU against dense bf16 peak: 989 TFLOP/s for an H100 SXM (DESIGN.md); none on the CPU.
  const double peak_flops = rt.backend == "cuda" ? 989e12 : 0.0;
  if (comm->rank() == 0) {
    const ModelLayout& layout = session.model.layout;
    std::printf("model %s: %lld parameters, %d layers, hidden %lld\n", layout.config.arch.c_str(),
                (long long)layout.parameter_count(), layout.num_layers(), (long long)layout.config.hidden_size);
    if (session.data) {
      const TokenDataset& d = *session.data;
      std::printf("data %s%s: %lld documents, %lld tokens, tokens %s; reader %.1f MiB per rank\n",
                  config.data.path[0].c_str(), d.sources() > 1 ? fmt(" and %lld more files", (long long)d.sources() - 1).c_str() : "",
                  (long long)d.documents(), (long long)d.total_tokens(), d.storage().c_str(),
                  double(d.memory().total()) / 1048576.0);
    } else {
      std::printf("data: RL rollouts from %s/step_<N>.h5\n", config.data.rollout_dir.c_str());
    }
    if (session.eval)
      std::printf("eval %s: %lld rows of %lld, every %s%s\n", config.eval.path.c_str(), (long long)session.eval->rows(),
                  (long long)config.data.seq_len,
                  config.eval.interval > 0 ? fmt("%lld steps", (long long)config.eval.interval).c_str() : "run",
                  config.eval.at_end ? " and at the end" : "");
    // Large models spend real time here (host init, pinning, the state upload).
    const char* state = session.offload ? "pinning the offload buffers"
                        : session.engine.options().device_state ? "the state's upload to the GPU" : nullptr;
    const std::string kernels = session.engine.backend().kernels_note();
    if (!kernels.empty()) std::printf("attention: %s\n", kernels.c_str());
    std::printf("setup %.1f s: model, data, optimizer, engine", setup_s);
    if (state) std::printf("; %.1f s of it %s", session.state_setup_s, state);
    std::printf("\n");
    std::fflush(stdout);
  }

  // init from a checkpoint (ckpt.resume: latest | none | a file); SIGUSR1/SIGTERM/SIGINT stop after a step
  install_stop_signal_handlers();
  const ResumePoint start = resume(session, rt.role_comm);
  if (start.step > 0 && start.step >= config.run.max_steps) {  // a finished run started again: say so, train nothing
    if (comm->rank() == 0)
      std::printf("run already complete: %s is at step %lld and run.max_steps = %lld; nothing to train (raise "
                  "run.max_steps to go on, or set ckpt.resume = \"none\" to start over)\n",
                  start.path.c_str(), (long long)start.step, (long long)config.run.max_steps);
    broadcaster.finish();
    return 0;
  }
  Metrics metrics(config, comm->rank() == 0, describe_start(rt, config, start),
                  flops_per_token(session.model.layout, config.data.seq_len), peak_flops);

  // Saves go through the Checkpointer: with ckpt.async a save copies the state
  // and a background writer finishes the file while training goes on.
  Checkpointer checkpointer(session, rt.role_comm);
  auto stops_run = [&](const std::optional<SaveResult>& r) {  // a failed save under ckpt.on_error = "stop"
    return r && !r->ok && config.ckpt.on_error == "stop";
  };
  int exit_code = 0;
  int64_t tokens_seen = start.tokens_seen, steps_done = start.step;
  bool final_save_failed = false;  // with ckpt.on_error = "continue": the run's end state is not on disk
  for (int64_t step = start.step; step < config.run.max_steps; ++step) {
    StepStats stats = session.step(step);  // batch, forward, loss, backward, clip, optimizer
    if (session.eval_due(step + 1)) session.evaluate(stats);  // held-out loss, forward only
    metrics.log(stats);
    tokens_seen += stats.tokens;
    steps_done = step + 1;
    if (broadcaster.due(step + 1)) broadcaster.send(session, step + 1);  // host paths pull the state themselves
    if (stops_run(checkpointer.poll())) {  // a background save finished: reported here, failed or not
      exit_code = kExitCheckpointFailed;
      break;
    }
    const bool stop = stop_requested(*comm);  // SIGUSR1/SIGTERM/SIGINT on any rank, agreed by all (watched)
    if (stop || checkpoint_due(config.ckpt, step + 1, config.run.max_steps)) {
      std::optional<SaveResult> previous;  // the save still in flight, waited for first
      const SaveResult saved = checkpointer.save(step + 1, tokens_seen, &previous);
      final_save_failed = !saved.ok && step + 1 == config.run.max_steps;
      if (stops_run(previous) || stops_run(saved)) {
        exit_code = kExitCheckpointFailed;
        break;
      }
    }
    if (stop) {
      if (stops_run(checkpointer.wait())) {
        exit_code = kExitCheckpointFailed;
        break;
      }
      if (comm->rank() == 0)
        std::printf("stopped by signal %d after step %lld: exit %d (requeue and resume)\n", stop_signal(),
                    (long long)step + 1, kExitRequeue);
      exit_code = kExitRequeue;
      break;
    }
  }
  // The last save, if it was still being written: at run.max_steps that is the final one.
  const std::optional<SaveResult> last = checkpointer.wait();
  if (last && !last->ok && steps_done == config.run.max_steps) final_save_failed = true;
  if (stops_run(last) && exit_code == 0) exit_code = kExitCheckpointFailed;
  broadcaster.finish();
  if (exit_code != 0) {
    metrics.end(exit_code == kExitRequeue ? "stopped" : "checkpoint_failed", exit_code, steps_done);
    return exit_code;
  }
  if (!config.run.export_dir.empty()) {
    session.pull_state();
    export_hf(session.model, *comm, config.run.export_dir, config.run.export_dtype == "bf16" ? "BF16" : "F32");
    if (comm->rank() == 0)
      std::printf("exported the final weights to %s (%s)\n", config.run.export_dir.c_str(),
                  copy_tokenizer_files(config.model.hf, config.run.export_dir).c_str());
  }

  int64_t peak[2] = {host_memory().total_peak, device_memory().total_peak};
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, peak, 2, MPI_INT64_T, MPI_MAX, rt.role_comm));
  MemoryPlan plan = run_memory_plan(config, session.model.layout, session.engine.backend());
  plan.comm_staging += broadcaster.comm_staging_bytes();  // rank 0's staged broadcast Comm, if any
  // The readers as they are: two epochs' orders, the buffers, the session's micro-batch.
  if (session.data) plan.data_reader += session.data->memory().total();
  if (session.eval) plan.data_reader += session.eval->data().memory().total();
  metrics.summary(plan, peak[0], peak[1], session.bad_steps_total);
  if (session.offload && comm->rank() == 0) std::printf("%s\n", session.offload->summary().c_str());
  if (const MuonStep* muon = session.optimizer.muon()) {  // Muon's part of the optimizer time above
    const MuonTiming& t = muon->timing();
    double seconds[2] = {t.step_s, t.orthogonalize_s};
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, seconds, 2, MPI_DOUBLE, MPI_MAX, rt.role_comm));
    if (rt.world_rank == 0 && t.steps > 0)
      std::printf("muon (steps %lld..%lld, slowest rank): step %.1f ms, of which Newton–Schulz %.1f ms (%s)\n",
                  (long long)start.step + 2, (long long)start.step + t.steps + 1, 1e3 * seconds[0] / double(t.steps),
                  1e3 * seconds[1] / double(t.steps),
                  muon->orthogonalizer_name());
  }
  if (final_save_failed) {  // ckpt.on_error = "continue" trained on, but the end must be on disk
    if (rt.world_rank == 0)
      std::fprintf(stderr, "shardlm: the checkpoint at step %lld could not be saved (the reason is above); with "
                           "ckpt.on_error = \"continue\" training went on, but the run's final state is not on disk: "
                           "exit %d\n", (long long)steps_done, kExitCheckpointFailed);
    metrics.end("checkpoint_failed", kExitCheckpointFailed, steps_done);
    return kExitCheckpointFailed;
  }
  metrics.end("done", 0, steps_done);
  if (rt.world_rank == 0) std::printf("done: outputs in %s\n", config.run.dir.c_str());
  return 0;
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

  Runtime rt = runtime_init(&argc, &argv, args.command == "receive" ? Role::Receive : Role::Train);
  int rc = 1;
  try {
    rc = args.command == "check" ? cmd_check(rt, args)
         : args.command == "receive" ? cmd_receive(rt, args)
         : args.command == "inspect" ? cmd_inspect(args)
         : args.command == "export"  ? cmd_export(args)
                                     : cmd_train(rt, args);
  } catch (const std::exception& e) {
    fatal(e.what());  // one message naming the rank, then MPI_Abort: never a hang
  }
  runtime_finalize(rt);
  return rc;
}
