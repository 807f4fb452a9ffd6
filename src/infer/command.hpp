// command.hpp — `shardlm generate`: standalone sampling from an HF directory or
// a checkpoint, with a prompt file or ids, into one HDF5 file of completions.
//
// Owns: the subcommand's options and their checks, which prompts each rank
// takes (rank r: prompts r, r + W, ...), gathering the completions to rank 0,
// the decoded text, and the output file (docs/generate.md; written as
// FILE.tmp, then renamed). Composes InferenceModel, Decoder, generate() and
// the prompt reader; knows MPI (one communicator) but not the training state.
#pragma once

#include <mpi.h>

#include <map>
#include <string>
#include <vector>

#include "infer/generate.hpp"

namespace shardlm {

// Parsed from the command line (and the deck's defaults when --deck is given).
struct GenerateArgs {
  std::string hf, checkpoint, deck;
  std::vector<std::string> overrides;   // --set, for the deck
  std::string prompts_file, prompt_ids, out;
  std::string prompt_text;              // --prompt TEXT: encoded with the model's tokenizer.json
  bool has_prompt_text = false;
  int64_t n = 1;
  int64_t max_new_tokens = 64;
  int64_t batch = 8;                    // sequences decoded at once per rank (KV cache slots)
  int64_t kv_cache_tokens = 0;          // the KV pool in positions; 0 = every slot at its longest
  double kv_cache_memory = 0;           // or from this fraction of the device's memory (DecoderLimits::memory_fraction)
  std::string device;                   // --device auto|cpu|cuda ("": the deck's device.backend, else auto)
  SamplingParams sampling;
  bool seed_given = false;
};

// Reads and checks the options (numbers in range, one model source, one
// prompt source, --out); throws Error naming the option.
GenerateArgs parse_generate_args(const std::map<std::string, std::string>& options, const std::string& deck,
                                 const std::vector<std::string>& overrides);

// Collective over `comm`. Returns the exit status: 0 written; 1 bad input
// (rank 0 prints the reason, naming the file or option).
int run_generate(const GenerateArgs& args, MPI_Comm comm);

// Rank 0 of `comm` gets every rank's completions, sorted by (prompt, sample);
// the others get none. Collective.
std::vector<Completion> gather_completions(std::vector<Completion> mine, MPI_Comm comm);

// The output file's layout (docs/generate.md), for the writer and the tests.
struct GenerationsFile {
  std::string model_source, prompts_source;
  std::vector<int32_t> prompt_tokens;      // (Tp) every prompt, concatenated
  std::vector<int64_t> prompt_offsets;     // (P+1)
  std::vector<Completion> completions;     // (S) sorted by (prompt, sample)
  std::vector<std::string> texts;          // (S) decoded, or empty when there is no tokenizer
  std::vector<int32_t> stop_ids;
  SamplingParams sampling;
  int64_t n = 1, max_new_tokens = 0, world = 1;
};
void write_generations(const std::string& path, const GenerationsFile& g);

}  // namespace shardlm
