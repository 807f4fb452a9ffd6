// config.hpp — the input deck: typed sections, defaults, parsing, validation.
//
// Owns: Config and its sections, parse_deck() (TOML file + --set overrides),
// the resolved-deck writer, and every validation rule that can be checked before
// work starts. Knows nothing about MPI, devices or the model's tensors: the
// runtime decides who reads the deck and who prints the errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/model_config.hpp"

namespace shardlm {

struct RunSection {
  std::string name = "shardlm";
  std::string dir = "runs/shardlm";
  int64_t seed = 1234;
  int64_t max_steps = 100;
  bool deterministic = false;
  int64_t max_bad_steps = 5;        // NaN/Inf steps in a row before the run aborts
  std::string export_dir;           // HF directory written with the final weights ("" = none)
  std::string export_dtype = "bf16";  // bf16 | fp32
};

struct ModelSection {
  std::string hf;                   // HF model directory; empty = seeded init from the sizes below
  ModelConfig arch;                 // sizes (from the deck, or from hf/config.json)
  double init_std = 0.02;
  bool optim_cpu_offload = false;
  // With optim_cpu_offload, where a step's summed gradient waits for its unit's
  // update: "host" (a pinned host shard per unit, copied during backward) or
  // "device" (in the GPU accumulator, copied into one of two pinned landing
  // buffers as the update reaches the unit: 4 B per parameter less host memory).
  std::string optim_offload_grads = "host";
  // With optim_cpu_offload on a GPU: GPU memory per rank (GiB) the optimizer
  // state (fp32 masters and moments) of the units kept on the GPU may take,
  // from the embedding on; the rest are offloaded. < 0: what the memory plan
  // leaves free (the default); 0: every unit offloaded.
  double optim_gpu_state_gib = -1;
  // With optim_cpu_offload on a GPU: update each offloaded unit during the
  // backward as its gradient arrives, as if the step were not clipped, from a
  // copy of its state kept for the step that is (or is skipped): redone then,
  // bit-identical either way. 12 B per offloaded parameter of host memory.
  bool optim_offload_speculate = false;
  // Not a deck key: optim_gpu_state_gib resolved at start-up against the plan
  // and the GPU (app/plan.hpp, resolve_offload_split): units [0, n) keep their
  // state on the GPU. 0 in a session built without it (tests, tools).
  int64_t optim_gpu_units = 0;
  std::string activation_checkpointing = "none";  // none | full | selective (full, keeping attention's output)
  int64_t selective_layers = 0;     // with "selective": layers [0, n) keep attention's output; 0 = every layer
  bool reshard_after_forward = true;
  std::string reduce_dtype = "fp32";              // fp32 | bf16
  int64_t context_parallel = 1;     // ranks sharing one sequence (a group of consecutive ranks); docs/scaling.md
  // A model of experts: the ranks its experts are split over (each holds
  // num_experts / P whole experts; rows go to their expert's rank and back by
  // all-to-all). 1: off; else the number of training ranks. docs/config.md
  int64_t expert_parallel = 1;
  // The decoder blocks' linears (q, k, v, o, gate, up, down) in FP8 with one
  // scale per tensor or per row; embedding and lm-head stay as they are.
  std::string fp8 = "none";         // none | tensorwise | rowwise
  bool fp8_weight_cache = false;    // keep each layer's weight codes until the parameters change (GPU, model.fp8)
  bool fp8_attention = false;       // cuDNN's FP8 attention where it takes the shape (GPU; docs/config.md)
  std::string residual_dtype = "fp32";  // fp32 | bf16: the residual stream between kernels (GPU)
  std::string norm_dtype = "fp32";      // fp32 | bf16: the norm weights the RMSNorm kernels read (GPU)
};

struct DataSection {
  std::vector<std::string> path;    // SFT token files; several are mixed by `weights`
  std::vector<double> weights;      // one per path; empty = in proportion to each file's targets
  bool shuffle = true;              // false: file order in every epoch
  int64_t seq_len = 2048;
  int64_t micro_batch = 1;          // rows per micro-batch per rank
  int64_t global_batch = 1;         // rows per optimizer step, all ranks together
  bool packing = true;
  std::string rollout_dir;
  int64_t max_async = 0;
  double rollout_timeout_s = 600.0;
};

// Held-out evaluation: a token file whose loss the trainers compute (forward
// only) during and after training, and, in an RL job, a prompt file whose
// accuracy the inference ranks measure on the weights they hold (docs/rl.md).
// [env]: an environment program the inference ranks talk to over several turns
// of an RL episode (src/infer/env.hpp, docs/rl.md "Environments").
struct EnvSection {
  std::string program;              // a shell command; "" = one turn, no environment
  double timeout_s = 60;            // its time to answer one message
};

struct EvalSection {
  std::string path;                 // token file like data.path; "" = no loss evaluation
  int64_t interval = 0;             // every this many steps (policy steps for prompts); 0 = only at the end
  int64_t rows = 0;                 // rows of seq_len from the start of the file; 0 = the whole file
  bool at_end = true;               // evaluate after the last step
  std::string prompts;              // prompt file (tools/make_prompts.py) with answers; "" = no accuracy evaluation
  int64_t samples = 0;              // sampled completions per prompt for pass@k; 0 = greedy only
  int64_t max_new_tokens = 0;       // 0 = rollout.max_new_tokens (filled in when eval.prompts is set)
  int64_t batch = 0;                // sequences decoded at once per inference rank; 0 = rollout.batch (filled in)
  double correct_above = 0.0;       // a completion is correct when its reward is above this
};

struct OptimSection {
  std::string name = "adamw";       // adamw | sgd | muon
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;            // sgd
  double max_norm = 1.0;            // 0 disables clipping
  // muon: lr and weight_decay above are the hidden matrices'; the rest (embeddings,
  // lm_head, norms, biases) is AdamW with beta1/beta2/eps and these two.
  double muon_momentum = 0.95;      // Nesterov momentum of the matrices
  int64_t ns_steps = 5;             // Newton–Schulz iterations
  double adamw_lr = 0.0;            // peak lr of the AdamW group; 0 = optim.lr (same schedule)
  double adamw_weight_decay = -1.0; // weight decay of the AdamW group; < 0 = optim.weight_decay
};

struct SchedSection {
  std::string name = "constant";    // constant | linear | cosine
  int64_t warmup = 0;               // steps of linear warmup from 0
  int64_t decay = 0;                // linear: steps of the final decay (0 = to max_steps)
  double min_lr = 0.0;              // absolute floor of linear / cosine decay
  double min_lr_ratio = 0.0;        // the floor as a fraction of each group's peak lr (not with min_lr)
};

struct LossSection {
  std::string type = "sft";         // sft | rl
  int64_t chunk_tokens = 1024;      // tokens per lm-head + loss chunk
  double mask_high = 0.2;
  double mask_low = 0.2;
  double kl_coef = 1e-3;
  double ce_coef = 0.0;
  // The policy term (docs/rl.md, "The trainers' loss"): "masked" (-A r,
  // tokens whose probability moved past mask_high / mask_low dropped),
  // "clipped" (the PPO/GRPO surrogate -min(r A, clip(r, 1 - clip_low,
  // 1 + clip_high) A)), "gspo" (the same clip on the sequence's ratio, the
  // geometric mean of its tokens' r) or "cispo" (-sg(clip(r)) A log p on
  // every token).
  std::string objective = "masked";  // masked | clipped | gspo | cispo
  // The clip's bounds. Not given, they follow the objective: clipped 0.2 /
  // 0.28, gspo 3e-4 / 4e-4 (GSPO's sequence ratios sit much closer to 1),
  // cispo 1 (no lower bound) / 0.28.
  double clip_low = 0.2;
  double clip_high = 0.28;
  // How a step's token losses are averaged: "token" (sum / loss tokens of the
  // step), "sequence" (each sample's mean over its loss tokens, then the
  // mean over samples) or "constant" (sum / normalize_constant, Dr. GRPO).
  std::string normalize = "token";   // token | sequence | constant
  // normalize = "constant": the divisor; not given, rollout.max_new_tokens x
  // rollout.prompts_per_step x rollout.n (the most tokens a step can hold).
  double normalize_constant = 0;
  // Importance sampling against the train/inference mismatch: the ratio
  // rho = exp(logp_train - logp_sampling) per token ("token") or its product
  // over the sample ("sequence"); the policy term is multiplied by
  // min(rho, is_cap) (stop-gradient), and with is_mask > 0 tokens / samples
  // whose rho is outside [1 / is_mask, is_mask] carry no loss.
  std::string is_level = "none";     // none | token | sequence
  double is_cap = 2.0;               // >= 1
  double is_mask = 0.0;              // 0 = off, else > 1
  double entropy_coef = 0.0;         // weight of -H(softmax(logits / tau)) on every loss token
  // Several optimizer updates per rollout step (docs/rl.md, "Several updates
  // per rollout step"): the step's samples split into mini_batches parts of
  // whole samples (in file order, the same on every rank), each part one
  // update normalised over its own samples, all of it repeated epochs times.
  // The ratio stays against the rollout file's logprobs, so from the second
  // update on the clips act. run.max_steps, the schedule and checkpoints
  // count rollout steps.
  int64_t epochs = 1;
  int64_t mini_batches = 1;
  // A KL penalty against the run's starting weights (model.hf, or the seeded
  // init), kept frozen: ref_kl_coef x an estimator of KL(pi || pi_ref) on
  // every loss token, k1 = log(pi / pi_ref), k2 = (log(pi / pi_ref))^2 / 2 or
  // k3 = pi_ref / pi - log(pi_ref / pi) - 1 (Schulman 2020, "Approximating KL
  // divergence"). 0 = off: no frozen copy, no reference pass.
  double ref_kl_coef = 0.0;
  std::string ref_kl_estimator = "k3";  // k1 | k2 | k3
  // Router replay (a model of experts): the inference ranks record the
  // experts their router chose for every token they feed (the rollout file's
  // 'routes'), and the trainers' forward takes those instead of its own top-k,
  // weighted by its own router's probabilities of them, so the trainer's
  // logprobs follow the sampler's routing (verl / prime-rl's routing replay).
  bool router_replay = false;
};

struct CkptSection {
  int64_t interval = 0;             // 0 = only at the end / on signal
  int64_t keep_last = 2;
  int64_t keep_interval = 0;
  std::string resume = "latest";    // latest | none | path
  std::string on_error = "stop";    // stop | continue
  bool save_final = true;           // false: no checkpoint at run.max_steps (benchmarks)
  bool async = true;                // snapshot, then a background writer (src/checkpoint/async.hpp)
  double async_host_gib = 0;        // bound on the async snapshot's host memory per rank (0: the whole state)
};

struct BroadcastSection {
  std::string backend = "none";     // none | nccl | filesystem
  int64_t interval = 1;
  std::string dir;
  int64_t keep = 2;
};

// The inference role of an RL job (`shardlm generate DECK` beside the trainers):
// what it samples, how it scores, how it turns rewards into advantages
// (docs/rl.md). The sampling draws use run.seed.
struct RolloutSection {
  std::string prompts;              // prompt file (tools/make_prompts.py)
  int64_t prompts_per_step = 8;     // prompts of each step's rollout file
  int64_t n = 4;                    // samples per prompt (a group)
  int64_t max_new_tokens = 64;
  double temperature = 1.0;         // > 0 (the trainer's loss divides by it)
  double top_p = 1.0;
  int64_t top_k = 0;
  int64_t batch = 16;               // sequences decoded at once per inference rank
  int64_t kv_cache_tokens = 0;      // the paged KV pool of an inference rank, in positions; 0 = every slot at its longest
  double kv_cache_memory = 0;       // or sized from this fraction of the device's memory (decoder.hpp, size_pool); 0 = off
  bool in_flight_updates = false;   // new weights taken between two decode steps, not only between rollout steps
  int64_t max_turns = 8;            // with env.program: the assistant turns of an episode at most
  // The reward's components (exact | numeric | regex | program | env, each at most
  // once) and their weights (empty = 1 each): reward = sum of weight * component.
  std::vector<std::string> reward = {"exact"};
  std::vector<double> reward_weights;
  std::string reward_regex;         // reward = "regex": 1 when the completion matches ({answer}: the reference)
  std::string reward_program;       // reward = "program": a command; JSONL on its stdin, one reward per line back
  double reward_timeout_s = 60.0;   // the program's answer for one step, at most
  // mean_std | mean | rloo | batch_std: reward - the group's mean [/ (the group's std + 1e-6)];
  // rloo: reward - the mean of the group's other samples; batch_std: reward - the
  // group's mean, / (the std of the step's rewards + 1e-6) (docs/rl.md).
  std::string advantage = "mean_std";
  // DAPO's data rules (docs/rl.md). dynamic_sampling: groups whose rewards are
  // all equal are dropped and more prompts sampled, in at most
  // dynamic_max_rounds rounds, until the step has prompts_per_step groups that train.
  bool dynamic_sampling = false;
  int64_t dynamic_max_rounds = 8;
  // Completions cut at max_new_tokens: "train" as any other, "mask" (no loss on
  // their tokens), "penalty" (the soft overlong penalty over the last
  // overlong_window tokens of the budget, added to every completion's reward;
  // 0 = max_new_tokens / 5, at least 1).
  std::string truncated = "train";   // train | mask | penalty
  int64_t overlong_window = 0;
};

struct LogSection {
  int64_t interval = 1;
  std::string jsonl = "metrics.jsonl";  // relative to run.dir
  bool tensorboard = false;         // <run.dir>/tensorboard/events.out.tfevents.*
};

struct DeviceSection {
  std::string backend = "auto";     // auto | cpu | cuda
  int64_t cpu_threads = 0;          // 0 = OMP_NUM_THREADS or all cores
  double memory_limit_gib = 0;      // cap on the GPU memory shardlm allocates; 0 = none
  std::string attention = "auto";   // auto | cudnn | flash: cuDNN's fused attention or shardlm's kernels
};

struct CommSection {
  std::string backend = "auto";     // auto | mpi | nccl
  double timeout_s = 600.0;
};

struct Config {
  std::string deck_path;
  RunSection run;
  ModelSection model;
  DataSection data;
  EvalSection eval;
  EnvSection env;
  OptimSection optim;
  SchedSection sched;
  LossSection loss;
  CkptSection ckpt;
  BroadcastSection broadcast;
  RolloutSection rollout;
  LogSection log;
  DeviceSection device;
  CommSection comm;
};

// What parse_deck found: the config and every error (empty = valid).
struct DeckResult {
  Config config;
  std::vector<std::string> errors;
  bool ok() const { return errors.empty(); }
};

// Parse `deck_path`, apply `overrides` ("section.key=value", value parsed as TOML;
// an unquoted value for a string key is taken as the string), and validate.
// `world` is the number of training ranks the cross-field checks assume.
DeckResult parse_deck(const std::string& deck_path, const std::vector<std::string>& overrides,
                      int world);
// The same from deck text (tests; `source_name` stands in for the file name).
DeckResult parse_deck_text(const std::string& text, const std::string& source_name,
                           const std::vector<std::string>& overrides, int world);

// What a model of experts (`arch`: the deck's or model.hf's) does not run with
// yet among the deck's other choices (model.fp8, model.context_parallel > 1,
// and model.expert_parallel's rules but the world's, the CUDA backend among
// them), as a sentence naming the key; "" when none.
std::string moe_deck_error(const Config& config, const ModelConfig& arch);

// The resolved deck as TOML: every key with its value, defaults included.
std::string resolved_deck(const Config& config);

// Every key the deck accepts, "section.key" (help text, tests).
std::vector<std::string> known_keys();

}  // namespace shardlm
