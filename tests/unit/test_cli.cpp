// test_cli.cpp — the shardlm binary as users run it: exit codes and messages,
// singleton and mpirun launches, and abort-not-hang when one rank fails.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "config/cli.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/error.hpp"
#include "base/run_dir.hpp"
#include "shardlm/h5util.hpp"
#include "run_command.hpp"

using namespace shardlm;
using shardlm_test::run;
using shardlm_test::shardlm_bin;
using shardlm_test::mpirun;
using shardlm_test::host_name;

namespace {
// A row of the memory plan `check` prints ("  total              GPU   27155.349 MiB"):
// its MiB, `row` being the row's label as printed (kGpuTotal).
double plan_mib(const std::string& out, const std::string& row) {
  const size_t at = out.find(row);
  REQUIRE(at != std::string::npos);
  return std::stod(out.substr(at + row.size()));
}
const std::string kGpuTotal = "total              GPU", kHostTotal = "total              host";

// Whether `check` on the CUDA backend printed its memory plan: not in a CPU-only
// build, which the test then says and skips.
bool has_cuda_plan(const shardlm_test::CommandResult& r) {
  if (r.output.find("built without CUDA") == std::string::npos) return true;
  MESSAGE("CPU-only build: the CUDA memory plan is not available; nothing to check");
  return false;
}
}  // namespace

TEST_SUITE("cli") {

TEST_CASE("argument parsing: commands, --set forms, --world, errors") {
  const char* a1[] = {"shardlm", "check", "d.toml", "--set", "optim.lr=1", "--set=run.seed=3", "--world", "4"};
  CliArgs c = parse_cli(8, a1);
  CHECK(c.command == "check");
  CHECK(c.deck == "d.toml");
  REQUIRE(c.overrides.size() == 2);
  CHECK(c.overrides[1] == "run.seed=3");
  CHECK(c.world == 4);
  const char* a2[] = {"shardlm", "trian", "d.toml"};
  CHECK_THROWS_WITH_AS(parse_cli(3, a2), doctest::Contains("unknown command 'trian'"), Error);
  const char* a3[] = {"shardlm", "check", "d.toml", "--world", "zero"};
  CHECK_THROWS_WITH_AS(parse_cli(5, a3), doctest::Contains("--world expects a positive integer, got 'zero'"), Error);
  const char* a4[] = {"shardlm", "train"};
  CHECK_THROWS_WITH_AS(parse_cli(2, a4), doctest::Contains("'train' needs a deck"), Error);
  const char* a5[] = {"shardlm", "train", "d.toml", "--world", "2"};
  CHECK_THROWS_WITH_AS(parse_cli(5, a5), doctest::Contains("unknown option '--world' for 'train'"), Error);
}

TEST_CASE("--version and --help") {
  auto v = run(shardlm_bin() + " --version");
  CHECK(v.status == 0);
  CHECK(v.output.rfind("shardlm ", 0) == 0);
  auto h = run(shardlm_bin() + " --help");
  CHECK(h.status == 0);
  CHECK(h.output.find("usage: shardlm train DECK") != std::string::npos);
  auto bad = run(shardlm_bin() + " frobnicate");
  CHECK(bad.status == 2);
  CHECK(bad.output.find("unknown command 'frobnicate'") != std::string::npos);
}

TEST_CASE("check refuses fsdp_cpu_offload with a message naming optim_cpu_offload") {
  auto r = run(shardlm_bin() + " check inputs/tiny-sft.toml --set model.fsdp_cpu_offload=true");
  CHECK(r.status == 1);
  CHECK(r.output.find("model.fsdp_cpu_offload was removed") != std::string::npos);
  CHECK(r.output.find("model.optim_cpu_offload") != std::string::npos);
}

TEST_CASE("check reports an unknown key in a deck file with file, line and column") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-cli-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const auto deck = dir / "bad.toml";
  std::FILE* f = std::fopen(deck.c_str(), "w");
  REQUIRE(f);
  std::fputs("[run]\nname = \"x\"\n\n[optim]\nlr = 1e-3\n  lr_schedul = \"cosine\"\n", f);
  std::fclose(f);
  auto r = run(shardlm_bin() + " check " + deck.string());
  CHECK(r.status == 1);
  CHECK(r.output.find(deck.string() + ":6:3: unknown key 'optim.lr_schedul' (did you mean 'optim.lr'?)") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("check prints the resolved deck and exits 0; --world drives the batch check") {
  auto ok = run(shardlm_bin() + " check inputs/tiny-sft.toml --world 4");
  CHECK(ok.status == 0);
  CHECK(ok.output.find("valid for 4 training ranks") != std::string::npos);
  CHECK(ok.output.find("[optim]") != std::string::npos);
  auto bad = run(shardlm_bin() + " check inputs/tiny-sft.toml --world 3");
  CHECK(bad.status == 1);
  CHECK(bad.output.find("data.global_batch = 8 must be a multiple of data.micro_batch x training ranks = 2 x 3 = 6") !=
        std::string::npos);
}

TEST_CASE("check with optim_cpu_offload on the CUDA backend prints the GPU bytes saved and the host bytes used") {
  auto off = run(shardlm_bin() + " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                                 "--set device.backend=cuda");
  if (!has_cuda_plan(off)) return;
  // Every unit offloaded (on a GPU machine the automatic split would keep some on it).
  auto on = run(shardlm_bin() + " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                                 "--set device.backend=cuda "
                                "--set model.optim_cpu_offload=true --set model.optim_gpu_state_gib=0");
  REQUIRE(off.status == 0);
  REQUIRE(on.status == 0);
  const double saved_gpu = plan_mib(off.output, kGpuTotal) - plan_mib(on.output, kGpuTotal);
  const double more_host = plan_mib(on.output, kHostTotal) - plan_mib(off.output, kHostTotal);
  // 1.236e9 parameters: the fp32 masters and AdamW moments (12 B each) leave the
  // GPU; the fp32 gradient accumulator (4 B) stays, and nothing else is added.
  CHECK(saved_gpu == doctest::Approx(12.0 * 1.2358e9 / 1048576.0).epsilon(1e-3));
  CHECK(more_host > 0);
  const std::string line = on.output.substr(on.output.find("optim_cpu_offload: "));
  CHECK(std::stod(line.substr(19)) == doctest::Approx(saved_gpu).epsilon(1e-6));
  CHECK(line.find("more host memory") != std::string::npos);
  CHECK(off.output.find("optim_cpu_offload: ") == std::string::npos);

  // Gradients on the device: no host gradient shards (4 B per parameter), two
  // pinned fp32 landing buffers of the largest shard (the 128256 x 2048
  // embedding) instead; the GPU plan is the same.
  auto dev = run(shardlm_bin() + " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                                 "--set device.backend=cuda "
                                 "--set model.optim_cpu_offload=true --set model.optim_offload_grads=device "
                                 "--set model.optim_gpu_state_gib=0");
  REQUIRE(dev.status == 0);
  CHECK(plan_mib(dev.output, kGpuTotal) == plan_mib(on.output, kGpuTotal));
  CHECK(plan_mib(on.output, kHostTotal) - plan_mib(dev.output, kHostTotal) ==
        doctest::Approx((4.0 * 1.2358e9 - 8.0 * 128256 * 2048) / 1048576.0).epsilon(1e-3));
  CHECK(dev.output.find("gradient shards    host") == std::string::npos);

  // model.optim_gpu_state_gib = 4: the embedding's state (128256 x 2048 x 12 B =
  // 2.94 GiB) and one decoder layer's (~0.73 GiB) fit, a second layer does not.
  // check prints the split; the GPU plan grows by exactly those units' state.
  auto split = run(shardlm_bin() + " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                                   "--set device.backend=cuda --set model.optim_cpu_offload=true "
                                   "--set model.optim_gpu_state_gib=4");
  REQUIRE(split.status == 0);
  const size_t at = split.output.find("offload split: ");
  REQUIRE(at != std::string::npos);
  const std::string split_line = split.output.substr(at, split.output.find('\n', at) - at);
  CHECK(split_line.find("offload split: optimizer state of 2 of 18 units on the GPU (model.optim_gpu_state_gib = 4): "
                  "units 0..1 (embed..layers.0) on the GPU, ") == 0);
  CHECK(split_line.find("units 2..17 (layers.1..head) offloaded to the CPU optimizer") != std::string::npos);
  const double device_units_mib = std::stod(split_line.substr(split_line.find("on the GPU, ") + 12));
  const double embed = 128256.0 * 2048, layer = (1.2358e9 - embed) / 16;  // parameters (the head is a norm: tied)
  CHECK(device_units_mib == doctest::Approx(12.0 * (embed + layer) / 1048576.0).epsilon(1e-3));
  CHECK(plan_mib(split.output, kGpuTotal) - plan_mib(on.output, kGpuTotal) ==
        doctest::Approx(device_units_mib).epsilon(1e-6));
  CHECK(on.output.find("offload split: optimizer state of 0 of 18 units on the GPU (model.optim_gpu_state_gib = 0): "
                       "none on the GPU, units 0..17 (embed..head) offloaded") != std::string::npos);
}

// `shardlm check` of the 1B shape at 32K tokens, one row a step, selective
// checkpointing, on the CUDA backend's plan: the plan tests below move one key from it.
const std::string kCheck1b32kSelective =
    " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 --set device.backend=cuda "
    "--set data.seq_len=32768 --set data.global_batch=1 --set model.activation_checkpointing=selective";

TEST_CASE("check on the CUDA backend: cuDNN's attention adds only its persistent 64.5 MiB at 32K tokens") {
  // Its backward buffers (dq accumulator, row sums, per-head dk/dv: 537 MiB at the
  // 1B shape and 32768 tokens) live in each layer's gate/up buffer, dead by then.
  const std::string deck = kCheck1b32kSelective;
  auto flash = run(shardlm_bin() + deck + " --set device.attention=flash");
  if (!has_cuda_plan(flash)) return;
  auto cudnn = run(shardlm_bin() + deck + " --set device.attention=auto");
  REQUIRE(flash.status == 0);
  REQUIRE(cudnn.status == 0);
  // persistent_bytes(32768): lengths and three offset arrays, 256-byte aligned, and 64 MiB for the plans
  const double persistent_mib = (131072.0 + 3 * 131328.0 + 64.0 * 1048576) / 1048576.0;
  CHECK(plan_mib(cudnn.output, kGpuTotal) - plan_mib(flash.output, kGpuTotal) ==
        doctest::Approx(persistent_mib).epsilon(1e-3));
}

TEST_CASE("check on the CUDA backend: model.fp8_attention's scratch moves the attention phase out of gate/up") {
  // The 1B shape at 32K: the attention phase (d_att, dq, dk, dv, then the larger of
  // cuDNN's bf16 backward buffers and the FP8 scratch) fits in a layer's gate/up
  // (N x 2I bf16, 1 GiB) with bf16 attention; with the FP8 scratch (e4m3 codes of
  // q, out, dout, dq and of k, v, dk, dv; the FP8 backward's fp32 dq/dk/dv
  // accumulators, row sums and 64 MiB) it does not, so it becomes the shared
  // region (which held dh, N x I bf16); plus the 16 layers' scales (30 floats each).
  const std::string deck = kCheck1b32kSelective;
  auto bf16 = run(shardlm_bin() + deck);
  if (!has_cuda_plan(bf16)) return;
  auto fp8 = run(shardlm_bin() + deck + " --set model.fp8_attention=true");
  REQUIRE(bf16.status == 0);
  REQUIRE(fp8.status == 0);
  const double N = 32768, H = 32, KV = 8, D = 64, I = 8192;
  const double grads = 2 * (2 * N * H * D + 2 * N * KV * D);  // d_att, dq (N, H, D); dk, dv (N, KV, D) bf16
  const double scratch = 4 * N * H * D + 4 * N * KV * D + 3 * N * H * D * 4 + N * H * 4 + 64.0 * 1048576;
  const double scales = 256 * 8;  // 16 x 30 floats, 256-byte aligned
  const double extra = plan_mib(fp8.output, kGpuTotal) - plan_mib(bf16.output, kGpuTotal);
  CHECK(extra == doctest::Approx((grads + scratch - 2 * N * I + scales) / 1048576.0).epsilon(1e-4));
  const size_t at = fp8.output.find("model.fp8_attention: ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(fp8.output.substr(at + 21)) == doctest::Approx(extra).epsilon(1e-6));
  CHECK(bf16.output.find("model.fp8_attention: ") == std::string::npos);
  CHECK(fp8.output.find("on Hopper cuDNN's FP8 attention backward takes head dim 128 only, and this model's is 64: "
                        "there FP8 attention turns off at the first backward") != std::string::npos);
}

TEST_CASE("check on the CUDA backend: model.selective_layers keeps K layers' attention, each N·H·(2·D + 4) bytes") {
  const std::string deck = kCheck1b32kSelective;
  auto all = run(shardlm_bin() + deck);
  if (!has_cuda_plan(all)) return;
  auto half = run(shardlm_bin() + deck + " --set model.selective_layers=8");
  REQUIRE(all.status == 0);
  REQUIRE(half.status == 0);
  // All 16 layers keep theirs (the shared set then holds none: 15 more than full);
  // 8 keep theirs and the shared set holds one for the other 8: 7 layers' worth less.
  const double layer_mib = (2.0 * 32768 * 2048 + 4.0 * 32768 * 32) / 1048576.0;
  CHECK(plan_mib(all.output, kGpuTotal) - plan_mib(half.output, kGpuTotal) ==
        doctest::Approx(7 * layer_mib).epsilon(1e-3));
}

TEST_CASE("check on the CUDA backend: the fp32 residual stream (the default) adds 2 bytes per stream element, as planned") {
  // The stream's (L + 1) layer boundaries and L x_mid activations (no
  // checkpointing), d_x and d_mid in the workspace, and two bf16 (N, C) buffers
  // between the stream and the GEMMs: the o / down outputs and the gradient's copy;
  // and the token ids the engine builds the stream's fp32 first rows from.
  const std::string deck = " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                           "--set device.backend=cuda";
  auto bf16 = run(shardlm_bin() + deck + " --set model.residual_dtype=bf16");
  if (!has_cuda_plan(bf16)) return;
  auto fp32 = run(shardlm_bin() + deck);
  REQUIRE(bf16.status == 0);
  REQUIRE(fp32.status == 0);
  const double L = 16, N = 4096, C = 2048, MiB = 1048576.0;  // llama-1b.toml: one 4096-token row a micro-batch
  const double activations = 2 * N * C * (L + 1 + L) / MiB, workspace = (4 * 2 * N * C + 4 * N) / MiB;
  CHECK(plan_mib(fp32.output, "activations        GPU") - plan_mib(bf16.output, "activations        GPU") ==
        doctest::Approx(activations).epsilon(1e-6));
  CHECK(plan_mib(fp32.output, "workspace          GPU") - plan_mib(bf16.output, "workspace          GPU") ==
        doctest::Approx(workspace).epsilon(1e-5));  // the plan prints MiB to 3 decimals
  // check says what the stream costs, and a bf16 stream's plan says nothing of it.
  const std::string line = "model.residual_dtype = \"fp32\": ";
  const size_t at = fp32.output.find(line);
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(fp32.output.substr(at + line.size())) == doctest::Approx(activations + workspace).epsilon(1e-5));
  CHECK(bf16.output.find(line) == std::string::npos);
}

TEST_CASE("check on the CUDA backend: the fp32 stream's rows at 8 ranks take a bounded buffer, not world x tokens x hidden") {
  // Engine::embed_rows_fp32 at world > 1: each chunk's parts are world x
  // chunk x hidden fp32 within 64 MiB; the ids every rank's tokens (4 bytes each).
  const std::string deck = " check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 "
                           "--set device.backend=cuda --set data.seq_len=32768 --set data.global_batch=8 --world 8";
  auto bf16 = run(shardlm_bin() + deck + " --set model.residual_dtype=bf16");
  if (!has_cuda_plan(bf16)) return;
  auto fp32 = run(shardlm_bin() + deck);
  REQUIRE(bf16.status == 0);
  REQUIRE(fp32.status == 0);
  const double N = 32768, C = 2048, W = 8, MiB = 1048576.0;
  const double rows = (4 * W * (64 * MiB / (4 * W * C)) * C + 4 * W * N) / MiB;  // 64 + 1 MiB (not 2 GiB)
  CHECK(rows == doctest::Approx(65.0));
  CHECK(plan_mib(fp32.output, "workspace          GPU") - plan_mib(bf16.output, "workspace          GPU") ==
        doctest::Approx(4 * 2 * N * C / MiB + rows).epsilon(1e-5));
}

TEST_CASE("train under mpirun -np 2 with a bad deck: one report, clean exit 1") {
  auto r = run(mpirun(2) + shardlm_bin() + " train inputs/tiny-sft.toml --set optim.lr=-1");
  CHECK(r.status == 1);
  CHECK(r.output.find("optim.lr = -1 is out of range") != std::string::npos);
  // printed once, not once per rank
  CHECK(r.output.find("optim.lr = -1") == r.output.rfind("optim.lr = -1"));
}

TEST_CASE("train under mpirun -np 2: banner, progress, config.toml and metrics.jsonl") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-train-" + std::to_string(getpid()));
  auto r = run("OMP_NUM_THREADS=1 " + mpirun(2) + shardlm_bin() + " train inputs/tiny-sft.toml --set run.max_steps=10 " +
                   "--set log.interval=5 --set run.dir=" + dir.string(),
               300);
  CHECK(r.status == 0);
  CHECK(r.output.find("2 ranks: 2 trainers, 0 receivers") != std::string::npos);
  CHECK(r.output.find("step      5/10 | loss ") != std::string::npos);
  CHECK(r.output.find("step     10/10 | loss ") != std::string::npos);
  CHECK(r.output.find("summary: 10 steps") != std::string::npos);
  CHECK(r.output.find("memory: peak ") != std::string::npos);
  // the resolved deck is a valid deck again, with the override applied
  auto again = run(shardlm_bin() + " check " + (dir / "config.toml").string());
  CHECK(again.status == 0);
  CHECK(again.output.find("max_steps = 10") != std::string::npos);
  std::FILE* f = std::fopen((dir / "metrics.jsonl").c_str(), "r");
  REQUIRE(f);
  char line[4096];
  int lines = 0;
  std::string first, last_step, last;
  while (std::fgets(line, sizeof line, f)) {
    ++lines, last = line;
    if (lines == 1) first = line;
    if (last.rfind("{\"step\": ", 0) == 0) last_step = line;
  }
  std::fclose(f);
  CHECK(lines == 4);  // start, steps 5 and 10, end
  CHECK(first.rfind("{\"event\": \"start\", \"step\": 0, \"run_name\": \"tiny-sft\"", 0) == 0);
  CHECK(last.rfind("{\"event\": \"end\", \"step\": 10, \"status\": \"done\", \"exit_code\": 0,", 0) == 0);
  last = last_step;
  for (const char* key : {"\"step\": 10", "\"loss\": ", "\"grad_norm\": ", "\"lr\": ", "\"tokens\": ",
                          "\"tokens_per_s\": ", "\"step_time_s\": ", "\"mem_peak_bytes\": "})
    CHECK_MESSAGE(last.find(key) != std::string::npos, key);
  std::filesystem::remove_all(dir);
}

TEST_CASE("train: the setup line, and ckpt.save_final = false leaves no checkpoint at run.max_steps") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-final-" + std::to_string(getpid()));
  for (const bool save : {true, false}) {
    INFO("ckpt.save_final = " << save);
    std::filesystem::remove_all(dir);
    auto r = run("OMP_NUM_THREADS=1 " + shardlm_bin() + " train inputs/tiny-sft.toml --set run.max_steps=6 " +
                     "--set log.interval=6 --set ckpt.save_final=" + (save ? "true" : "false") + " --set run.dir=" +
                     dir.string(),
                 300);
    CHECK(r.status == 0);
    CHECK(r.output.find("setup ") != std::string::npos);
    CHECK(r.output.find("s: model, data, optimizer, engine") != std::string::npos);
    CHECK(std::filesystem::exists(dir / "checkpoints" / "step_6.h5") == save);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("train with [eval] and two mixed files: eval loss in the progress line, metrics.jsonl and the summary") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-eval-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  auto r = run("OMP_NUM_THREADS=1 " + shardlm_bin() + " train inputs/tiny-sft.toml --set run.max_steps=6 " +
                   "--set log.interval=4 --set ckpt.save_final=false --set eval.path=inputs/data/tiny.h5 " +
                   "--set eval.interval=3 --set eval.rows=8 " +
                   "--set 'data.path=[\"inputs/data/tiny.h5\", \"inputs/data/tiny.h5\"]' --set 'data.weights=[1, 2]' " +
                   "--set run.dir=" + dir.string(),
               300);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("data inputs/data/tiny.h5 and 1 more files: 60 documents, 11546 tokens, tokens contiguous") !=
        std::string::npos);
  CHECK(r.output.find("eval inputs/data/tiny.h5: 8 rows of 64, every 3 steps and at the end") != std::string::npos);
  CHECK(r.output.find("step      3/6 | loss ") != std::string::npos);  // not a log step: shown for its eval
  CHECK(r.output.find(" | eval loss ") != std::string::npos);
  CHECK(r.output.find("eval: loss ") != std::string::npos);
  CHECK(r.output.find("(2 evaluations of inputs/data/tiny.h5)") != std::string::npos);
  CHECK(r.output.find("data reader") == std::string::npos);  // the plan's rows are printed by check
  std::ifstream jsonl(dir / "metrics.jsonl");
  std::string line;
  int with_eval = 0;
  while (std::getline(jsonl, line)) with_eval += line.find("\"eval_loss\": ") != std::string::npos;
  CHECK(with_eval == 2);  // steps 3 and 6
  auto check = run(shardlm_bin() + " check inputs/tiny-sft.toml --set eval.path=inputs/data/tiny.h5");
  CHECK(check.status == 0);
  CHECK(check.output.find("data reader        host ") != std::string::npos);
  auto missing = run(shardlm_bin() + " check inputs/tiny-sft.toml --set data.path=/nonexistent/x.h5");
  CHECK(missing.status == 1);  // check opens the data as train does
  CHECK(missing.output.find("data file '/nonexistent/x.h5' does not exist") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a run on two mixed files resumed from a checkpoint continues with the same losses") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-mix-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const std::string deck = shardlm_bin() + " train inputs/tiny-sft.toml --set run.max_steps=6 --set log.interval=1 " +
                           "--set 'data.path=[\"inputs/data/tiny.h5\", \"inputs/data/tiny.h5\"]' " +
                           "--set 'data.weights=[3, 1]' --set ckpt.keep_last=5 ";
  auto whole = run("OMP_NUM_THREADS=1 " + deck + "--set ckpt.interval=3 --set run.dir=" + (dir / "whole").string(), 300);
  REQUIRE(whole.status == 0);
  auto resumed = run("OMP_NUM_THREADS=1 " + deck + "--set ckpt.resume=" + (dir / "whole/checkpoints/step_3.h5").string() +
                         " --set run.dir=" + (dir / "resumed").string(),
                     300);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  // the loss of step N as metrics.jsonl printed it (9 significant digits)
  auto loss_at = [](const std::filesystem::path& file, int step) {
    std::ifstream in(file);
    std::string line;
    const std::string key = "{\"step\": " + std::to_string(step) + ", \"loss\": ";
    while (std::getline(in, line))
      if (line.rfind(key, 0) == 0) return line.substr(key.size(), line.find(',', key.size()) - key.size());
    return std::string("missing");
  };
  for (int step = 4; step <= 6; ++step) {
    CAPTURE(step);
    CHECK(loss_at(dir / "resumed/metrics.jsonl", step) == loss_at(dir / "whole/metrics.jsonl", step));
    CHECK(loss_at(dir / "whole/metrics.jsonl", step) != "missing");
  }
  auto inspect = run(shardlm_bin() + " inspect " + (dir / "whole/checkpoints/step_3.h5").string());
  CHECK(inspect.output.find("data: step 3 starts at row 24; seq_len 64, seed 1234, 60 documents, shuffle on") !=
        std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("weight broadcast to a receiver (MPI path): the receiver's weights equal the trainer's export bit for bit") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-bcast-" + std::to_string(getpid()));
  const std::string sets = " --set broadcast.backend=nccl --set broadcast.interval=5 --set run.max_steps=10";
  auto r = run("OMP_NUM_THREADS=1 " + mpirun(2) + shardlm_bin() + " train inputs/tiny-sft.toml" + sets +
                   " --set run.dir=" + (dir / "run").string() + " --set run.export_dir=" + (dir / "trainer").string() +
                   " : -np 1 " + shardlm_bin() + " receive inputs/tiny-sft.toml" + sets + " --out " +
                   (dir / "receiver").string(),
               300);
  CHECK(r.status == 0);
  CHECK(r.output.find("receive[0]: step 5: 20 tensors") != std::string::npos);
  CHECK(r.output.find("receive[0]: step 10: 20 tensors") != std::string::npos);
  CHECK(r.output.find("2 broadcasts received") != std::string::npos);
  // a seeded model has no tokenizer files to carry, and both outputs say so
  CHECK(r.output.find("receive[0]: last weights written to " + (dir / "receiver").string() +
                      " (no tokenizer files: the weights did not come from an HF directory") != std::string::npos);
  CHECK(r.output.find("exported the final weights to " + (dir / "trainer").string() + " (no tokenizer files") !=
        std::string::npos);
  auto same = run("cmp " + (dir / "trainer/model.safetensors").string() + " " +
                  (dir / "receiver/model.safetensors").string());
  CHECK_MESSAGE(same.status == 0, same.output);
  std::filesystem::remove_all(dir);
}

TEST_CASE("weight broadcast through the filesystem: step dirs, STABLE, keep, checksums, equal weights") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-fsb-" + std::to_string(getpid()));
  const std::string sets = " --set broadcast.backend=filesystem --set broadcast.interval=3 --set broadcast.keep=2"
                           " --set data.global_batch=6 --set run.max_steps=9 --set broadcast.dir=" +
                           (dir / "bcast").string();
  auto r = run("OMP_NUM_THREADS=1 " + mpirun(3) + shardlm_bin() + " train inputs/tiny-sft.toml" + sets +
                   " --set run.dir=" + (dir / "run").string() + " --set run.export_dir=" + (dir / "trainer").string() +
                   " : -np 1 " + shardlm_bin() + " receive inputs/tiny-sft.toml" + sets + " --out " +
                   (dir / "receiver").string(),
               300);
  CHECK(r.status == 0);
  CHECK(r.output.find("receive[0]: step 9: 20 tensors") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir / "bcast/step_3"));  // keep = 2
  CHECK(std::filesystem::exists(dir / "bcast/step_6/STABLE"));
  CHECK(std::filesystem::exists(dir / "bcast/step_9/config.json"));
  auto same = run("cmp " + (dir / "trainer/model.safetensors").string() + " " +
                  (dir / "receiver/model.safetensors").string());
  CHECK_MESSAGE(same.status == 0, same.output);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a receiver that dies makes the trainers abort with a message, not hang") {
  const std::string sets = " --set broadcast.backend=nccl --set broadcast.interval=2 --set run.max_steps=50";
  auto r = run("SHARDLM_FAULT=receive@2 OMP_NUM_THREADS=1 " + mpirun(2) + "-x SHARDLM_FAULT " + shardlm_bin() +
                   " train inputs/tiny-sft.toml" + sets + " --set run.dir=" +
                   (std::filesystem::temp_directory_path() / ("shardlm-deadrecv-" + std::to_string(getpid()))).string() + " : -np 1 " +
                   shardlm_bin() + " receive inputs/tiny-sft.toml" + sets,
               120);
  CHECK(r.status != 0);
  CHECK(r.status != 124);
  CHECK(r.output.find("shardlm: error on rank 2 of 3") != std::string::npos);
}

TEST_CASE("receive refuses a deck without a broadcast backend; train refuses nccl broadcast without receivers") {
  auto r = run(mpirun(1) + shardlm_bin() + " train inputs/tiny-sft.toml --set broadcast.backend=nccl");
  CHECK(r.status != 0);
  CHECK(r.output.find("this job has no receiver ranks") != std::string::npos);
  auto fsb = run(shardlm_bin() + " check inputs/tiny-sft.toml --set broadcast.backend=filesystem");
  CHECK(fsb.status == 1);
  CHECK(fsb.output.find("needs broadcast.dir") != std::string::npos);
}

TEST_CASE("an MPMD launch whose receivers cannot start fails at once with exit 1, never the requeue code") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-norecv-" + std::to_string(getpid()));
  auto r = run("OMP_NUM_THREADS=1 " + mpirun(1) + shardlm_bin() + " train inputs/tiny-sft.toml --set run.dir=" +
                   dir.string() + " : -np 1 " + shardlm_bin() + " receive inputs/tiny-sft.toml",
               120);
  CHECK(r.status == 1);
  CHECK(r.output.find("this job has 1 receiver rank but broadcast.backend = \"none\"") != std::string::npos);
  CHECK(r.output.find("stopped by signal") == std::string::npos);
  CHECK(r.output.find("exit 75") == std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir / "checkpoints"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("run.lock under mpirun -np 2: rank 0's refusal ends every rank with exit 73 and one message") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-locked-" + std::to_string(getpid()));
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  {
    const RunDirLock holder(dir, "holder", "a.toml");  // this test process holds the directory
    auto r = run("OMP_NUM_THREADS=1 " + mpirun(2) + shardlm_bin() + " train inputs/tiny-sft.toml --set run.dir=" +
                     dir.string(),
                 120);
    CHECK(r.status == 73);
    const std::string held = "is held by pid " + std::to_string(getpid()) + " on host " + host + ", started ";
    CHECK(r.output.find(held) != std::string::npos);
    CHECK(r.output.find(held) == r.output.rfind(held));  // said once, by rank 0
    CHECK(r.output.find(" UTC (run 'holder', deck a.toml)") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir / "config.toml"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("RL end to end: tiny-rl trains on synthetic rollouts and broadcasts; receiver == export, bit for bit") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-rl-" + std::to_string(getpid()));
  auto gen = run(std::string(getenv("PYTHON") && *getenv("PYTHON") ? getenv("PYTHON") : "/usr/bin/python3") +
                 " tools/make_rollouts.py inputs/data/tiny.h5 --out " + (dir / "rollouts").string() + " --steps 10");
  REQUIRE_MESSAGE(gen.status == 0, gen.output);
  // Both runs share run.dir: the second must not resume from the first one's final checkpoint.
  const std::string sets = " --set run.max_steps=10 --set ckpt.resume=none --set data.rollout_dir=" +
                           (dir / "rollouts").string();
  for (const std::string backend : {"nccl", "filesystem"}) {
    CAPTURE(backend);
    const std::string b = sets + " --set broadcast.backend=" + backend + " --set broadcast.dir=" + (dir / "bc").string();
    auto r = run("OMP_NUM_THREADS=1 " + mpirun(2) + shardlm_bin() + " train inputs/tiny-rl.toml" + b +
                     " --set run.dir=" + (dir / "run").string() + " --set run.export_dir=" +
                     (dir / ("trainer-" + backend)).string() + " : -np 1 " + shardlm_bin() +
                     " receive inputs/tiny-rl.toml" + b + " --out " + (dir / ("receiver-" + backend)).string(),
                 300);
    CHECK(r.status == 0);
    CHECK(r.output.find("rl | entropy ") != std::string::npos);
    CHECK(r.output.find("receive[0]: step 10: 20 tensors") != std::string::npos);
    CHECK(r.output.find("2 broadcasts received") != std::string::npos);
    auto same = run("cmp " + (dir / ("trainer-" + backend) / "model.safetensors").string() + " " +
                    (dir / ("receiver-" + backend) / "model.safetensors").string());
    CHECK_MESSAGE(same.status == 0, same.output);
  }
  // metrics.jsonl carries the RL fields (its first step row, after the start row)
  std::FILE* f = std::fopen((dir / "run/metrics.jsonl").c_str(), "r");
  REQUIRE(f);
  char line[4096] = {0};
  REQUIRE(std::fgets(line, sizeof line, f));
  REQUIRE(std::fgets(line, sizeof line, f));
  std::fclose(f);
  for (const char* key : {"\"entropy\": ", "\"mismatch_kl\": ", "\"masked_high\": ", "\"masked_low\": ",
                          "\"mean_advantage\": "})
    CHECK_MESSAGE(std::string(line).find(key) != std::string::npos, key);
  std::filesystem::remove_all(dir);
}

TEST_CASE("RL: a rollout file that never comes is a clear error after data.rollout_timeout_s") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-rlwait-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir / "rollouts");
  auto r = run(mpirun(1) + shardlm_bin() + " train inputs/tiny-rl.toml --set broadcast.backend=none" +
                   " --set data.rollout_timeout_s=1.5 --set data.rollout_dir=" + (dir / "rollouts").string() +
                   " --set run.dir=" + (dir / "run").string(),
               60);
  CHECK(r.status != 0);
  CHECK(r.status != 124);
  CHECK(r.output.find("no rollouts for step 0 in " + (dir / "rollouts").string()) != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("check opens data.path as train does: missing, a directory, /dev/zero, not HDF5, vocab_size") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-checkdata-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto check = [&](const std::string& sets) { return run(shardlm_bin() + " check inputs/tiny-sft.toml " + sets); };
  auto refused = [&](const std::string& sets, const std::string& message) {
    const auto r = check(sets);
    CHECK(r.status == 1);
    CHECK_MESSAGE(r.output.find(message) != std::string::npos, r.output);
    CHECK(r.output.find("valid for") == std::string::npos);
  };
  const auto ok = check("");
  CHECK(ok.status == 0);
  CHECK(ok.output.find("data: inputs/data/tiny.h5 is a token file for vocab_size 258") != std::string::npos);
  refused("--set data.path=" + (dir / "none.h5").string(), "data file '" + (dir / "none.h5").string() + "' does not exist");
  refused("--set data.path=" + dir.string(), "data file '" + dir.string() + "' is a directory");
  refused("--set data.path=/dev/zero", "data file '/dev/zero' is not a regular file (a device, pipe or socket)");
  refused("--set data.path=inputs/tiny-sft.toml", "data file 'inputs/tiny-sft.toml' is not an HDF5 file");
  refused("--set model.vocab_size=100",
          "data file 'inputs/data/tiny.h5' was tokenized for a vocabulary of 258 ids (attribute vocab_size, tokenizer");
  {  // a vocab_size attribute of -1
    const std::string bad = (dir / "vocab.h5").string();
    h5::Handle file(H5_CHECK(H5Fcreate(bad.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)), H5Fclose);
    const int32_t tokens[2] = {1, 2};
    const int64_t offsets[2] = {0, 2};
    for (const char* name : {"tokens", "offsets"}) {
      const bool t = name[0] == 't';
      const hsize_t n = 2;
      h5::Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr)), H5Sclose);
      h5::Handle dset(H5_CHECK(H5Dcreate2(file, name, t ? H5T_STD_I32LE : H5T_STD_I64LE, space, H5P_DEFAULT,
                                          H5P_DEFAULT, H5P_DEFAULT)), H5Dclose);
      H5_CHECK(H5Dwrite(dset, t ? H5T_NATIVE_INT32 : H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                        t ? static_cast<const void*>(tokens) : static_cast<const void*>(offsets)));
    }
    h5::Handle scalar(H5_CHECK(H5Screate(H5S_SCALAR)), H5Sclose);
    h5::Handle attr(H5_CHECK(H5Acreate2(file, "vocab_size", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT)), H5Aclose);
    const int64_t minus_one = -1;
    H5_CHECK(H5Awrite(attr, H5T_NATIVE_INT64, &minus_one));
  }
  refused("--set data.path=" + (dir / "vocab.h5").string(),
          "data file '" + (dir / "vocab.h5").string() + "': attribute vocab_size = -1; it must be the tokenizer's "
          "vocabulary size (> 0)");
  // RL: the rollout directory, and step_0.h5 when it is there.
  std::FILE* f = std::fopen((dir / "file").c_str(), "w");
  REQUIRE(f);
  std::fclose(f);
  const auto rl_file = run(shardlm_bin() + " check inputs/tiny-rl.toml --set data.rollout_dir=" + (dir / "file").string());
  CHECK(rl_file.status == 1);
  CHECK(rl_file.output.find("data.rollout_dir = '" + (dir / "file").string() + "' is not a directory") !=
        std::string::npos);
  const auto rl_later = run(shardlm_bin() + " check inputs/tiny-rl.toml --set data.rollout_dir=" + (dir / "later").string());
  CHECK(rl_later.status == 0);
  CHECK(rl_later.output.find("the directory does not exist yet") != std::string::npos);
  std::filesystem::create_directories(dir / "rollouts");
  std::filesystem::copy_file("inputs/tiny-sft.toml", dir / "rollouts" / "step_0.h5");
  const auto rl_bad = run(shardlm_bin() + " check inputs/tiny-rl.toml --set data.rollout_dir=" + (dir / "rollouts").string());
  CHECK(rl_bad.status == 1);
  CHECK(rl_bad.output.find((dir / "rollouts" / "step_0.h5").string()) != std::string::npos);
  std::filesystem::remove_all(dir);
}

// A 3.8e12-parameter model: every size in range, 61 TB of host memory per rank.
const char* kHugeModel = " --set model.num_layers=1000 --set model.hidden_size=16384 --set model.intermediate_size=65536"
                         " --set model.num_heads=128 --set model.num_kv_heads=8";

TEST_CASE("the memory plan is compared with the machine: check notes it, train refuses before building anything") {
  const auto c = run(shardlm_bin() + " check inputs/tiny-sft.toml" + kHugeModel);
  CHECK(c.status == 0);  // the nodes that run it may be larger than this one
  CHECK(c.output.find("this machine: ") != std::string::npos);
  CHECK(c.output.find("one rank's plan does not fit: the memory plan needs ") != std::string::npos);
  CHECK(run(shardlm_bin() + " check inputs/tiny-sft.toml").output.find("one rank's plan fits") != std::string::npos);

  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-huge-" + std::to_string(getpid()));
  const auto t = run(shardlm_bin() + " train inputs/tiny-sft.toml" + kHugeModel + " --set run.dir=" + dir.string());
  CHECK(t.status == 1);
  CHECK_MESSAGE(t.output.find("inputs/tiny-sft.toml: the memory plan needs ") != std::string::npos, t.output);
  CHECK(t.output.find("GiB of host memory per rank x 1 rank on this node = ") != std::string::npos);
  CHECK(t.output.find("model.activation_checkpointing") != std::string::npos);
  CHECK(!std::filesystem::exists(dir));  // refused before the run dir was made
}

TEST_CASE("an unwritable checkpoint directory and a full disk at start name the path and the reason") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-unwritable-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string train = shardlm_bin() + " train inputs/tiny-sft.toml --set run.max_steps=5 --set run.dir=";
  // As root, mode bits do not stop a write: /sys refuses root too.
  std::filesystem::create_directory_symlink("/sys", dir / "checkpoints");
  const auto r = run(train + dir.string());
  CHECK(r.status == 74);  // ckpt.on_error = "stop": as at a failed save, before the first step
  CHECK_MESSAGE(r.output.find("cannot write in the checkpoint directory " + (dir / "checkpoints").string() + ": ") !=
                    std::string::npos, r.output);
  CHECK(r.output.find("exit 74 before the first step") != std::string::npos);
  CHECK(r.output.find("step ") == std::string::npos);
  CHECK(r.output.find("MPI_ERR") == std::string::npos);
  std::filesystem::remove_all(dir);

  // A full disk: the file being written is /dev/full, which fails every write with ENOSPC.
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink("/dev/full", dir / "config.toml.tmp");
  const auto full = run(train + dir.string());
  CHECK(full.status == 1);
  CHECK_MESSAGE(full.output.find("cannot write " + (dir / "config.toml").string() + ": No space left on device") !=
                    std::string::npos, full.output);
  CHECK(!std::filesystem::exists(dir / "config.toml"));  // no 0-byte config.toml left
  CHECK(!std::filesystem::exists(std::filesystem::symlink_status(dir / "config.toml.tmp")));
  std::filesystem::remove_all(dir);
}

TEST_CASE("context parallelism: a rank that stops mid-ring is named by the watchdog") {
  // Rank 1 of a group of 2 freezes (SIGSTOP) at its third ring exchange (the
  // first backward layer); rank 0 waits for its block.
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-ring-stopped-" + std::to_string(getpid()));
  auto r = run("SHARDLM_FAULT=ring_stop@1 OMP_NUM_THREADS=1 " + mpirun(2) + "-x SHARDLM_FAULT " + shardlm_bin() +
               " train inputs/tiny-sft.toml --set model.context_parallel=2 --set comm.timeout_s=3"
               " --set run.dir=" + dir.string());
  CHECK(r.status != 0);
  CHECK(r.status != 124);  // the hang guard did not fire: the watchdog did
  CHECK_MESSAGE(r.output.find("collective ring_exchange (#3 of a communicator of 2 ranks) has not completed after 3.") !=
                    std::string::npos, r.output);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  CHECK_MESSAGE(r.output.find(std::string("(comm.timeout_s = 3): rank 1 on ") + host + " did not arrive (stopped, dead, "
                              "or stuck outside any collective); waiting in it: rank 0 on " + host) !=
                    std::string::npos, r.output);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a stopped rank: the MPI watchdog aborts after comm.timeout_s naming the collective and the rank") {
  // Rank 2 of 3 freezes (SIGSTOP) at its first all-reduce; ranks 0 and 1 wait in it.
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-stopped-" + std::to_string(getpid()));
  auto r = run("SHARDLM_FAULT=mpi_stop@2 OMP_NUM_THREADS=1 " + mpirun(3) + "-x SHARDLM_FAULT " + shardlm_bin() +
               " train inputs/tiny-sft.toml --set data.global_batch=12 --set data.micro_batch=1 --set comm.timeout_s=3"
               " --set run.dir=" + dir.string());
  CHECK(r.status != 0);
  CHECK(r.status != 124);  // the hang guard did not fire: the watchdog did
  CHECK_MESSAGE(r.output.find("collective all_reduce_sum (#") != std::string::npos, r.output);
  CHECK(r.output.find("has not completed after 3.") != std::string::npos);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);  // the node of every rank, named in the message
  CHECK_MESSAGE(r.output.find(std::string("(comm.timeout_s = 3): rank 2 on ") + host + " did not arrive (stopped, dead, "
                              "or stuck outside any collective); waiting in it: ranks 0, 1 on " + host) !=
                    std::string::npos, r.output);
  // One report for the job, by the lowest waiting rank.
  CHECK(r.output.find("has not completed") == r.output.rfind("has not completed"));
  CHECK(r.output.find("shardlm: error on rank 0 of 3") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a killed rank ends the job in seconds with a line naming it") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-killed-" + std::to_string(getpid()));
  auto r = run("SHARDLM_FAULT=mpi_kill@2 OMP_NUM_THREADS=1 " + mpirun(3) + "-x SHARDLM_FAULT " + shardlm_bin() +
               " train inputs/tiny-sft.toml --set data.global_batch=12 --set data.micro_batch=1 --set run.dir=" +
               dir.string());
  CHECK(r.status != 0);
  CHECK(r.status != 124);
  // The launcher sees the death first and names the rank (Open MPI: "process rank 2 ... exited on signal 9").
  CHECK_MESSAGE(r.output.find("rank 2") != std::string::npos, r.output);
  std::filesystem::remove_all(dir);
}

// A tiny-sft run at -np np with SHARDLM_FAULT=fault, which must die (not hang):
// its output; made_run_dir: whether it got as far as making its run dir.
std::string crashed_run(const std::string& fault, int np, bool* made_run_dir = nullptr) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardlm-crash-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  auto r = run("SHARDLM_FAULT=" + fault + " OMP_NUM_THREADS=1 " + mpirun(np) + "-x SHARDLM_FAULT " + shardlm_bin() +
               " train inputs/tiny-sft.toml --set run.dir=" + dir.string());
  CHECK(r.status != 0);
  CHECK(r.status != 124);
  if (made_run_dir) *made_run_dir = std::filesystem::exists(dir);
  std::filesystem::remove_all(dir);
  return r.output;
}

TEST_CASE("a crashing rank names itself before it dies") {
  const std::string out = crashed_run("segv@1", 2);
  CHECK_MESSAGE(out.find("shardlm: rank 1 of 2 (trainer rank 1 of 2, " + host_name() + ", pid ") != std::string::npos,
                out);
  CHECK_MESSAGE(out.find("died of signal 11 (SIGSEGV): a crash: invalid memory access") != std::string::npos, out);
}

TEST_CASE("a rank that calls a null function pointer says from where, as library+offset") {
  const std::string out = crashed_run("null_call@1", 2);
  CHECK_MESSAGE(out.find("shardlm: rank 1 of 2 (trainer rank 1 of 2, ") != std::string::npos, out);
  // pc 0 has no frames to walk from; the caller's return address names the binary.
  CHECK_MESSAGE(out.find("shardlm:   at pc 0x0, called from 0x") != std::string::npos, out);
  CHECK_MESSAGE(out.find(" (shardlm+0x") != std::string::npos, out);
  CHECK_MESSAGE(out.find("fault address (nil)") != std::string::npos, out);
}

TEST_CASE("a crash inside MPI_Init_thread is reported as one, before any rank is known") {
  bool made_run_dir = true;
  const std::string out = crashed_run("segv_init@0", 1, &made_run_dir);
  CHECK_MESSAGE(out.find("shardlm: a rank (" + host_name() + ", pid ") != std::string::npos, out);
  CHECK_MESSAGE(out.find("died of signal 11 (SIGSEGV) inside MPI_Init_thread") != std::string::npos, out);
  CHECK_MESSAGE(out.find("shardlm:   at pc 0x") != std::string::npos, out);
  CHECK_FALSE(made_run_dir);  // nothing ran: no run dir
}

TEST_CASE("where a peer is, for a timed-out collective's message: ahead is not a mismatch") {
  CHECK(shardlm::where_is_peer("all_gather", 57, "all_gather", 57) == shardlm::PeerPlace::Waiting);
  CHECK(shardlm::where_is_peer("all_gather", 57, "reduce_scatter", 58) == shardlm::PeerPlace::Ahead);
  CHECK(shardlm::where_is_peer("all_gather", 57, "broadcast", 56) == shardlm::PeerPlace::Behind);
  CHECK(shardlm::where_is_peer("all_gather", 57, "barrier", 57) == shardlm::PeerPlace::Mismatch);
  CHECK(shardlm::where_is_peer("all_gather", 57, "export: writing x", -1) == shardlm::PeerPlace::Busy);
}

TEST_CASE("a fatal error on one rank aborts the whole job with one message, never a hang") {
  auto r = run("SHARDLM_FAULT=startup@1 " + mpirun(2) + "-x SHARDLM_FAULT " + shardlm_bin() +
                   " train inputs/tiny-sft.toml --set run.dir=" +
                   (std::filesystem::temp_directory_path() / ("shardlm-abort-" + std::to_string(getpid()))).string());
  CHECK(r.status != 0);
  CHECK(r.status != 124);  // 124: the timeout fired, i.e. the job hung
  CHECK(r.output.find("shardlm: error on rank 1 of 2") != std::string::npos);
  CHECK(r.output.find("injected fault 'startup'") != std::string::npos);
  CHECK(r.output.find("error on rank 0") == std::string::npos);
}

}  // TEST_SUITE
