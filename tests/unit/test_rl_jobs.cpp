// test_rl_jobs.cpp — rollout files and an RL job's identity: the job id a job's
// inference ranks stamp on their files and the only files its trainers take
// (a file of another job is named once and waited past until the job's own is
// renamed over it; without an id expected, any file is taken), and
// rollouts.jsonl rewritten at a launch without the rows of the steps it redoes.
// End to end (two jobs in one rollout directory, a resumed job):
// tests/scripts/test_rl_jobs.sh.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "base/run_dir.hpp"
#include "data/rollouts.hpp"
#include "infer/rollout.hpp"
#include "shardlm/error.hpp"

namespace fs = std::filesystem;
using namespace shardlm;

namespace {

struct JobDir {
  fs::path path = fs::temp_directory_path() / ("shardlm-rl-jobs-" + std::to_string(getpid()));
  JobDir() { fs::remove_all(path), fs::create_directories(path); }
  ~JobDir() { fs::remove_all(path); }
};

RolloutFile one_step(int64_t step, uint64_t job_id) {
  RolloutFile f;
  f.step = f.policy_step = step;
  f.tokens = {1, 2, 3};
  f.offsets = {0, 3};
  f.loss_mask = {0, 1, 1};
  f.advantages = {0.5f};
  f.inference_logprobs = {0, -0.5f, -0.25f};
  f.temperature = {1.0f};
  f.job_id = job_id;
  return f;
}

}  // namespace

TEST_SUITE("rl_jobs") {

TEST_CASE("rl jobs: the job id written is read back; a file without one reads 0") {
  JobDir dir;
  write_rollouts(dir.path.string(), one_step(0, 0xfeedbeef12345678ull));
  write_rollouts(dir.path.string(), one_step(1, 0));
  CHECK(read_rollout_job_id(rollout_path(dir.path.string(), 0)) == 0xfeedbeef12345678ull);
  CHECK(read_rollout_job_id(rollout_path(dir.path.string(), 1)) == 0);
  CHECK(read_rollouts(rollout_path(dir.path.string(), 0), 8).loss_tokens == 2);
}

TEST_CASE("rl jobs: a trainer waits past another job's file, says so once, and takes its own") {
  JobDir dir;
  const std::string d = dir.path.string(), path = rollout_path(d, 2);
  write_rollouts(d, one_step(2, 111));  // an earlier job's
  // This job's file, written aside now and renamed over the other job's later,
  // as the inference rank's write ends: HDF5 is not called from two threads.
  const fs::path aside = dir.path / "aside";
  fs::create_directories(aside);
  write_rollouts(aside.string(), one_step(2, 222));
  std::vector<std::string> said;
  std::thread own_inference_rank([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    fs::rename(rollout_path(aside.string(), 2), path);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const std::string got = wait_for_rollouts(d, 2, 20.0, [&](const std::string& m) { said.push_back(m); }, 10.0, 222);
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  own_inference_rank.join();
  CHECK(got == path);
  CHECK(waited_s >= 0.3);
  CHECK(read_rollout_job_id(got) == 222);
  REQUIRE(said.size() == 1);
  CHECK(said[0] == "waiting for rollouts for step 2: " + path + " belongs to another job (job 000000000000006f), "
                   "not this one (job 00000000000000de): waiting for this job's inference ranks to replace it");

  // Offline rollouts (no id) are another job's for a job with inference ranks, and
  // any trainer's without them.
  write_rollouts(d, one_step(3, 0));
  said.clear();
  std::string message;
  try {
    wait_for_rollouts(d, 3, 0.3, [&](const std::string& m) { said.push_back(m); }, 10.0, 222);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("no rollouts for step 3 in " + d + " after 0.3 s") != std::string::npos);
  REQUIRE(said.size() == 1);
  CHECK(said[0].find("has no job id; it belongs to another job") != std::string::npos);
  CHECK(wait_for_rollouts(d, 3, 0.0, nullptr) == rollout_path(d, 3));
}

TEST_CASE("rl jobs: rollouts.jsonl loses the rows at or past a launch's first step, and torn lines") {
  JobDir dir;
  const fs::path jsonl = dir.path / "rollouts.jsonl";
  {
    std::ofstream out(jsonl);
    for (int s = 0; s < 4; ++s) out << "{\"step\": " << s << ", \"reward_mean\": 0.5}\n";
    out << "{\"step\": 4, \"rew";  // a crash mid-row
  }
  CHECK(keep_jsonl_rows_before(jsonl, 2) == 3);
  std::ifstream in(jsonl);
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(line);
  CHECK(rows == std::vector<std::string>{"{\"step\": 0, \"reward_mean\": 0.5}", "{\"step\": 1, \"reward_mean\": 0.5}"});
  CHECK(keep_jsonl_rows_before(jsonl, 2) == 0);
  CHECK(keep_jsonl_rows_before(dir.path / "absent.jsonl", 0) == 0);
}

}  // TEST_SUITE
