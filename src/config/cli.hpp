// cli.hpp — the command line: subcommand, deck, --set overrides, options.
//
// Owns: parse_cli() and the usage text. Knows nothing about what the commands do.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace shardlm {

struct CliArgs {
  std::string command;                       // train | check | help | version
  std::string deck;                          // the TOML deck (train, check)
  std::vector<std::string> overrides;        // --set section.key=value, in order
  int world = 0;                             // check --world N (0 = the MPI world)
  std::map<std::string, std::string> options;  // other --name value options
  // `shardlm generate DECK` (the deck positional, no sampling options): the
  // inference ranks of an RL job, beside `shardlm train DECK` (docs/rl.md).
  bool inference_role = false;
};

// Throws shardlm::Error with a message that ends in the usage line.
CliArgs parse_cli(int argc, const char* const* argv);
const char* usage();

}  // namespace shardlm
