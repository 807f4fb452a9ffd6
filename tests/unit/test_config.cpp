// test_config.cpp — the deck: parsing, every validation error, overrides, echo.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>

#include "shardlm/config.hpp"
#include "shardlm/memory.hpp"
#include "train/train.hpp"

using namespace shardlm;

namespace {

const char* kValid = R"(
[run]
name = "t"
dir = "runs/t"
max_steps = 10
[model]
vocab_size = 258
hidden_size = 64
intermediate_size = 176
num_layers = 2
num_heads = 4
num_kv_heads = 2
[data]
path = "inputs/data/tiny.h5"
seq_len = 64
micro_batch = 2
global_batch = 8
)";

DeckResult parse(const std::string& text, std::vector<std::string> sets = {}, int world = 1) {
  return parse_deck_text(text, "deck.toml", sets, world);
}

std::string only_error(const DeckResult& r) {
  REQUIRE(r.errors.size() == 1);
  return r.errors[0];
}

}  // namespace

TEST_SUITE("config") {

TEST_CASE("a valid deck parses with its values and the defaults") {
  DeckResult r = parse(kValid);
  REQUIRE(r.ok());
  CHECK(r.config.run.name == "t");
  CHECK(r.config.run.max_steps == 10);
  CHECK(r.config.model.arch.hidden_size == 64);
  CHECK(r.config.model.arch.head_dim == 16);        // derived: hidden / heads
  CHECK(r.config.optim.name == "adamw");            // default
  CHECK(r.config.optim.lr == doctest::Approx(3e-4));
  CHECK(r.config.model.reshard_after_forward == true);
  CHECK(r.config.data.global_batch == 8);
}

TEST_CASE("unknown key: file, line, column and a did-you-mean hint") {
  std::string text = std::string(kValid) + "[optim]\nlr = 1e-3\nlr_schedul = \"cosine\"\n";
  const std::string e = only_error(parse(text));
  CHECK(e == "deck.toml:20:1: unknown key 'optim.lr_schedul' (did you mean 'optim.lr'?)");
}

TEST_CASE("a key under the wrong section points to the right one") {
  const std::string e = only_error(parse(std::string(kValid) + "[optim]\nwarmup = 10\n"));
  CHECK(e == "deck.toml:19:1: unknown key 'optim.warmup' (did you mean 'sched.warmup'?)");
}

TEST_CASE("misspelled key and section get hints; a far-off key gets none") {
  CHECK(only_error(parse(std::string(kValid) + "[optim]\nweight_decy = 0.1\n")) ==
        "deck.toml:19:1: unknown key 'optim.weight_decy' (did you mean 'optim.weight_decay'?)");
  CHECK(only_error(parse(std::string(kValid) + "[optimizer]\nlr = 0.1\n")) ==
        "deck.toml:18:2: unknown section 'optimizer'");
  CHECK(only_error(parse(std::string(kValid) + "[shced]\nwarmup = 1\n")) ==
        "deck.toml:18:2: unknown section 'shced' (did you mean 'sched'?)");
  CHECK(only_error(parse(std::string(kValid) + "[log]\nzzzzzz = 1\n")) ==
        "deck.toml:19:1: unknown key 'log.zzzzzz'");
}

TEST_CASE("fsdp_cpu_offload is refused and the message names optim_cpu_offload") {
  for (const char* v : {"true", "false"}) {
    const std::string e = only_error(parse(kValid, {std::string("model.fsdp_cpu_offload=") + v}));
    CHECK(e.find("--set model.fsdp_cpu_offload=") == 0);
    CHECK(e.find("was removed") != std::string::npos);
    CHECK(e.find("model.optim_cpu_offload") != std::string::npos);
  }
  std::string text = kValid;
  text.replace(text.find("num_kv_heads = 2"), 16, "num_kv_heads = 2\nfsdp_cpu_offload = true");
  const std::string in_file = only_error(parse(text));
  CHECK(in_file.rfind("deck.toml:13:1: model.fsdp_cpu_offload was removed", 0) == 0);
  CHECK(in_file.find("model.optim_cpu_offload") != std::string::npos);
}

TEST_CASE("wrong types name the key, the value and what is accepted") {
  CHECK(only_error(parse(kValid, {"optim.lr=\"fast\""})) ==
        "--set optim.lr=\"fast\": optim.lr = \"fast\" has the wrong type: expected a number");
  CHECK(only_error(parse(kValid, {"run.max_steps=1.5"})) ==
        "--set run.max_steps=1.5: run.max_steps = 1.5 has the wrong type: expected an integer");
  CHECK(only_error(parse(kValid, {"run.deterministic=1"})) ==
        "--set run.deterministic=1: run.deterministic = 1 has the wrong type: expected a boolean (true or false)");
  CHECK(only_error(parse(kValid, {"optim.lr=abc"})) ==
        "--set optim.lr=abc: 'abc' is not a valid TOML value (optim.lr expects a number)");
}

TEST_CASE("out-of-range values and unknown choices") {
  CHECK(only_error(parse(kValid, {"optim.lr=-1"})) ==
        "--set optim.lr=-1: optim.lr = -1 is out of range: it must be a finite number > 0 and <= 1000");
  CHECK(only_error(parse(kValid, {"optim.beta2=1.5"})) ==
        "--set optim.beta2=1.5: optim.beta2 = 1.5 is out of range: it must be a finite number between 0 and 0.999999");
  CHECK(only_error(parse(kValid, {"data.seq_len=1"})) ==
        "--set data.seq_len=1: data.seq_len = 1 is out of range: it must be between 2 and 16777216");
  CHECK(only_error(parse(kValid, {"optim.name=adam"})) ==
        "--set optim.name=adam: optim.name = \"adam\" is not accepted: it must be one of \"adamw\", \"sgd\", \"muon\"");
}

TEST_CASE("features not built yet are refused, never ignored") {
  CHECK(only_error(parse(kValid, {"data.packing=false"})) ==
        "deck.toml: data.packing = false is not implemented yet (rows are always packed)");
  CHECK(parse(kValid, {"model.optim_cpu_offload=true"}).config.model.optim_cpu_offload);  // built: accepted
  CHECK(parse(kValid, {"comm.timeout_s=30"}).config.comm.timeout_s == 30.0);
}

TEST_CASE("device communicator keys: NCCL and bf16 reduction need the CUDA backend") {
  const DeckResult gpu = parse(kValid, {"device.backend=cuda", "comm.backend=nccl", "model.reduce_dtype=bf16"});
  for (const auto& e : gpu.errors) MESSAGE(e);
  CHECK(gpu.ok());
  CHECK(gpu.config.comm.backend == "nccl");
  CHECK(gpu.config.model.reduce_dtype == "bf16");
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "comm.backend=nccl"})) ==
        "deck.toml: comm.backend = \"nccl\" needs device.backend = \"cuda\" (NCCL moves device memory only; the CPU backend "
        "uses MPI)");
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "model.reduce_dtype=bf16"})) ==
        "deck.toml: model.reduce_dtype = \"bf16\" needs device.backend = \"cuda\" (the CPU backend is the fp32 reference)");
  CHECK(only_error(parse(kValid, {"comm.timeout_s=0"})) ==
        "--set comm.timeout_s=0: comm.timeout_s = 0 is out of range: it must be a finite number > 0 and <= 32000000");
}

TEST_CASE("model.context_parallel: divides the ranks, splits seq_len into 2C chunks") {
  const DeckResult ok = parse(kValid, {"model.context_parallel=4"}, 8);  // 2 data-parallel groups x 4
  for (const auto& e : ok.errors) MESSAGE(e);
  REQUIRE(ok.ok());
  CHECK(ok.config.model.context_parallel == 4);
  CHECK(parse(kValid).config.model.context_parallel == 1);
  CHECK(only_error(parse(kValid, {"model.context_parallel=4"}, 6)) ==
        "deck.toml: model.context_parallel = 4 does not divide the 6 training ranks: the ranks form groups of "
        "model.context_parallel that share one sequence; run a multiple of 4 ranks or change it");
  CHECK(only_error(parse(kValid, {"model.context_parallel=2", "data.seq_len=62"}, 2)) ==
        "deck.toml: data.seq_len = 62 does not split into 2 x model.context_parallel = 4 equal chunks (each rank of a "
        "group keeps an early and a late chunk): make data.seq_len a multiple of 4");
  // The CUDA ring (cuda/ring_attention.hpp) runs shardlm's masked kernels: cuDNN's attention cannot be asked for.
  const DeckResult gpu = parse(kValid, {"model.context_parallel=2", "device.backend=cuda"}, 2);
  for (const auto& e : gpu.errors) MESSAGE(e);
  CHECK(gpu.ok());
  CHECK(only_error(parse(kValid, {"model.context_parallel=2", "device.backend=cuda", "device.attention=cudnn"}, 2)) ==
        "deck.toml: device.attention = \"cudnn\" with model.context_parallel > 1: the ring attends block by block "
        "with shardlm's masked flash kernels, not cuDNN's; set device.attention = \"auto\" or \"flash\"");
  // global_batch splits over the data-parallel groups, not the ranks: 8 rows = 2 x 4 groups at 8 ranks, C = 2.
  CHECK(parse(kValid, {"model.context_parallel=2"}, 8).ok());
  CHECK(only_error(parse(kValid, {"model.context_parallel=2"}, 16)) ==
        "deck.toml: data.global_batch = 8 must be a multiple of data.micro_batch x data-parallel groups (ranks / "
        "model.context_parallel) = 2 x 8 = 16");
  CHECK(only_error(parse(kValid, {"model.context_parallel=0"})).find("model.context_parallel = 0 is out of range") !=
        std::string::npos);
}

TEST_CASE("model.fp8_weight_cache: off by default; on only with model.fp8") {
  CHECK_FALSE(parse(kValid).config.model.fp8_weight_cache);
  const DeckResult r = parse(kValid, {"model.fp8=tensorwise", "model.fp8_weight_cache=true"});
  REQUIRE(r.ok());
  CHECK(engine_options_for(r.config).fp8_weight_cache);
  CHECK_FALSE(engine_options_for(parse(kValid, {"model.fp8=tensorwise"}).config).fp8_weight_cache);
  CHECK(only_error(parse(kValid, {"model.fp8_weight_cache=true"})) ==
        "deck.toml: model.fp8_weight_cache = true keeps the FP8 codes of the weights, but model.fp8 = \"none\" makes none: set "
        "model.fp8 = \"tensorwise\" or \"rowwise\", or leave the cache off");
}

TEST_CASE("model.fp8_attention: off by default; on with cuDNN's attention on the GPU only") {
  CHECK_FALSE(parse(kValid).config.model.fp8_attention);
  CHECK_FALSE(engine_options_for(parse(kValid).config).fp8_attention);
  const DeckResult r = parse(kValid, {"device.backend=cuda", "model.fp8_attention=true"});
  REQUIRE(r.ok());
  CHECK(engine_options_for(r.config).fp8_attention);
  CHECK(parse(kValid, {"device.backend=auto", "device.attention=cudnn", "model.fp8_attention=true",
                       "model.fp8=tensorwise"}).ok());
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "model.fp8_attention=true"})) ==
        "deck.toml: model.fp8_attention = true runs cuDNN's FP8 attention on the GPU: it needs device.backend = "
        "\"cuda\" (or \"auto\" on a GPU machine); the CPU backend has no emulation of it");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "device.attention=flash", "model.fp8_attention=true"})) ==
        "deck.toml: model.fp8_attention = true runs cuDNN's FP8 attention, but device.attention = \"flash\" keeps "
        "shardlm's bf16 kernels: set device.attention = \"auto\" or \"cudnn\", or leave model.fp8_attention off");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "run.deterministic=true", "model.fp8_attention=true"})) ==
        "deck.toml: model.fp8_attention = true with run.deterministic = true: cuDNN's attention backward is not "
        "bitwise reproducible on Hopper, so deterministic runs keep shardlm's bf16 kernels; leave "
        "model.fp8_attention off");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "model.context_parallel=2", "model.fp8_attention=true"},
                         2)) ==
        "deck.toml: model.fp8_attention = true with model.context_parallel > 1: the ring attends block by block "
        "with shardlm's bf16 kernels; leave model.fp8_attention off");
}

TEST_CASE("model.norm_dtype: fp32 by default, or bf16; nothing else") {
  CHECK(parse(kValid).config.model.norm_dtype == "fp32");
  CHECK(engine_options_for(parse(kValid).config).norm_fp32);
  const DeckResult r = parse(kValid, {"model.norm_dtype=bf16"});
  REQUIRE(r.ok());
  CHECK_FALSE(engine_options_for(r.config).norm_fp32);
  CHECK(only_error(parse(kValid, {"model.norm_dtype=fp16"})) ==
        "--set model.norm_dtype=fp16: model.norm_dtype = \"fp16\" is not accepted: it must be one of "
        "\"bf16\", \"fp32\"");
}

TEST_CASE("model.residual_dtype: fp32 by default, or bf16; nothing else") {
  CHECK(parse(kValid).config.model.residual_dtype == "fp32");
  CHECK(engine_options_for(parse(kValid).config).residual_fp32);
  const DeckResult r = parse(kValid, {"model.residual_dtype=bf16"});
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  CHECK(r.config.model.residual_dtype == "bf16");
  CHECK_FALSE(engine_options_for(r.config).residual_fp32);
  CHECK(only_error(parse(kValid, {"model.residual_dtype=fp16"})) ==
        "--set model.residual_dtype=fp16: model.residual_dtype = \"fp16\" is not accepted: it must be one of "
        "\"bf16\", \"fp32\"");
}

TEST_CASE("model.fp8: none by default, tensorwise or rowwise; sizes in multiples of 16; not with context parallelism") {
  CHECK(parse(kValid).config.model.fp8 == "none");
  for (const char* mode : {"tensorwise", "rowwise"}) {
    const DeckResult r = parse(kValid, {std::string("model.fp8=") + mode});
    for (const auto& e : r.errors) MESSAGE(e);
    REQUIRE(r.ok());
    CHECK(r.config.model.fp8 == mode);
  }
  CHECK(only_error(parse(kValid, {"model.fp8=e4m3"})) ==
        "--set model.fp8=e4m3: model.fp8 = \"e4m3\" is not accepted: it must be one of \"none\", \"tensorwise\", "
        "\"rowwise\"");
  // cuBLASLt's FP8 GEMMs: every width and a row's tokens in multiples of 16, on the CPU backend too (one deck, both).
  CHECK(only_error(parse(kValid, {"model.fp8=rowwise", "model.intermediate_size=172"})) ==
        "deck.toml: model.fp8 needs intermediate_size = 172 to be a multiple of 16 (cuBLASLt's FP8 GEMMs take sizes in "
        "multiples of 16); change it or set model.fp8 = \"none\"");
  CHECK(only_error(parse(kValid, {"model.fp8=tensorwise", "model.num_heads=8", "model.num_kv_heads=1"})) ==
        "deck.toml: model.fp8 needs num_kv_heads x head_dim = 8 to be a multiple of 16 (cuBLASLt's FP8 GEMMs take "
        "sizes in multiples of 16); change it or set model.fp8 = \"none\"");
  CHECK(only_error(parse(kValid, {"model.fp8=rowwise", "data.seq_len=40"})) ==
        "deck.toml: model.fp8 needs data.seq_len / model.context_parallel (the tokens of a row on one rank) = 40 to be "
        "a multiple of 16 (cuBLASLt's FP8 GEMMs take sizes in multiples of 16); change it or set model.fp8 = \"none\"");
  // Context parallelism splits the rows: a scale over tokens would follow the split.
  for (const char* mode : {"tensorwise", "rowwise"})
    CHECK(only_error(parse(kValid, {std::string("model.fp8=") + mode, "model.context_parallel=2"}, 2)) ==
          "deck.toml: model.fp8 with model.context_parallel > 1 is not built yet: the scales that run over tokens (an "
          "activation tensor's, or under \"rowwise\" the weight gradient's per column) would be each rank's share's, "
          "so the numbers would change with model.context_parallel (it needs the amaxes all-reduced over the group); "
          "set model.fp8 = \"none\" or model.context_parallel = 1");
}

TEST_CASE("model.optim_offload_grads: host or device, device only with the offloaded AdamW/SGD on a GPU") {
  const DeckResult dev = parse(kValid, {"device.backend=cuda", "model.optim_cpu_offload=true",
                                        "model.optim_offload_grads=device"});
  for (const auto& e : dev.errors) MESSAGE(e);
  REQUIRE(dev.ok());
  CHECK(dev.config.model.optim_offload_grads == "device");
  CHECK(parse(kValid, {}).config.model.optim_offload_grads == "host");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "model.optim_offload_grads=device"})) ==
        "deck.toml: model.optim_offload_grads = \"device\" sets where the offloaded optimizer's gradients wait: it needs "
        "model.optim_cpu_offload = true");
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "model.optim_cpu_offload=true",
                                  "model.optim_offload_grads=device"})) ==
        "deck.toml: model.optim_offload_grads = \"device\" keeps gradients in GPU memory: it needs device.backend = "
        "\"cuda\"");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "model.optim_cpu_offload=true", "optim.name=muon",
                                  "optim.lr=0.02", "model.optim_offload_grads=device"})) ==
        "deck.toml: model.optim_offload_grads = \"device\" is for AdamW and SGD: Muon's offloaded step reads every "
        "gradient on the host (docs/muon.md)");
  CHECK(only_error(parse(kValid, {"model.optim_offload_grads=gpu"})).find("model.optim_offload_grads") !=
        std::string::npos);
}

TEST_CASE("device.attention: auto by default; cudnn needs the GPU and no run.deterministic; selective checkpointing") {
  const DeckResult def = parse(kValid, {});
  REQUIRE(def.ok());
  CHECK(def.config.device.attention == "auto");
  const DeckResult cudnn = parse(kValid, {"device.backend=cuda", "device.attention=cudnn"});
  REQUIRE(cudnn.ok());
  CHECK(cudnn.config.device.attention == "cudnn");
  CHECK(parse(kValid, {"device.backend=cuda", "device.attention=flash", "run.deterministic=true"}).ok());
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "device.attention=cudnn"})) ==
        "deck.toml: device.attention = \"cudnn\" is cuDNN's GPU attention: it needs device.backend = \"cuda\" (or "
        "\"auto\" on a GPU machine)");
  CHECK(only_error(parse(kValid, {"device.backend=cuda", "device.attention=cudnn", "run.deterministic=true"})) ==
        "deck.toml: device.attention = \"cudnn\" with run.deterministic = true: cuDNN's attention backward is not "
        "bitwise reproducible on Hopper; use device.attention = \"auto\" or \"flash\" (shardlm's deterministic "
        "kernels)");
  const std::string bad = only_error(parse(kValid, {"device.attention=fa3"}));
  CHECK(bad.find("device.attention") != std::string::npos);
  CHECK(bad.find("cudnn") != std::string::npos);
  const DeckResult sel = parse(kValid, {"model.activation_checkpointing=selective"});
  REQUIRE(sel.ok());
  CHECK(sel.config.model.activation_checkpointing == "selective");
  CHECK(only_error(parse(kValid, {"model.activation_checkpointing=some"})).find("selective") != std::string::npos);
  CHECK(sel.config.model.selective_layers == 0);  // every layer
  const DeckResult part = parse(kValid, {"model.activation_checkpointing=selective", "model.selective_layers=1"});
  REQUIRE(part.ok());
  CHECK(part.config.model.selective_layers == 1);
  CHECK(only_error(parse(kValid, {"model.activation_checkpointing=full", "model.selective_layers=1"})) ==
        "deck.toml: model.selective_layers says how many layers keep their attention output under "
        "model.activation_checkpointing = \"selective\"; it is \"full\" here");
  CHECK(only_error(parse(kValid, {"model.activation_checkpointing=selective", "model.selective_layers=3"})) ==
        "deck.toml: model.selective_layers = 3 is more than model.num_layers = 2");
  CHECK(parse(kValid, {"model.activation_checkpointing=selective", "model.selective_layers=0"}).ok());  // every layer
  CHECK(only_error(parse(kValid, {"model.activation_checkpointing=selective", "model.selective_layers=-1"}))
            .find("model.selective_layers = -1 is out of range") != std::string::npos);
}

TEST_CASE("device.memory_limit_gib: parsed, refused on the CPU backend, and the cap refuses what passes it") {
  const DeckResult gpu = parse(kValid, {"device.backend=cuda", "device.memory_limit_gib=79.5"});
  for (const auto& e : gpu.errors) MESSAGE(e);
  REQUIRE(gpu.ok());
  CHECK(gpu.config.device.memory_limit_gib == 79.5);
  CHECK(only_error(parse(kValid, {"device.backend=cpu", "device.memory_limit_gib=80"})) ==
        "deck.toml: device.memory_limit_gib caps GPU memory: it needs device.backend = \"cuda\" (or \"auto\" on a "
        "GPU machine)");
  CHECK(only_error(parse(kValid, {"device.memory_limit_gib=-1"})) ==
        "--set device.memory_limit_gib=-1: device.memory_limit_gib = -1 is out of range: it must be a finite number between 0 and 1000000");

  // The cap itself (what the GPU allocators ask before allocating).
  const int64_t base = device_memory().total_current, mib = 1 << 20;
  set_device_memory_limit(base + 100 * mib);
  CHECK_NOTHROW(device_mem_admit(Mem::Activations, 100 * mib));
  device_mem_track(Mem::Activations, 60 * mib);
  CHECK_THROWS_WITH(device_mem_admit(Mem::Activations, 41 * mib),
                    doctest::Contains("allocating 41.0 MiB for activations would hold"));
  CHECK_NOTHROW(device_mem_admit(Mem::Activations, 40 * mib));
  device_mem_track(Mem::Activations, -60 * mib);
  set_device_memory_limit(0);  // none
  CHECK_NOTHROW(device_mem_admit(Mem::Activations, int64_t(1) << 50));
}

TEST_CASE("muon: its keys parse, its AdamW group defaults to lr and weight_decay, other optimizers refuse them") {
  DeckResult r = parse(kValid, {"optim.name=muon", "optim.lr=0.02", "optim.weight_decay=0.1"});
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  CHECK(r.config.optim.adamw_lr == 0.02);
  CHECK(r.config.optim.adamw_weight_decay == 0.1);
  CHECK(r.config.optim.muon_momentum == 0.95);
  CHECK(r.config.optim.ns_steps == 5);
  r = parse(kValid, {"optim.name=muon", "optim.adamw_lr=3e-4", "optim.adamw_weight_decay=0", "optim.ns_steps=3",
                     "optim.muon_momentum=0.9"});
  REQUIRE(r.ok());
  CHECK(r.config.optim.adamw_lr == 3e-4);
  CHECK(r.config.optim.adamw_weight_decay == 0.0);
  CHECK(r.config.optim.ns_steps == 3);
  CHECK(r.config.optim.muon_momentum == 0.9);
  const DeckResult back = parse_deck_text(resolved_deck(r.config), "config.toml", {}, 1);  // the echo is concrete
  REQUIRE(back.ok());
  CHECK(back.config.optim.adamw_lr == 3e-4);
  CHECK(only_error(parse(kValid, {"optim.ns_steps=3"})) ==
        "deck.toml: optim.ns_steps has no meaning for optim.name = \"adamw\" (it sets Muon; see docs/muon.md)");
  CHECK(only_error(parse(kValid, {"optim.name=muon", "optim.ns_steps=0"})) ==
        "--set optim.ns_steps=0: optim.ns_steps = 0 is out of range: it must be between 1 and 20");
  // On a GPU, Muon runs offloaded (Newton–Schulz on the GPU) and only so.
  CHECK(only_error(parse(kValid, {"optim.name=muon", "device.backend=cuda"})).find(
            "optim.name = \"muon\" with device.backend = \"cuda\" needs model.optim_cpu_offload = true") !=
        std::string::npos);
  CHECK(parse(kValid, {"optim.name=muon", "device.backend=cuda", "model.optim_cpu_offload=true"}).ok());
}

TEST_CASE("the model's size table: one row per size, one check of their rules") {
  // The names every schema uses: the deck and checkpoint attributes, config.json.
  std::vector<std::string> names, hf_keys;
  for (const ModelSizeField& f : model_size_fields()) names.push_back(f.name), hf_keys.push_back(f.hf_key);
  CHECK(names == std::vector<std::string>{"vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                          "num_kv_heads", "head_dim"});
  CHECK(hf_keys == std::vector<std::string>{"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim"});
  ModelConfig c;
  c.vocab_size = 258, c.hidden_size = 64, c.intermediate_size = 176, c.num_layers = 2;
  c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 16;
  CHECK(check_model_sizes(c).rule == ModelSizeProblem::Rule::None);
  CHECK(model_size_error(c).empty());
  ModelConfig bad = c;
  bad.num_kv_heads = 3;
  CHECK(check_model_sizes(bad).rule == ModelSizeProblem::Rule::HeadsNotMultipleOfKvHeads);
  CHECK(model_size_error(bad) == "num_heads = 4 is not a multiple of num_kv_heads = 3");
  bad = c;
  bad.num_layers = kMaxLayers + 1;
  const ModelSizeProblem range = check_model_sizes(bad);
  CHECK(range.rule == ModelSizeProblem::Rule::OutOfRange);
  REQUIRE(range.field != nullptr);
  CHECK(std::string(range.field->name) == "num_layers");
  CHECK(range.value == kMaxLayers + 1);
  CHECK(model_size_error(bad) == "num_layers = 16385 is out of range: shardlm accepts 1 to 16384");
  bad = c;
  bad.num_kv_heads = 0;  // not a divisor question: out of range first
  CHECK(model_size_error(bad) == "num_kv_heads = 0 is out of range: shardlm accepts 1 to 16384");
  bad = c;
  bad.vocab_size = kMaxVocabSize, bad.hidden_size = kMaxHiddenSize, bad.num_layers = kMaxLayers;
  CHECK(check_model_sizes(bad).rule == ModelSizeProblem::Rule::TooManyParameters);
}

TEST_CASE("cross-field checks run before any work") {
  CHECK(only_error(parse(kValid, {}, 3)) ==
        "deck.toml: data.global_batch = 8 must be a multiple of data.micro_batch x training ranks = 2 x 3 = 6");
  CHECK(parse(kValid, {}, 4).ok());
  CHECK(only_error(parse(kValid, {"model.num_kv_heads=3"})) ==
        "deck.toml: model.num_heads = 4 is not a multiple of model.num_kv_heads = 3");
  CHECK(only_error(parse(kValid, {"sched.warmup=20"})) == "deck.toml: sched.warmup = 20 is longer than run.max_steps = 10");
  CHECK(only_error(parse(kValid, {"sched.min_lr=1"})) ==
        "deck.toml: sched.min_lr = 1 is larger than optim.lr = 0.0003 (min_lr is absolute; sched.min_lr_ratio gives the "
        "floor as a fraction of optim.lr)");
  CHECK(only_error(parse(kValid, {"sched.min_lr=1e-5", "sched.min_lr_ratio=0.1"})) ==
        "deck.toml: sched.min_lr = 1e-05 and sched.min_lr_ratio = 0.1 both set the end of the decay: give one "
        "(min_lr_ratio, a fraction of optim.lr, follows the peak in an lr sweep)");
  CHECK(only_error(parse(kValid, {"sched.min_lr_ratio=1.5"})) ==
        "--set sched.min_lr_ratio=1.5: sched.min_lr_ratio = 1.5 is out of range: it must be a finite number between 0 and 1");
  CHECK(only_error(parse(kValid, {"data.path="})) ==
        "deck.toml: data.path is not set: SFT needs a token file (see docs/data.md)");
  CHECK(only_error(parse(kValid, {"model.max_position_embeddings=32"})) ==
        "deck.toml: data.seq_len = 64 is larger than model.max_position_embeddings = 32");
}

TEST_CASE("a model of experts: what the deck refuses before any work") {
  const std::vector<std::string> moe = {"model.arch=qwen2_moe", "model.attention_bias=true", "model.num_experts=4",
                                        "model.num_experts_per_tok=2", "model.moe_intermediate_size=8"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), moe.begin(), moe.end());
    return extra;
  };
  CHECK(parse(kValid, with({})).ok());
  CHECK(parse(kValid, with({"run.export_dir=out"})).ok());
  CHECK(only_error(parse(kValid, with({"model.attention_bias=false", "run.export_dir=out"}))) ==
        "deck.toml: run.export_dir is set, but a qwen2_moe model always has q/k/v biases; this one has "
        "model.attention_bias = false (set it true)");
  CHECK(parse(kValid, with({"model.attention_bias=false"})).ok());  // nothing to express without an export
  CHECK(parse(kValid, with({"device.backend=cuda"})).ok());  // the GPU trains experts
  CHECK(only_error(parse(kValid, with({"model.num_experts_per_tok=5"}))) ==
        "deck.toml: model.num_experts_per_tok = 5 must be between 1 and model.num_experts = 4");
}

TEST_CASE("sizes past their bounds are refused by key with the accepted range, never wrapped") {
  // micro_batch x world must not wrap to 0 and divide by it (SIGFPE).
  CHECK(only_error(parse(kValid, {"data.micro_batch=4611686018427387904"}, 4)) ==
        "--set data.micro_batch=4611686018427387904: data.micro_batch = 4611686018427387904 is out of range: it must "
        "be between 1 and 2147483647");
  CHECK(only_error(parse(kValid, {"model.hidden_size=4611686018427387904"})) ==
        "--set model.hidden_size=4611686018427387904: model.hidden_size = 4611686018427387904 is out of range: it "
        "must be between 1 and 1048576");
  CHECK(only_error(parse(kValid, {"data.seq_len=4611686018427387904"})) ==
        "--set data.seq_len=4611686018427387904: data.seq_len = 4611686018427387904 is out of range: it must be "
        "between 2 and 16777216");
  CHECK(only_error(parse(kValid, {"model.num_layers=1000000000"})) ==
        "--set model.num_layers=1000000000: model.num_layers = 1000000000 is out of range: it must be between 1 and "
        "16384");
  CHECK(only_error(parse(kValid, {"device.cpu_threads=1099511627776"})).find(
            "device.cpu_threads = 1099511627776 is out of range: it must be between 0 and 4096") != std::string::npos);
  // Each in range, the product not: the parameter count and the tokens per micro-batch.
  const std::string params = only_error(parse(kValid, {"model.vocab_size=16777216", "model.hidden_size=1048576",
                                                       "model.num_heads=128"}));
  CHECK(params.find("deck.toml: model: the model would have ") == 0);
  CHECK(params.find(" parameters (vocab_size 16777216, hidden_size 1048576, intermediate_size 176, num_layers 2, "
                    "num_heads 128 x head_dim 8192): more than the 35184372088832 shardlm accepts") != std::string::npos);
  CHECK(only_error(parse(kValid, {"data.micro_batch=1048576", "data.seq_len=4096", "data.global_batch=1048576",
                                  "model.max_position_embeddings=4096"})) ==
        "deck.toml: data.micro_batch x data.seq_len = 1048576 x 4096 tokens per micro-batch is more than 2147483647 "
        "(positions are int32): lower data.micro_batch and raise data.global_batch's accumulation instead");
  const std::string acts = only_error(parse(kValid, {"data.micro_batch=65536", "data.seq_len=16384", "data.global_batch=65536",
                                                     "model.max_position_embeddings=16384", "model.num_layers=4096",
                                                     "model.hidden_size=16384", "model.intermediate_size=65536"}));
  CHECK(acts.find("deck.toml: model: 1073741824 tokens per micro-batch through 4096 layers of hidden_size 16384") == 0);
  CHECK(acts.find("more than 2^56 activation floats per rank") != std::string::npos);
}

TEST_CASE("floats must be finite and in range: inf, nan and 1e308 name the key and the range") {
  const std::string deck = std::string(kValid) + "[optim]\nlr = inf\n";
  CHECK(only_error(parse(deck)) == "deck.toml:19:1: optim.lr = inf is out of range: it must be a finite number > 0 and "
                                   "<= 1000");
  CHECK(only_error(parse(kValid, {"optim.lr=nan"})) ==
        "--set optim.lr=nan: optim.lr = nan is out of range: it must be a finite number > 0 and <= 1000");
  CHECK(only_error(parse(kValid, {"optim.max_norm=1e308"})) ==
        "--set optim.max_norm=1e308: optim.max_norm = 1e+308 is out of range: it must be a finite number between 0 "
        "and 1000000000000");
  CHECK(only_error(parse(kValid, {"comm.timeout_s=inf"})).find("comm.timeout_s = inf is out of range") !=
        std::string::npos);
  CHECK(only_error(parse(kValid, {"optim.weight_decay=-inf"})).find("optim.weight_decay = -inf is out of range") !=
        std::string::npos);
  CHECK(parse(kValid, {"optim.lr=1000", "optim.max_norm=1e12"}).ok());  // the bounds themselves are accepted
}

TEST_CASE("cross-field checks see what the deck gave, not what was filled in from it") {
  // head_dim is derived from hidden / heads only after the divisibility check.
  CHECK(only_error(parse(kValid, {"model.hidden_size=66"})) ==
        "deck.toml: model.hidden_size = 66 is not a multiple of model.num_heads = 4; set model.head_dim");
  CHECK(parse(kValid, {"model.hidden_size=66", "model.head_dim=16"}).ok());  // Qwen3-style: head_dim given
  CHECK(only_error(parse(kValid, {"model.hidden_size=72", "model.num_heads=8", "model.num_kv_heads=8"})) ==
        "deck.toml: model.hidden_size / model.num_heads = 9 (the head_dim) must be even (RoPE rotates pairs); set "
        "model.head_dim");
  // Optimizer-specific keys are refused from the deck as from --set.
  const std::string sgd = std::string(kValid) + "[optim]\nname = \"sgd\"\nbeta1 = 0.8\n";
  CHECK(only_error(parse(sgd)) == "deck.toml: optim.beta1 has no meaning for optim.name = \"sgd\" (use optim.momentum)");
  const std::string adamw = std::string(kValid) + "[optim]\nns_steps = 3\nmomentum = 0.9\n";
  const DeckResult r = parse(adamw);
  REQUIRE(r.errors.size() == 2);
  CHECK(r.errors[0] == "deck.toml: optim.momentum is SGD's; it has no meaning for optim.name = \"adamw\" (AdamW's is "
                       "optim.beta1)");
  CHECK(r.errors[1] == "deck.toml: optim.ns_steps has no meaning for optim.name = \"adamw\" (it sets Muon; see "
                       "docs/muon.md)");
  CHECK(parse(kValid, {"optim.name=sgd", "optim.momentum=0.9"}).ok());
}

TEST_CASE("a deck without model sizes says which one is missing") {
  CHECK(only_error(parse("[data]\npath = \"x.h5\"\n")).find("model.vocab_size is not set") != std::string::npos);
}

TEST_CASE("--set overrides: TOML values, unquoted strings, new sections, order") {
  DeckResult r = parse(kValid, {"optim.lr=3e-4", "run.dir=runs/a", "run.name=\"quoted\"", "sched.name=cosine",
                                "run.seed=7", "run.seed=8", "run.deterministic=true", "log.interval=5"});
  REQUIRE(r.ok());
  CHECK(r.config.optim.lr == doctest::Approx(3e-4));
  CHECK(r.config.run.dir == "runs/a");
  CHECK(r.config.run.name == "quoted");
  CHECK(r.config.sched.name == "cosine");
  CHECK(r.config.run.seed == 8);  // the last override wins
  CHECK(r.config.run.deterministic);
  CHECK(r.config.log.interval == 5);
  CHECK(parse(kValid, {"run.name=123"}).config.run.name == "123");  // string key: the text as given
  CHECK(only_error(parse(kValid, {"optim.lr"})) == "--set optim.lr: expected section.key=value (e.g. --set optim.lr=3e-4)");
  CHECK(only_error(parse(kValid, {"lr=3"})) == "--set lr=3: 'lr' is not of the form section.key");
}

TEST_CASE("TOML syntax errors carry file, line and column") {
  const std::string e = only_error(parse("[run]\nname = \"unterminated\n"));
  CHECK(e.rfind("deck.toml:2:", 0) == 0);
}

TEST_CASE("a missing deck file is named") {
  DeckResult r = parse_deck("/nonexistent/deck.toml", {}, 1);
  REQUIRE(r.errors.size() == 1);
  CHECK(r.errors[0] == "/nonexistent/deck.toml: cannot open the deck (does the file exist and is it readable?)");
}

TEST_CASE("errors come in deck order and all of them at once") {
  DeckResult r = parse("[run]\nmax_steps = -1\n[optim]\nlr = \"x\"\nbogus = 1\n");
  REQUIRE(r.errors.size() == 3);
  CHECK(r.errors[0].rfind("deck.toml:2:", 0) == 0);
  CHECK(r.errors[1].rfind("deck.toml:4:", 0) == 0);
  CHECK(r.errors[2].rfind("deck.toml:5:", 0) == 0);
}

TEST_CASE("the resolved deck parses back to the same config") {
  DeckResult r = parse(kValid, {"optim.lr=1.25e-3", "run.seed=99", "sched.name=linear"});
  REQUIRE(r.ok());
  const std::string echo = resolved_deck(r.config);
  DeckResult back = parse_deck_text(echo, "config.toml", {}, 1);
  for (const auto& e : back.errors) MESSAGE(e);
  REQUIRE(back.ok());
  CHECK(back.config.optim.lr == r.config.optim.lr);
  CHECK(back.config.run.seed == 99);
  CHECK(back.config.sched.name == "linear");
  CHECK(back.config.model.arch.head_dim == 16);
  const std::string again = resolved_deck(back.config);
  CHECK(again.substr(again.find('\n')) == echo.substr(echo.find('\n')));  // all but the header line
}


TEST_CASE("data.path lists several files, data.weights one per file, data.shuffle; each checked") {
  const DeckResult two = parse(kValid, {"data.path=[\"a.h5\", \"b.h5\"]", "data.weights=[3, 1.5]", "data.shuffle=false"});
  REQUIRE(two.ok());
  CHECK(two.config.data.path == std::vector<std::string>{"a.h5", "b.h5"});
  CHECK(two.config.data.weights == std::vector<double>{3.0, 1.5});
  CHECK_FALSE(two.config.data.shuffle);
  CHECK(parse(kValid).config.data.shuffle);  // default
  CHECK(parse(kValid, {"data.path=other.h5"}).config.data.path == std::vector<std::string>{"other.h5"});
  // the echo writes a list back as a list, and it parses to the same
  const std::string echo = resolved_deck(two.config);
  CHECK(echo.find("path = ['a.h5', 'b.h5']") != std::string::npos);
  CHECK(echo.find("weights = [3.0, 1.5]") != std::string::npos);
  CHECK(echo.find("shuffle = false") != std::string::npos);
  const DeckResult back = parse_deck_text(echo, "config.toml", {}, 1);
  REQUIRE(back.ok());
  CHECK(back.config.data.path == two.config.data.path);
  CHECK(back.config.data.weights == two.config.data.weights);

  CHECK(only_error(parse(kValid, {"data.path=[\"a.h5\", \"b.h5\"]", "data.weights=[1.0]"})) ==
        "deck.toml: data.weights has 1 entry but data.path lists 2 files: give one weight per file");
  CHECK(only_error(parse(kValid, {"data.weights=[0.5, 0.5]"})) ==
        "deck.toml: data.weights has 2 entries but data.path lists 1 file: give one weight per file");
  CHECK(only_error(parse(kValid, {"data.path=[\"a.h5\", \"b.h5\"]", "data.weights=[0, 0]"})) ==
        "deck.toml: data.weights are all 0: at least one file needs a positive weight");
  CHECK(only_error(parse(kValid, {"data.path=[\"a.h5\", \"b.h5\"]", "data.weights=[1, -2]"})) ==
        "--set data.weights=[1, -2]: data.weights = an array: entry 1 is out of range: it must be a finite number between 0 "
        "and 1000000");
  CHECK(only_error(parse(kValid, {"data.weights=0.5"})) ==
        "--set data.weights=0.5: data.weights = 0.5 has the wrong type: expected an array of numbers");
  CHECK(only_error(parse(kValid, {"data.path=[\"a.h5\", 3]"})) ==
        "--set data.path=[\"a.h5\", 3]: data.path = an array: entry 1 is not a non-empty string");
  CHECK(only_error(parse(kValid, {"data.shuffle=\"no\""})) ==
        "--set data.shuffle=\"no\": data.shuffle = \"no\" has the wrong type: expected a boolean (true or false)");
  const std::string deck_list = std::string(kValid) + "[eval]\npath = \"inputs/data/tiny.h5\"\n";
  CHECK(parse(deck_list).ok());
}

TEST_CASE("[eval]: path, interval, rows, at_end; keys without a path and a path never used are refused") {
  const DeckResult r = parse(kValid, {"eval.path=held.h5", "eval.interval=5", "eval.rows=16"});
  REQUIRE(r.ok());
  CHECK(r.config.eval.path == "held.h5");
  CHECK(r.config.eval.interval == 5);
  CHECK(r.config.eval.rows == 16);
  CHECK(r.config.eval.at_end);  // default
  CHECK(parse(kValid).config.eval.path.empty());
  CHECK(only_error(parse(kValid, {"eval.interval=5"})) ==
        "deck.toml: eval.interval is set but eval.path is not: give the token file to evaluate on (docs/data.md), or "
        "eval.prompts, a prompt file whose accuracy an RL job's inference ranks measure (docs/rl.md)");
  CHECK(only_error(parse(kValid, {"eval.rows=4"})) ==
        "deck.toml: eval.rows is set but eval.path is not: give the token file to evaluate on (docs/data.md)");
  CHECK(only_error(parse(kValid, {"eval.path=held.h5", "eval.at_end=false"})) ==
        "deck.toml: eval.path is set but the loss is never evaluated: set eval.interval > 0 or eval.at_end = true");
  CHECK(only_error(parse(kValid, {"eval.interval=-1", "eval.path=held.h5"})) ==
        "--set eval.interval=-1: eval.interval = -1 is out of range: it must be >= 0");
  CHECK(only_error(parse(kValid, {"eval.path=held.h5", "eval.rowz=3"})) ==
        "--set eval.rowz=3: unknown key 'eval.rowz' (did you mean 'eval.rows'?)");
}

TEST_CASE("every key the project relies on exists") {
  const auto keys = known_keys();
  for (const char* k : {"run.dir", "run.name", "run.seed", "run.max_steps", "run.deterministic", "optim.name",
                        "optim.lr", "model.optim_cpu_offload", "ckpt.interval", "ckpt.resume", "log.interval"})
    CHECK_MESSAGE(std::find(keys.begin(), keys.end(), k) != keys.end(), k);
}

}  // TEST_SUITE

namespace {

// An RL deck: rollout files instead of token files.
const char* kRl = R"(
[run]
name = "rl"
dir = "runs/rl"
max_steps = 10
[model]
vocab_size = 16
hidden_size = 32
intermediate_size = 64
num_layers = 2
num_heads = 2
[data]
rollout_dir = "runs/rl/rollouts"
seq_len = 16
micro_batch = 4
[loss]
type = "rl"
)";

}  // namespace

TEST_SUITE("config") {

TEST_CASE("RL loss keys: the objectives, their clip defaults, aggregation, importance sampling, entropy, advantages") {
  // Not given, the clip's bounds follow the objective: GSPO's paper values, CISPO without a lower bound.
  const DeckResult gspo = parse(kRl, {"loss.objective=gspo"});
  REQUIRE(gspo.ok());
  CHECK(gspo.config.loss.clip_low == 3e-4);
  CHECK(gspo.config.loss.clip_high == 4e-4);
  const DeckResult cispo = parse(kRl, {"loss.objective=cispo"});
  REQUIRE(cispo.ok());
  CHECK(cispo.config.loss.clip_low == 1.0);
  CHECK(cispo.config.loss.clip_high == 0.28);
  const DeckResult clipped = parse(kRl, {"loss.objective=clipped"});
  CHECK(clipped.config.loss.clip_low == 0.2);
  CHECK(clipped.config.loss.clip_high == 0.28);
  const DeckResult given = parse(kRl, {"loss.objective=gspo", "loss.clip_low=0.01", "loss.clip_high=0.02"});
  REQUIRE(given.ok());
  CHECK(given.config.loss.clip_low == 0.01);
  CHECK(given.config.loss.clip_high == 0.02);

  // normalize = "constant": by default the most tokens a step's rollouts can hold (64 x 8 x 4).
  const DeckResult constant = parse(kRl, {"loss.normalize=constant"});
  REQUIRE(constant.ok());
  CHECK(constant.config.loss.normalize_constant == 64.0 * 8 * 4);
  const DeckResult budget = parse(kRl, {"loss.normalize=constant", "rollout.max_new_tokens=100", "rollout.n=8"});
  CHECK(budget.config.loss.normalize_constant == 100.0 * 8 * 8);
  CHECK(parse(kRl, {"loss.normalize=constant", "loss.normalize_constant=512"}).config.loss.normalize_constant == 512.0);

  const DeckResult is = parse(kRl, {"loss.is_level=sequence", "loss.is_cap=3", "loss.is_mask=8", "loss.entropy_coef=0.01",
                                    "rollout.advantage=rloo"});
  for (const auto& e : is.errors) MESSAGE(e);
  REQUIRE(is.ok());
  const RlLossParams p = rl_loss_params(is.config.loss);
  CHECK(p.is_level == IsLevel::Sequence);
  CHECK(p.is_cap == 3.0);
  CHECK(p.is_mask == 8.0);
  CHECK(p.entropy_coef == 0.01);
  CHECK(p.needs_sequence_terms());
  CHECK(is.config.rollout.advantage == "rloo");
  CHECK(parse(kRl, {"rollout.advantage=batch_std"}).ok());
  CHECK(rl_loss_params(gspo.config.loss).objective == RlObjective::Gspo);
  CHECK(rl_loss_params(gspo.config.loss).needs_sequence_terms());          // GSPO's ratio needs its sample
  CHECK(!rl_loss_params(parse(kRl, {"loss.objective=gspo", "loss.is_level=token"}).config.loss).needs_sequence_terms());
  CHECK(rl_loss_params(cispo.config.loss).objective == RlObjective::Cispo);
  CHECK(!rl_loss_params(cispo.config.loss).needs_sequence_terms());
  // The forward-only pass's host buffers in the memory plan: 4 x 16 tokens x (float + 2 doubles); none without it.
  CHECK(sequence_pass_bytes(engine_options_for(gspo.config)) == 64 * 20);
  CHECK(sequence_pass_bytes(engine_options_for(cispo.config)) == 0);

  // The echo writes the resolved values and reads back as the same deck.
  const std::string echo = resolved_deck(gspo.config);
  CHECK(echo.find("clip_low = 0.0003\n") != std::string::npos);
  CHECK(echo.find("# mask_high = ") != std::string::npos);  // the masked objective's, shown as a comment
  const DeckResult back = parse_deck_text(echo, "config.toml", {}, 1);
  for (const auto& e : back.errors) MESSAGE(e);
  CHECK(back.ok());
  CHECK(back.config.loss.clip_high == 4e-4);
}

TEST_CASE("model.expert_parallel: 1 by default; the training ranks, for a model of experts they divide, on either "
          "backend; every other case refused naming the knob") {
  const std::vector<std::string> moe = {"model.arch=qwen3_moe", "model.qk_norm=true", "model.num_experts=4",
                                        "model.num_experts_per_tok=2", "model.moe_intermediate_size=8"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), moe.begin(), moe.end());
    return extra;
  };
  CHECK(parse(kValid, with({})).config.model.expert_parallel == 1);
  const DeckResult ok = parse(kValid, with({"model.expert_parallel=2"}), 2);
  for (const auto& e : ok.errors) MESSAGE(e);
  REQUIRE(ok.ok());
  CHECK(ok.config.model.expert_parallel == 2);
  CHECK(resolved_deck(ok.config).find("expert_parallel = 2") != std::string::npos);  // `shardlm check` shows it
  CHECK(parse(kValid, with({"model.expert_parallel=4"}), 4).ok());

  CHECK(only_error(parse(kValid, {"model.expert_parallel=2"}, 2)) ==
        "deck.toml: model.expert_parallel = 2 splits the experts of a model of experts, but arch llama has none "
        "(num_experts = 0): set model.expert_parallel = 1");
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=3", "data.global_batch=12"}), 3)) ==
        "deck.toml: model.expert_parallel = 3 does not divide num_experts = 4: each rank holds num_experts / "
        "model.expert_parallel whole experts");
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=2"}), 4)) ==
        "deck.toml: model.expert_parallel = 2 with 4 training ranks: it must equal the number of training ranks (each "
        "rank holds num_experts / 2 whole experts; experts are not replicated over groups of ranks): run 2 ranks or "
        "set model.expert_parallel = 4");
  CHECK(parse(kValid, with({"model.expert_parallel=2", "device.backend=cuda"}), 2).ok());  // NCCL or staged MPI
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=2", "model.context_parallel=2"}), 2)) ==
        "deck.toml: model.expert_parallel = 2 with model.context_parallel = 2: the two do not combine yet (the "
        "experts' rows would be exchanged over a group that shares sequences); set one of them to 1");
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=2", "optim.name=muon"}), 2)) ==
        "deck.toml: model.expert_parallel = 2 with optim.name = \"muon\": Muon's owner exchange is not built over "
        "the experts' units; use adamw or sgd, or set model.expert_parallel = 1");
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=2", "model.hidden_size=40",
                                       "model.moe_intermediate_size=1"}), 2)) ==
        "deck.toml: model.expert_parallel = 2: a rank's share of a layer's experts (2 x 3 x 1 x 40 = 240 floats) "
        "must be a multiple of 64 floats, a shard's alignment; set model.expert_parallel = 1");
  // A run that broadcasts weights: the inference ranks lay the model out whole.
  std::vector<std::string> rl = with({"model.expert_parallel=2", "broadcast.backend=filesystem",
                                      "broadcast.dir=runs/rl/weights"});
  const DeckResult broadcast = parse(kRl, rl, 2);
  bool named = false;
  for (const auto& e : broadcast.errors)
    named |= e == "deck.toml: model.expert_parallel = 2 with broadcast.backend = \"filesystem\": the inference "
                  "ranks receive the model laid out whole; set model.expert_parallel = 1 for a run that broadcasts "
                  "weights";
  CHECK(named);
  CHECK(only_error(parse(kValid, with({"model.expert_parallel=0"}))).find("model.expert_parallel = 0 is out of "
                                                                           "range") != std::string::npos);
}

TEST_CASE("loss.router_replay: on with a model of experts (CPU); refused for a dense model, on the CUDA backend and "
          "outside RL") {
  const std::vector<std::string> experts = {"model.arch=qwen3_moe", "model.qk_norm=true", "model.num_experts=4",
                                            "model.num_experts_per_tok=2", "model.moe_intermediate_size=16"};
  CHECK(!parse(kRl, experts).config.loss.router_replay);  // off by default
  std::vector<std::string> on = experts;
  on.push_back("loss.router_replay=true");
  const DeckResult ok = parse(kRl, on);
  for (const auto& e : ok.errors) MESSAGE(e);
  REQUIRE(ok.ok());
  CHECK(ok.config.loss.router_replay);
  CHECK(ok.config.model.arch.route_width() == 2 * 2);  // 2 layers of experts x 2 a token

  const std::string dense = only_error(parse(kRl, {"loss.router_replay=true"}));
  CHECK(dense.find("loss.router_replay = true replays the experts a sampler's router chose, but arch llama has no "
                   "experts (num_experts = 0): set loss.router_replay = false") != std::string::npos);
  std::vector<std::string> cuda = on;
  cuda.push_back("device.backend=cuda");
  CHECK(parse(kRl, cuda).ok());  // the GPU's decoder records the routes, its trainer replays them
  const std::string sft = only_error(parse(kValid, on));
  CHECK(sft.find("loss.router_replay") != std::string::npos);
  CHECK(sft.find("it needs loss.type = \"rl\"") != std::string::npos);
}

TEST_CASE("RL loss keys: unknown values list the accepted ones, bad numbers and keys without meaning are refused") {
  CHECK(only_error(parse(kRl, {"loss.objective=ppo"})) ==
        "--set loss.objective=ppo: loss.objective = \"ppo\" is not accepted: it must be one of \"masked\", \"clipped\", "
        "\"gspo\", \"cispo\"");
  CHECK(only_error(parse(kRl, {"loss.normalize=mean"})) ==
        "--set loss.normalize=mean: loss.normalize = \"mean\" is not accepted: it must be one of \"token\", "
        "\"sequence\", \"constant\"");
  CHECK(only_error(parse(kRl, {"loss.is_level=sample"})) ==
        "--set loss.is_level=sample: loss.is_level = \"sample\" is not accepted: it must be one of \"none\", \"token\", "
        "\"sequence\"");
  CHECK(only_error(parse(kRl, {"rollout.advantage=median"})) ==
        "--set rollout.advantage=median: rollout.advantage = \"median\" is not accepted: it must be one of "
        "\"mean_std\", \"mean\", \"rloo\", \"batch_std\"");
  CHECK(only_error(parse(kRl, {"loss.is_level=token", "loss.is_cap=0.5"})) ==
        "--set loss.is_cap=0.5: loss.is_cap = 0.5 is out of range: it must be a finite number between 1 and 1000000");
  CHECK(only_error(parse(kRl, {"loss.normalize=constant", "loss.normalize_constant=0"})) ==
        "--set loss.normalize_constant=0: loss.normalize_constant = 0 is out of range: it must be a finite number > 0 "
        "and <= 1e+15");
  CHECK(only_error(parse(kRl, {"loss.entropy_coef=-1"})) ==
        "--set loss.entropy_coef=-1: loss.entropy_coef = -1 is out of range: it must be a finite number between 0 "
        "and 1000000");
  CHECK(only_error(parse(kRl, {"loss.is_level=token", "loss.is_mask=0.5"})) ==
        "deck.toml: loss.is_mask = 0.5: tokens (samples) whose importance ratio is outside [1 / is_mask, is_mask] "
        "carry no loss, so it must be > 1 (e.g. 2 or 8), or 0 to keep them all");
  CHECK(only_error(parse(kRl, {"loss.normalize_constant=100"})) ==
        "deck.toml: loss.normalize_constant is the divisor of loss.normalize = \"constant\"; loss.normalize is \"token\" "
        "here");
  CHECK(only_error(parse(kRl, {"loss.is_cap=3"})) ==
        "deck.toml: loss.is_cap bounds the importance weight of loss.is_level = \"token\" or \"sequence\"; "
        "loss.is_level is \"none\" here");
  CHECK(only_error(parse(kRl, {"loss.objective=cispo", "loss.mask_low=0.1"})) ==
        "deck.toml: loss.mask_low is loss.objective = \"masked\"'s; with \"cispo\" the ratio is bounded by "
        "loss.clip_low / loss.clip_high");
  CHECK(only_error(parse(kRl, {"loss.clip_high=0.3"})) ==
        "deck.toml: loss.clip_high bounds the ratio of loss.objective = \"clipped\", \"gspo\" or \"cispo\"; "
        "loss.objective is \"masked\" here");
  // The RL loss's keys in an SFT deck.
  CHECK(only_error(parse(kValid, {"loss.entropy_coef=0.01"})) ==
        "deck.toml: loss.entropy_coef sets the RL policy loss; it needs loss.type = \"rl\"");
  CHECK(only_error(parse(kValid, {"loss.is_level=token"})) ==
        "deck.toml: loss.is_level sets the RL policy loss; it needs loss.type = \"rl\"");
}

TEST_CASE("[eval] on prompts (RL): the keys, their defaults from [rollout], the echo, and the decks that refuse them") {
  const DeckResult r = parse(kRl, {"rollout.prompts=\"p.h5\"", "rollout.max_new_tokens=6", "rollout.batch=12",
                                   "eval.prompts=\"held.h5\"", "eval.interval=4", "eval.samples=8"});
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  const EvalSection& e = r.config.eval;
  CHECK(e.prompts == "held.h5");
  CHECK(e.interval == 4);  // without eval.path: the prompts' alone
  CHECK(e.samples == 8);
  CHECK(e.max_new_tokens == 6);  // rollout.max_new_tokens
  CHECK(e.batch == 12);          // rollout.batch
  CHECK(e.correct_above == 0.0);
  CHECK(e.at_end);
  CHECK(e.path.empty());
  const DeckResult back = parse_deck_text(resolved_deck(r.config), "config.toml", {}, 1);  // the echo is concrete
  for (const auto& m : back.errors) MESSAGE(m);
  REQUIRE(back.ok());
  CHECK(back.config.eval.prompts == "held.h5");
  CHECK(back.config.eval.max_new_tokens == 6);
  CHECK(back.config.eval.batch == 12);
  CHECK(back.config.eval.samples == 8);
  const DeckResult given = parse(kRl, {"rollout.prompts=\"p.h5\"", "eval.prompts=\"held.h5\"",
                                       "eval.max_new_tokens=3", "eval.batch=5", "eval.correct_above=0.5"});
  REQUIRE(given.ok());
  CHECK(given.config.eval.max_new_tokens == 3);
  CHECK(given.config.eval.batch == 5);
  CHECK(given.config.eval.correct_above == 0.5);
  CHECK(given.config.eval.samples == 0);  // greedy only
  // Without eval.prompts its keys stay 0 and are left out of the echo (a comment says why).
  const DeckResult none = parse(kRl, {"rollout.prompts=\"p.h5\""});
  REQUIRE(none.ok());
  CHECK(none.config.eval.max_new_tokens == 0);
  CHECK(resolved_deck(none.config).find("# max_new_tokens = 0  # eval.max_new_tokens sets the accuracy evaluation on "
                                        "eval.prompts, which is not set") != std::string::npos);

  const std::string needs_rl = " eval.prompts is scored by an RL job's inference ranks (`shardlm generate DECK` beside "
                               "the trainers): it needs loss.type = \"rl\" and rollout.prompts (to score an exported "
                               "model, run `shardlm generate` and tools/score_generate.py)";
  CHECK(only_error(parse(kRl, {"eval.prompts=\"held.h5\""})) == "deck.toml:" + needs_rl);    // no inference ranks
  CHECK(only_error(parse(kValid, {"eval.prompts=\"held.h5\""})) == "deck.toml:" + needs_rl);  // an SFT deck
  for (const char* key : {"eval.samples=4", "eval.max_new_tokens=4", "eval.batch=4", "eval.correct_above=0.5"}) {
    const std::string name = std::string(key).substr(0, std::string(key).find('='));
    CHECK(only_error(parse(kRl, {"rollout.prompts=\"p.h5\"", key})) ==
          "deck.toml: " + name + " sets the accuracy evaluation on eval.prompts, which is not set");
  }
  const std::vector<std::string> rl_eval = {"rollout.prompts=\"p.h5\"", "eval.prompts=\"held.h5\""};
  auto with = [&](const char* extra) {
    std::vector<std::string> sets = rl_eval;
    sets.push_back(extra);
    return parse(kRl, sets);
  };
  CHECK(only_error(with("eval.samples=-1")) ==
        "--set eval.samples=-1: eval.samples = -1 is out of range: it must be between 0 and 65536");
  CHECK(only_error(with("eval.max_new_tokens=0")).find("eval.max_new_tokens = 0 is out of range: it must be between 1 "
                                                        "and ") != std::string::npos);
  CHECK(only_error(with("eval.batch=0")) ==
        "--set eval.batch=0: eval.batch = 0 is out of range: it must be between 1 and 65536");
  CHECK(only_error(with("eval.correct_above=\"x\"")) ==
        "--set eval.correct_above=\"x\": eval.correct_above = \"x\" has the wrong type: expected a number");
  CHECK(only_error(with("eval.rows=4")) ==
        "deck.toml: eval.rows is set but eval.path is not: give the token file to evaluate on (docs/data.md)");
  CHECK(with("eval.at_end=false").ok());  // the starting weights are evaluated all the same
  CHECK(with("eval.path=\"held-tokens.h5\"").ok());  // the trainers' loss and the inference ranks' accuracy
  CHECK(only_error(parse(kRl, {"rollout.prompts=\"p.h5\"", "eval.sample=2"})) ==
        "--set eval.sample=2: unknown key 'eval.sample' (did you mean 'eval.samples'?)");
}

TEST_CASE("DAPO's data rules: dynamic sampling, truncated completions and the overlong window") {
  const DeckResult r = parse(kRl);
  REQUIRE(r.ok());
  const shardlm::Config& d = r.config;
  CHECK_FALSE(d.rollout.dynamic_sampling);
  CHECK(d.rollout.dynamic_max_rounds == 8);
  CHECK(d.rollout.truncated == "train");
  CHECK(d.rollout.overlong_window == 0);
  CHECK(parse(kRl, {"rollout.dynamic_sampling=true", "rollout.dynamic_max_rounds=3", "rollout.truncated=\"penalty\"",
                    "rollout.overlong_window=2"}).ok());
  CHECK(only_error(parse(kRl, {"rollout.truncated=\"drop\""})) ==
        "--set rollout.truncated=\"drop\": rollout.truncated = \"drop\" is not accepted: it must be one of \"train\", "
        "\"mask\", \"penalty\"");
  CHECK(only_error(parse(kRl, {"rollout.dynamic_max_rounds=0"})) ==
        "--set rollout.dynamic_max_rounds=0: rollout.dynamic_max_rounds = 0 is out of range: it must be between 1 and "
        "1000");
  CHECK(only_error(parse(kRl, {"rollout.overlong_window=2"})) ==
        "deck.toml: rollout.overlong_window = 2 is set but rollout.truncated = \"train\": the window belongs to "
        "truncated = \"penalty\"");
  CHECK(only_error(parse(kRl, {"rollout.truncated=\"penalty\"", "rollout.overlong_window=1000"})).find(
            "rollout.overlong_window = 1000 is longer than rollout.max_new_tokens") != std::string::npos);
  const DeckResult one = parse(kRl, {"rollout.dynamic_sampling=true", "rollout.n=1"});
  REQUIRE(one.errors.size() == 2);  // beside rollout.n = 1's own: nothing trains
  CHECK(one.errors[1].find("rollout.dynamic_sampling = true with rollout.n = 1: a group of one sample always has "
                           "equal rewards") != std::string::npos);
}


}  // TEST_SUITE
