// env.hpp — an environment program an RL inference rank talks to over the
// turns of its episodes (the deck's [env]; docs/rl.md "Environments").
//
// Owns: EnvProgram: `/bin/sh -c env.program`, started once per inference rank
// and kept running, and the JSON-lines exchange with it. After each assistant
// turn of an episode (a sample: prompt key and sample number) the rank writes
// one line and reads one answer:
//   -> {"episode": "K.S", "prompt": P, "sample": S, "answer": "...", "metadata": {...},
//       "turn": k, "ids": [...], "text": "...", "end": "length" | "max_turns"}
//      (`end` only on an episode's last message: the policy ran out of tokens
//      or turns, and only a reward may answer; an episode of the evaluation
//      is "eval.P.S" and carries "eval": true)
//   <- {"episode": "K.S", "observation": [ids]}   the next turn follows them
//   <- {"episode": "K.S", "reward": r, "metrics": {"name": x, ...}}
//                                                  the episode ends with r (metrics optional)
// An answer that is late (env.timeout_s), not JSON, for another episode,
// without either key, with metrics that are not named numbers, or a program
// that ended, ends the job with one message naming the program, the episode
// and what went wrong. Must not know: the decoder, MPI, files.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace shardlm {

// What the environment is told of one turn.
struct EnvTurn {
  int64_t key = 0, sample = 0;  // the episode: the sample's draw key and number
  int64_t prompt = 0;           // index in the prompt file
  bool eval = false;            // an episode of the evaluation (eval.prompts), not of the rollouts
  std::string answer;           // the prompt's reference answer ("" when the file has none)
  std::string metadata;         // the prompt's metadata (JSON text; "" when the file has none)
  int64_t turn = 1;             // 1, 2, ...
  std::vector<int32_t> ids;     // the turn's drawn ids, its stop id included
  std::string text;             // decoded (or the ids in decimal without a tokenizer)
  const char* end = nullptr;    // the episode's last message: "length", "max_turns"
};

// How an episode ended, on the environment's side.
struct EnvOutcome {
  double reward = 0;
  std::string metrics;  // the answer's "metrics" object as compact JSON; "" when it had none
};

class EnvProgram {
 public:
  EnvProgram(std::string command, double timeout_s);
  ~EnvProgram();
  EnvProgram(const EnvProgram&) = delete;
  EnvProgram& operator=(const EnvProgram&) = delete;

  // The environment's answer to a turn: its observation (nullopt when it ended
  // the episode, whose outcome is then held for outcome_of).
  std::optional<std::vector<int32_t>> turn(const EnvTurn& t);
  // An episode's outcome once it ended (erased as it is taken); nullopt when the
  // environment has not given one (the episode ended on the policy's side:
  // tell it with turn() and `end` set, which must answer with a reward).
  std::optional<EnvOutcome> outcome_of(bool eval, int64_t key, int64_t sample);
  const std::string& command() const { return command_; }
  // Seconds spent waiting for the program's answers, in all.
  double seconds() const { return seconds_; }

 private:
  std::string exchange(const std::string& line, const std::string& where);  // one line out, one back

  std::string command_;
  double timeout_s_;
  pid_t pid_ = -1;
  int in_fd_ = -1, out_fd_ = -1;
  std::string buffer_;  // what was read past the last answer's newline
  double seconds_ = 0;
  std::map<std::tuple<bool, int64_t, int64_t>, EnvOutcome> outcomes_;
};

}  // namespace shardlm
