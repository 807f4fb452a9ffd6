// rollouts.hpp — RL rollout files: reading and validating
// <data.rollout_dir>/step_<N>.h5, waiting for the inference side to publish it,
// and packing its samples into micro-batches balanced across ranks.
//
// Owns: RolloutBatch, read_rollouts, rollout_path, wait_for_rollouts,
// check_rollout_step, RlMicroBatch, RankRollouts, assign_samples_to_ranks,
// pack_rollouts. Knows nothing about MPI (rank and world are plain ints: every
// rank reads the whole file and packs the same assignment, so no communication
// is needed), devices, the model or the loss. File format: docs/rollouts.md.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "data/data.hpp"

namespace shardlm {

// One step's rollouts as read from the file, validated, with defaults filled in.
// T = tokens of all samples, S = samples.
struct RolloutBatch {
  std::string path;
  int64_t step = 0;         // root attribute: the trainer step these are for
  int64_t policy_step = 0;  // root attribute: the trainer step whose weights generated them
  std::vector<int32_t> tokens;             // (T)
  std::vector<int64_t> offsets;            // (S+1) sample s = tokens[offsets[s] .. offsets[s+1])
  std::vector<uint8_t> loss_mask;          // (T) 1 = completion token that carries loss
  std::vector<float> advantages;           // (T) per token; a per-sample dataset is expanded
  bool advantages_per_sample = false;      // how the file stored them
  std::vector<float> inference_logprobs;   // (T) log p_inference(token t | tokens < t), temperature-scaled full softmax
  std::vector<float> sampling_logprobs;    // (T) under the distribution drawn from (top-k/top-p); empty: = inference
  // Router replay (a model of experts): (T, route_width) the experts the
  // sampler's router chose for token t when it was fed in, each layer of
  // experts' K in turn; -1 where nothing was fed (a sample's last token).
  // Empty (route_width 0) when the file has none.
  std::vector<int32_t> routes;
  int64_t route_width = 0;
  std::vector<float> temperature;          // (S) 1 where the file has none
  std::vector<float> loss_weight;          // (T) 1 where the file has none
  // The group 'metrics': what the inference side measured while making the
  // file (reward_mean, sampling_tokens_per_s, ...), by name in name order; the
  // trainers log them with the step that trains on the file. Empty when absent.
  std::vector<std::pair<std::string, double>> metrics;
  int64_t loss_tokens = 0;  // targets with loss_mask 1 and loss_weight > 0 (a sample's
                            // first token is never a target): the step's loss divisor

  int64_t samples() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t sample_tokens(int64_t s) const { return offsets[s + 1] - offsets[s]; }
  // (input, target) positions sample s fills in a row: tokens - 1, or 0.
  int64_t sample_pairs(int64_t s) const { return sample_tokens(s) > 1 ? sample_tokens(s) - 1 : 0; }
};

// A 64-bit fingerprint of everything a batch holds that training reads (FNV-1a
// over the arrays' 8-byte words and the step attributes): equal on two ranks that read the same file.
uint64_t rollout_fingerprint(const RolloutBatch& b);

// What the inference side writes for one step (docs/rollouts.md): S samples of
// prompt + completion, per-sample advantages and temperatures.
struct RolloutFile {
  int64_t step = 0, policy_step = 0;
  std::vector<int32_t> tokens;             // (T)
  std::vector<int64_t> offsets;            // (S+1)
  std::vector<uint8_t> loss_mask;          // (T) 1 on completion tokens
  std::vector<float> advantages;           // (S)
  std::vector<float> inference_logprobs;   // (T) 0 on prompt tokens; log_softmax(logits / temperature)[token]
  std::vector<float> sampling_logprobs;    // (T) optional, 0 on prompt tokens: under the truncated (top-k, top-p)
                                           //   distribution the token was drawn from
  std::vector<int32_t> routes;             // (T, route_width) optional: router replay's experts (as RolloutBatch's)
  int64_t route_width = 0;
  std::vector<float> temperature;          // (S)
  std::vector<double> rewards;             // (S) optional: each sample's reward (the advantages' input)
  std::vector<std::pair<std::string, double>> metrics;  // optional: the group 'metrics', one attribute each
  uint64_t job_id = 0;  // the writing job's id (root attribute 'job_id'); 0: none written (offline rollouts)
};
// Writes rollout_path(dir, file.step) as <it>.tmp, then renames it: the
// trainers never see a half-written file. Throws Error naming the path.
void write_rollouts(const std::string& dir, const RolloutFile& file);

// "<dir>/step_<step>.h5".
std::string rollout_path(const std::string& dir, int64_t step);

// Throws Error when `dir` exists and is not a directory (absent is fine: the
// inference side may create it). wait_for_rollouts and `shardlm check` call it.
void validate_rollout_dir(const std::string& dir);

// Reads and validates the whole file. Throws shardlm::Error naming the file and
// what is wrong (missing file or dataset, wrong dtype or rank, lengths that do
// not match, a token id outside [0, vocab_size), a NaN/inf or positive inference
// logprob at a loss token, no samples, no loss token, ...; docs/rollouts.md).
RolloutBatch read_rollouts(const std::string& path, int64_t vocab_size);

// The root attribute 'job_id' of a rollout file: the id of the job whose
// inference ranks wrote it, 0 when it has none (offline rollouts). Throws when
// the file cannot be opened as HDF5.
uint64_t read_rollout_job_id(const std::string& path);

// Waits until rollout_path(dir, step) exists. Writers create step_<N>.h5.tmp and
// rename it when complete, so the final name appearing means the file is whole.
// job_id != 0 (the job has inference ranks): only a file whose 'job_id' is
// that counts; one of another job (or none) is said once through progress and
// waited past, until this job's inference rank renames its own over it.
// Polls every 0.1 s; calls progress(message) every progress_interval_s while
// waiting (nullptr: silent). Returns the path. Throws shardlm::Error
// "no rollouts for step N in DIR after T s (is the inference server running?)"
// once timeout_s have passed.
std::string wait_for_rollouts(const std::string& dir, int64_t step, double timeout_s,
                              const std::function<void(const std::string&)>& progress,
                              double progress_interval_s = 10.0, uint64_t job_id = 0);

// The file belongs to `step` (its step attribute) and its policy lag is allowed:
// step - max_async <= policy_step <= step (data.max_async). Throws otherwise.
void check_rollout_step(const RolloutBatch& batch, int64_t step, int64_t max_async);

// loss.normalize = "sequence": each sample's loss weights divided by its count
// of loss tokens, so that a sample's tokens weigh 1 together. Returns the
// samples that carry loss (the step's loss divisor then).
int64_t normalize_per_sequence(RolloutBatch& batch);

// An RL micro-batch: the SFT fields plus the per-position RL inputs of the loss.
// Every vector holds rows * seq_len entries; position j of a sample holds input
// x_j and target x_{j+1}, and the RL values below are those of the TARGET token.
struct RlMicroBatch {
  MicroBatch batch;  // tokens, targets (-1 padding), weights = loss_mask * loss_weight
                     // of the target (0 padding), positions, seq_ids, loss_tokens
  std::vector<float> advantages;          // (rows, seq_len) A of the target; 0 padding
  std::vector<float> inference_logprobs;  // (rows, seq_len) logprob of the target; 0 padding
  std::vector<float> sampling_logprobs;   // (rows, seq_len) the same under the sampling distribution; empty: none
  // (rows, seq_len, route_width) router replay: the experts the sampler chose
  // for the INPUT token (the route recorded when it was fed in); -1 padding;
  // empty: none.
  std::vector<int32_t> routes;
  int64_t route_width = 0;
  std::vector<float> temperatures;        // (rows, seq_len) the sample's; 1 padding
  std::vector<int32_t> sample_ids;        // (rows, seq_len) index of the sample in the file; -1 padding
};

// One rank's share of a step.
struct RankRollouts {
  // Equally many on every rank (the collectives need it): ranks with fewer real
  // micro-batches get empty ones at the end (all padding, weight 0).
  std::vector<RlMicroBatch> micro_batches;
  int64_t real_micro_batches = 0;  // the first ones, holding this rank's samples
  int64_t samples = 0, tokens = 0, loss_tokens = 0;  // this rank's (tokens = filled positions)
  int64_t tokens_global = 0;       // filled positions over all ranks
  int64_t loss_tokens_global = 0;  // = batch.loss_tokens: the loss divisor, no all-reduce
};

// Deterministic greedy balance by filled positions: samples sorted by
// sample_pairs descending (file order on ties), each given to the rank with the
// fewest positions so far (the lowest rank on ties). Samples with fewer than 2
// tokens have nothing to predict and get -1. Returns the rank of each sample.
std::vector<int> assign_samples_to_ranks(const RolloutBatch& batch, int world);

// Rank `rank`'s micro-batches of `micro_batch` rows of `seq_len` positions.
// Within a rank, samples are packed best-fit decreasing (each into the fullest
// row it still fits, else a new row); a sample is never split. A sample with
// more than seq_len + 1 tokens is an error naming it.
RankRollouts pack_rollouts(const RolloutBatch& batch, int64_t seq_len, int64_t micro_batch, int rank,
                           int world);

}  // namespace shardlm
