// cli.cpp — command-line parsing for the shardlm subcommands.
#include "config/cli.hpp"

#include <cstdlib>
#include <cstring>

#include "shardlm/error.hpp"

namespace shardlm {

const char* usage() {
  return "usage: shardlm train DECK [--set section.key=value]...\n"
         "       shardlm check DECK [--set section.key=value]... [--world N]\n"
         "       shardlm receive DECK [--set section.key=value]... [--out DIR]\n"
         "       shardlm forward --hf DIR --tokens IN.h5 --out OUT.h5\n"
         "       mpirun -np T shardlm train DECK : -np G shardlm generate DECK [--set section.key=value]...\n"
         "       shardlm generate --hf DIR | --checkpoint CKPT | --deck DECK  --prompts FILE | --prompt-ids \"1,2,3\" | --prompt \"TEXT\"\n"
         "               --out FILE [--n N] [--max-new-tokens M] [--temperature T] [--top-p P] [--top-k K]\n"
         "               [--seed S] [--batch B] [--kv-cache-tokens T | --kv-cache-memory F] [--device auto|cpu|cuda]\n"
         "       shardlm inspect CHECKPOINT\n"
         "       shardlm export CHECKPOINT --out DIR [--dtype bf16|fp32]\n"
         "       shardlm --help | --version\n"
         "\n"
         "  train   run the deck's training job (launch with mpirun or srun; a singleton works too)\n"
         "  check   validate the deck, print the resolved deck and the per-rank memory plan, exit\n"
         "  receive the reference weight receiver of an RL job (second app of an MPMD launch:\n"
         "          mpirun -np N shardlm train D : -np 1 shardlm receive D); --out writes the last weights\n"
         "  forward logits of an HF model directory for int32 `tokens` [B, T] (each row one sequence),\n"
         "          written as float32 `logits` [B, T, V]; one process\n"
         "  generate sample completions of prompts (a tools/make_prompts.py file, or ids) from an HF directory\n"
         "          or a checkpoint (KV cache, continuous batching; temperature 0 = greedy) into an HDF5 file\n"
         "          with ids, logprobs and text (docs/generate.md); under mpirun each rank takes a share.\n"
         "          `generate DECK` beside `train DECK` in one mpirun: the RL job's inference ranks, which\n"
         "          receive the trainers' weights, sample, score and write the rollout files (docs/rl.md)\n"
         "  inspect print a checkpoint's step, world size, model and optimizer, and verify every\n"
         "          checksum (exit 1 when damaged, 2 when not there); CHECKPOINT is a step_N.h5 file or a run dir\n"
         "  export  write an HF model directory (config.json + model.safetensors, and the tokenizer files of\n"
         "          the model.hf it was trained from) from a checkpoint;\n"
         "          one process is enough (default --dtype bf16)\n"
         "  --set   override any deck key; the value is parsed as TOML (--set optim.lr=3e-4,\n"
         "          --set 'run.dir=\"runs/a\"'); for string keys an unquoted value is the string\n"
         "  --world the number of training ranks `check` plans for (default: the MPI world)\n";
}

CliArgs parse_cli(int argc, const char* const* argv) {
  CliArgs args;
  auto fail = [](const std::string& m) { SHARDLM_FAIL("%s\n%s", m.c_str(), usage()); };
  if (argc < 2) fail("no command given");
  const std::string first = argv[1];
  if (first == "--help" || first == "-h" || first == "help") return args.command = "help", args;
  if (first == "--version" || first == "version") return args.command = "version", args;
  if (first != "train" && first != "check" && first != "forward" && first != "receive" && first != "inspect" &&
      first != "export" && first != "generate") fail("unknown command '" + first + "'");
  args.command = first;
  // Options that take one value, per command.
  const auto takes = [&](const std::string& name) {
    return (args.command == "forward" && (name == "--hf" || name == "--tokens" || name == "--out")) ||
           (args.command == "receive" && name == "--out") ||
           (args.command == "export" && (name == "--out" || name == "--dtype")) ||
           (args.command == "generate" &&
            (name == "--hf" || name == "--checkpoint" || name == "--deck" || name == "--prompts" ||
             name == "--prompt-ids" || name == "--prompt" || name == "--out" || name == "--n" || name == "--max-new-tokens" ||
             name == "--temperature" || name == "--top-p" || name == "--top-k" || name == "--seed" ||
             name == "--batch" || name == "--kv-cache-tokens" || name == "--kv-cache-memory" || name == "--device"));
  };

  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) fail(std::string(name) + " needs a value");
      return argv[++i];
    };
    if (a == "--set") args.overrides.push_back(value("--set"));
    else if (a.rfind("--set=", 0) == 0) args.overrides.push_back(a.substr(6));
    else if (a == "--world" && args.command == "check") {
      const std::string v = value("--world");
      char* end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (*end != '\0' || n < 1 || n > 1000000) fail("--world expects a positive integer, got '" + v + "'");
      args.world = static_cast<int>(n);
    } else if (takes(a)) {
      args.options[a.substr(2)] = value(a.c_str());
    } else if (a == "--help" || a == "-h") return args.command = "help", args;
    else if (a.rfind("--", 0) == 0) fail("unknown option '" + a + "' for '" + args.command + "'");
    else if (args.deck.empty()) args.deck = a;
    else fail("unexpected argument '" + a + "' (the deck is already '" + args.deck + "')");
  }
  if (args.command == "forward") {
    for (const char* need : {"hf", "tokens", "out"})
      if (!args.options.count(need)) fail(std::string("'forward' needs --") + need);
    if (!args.deck.empty() || !args.overrides.empty()) fail("'forward' takes no deck and no --set");
    return args;
  }
  if (args.command == "generate") {  // the options are checked by parse_generate_args (src/infer/command.hpp)
    if (!args.deck.empty()) {  // the RL job's inference ranks: everything comes from the deck
      if (!args.options.empty())
        fail("'generate DECK' is the inference role of an RL job and takes its settings from the deck's [rollout] "
             "section (and --set); for standalone sampling give --deck DECK with --prompts and --out, not '--" +
             args.options.begin()->first + "' beside a positional deck");
      args.inference_role = true;
      return args;
    }
    if (args.options.count("deck")) args.deck = args.options.at("deck");
    return args;
  }
  if (args.command == "inspect" || args.command == "export") {
    if (args.deck.empty()) fail("'" + args.command + "' needs a checkpoint (a step_N.h5 file or a run dir)");
    if (!args.overrides.empty()) fail("'" + args.command + "' takes no --set");
    if (args.command == "export" && !args.options.count("out")) fail("'export' needs --out DIR");
    args.options["checkpoint"] = args.deck;  // the positional argument is the checkpoint, not a deck
    args.deck.clear();
    return args;
  }
  if (args.deck.empty()) fail("'" + args.command + "' needs a deck (a TOML file)");
  return args;
}

}  // namespace shardlm
