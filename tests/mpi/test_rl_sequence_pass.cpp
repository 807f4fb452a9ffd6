// test_rl_sequence_pass.cpp — RL losses over whole samples (GSPO's sequence
// ratio; sequence-level importance sampling with the entropy bonus) at any
// split of the ranks: the step's forward-only pass sums each sample over the
// micro-batches and shares that hold its tokens and all-reduces the sums, so
// data parallelism over every rank and context parallelism (C = 2) give the
// losses of one rank alone (train/sequence_pass.hpp). The same for GSPO with
// four updates a step (2 epochs x 2 parts, the sums formed again per update)
// and the KL term against the starting weights, whose forward pass on the
// frozen shards gathers and splits like the training weights'
// (train/reference_pass.hpp).
#include <doctest/doctest.h>

#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "train/train.hpp"
#include "mpi_world.hpp"

using namespace shardlm;

namespace {

using shardlm_test::world_rank;
using shardlm_test::world_size;

// tiny-rl.toml's model on tools/make_rollouts.py's files, strictly on-policy
// files read offline (no broadcast), and the loss under test.
std::string deck(const std::string& rollout_dir, const std::string& loss) {
  return R"(
[run]
name = "rl-sequence"
dir = "/tmp/shardlm-rl-sequence-run"
seed = 1234
max_steps = 2
[model]
vocab_size = 258
hidden_size = 64
intermediate_size = 176
num_layers = 2
num_heads = 4
num_kv_heads = 2
max_position_embeddings = 512
tie_word_embeddings = true
[data]
rollout_dir = ")" + rollout_dir + R"("
seq_len = 512
micro_batch = 1
max_async = 0
[optim]
lr = 1e-3
[loss]
type = "rl"
)" + loss;
}

std::vector<double> losses(const std::string& text, Comm& comm, int64_t cp, int world) {
  DeckResult r = parse_deck_text(text, "rl-sequence.toml", {"model.context_parallel=" + std::to_string(cp)}, world);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  std::vector<double> out;
  TrainSession session(r.config, comm);
  for (int s = 0; s < 2; ++s) out.push_back(session.step(s).loss);
  return out;
}

}  // namespace

TEST_SUITE("rl_sequence_pass") {

TEST_CASE("GSPO and sequence-level importance sampling: the same losses on one rank, over all ranks and at C = 2") {
  if (world_size() < 2) {
    MESSAGE("skipped at 1 rank: the comparison is between splits of the ranks");
    return;
  }
  long long pid = static_cast<long long>(getpid());  // rank 0's names the folder
  MPI_Bcast(&pid, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  const std::string dir = "/tmp/shardlm-rl-sequence-" + std::to_string(pid);
  if (world_rank() == 0) {
    // Samples of up to 120 tokens, inference logprobs far from the model's:
    // the sequence ratios and importance weights are far from 1 (clipped, capped).
    const std::string cmd = "/usr/bin/python3 tools/make_rollouts.py inputs/data/tiny.h5 --out " + dir +
                            " --steps 2 --samples-per-step 4 --max-tokens 120 > /dev/null 2>&1";
    REQUIRE(std::system(cmd.c_str()) == 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const struct {
    const char* name;
    const char* loss;
  } cases[] = {
      {"gspo", "objective = \"gspo\"\nclip_low = 0.2\nclip_high = 0.28\n"},
      {"sequence IS", "is_level = \"sequence\"\nis_cap = 2.0\nentropy_coef = 0.01\n"},
      {"gspo, 2 x 2 updates, ref KL",
       "objective = \"gspo\"\nclip_low = 0.2\nclip_high = 0.28\nepochs = 2\nmini_batches = 2\nref_kl_coef = 0.5\n"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    const std::string text = deck(dir, c.loss);
    auto self = make_self_comm();
    const std::vector<double> one = losses(text, *self, 1, 1);  // every rank alone, the reference
    auto world = make_mpi_comm(MPI_COMM_WORLD);
    const std::vector<double> dp = losses(text, *world, 1, world_size());
    std::vector<double> cp;
    if (world_size() % 2 == 0) cp = losses(text, *world, 2, world_size());
    double worst = 0;
    for (size_t s = 0; s < one.size(); ++s) {
      MESSAGE(std::string(c.name) << " step " << s << ": one rank " << one[s] << ", " << world_size() << " ranks " << dp[s]
                     << (cp.empty() ? "" : ", C = 2 " + std::to_string(cp[s])));
      worst = std::max(worst, std::fabs(dp[s] - one[s]) / std::max(1e-12, std::fabs(one[s])));
      if (!cp.empty()) worst = std::max(worst, std::fabs(cp[s] - one[s]) / std::max(1e-12, std::fabs(one[s])));
    }
    CHECK(worst <= 1e-5);
    CHECK(std::isfinite(one[0]));
    CHECK(one[0] != one[1]);  // the policy moved: the steps are not the same number
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

}  // TEST_SUITE
