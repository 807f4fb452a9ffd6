// app/report.cpp — `shardlm check`'s report, the setup lines and the
// end-of-run report (report.hpp).
#include "app/report.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include "data/data.hpp"
#include "data/prompts.hpp"
#include "data/rollouts.hpp"
#include "infer/decoder.hpp"
#include "infer/eval.hpp"
#include "infer/rollout.hpp"
#include "app/plan.hpp"
#include "shardlm/backend.hpp"
#include "shardlm/cuda.hpp"
#include "shardlm/memory.hpp"
#include "train/engine.hpp"
#include "train/eval.hpp"
#include "train/muon.hpp"
#include "train/optim.hpp"
#include "train/train.hpp"

namespace shardlm {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// What the reports read from a TrainSession, read here and nowhere else in
// this file: when the session's members move, only this changes.
struct SessionView {
  int rank;                          // in the trainers' communicator
  const ModelLayout& layout;
  const Backend& backend;
  const TokenDataset* data;          // the SFT reader; null in RL
  const EvalSet* eval;               // eval.path's reader; null without one
  TrainingState& state;              // host | device | offload: its summary line
  const char* state_setup;           // what placing the state at start-up did; null: nothing worth a line
  double state_setup_s;
  const MuonStep* muon;              // null unless optim.name = "muon"
  int64_t bad_steps_total;
};

SessionView view(TrainSession& s) {
  return {
      .rank = s.comm.rank(),
      .layout = s.model.layout,
      .backend = s.engine.backend(),
      .data = s.data ? &*s.data : nullptr,
      .eval = s.eval ? &*s.eval : nullptr,
      .state = *s.state,
      // Large models spend real time here (host init, pinning, the state upload).
      .state_setup = s.state->setup_what(),
      .state_setup_s = s.state->setup_s,
      .muon = s.optimizer.muon(),
      .bad_steps_total = s.bad_steps_total,
  };
}

// The data as train opens it, before the deck is called valid: the token
// files, or the rollout directory and its first file. Throws on a bad one.
std::string check_data(const Config& config, int64_t vocab_size) {
  std::string lines;
  if (config.loss.type == "sft") {
    for (const std::string& path : config.data.path) {
      validate_token_file(path, vocab_size);
      lines += fmt("data: %s is a token file for vocab_size %lld\n", path.c_str(), (long long)vocab_size);
    }
    return lines;
  }
  validate_rollout_dir(config.data.rollout_dir);
  const std::string first = rollout_path(config.data.rollout_dir, 0);
  // With [rollout] prompts the deck's job makes its own files, stamped with its
  // id: what is there now is another job's, which the trainers wait past.
  const bool job_makes_its_own = !config.rollout.prompts.empty();
  if (std::filesystem::exists(first) && job_makes_its_own) {
    const uint64_t found = read_rollout_job_id(first);
    const std::string whose = found == 0 ? std::string("no job id (offline rollouts)")
                                         : fmt("job %016llx", static_cast<unsigned long long>(found));
    return lines + fmt("data: rollouts from %s/step_<N>.h5, made by this deck's inference ranks; step_0.h5 there "
                       "belongs to another job (%s): not this job's, the trainers wait for their own to replace it\n",
                       config.data.rollout_dir.c_str(), whose.c_str());
  }
  if (std::filesystem::exists(first)) read_rollouts(first, vocab_size);
  lines += fmt("data: rollouts from %s/step_<N>.h5 (%s)\n", config.data.rollout_dir.c_str(),
               std::filesystem::exists(first) ? "step_0.h5 read and valid"
               : std::filesystem::is_directory(config.data.rollout_dir) ? "step_0.h5 not there yet"
                                                                       : "the directory does not exist yet");
  return lines;
}

// An RL deck's inference ranks (`shardlm generate DECK` beside the trainers):
// the prompt file checked against the deck, and the memory of one inference
// rank (with one of them: the most slots), from the table its decoder
// allocates from. trainer_gpu: a trainer rank's GPU plan, for the two sharing
// one GPU (the staged broadcast's case); gpu_bytes: this machine's GPU, or 0.
std::string inference_report(const Config& config, const ModelConfig& arch, bool cuda, int64_t trainer_gpu,
                             int64_t gpu_bytes) {
  const RolloutSection& ro = config.rollout;
  if (config.loss.type != "rl" || ro.prompts.empty()) return "";
  const PromptSet eval_prompts = read_eval_prompts(config, arch);  // checked as at start; none without eval.prompts
  if (!std::filesystem::exists(ro.prompts))
    return eval_plan_line(config, eval_prompts) +
           fmt("inference ranks: rollout.prompts '%s' does not exist yet (their plan needs its longest prompt)\n",
               ro.prompts.c_str());
  const PromptSet prompts = read_prompts(ro.prompts, arch.vocab_size);
  check_prompts(config, prompts, arch);
  const DecoderLimits limits =
      with_eval_limits(config, arch, eval_prompts, 1, rollout_decoder_limits(config, arch, prompts, 1));
  const DecoderPlan d = plan_decoder(arch, limits, cuda ? "cuda" : "cpu");
  int64_t model_host = 0;  // the InferenceModel the broadcast lands in: fp32, whole
  for (const Unit& u : ModelLayout(arch, 1).units) model_host += u.padded_numel * int64_t(sizeof(float));
  const char* where = cuda ? "GPU" : "host";
  std::string out = eval_plan_line(config, eval_prompts);
  out += fmt("inference rank plan (`shardlm generate DECK`, one of them: %lld slots x %lld positions: the "
             "longest of the %lld prompts, then rollout.max_new_tokens = %lld%s; a KV pool of %lld blocks of %lld "
             "positions, %s)\n",
             (long long)limits.slots, (long long)limits.max_len, (long long)prompts.size(),
             (long long)ro.max_new_tokens,
             eval_prompts.path.empty() ? "" : "; eval.batch's slots and eval.prompts' positions where they are more",
             (long long)pool_blocks(limits), (long long)limits.block_size,
             limits.blocks > 0            ? "rollout.kv_cache_tokens"
             : limits.memory_fraction > 0 ? "at most: rollout.kv_cache_memory sizes it at start"
                                          : "every slot at its longest");
  if (limits.memory_fraction > 0) {  // the pool this machine's device would give it
    const int64_t memory = cuda ? gpu_bytes : machine_host_memory().bytes;
    if (memory > 0) {
      try {
        const DecoderLimits sized = size_pool(arch, limits, cuda ? "cuda" : "cpu", memory);
        out += fmt("rollout.kv_cache_memory = %g of this machine's %.2f GiB (%s): a pool of %lld positions\n",
                   limits.memory_fraction, double(memory) / 1073741824.0, cuda ? "GPU" : "host",
                   (long long)(pool_blocks(sized) * sized.block_size));
      } catch (const Error& e) {
        out += fmt("rollout.kv_cache_memory on this machine: %s\n", e.what());
      }
    }
  }
  const std::tuple<const char*, const char*, int64_t> rows[] = {
      {"weights (bf16)", where, d.weights}, {"KV cache", where, d.cache},   {"activations", where, d.scratch},
      {"logits, staging", "host", d.host},  {"model (fp32)", "host", model_host},
      {"routes (replay)", "host", config.loss.router_replay ? routes_bytes(arch, limits) : 0}};
  for (const auto& [name, place, bytes] : rows)
    if (bytes > 0) out += fmt("  %-18s %-5s %12.3f MiB\n", name, place, double(bytes) / kMiB);
  const int64_t device = d.weights + d.cache + d.scratch;
  if (cuda) {
    out += fmt("  %-18s %-5s %12.3f MiB\n", "total", "GPU", double(device) / kMiB);
    out += fmt("one GPU shared by a trainer rank and an inference rank: %.2f + %.2f = %.2f GiB", trainer_gpu / 1073741824.0,
               device / 1073741824.0, (trainer_gpu + device) / 1073741824.0);
    out += gpu_bytes > 0 ? fmt(" of this machine's %.2f GiB (%s)\n", gpu_bytes / 1073741824.0,
                               trainer_gpu + device <= gpu_bytes ? "fits" : "does not fit")
                         : "\n";
  }
  return out;
}

}  // namespace

void check_report(const Config& deck_config, const std::string& deck, int world) {
  Config config = deck_config;
  const ModelConfig arch = model_config_for(config);
  const ModelLayout layout(arch, world, config.model.expert_parallel);
  const std::string data_lines = check_data(config, arch.vocab_size);
  // The plan of the backend this deck asks for; "auto" plans the CPU backend.
  const bool cuda = config.device.backend == "cuda";
  // The offload split against this machine's GPU (one rank on it), or the cap.
  int64_t gpu_bytes = cuda && cuda_device_count() > 0 ? cuda_device_memory_bytes(0) : 0;
  if (cuda && config.device.memory_limit_gib > 0)
    gpu_bytes = gpu_bytes > 0 ? std::min<int64_t>(gpu_bytes, int64_t(config.device.memory_limit_gib * 1073741824.0))
                              : int64_t(config.device.memory_limit_gib * 1073741824.0);
  if (cuda) config.model.optim_gpu_units = offload_gpu_units(config, layout, *make_cuda_backend(), gpu_bytes);
  // The plan of a deck on this deck's backend (this deck's, and the same deck with one lever moved).
  auto plan_of = [&](const Config& c) {
    return run_memory_plan(c, layout, cuda ? *make_cuda_backend() : *make_cpu_backend());
  };
  MemoryPlan plan = plan_of(config);
  std::string data_note;
  plan.data_reader = data_reader_bytes(config, arch.vocab_size, &data_note);
  std::printf("%s: valid for %d training rank%s\n\n%s\nmodel: %s, %lld parameters (%lld in matmuls)\n%s",
              deck.c_str(), world, world == 1 ? "" : "s", resolved_deck(config).c_str(), arch.arch.c_str(),
              (long long)layout.parameter_count(), (long long)layout.matmul_parameter_count(),
              format_memory_plan(plan, world).c_str());
  std::printf("%s%s", data_note.c_str(), data_lines.c_str());
  if (saves_async(config)) {  // what a background save holds and, staged, costs
    const int64_t state = checkpoint_state_bytes(config, layout);
    if (cuda && !config.model.optim_cpu_offload)
      std::printf("ckpt.async: the snapshot is the host mirror of the GPU state (pinned at start-up): no more host "
                  "memory\n");
    else if (plan.checkpoint_snapshot < state)
      std::printf("ckpt.async: the snapshot pool holds %.3f of the %.3f MiB state per rank: each save is staged "
                  "and blocks the loop for the write of the other %.3f MiB (~%.1f s at 1 GB/s)\n",
                  double(plan.checkpoint_snapshot) / kMiB, double(state) / kMiB,
                  double(state - plan.checkpoint_snapshot) / kMiB, double(state - plan.checkpoint_snapshot) / 1e9);
  }
  // One rank against this machine: the nodes that run the deck may differ.
  const MachineMemory host = machine_host_memory();
  const std::string fit = plan_fit_error(plan, 1, host, 1, 0);
  std::printf("this machine: %.2f GiB of host memory (%s); %s\n", double(host.bytes) / 1073741824.0, host.source,
              fit.empty() ? "one rank's plan fits" : ("one rank's plan does not fit: " + fit).c_str());
  if (plan.checkpoint_snapshot_flexible > 0 && host.bytes > 0) {
    // The default pool takes at most half of what the host has left (checkpoint/async.cpp).
    const int64_t left = host.bytes - (plan.host_total() - plan.checkpoint_snapshot);
    const int64_t pool = std::max(plan.checkpoint_snapshot - plan.checkpoint_snapshot_flexible, left / 2);
    if (pool < plan.checkpoint_snapshot)
      std::printf("ckpt.async: here the snapshot pool would take %.3f of the %.3f MiB state (half of what the rest "
                  "of the plan leaves): each save staged, the loop waiting for the write of the other %.3f MiB "
                  "(~%.1f s at 1 GB/s); ckpt.async_host_gib bounds it, ckpt.async = false saves synchronously\n",
                  double(pool) / kMiB, double(plan.checkpoint_snapshot) / kMiB,
                  double(plan.checkpoint_snapshot - pool) / kMiB, double(plan.checkpoint_snapshot - pool) / 1e9);
  }
  if (config.model.fp8 != "none") {  // FP8's scratch, against the same deck without it
    Config plain = config;
    plain.model.fp8 = "none";
    const MemoryPlan without = plan_of(plain);
    const int64_t extra = plan.device_total() + plan.host_total() - without.device_total() - without.host_total();
    std::printf("model.fp8 = \"%s\": %.3f MiB of the workspace per rank are its scratch (%s)\n",
                config.model.fp8.c_str(), double(extra) / kMiB,
                cuda ? "e4m3 codes of one GEMM's two operands and of the backward's transposed input, their scales"
                     : "the emulation's quantised operands as fp32, their scales, the weight gradient's product");
  }
  if (config.model.fp8_attention && cuda) {  // its scratch and scales, against the same deck with bf16 attention
    Config plain = config;
    plain.model.fp8_attention = false;
    const MemoryPlan without = plan_of(plain);
    std::printf("model.fp8_attention: %.3f MiB more GPU memory per rank (its e4m3 codes and the FP8 backward's fp32 "
                "accumulators, in the attention phase's memory where they fit; each layer's scales)%s\n",
                double(plan.device_total() - without.device_total()) / kMiB,
                arch.head_dim == 128 ? ""
                                     : fmt("; on Hopper cuDNN's FP8 attention backward takes head dim 128 only, and "
                                           "this model's is %lld: there FP8 attention turns off at the first backward",
                                           (long long)arch.head_dim).c_str());
  }
  if (plan.fp32_stream > 0)  // the fp32 residual stream (the default) against a bf16 one
    std::printf("model.residual_dtype = \"fp32\": %.3f MiB of the activations and workspace per rank are the fp32 "
                "stream's (model.residual_dtype = \"bf16\" gives them back)\n",
                double(plan.fp32_stream) / kMiB);
  std::printf("%s", offload_split_line(config, layout, gpu_bytes).c_str());
  std::printf("%s", inference_report(config, arch, cuda, plan.device_total(), gpu_bytes).c_str());
  if (cuda && config.model.optim_cpu_offload) {  // what the lever buys, against the state on the GPU
    Config on_gpu = config;
    on_gpu.model.optim_cpu_offload = false;
    const MemoryPlan without = plan_of(on_gpu);
    std::printf("optim_cpu_offload: %.3f MiB less GPU memory per rank (%.3f MiB with the state on the GPU), "
                "%.3f MiB more host memory\n",
                double(without.device_total() - plan.device_total()) / kMiB, double(without.device_total()) / kMiB,
                double(plan.host_total() - without.host_total()) / kMiB);
  }
  std::fflush(stdout);
}

void setup_report(const Config& config, TrainSession& session, double setup_s) {
  const SessionView s = view(session);
  if (s.rank != 0) return;
  const ModelLayout& layout = s.layout;
  std::printf("model %s: %lld parameters, %d layers, hidden %lld\n", layout.config.arch.c_str(),
              (long long)layout.parameter_count(), layout.num_layers(), (long long)layout.config.hidden_size);
  if (s.data) {
    const TokenDataset& d = *s.data;
    std::printf("data %s%s: %lld documents, %lld tokens, tokens %s; reader %.1f MiB per rank\n",
                config.data.path[0].c_str(),
                d.sources() > 1 ? fmt(" and %lld more files", (long long)d.sources() - 1).c_str() : "",
                (long long)d.documents(), (long long)d.total_tokens(), d.storage().c_str(),
                double(d.memory().total()) / 1048576.0);
  } else {
    std::printf("data: RL rollouts from %s/step_<N>.h5\n", config.data.rollout_dir.c_str());
  }
  if (s.eval)
    std::printf("eval %s: %lld rows of %lld, every %s%s\n", config.eval.path.c_str(), (long long)s.eval->rows(),
                (long long)config.data.seq_len,
                config.eval.interval > 0 ? fmt("%lld steps", (long long)config.eval.interval).c_str() : "run",
                config.eval.at_end ? " and at the end" : "");
  if (config.model.fp8 != "none")
    std::printf("fp8: the decoder blocks' q, k, v, o, gate, up, down in FP8, %s scales (e4m3 operands and gradients, "
                "fp32 accumulation; %s)\n",
                config.model.fp8 == "rowwise" ? "per-row" : "per-tensor",
                s.backend.host_resident() ? "emulated in fp32 on the CPU"
                                          : config.model.fp8 == "tensorwise"
                                              ? "cuBLASLt; the amaxes from the kernels that write the operands, "
                                                "quantisation in its own passes"
                                              : "cuBLASLt, amax and quantisation in their own passes");
  const std::string kernels = s.backend.kernels_note();
  if (!kernels.empty()) std::printf("attention: %s\n", kernels.c_str());
  std::printf("setup %.1f s: model, data, optimizer, engine", setup_s);
  if (s.state_setup) std::printf("; %.1f s of it %s", s.state_setup_s, s.state_setup);
  std::printf("\n");
  std::fflush(stdout);
}

void end_of_run_report(const Runtime& rt, const Config& config, TrainSession& session,
                       const WeightBroadcaster& broadcaster, Metrics& metrics, int64_t start_step, const RunEnd& end,
                       int64_t steps_done) {
  const SessionView s = view(session);
  int64_t peak[2] = {host_memory().total_peak, device_memory().total_peak};
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, peak, 2, MPI_INT64_T, MPI_MAX, rt.role_comm));
  MemoryPlan plan = run_memory_plan(config, s.layout, s.backend);
  plan.comm_staging += broadcaster.comm_staging_bytes();  // rank 0's staged broadcast Comm, if any
  // The readers as they are: two epochs' orders, the buffers, the session's micro-batch.
  if (s.data) plan.data_reader += s.data->memory().total();
  if (s.eval) plan.data_reader += s.eval->data().memory().total();
  metrics.summary(plan, peak[0], peak[1], s.bad_steps_total);
  // The activations alone, planned and measured (context parallelism divides them by C).
  int64_t activations_peak = (s.backend.host_resident() ? host_memory() : device_memory()).peak[int(Mem::Activations)];
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &activations_peak, 1, MPI_INT64_T, MPI_MAX, rt.role_comm));
  if (s.rank == 0)
    std::printf("memory: activations peak %.3f MiB %s on the largest rank, planned %.3f MiB\n",
                double(activations_peak) / 1048576.0, s.backend.host_resident() ? "host" : "GPU",
                double(plan.activations) / 1048576.0);
  if (config.model.fp8_attention && s.rank == 0)  // how many attention passes cuDNN took in FP8
    std::printf("attention at the end: %s\n", s.backend.kernels_note().c_str());
  if (const std::string line = s.state.summary(); !line.empty() && s.rank == 0) std::printf("%s\n", line.c_str());
  if (const std::string line = broadcaster.timing_summary(); !line.empty() && s.rank == 0)
    std::printf("%s s\n", line.c_str());
  if (s.muon) {  // Muon's part of the optimizer time above
    const MuonTiming& t = s.muon->timing();
    double seconds[2] = {t.step_s, t.orthogonalize_s};
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, seconds, 2, MPI_DOUBLE, MPI_MAX, rt.role_comm));
    if (rt.world_rank == 0 && t.steps > 0)
      std::printf("muon (steps %lld..%lld, slowest rank): step %.1f ms, of which Newton–Schulz %.1f ms (%s)\n",
                  (long long)start_step + 2, (long long)start_step + t.steps + 1, 1e3 * seconds[0] / double(t.steps),
                  1e3 * seconds[1] / double(t.steps), s.muon->orthogonalizer_name());
  }
  if (end.final_save_failed && rt.world_rank == 0)  // ckpt.on_error = "continue" trained on, but the end must be on disk
    std::fprintf(stderr, "shardlm: the checkpoint at step %lld could not be saved (the reason is above); with "
                         "ckpt.on_error = \"continue\" training went on, but the run's final state is not on disk: "
                         "exit %d\n", (long long)steps_done, kExitCheckpointFailed);
}

}  // namespace shardlm
