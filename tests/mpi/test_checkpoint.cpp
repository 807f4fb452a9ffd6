// test_checkpoint.cpp — HDF5 checkpoints through MPI: bit-exact resume at the
// same world size, resume at other world sizes, damaged and mismatched files,
// retention, failed saves, stop signals, the Checkpointer's decision at the end
// of a step (ckpt.on_error, exits 74 and 75), and that standard tools read the file.
//
// Sessions are built on communicators of the job's first n ranks, so one job
// at -np 4 saves on 2 ranks and resumes on 3 or 4 (and on 1, and back).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <functional>
#include <string>
#include <vector>

#include "../unit/run_command.hpp"
#include "checkpoint/async.hpp"
#include "checkpoint/checkpoint.hpp"
#include "checkpoint/layout.hpp"
#include "model/hf_config.hpp"
#include "model/safetensors.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/h5util.hpp"
#include "train/train.hpp"
#include "mpi_world.hpp"

using namespace shardlm;
namespace fs = std::filesystem;

namespace {

using shardlm_test::SharedDir;
using shardlm_test::world_rank;
using shardlm_test::world_size;


// The job's first n ranks (MPI_COMM_NULL on the others).
struct SubComm {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit SubComm(int n) { MPI_Comm_split(MPI_COMM_WORLD, world_rank() < n ? 0 : MPI_UNDEFINED, 0, &comm); }
  ~SubComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  bool member() const { return comm != MPI_COMM_NULL; }
};

Config tiny(const fs::path& run_dir, std::vector<std::string> sets, int world) {
  // global_batch 12 splits over 1, 2, 3 and 4 ranks with micro_batch 1.
  std::vector<std::string> all = {"data.micro_batch=1", "data.global_batch=12", "run.max_steps=20",
                                  "run.dir=" + run_dir.string()};
  all.insert(all.end(), sets.begin(), sets.end());
  DeckResult r = parse_deck("inputs/tiny-sft.toml", all, world);
  for (const auto& e : r.errors) MESSAGE(e);
  REQUIRE(r.ok());
  return r.config;
}

struct Trained {
  std::vector<double> losses;  // of steps [from, to)
  int64_t tokens = 0;
};
Trained train(TrainSession& s, int64_t from, int64_t to) {
  Trained t;
  for (int64_t step = from; step < to; ++step) {
    const StepStats st = s.step(step);
    t.losses.push_back(st.loss);
    t.tokens += st.tokens;
  }
  return t;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-30); }

bool contains(const std::string& text, const std::string& piece) { return text.find(piece) != std::string::npos; }

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Flips bytes inside the raw data of dataset `name` (not its metadata), so HDF5
// reads it fine and only the checksum can tell.
void corrupt_raw_data(const fs::path& file, const std::string& name) {
  haddr_t offset;
  {
    h5::Handle f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    REQUIRE(f.get() >= 0);
    h5::Handle d(H5Dopen2(f, name.c_str(), H5P_DEFAULT), H5Dclose);
    REQUIRE(d.get() >= 0);
    offset = H5Dget_offset(d);
    REQUIRE(offset != HADDR_UNDEF);
  }
  std::FILE* fp = std::fopen(file.c_str(), "r+b");
  REQUIRE(fp);
  std::fseek(fp, static_cast<long>(offset) + 40, SEEK_SET);
  unsigned char bytes[4];
  REQUIRE(std::fread(bytes, 1, 4, fp) == 4);
  for (auto& b : bytes) b ^= 0x5a;
  std::fseek(fp, static_cast<long>(offset) + 40, SEEK_SET);
  std::fwrite(bytes, 1, 4, fp);
  std::fclose(fp);
}

std::string capture_inspect(const fs::path& file, int* rc) {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&text, &size);
  *rc = inspect_checkpoint(file, MPI_COMM_SELF, out);
  std::fclose(out);
  std::string s(text, size);
  std::free(text);
  return s;
}

}  // namespace

TEST_SUITE("checkpoint") {

TEST_CASE("10 steps, save, new session, resume, 10 steps: the 20-step losses bit for bit") {
  SharedDir dir;
  const Config config = tiny(dir.path, {}, world_size());
  auto comm = make_mpi_comm(MPI_COMM_WORLD);

  std::vector<double> straight;
  std::vector<std::vector<float>> straight_params;
  {
    TrainSession a(config, *comm);
    straight = train(a, 0, 20).losses;
    straight_params = gather_all_params(a.model, *comm);
  }
  int64_t tokens = 0;
  std::vector<std::vector<float>> saved_params;
  {
    TrainSession b(config, *comm);
    tokens = train(b, 0, 10).tokens;
    const SaveResult saved = save_checkpoint(b, MPI_COMM_WORLD, 10, tokens);
    REQUIRE(saved.ok);
    CHECK(saved.path == dir.ckpt() / "step_10.h5");
    CHECK(saved.bytes > 0);
    saved_params = gather_all_params(b.model, *comm);
  }
  TrainSession c(config, *comm);
  const ResumePoint p = resume(c, MPI_COMM_WORLD);
  CHECK(p.path == dir.ckpt() / "step_10.h5");
  CHECK(p.step == 10);
  CHECK(p.tokens_seen == tokens);
  CHECK(p.skipped.empty());
  CHECK(c.optimizer.steps_taken() == 10);
  CHECK(gather_all_params(c.model, *comm) == saved_params);  // exact, every element
  const std::vector<double> resumed = train(c, 10, 20).losses;
  REQUIRE(resumed.size() == 10);
  int identical = 0;
  for (int i = 0; i < 10; ++i) identical += resumed[i] == straight[10 + i];
  MESSAGE("world " << world_size() << ": " << identical << "/10 resumed losses bit-identical; step 20 loss "
                   << resumed.back());
  CHECK(identical == 10);
  CHECK(gather_all_params(c.model, *comm) == straight_params);
}

TEST_CASE("save at one world size, resume at another: losses within 1e-5") {
  const int W = world_size();
  std::vector<std::pair<int, int>> pairs;  // (ranks that save, ranks that resume)
  if (W >= 2) pairs = {{W, 1}, {1, W}};
  if (W >= 3) pairs.push_back({2, W});
  if (W >= 4) pairs.push_back({2, 3});
  if (pairs.empty()) return;

  SharedDir ref_dir;
  std::vector<double> reference;  // 20 steps straight on every rank
  {
    auto comm = make_mpi_comm(MPI_COMM_WORLD);
    TrainSession s(tiny(ref_dir.path, {}, W), *comm);
    reference = train(s, 0, 20).losses;
  }
  int pair_index = 0;
  for (const auto& [save_n, load_n] : pairs) {
    // Every way ranks move raw data, each pair saving with one and loading with another.
    const char* modes[] = {"direct", "collective", "independent"};
    setenv("SHARDLM_CKPT_XFER", modes[pair_index % 3], 1);
    const char* load_xfer = modes[(pair_index + 1) % 3];
    ++pair_index;
    SharedDir dir;
    {
      SubComm saver(save_n);
      if (saver.member()) {
        auto comm = make_mpi_comm(saver.comm);
        TrainSession s(tiny(dir.path, {}, save_n), *comm);
        const int64_t tokens = train(s, 0, 10).tokens;
        REQUIRE(save_checkpoint(s, saver.comm, 10, tokens).ok);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
    std::vector<double> resumed;
    int64_t world_at_save = 0;
    setenv("SHARDLM_CKPT_XFER", load_xfer, 1);
    {
      SubComm loader(load_n);
      if (loader.member()) {
        auto comm = make_mpi_comm(loader.comm);
        TrainSession s(tiny(dir.path, {}, load_n), *comm);
        const ResumePoint p = resume(s, loader.comm);
        REQUIRE(p.step == 10);
        world_at_save = read_checkpoint_info(p.path).world_size_at_save;
        resumed = train(s, 10, 20).losses;
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
    unsetenv("SHARDLM_CKPT_XFER");
    if (world_rank() != 0) continue;
    CHECK(world_at_save == save_n);
    REQUIRE(resumed.size() == 10);
    double worst = 0;
    for (int i = 0; i < 10; ++i) worst = std::max(worst, rel(resumed[i], reference[10 + i]));
    MESSAGE("saved on " << save_n << " (" << std::string(modes[(pair_index - 1) % 3]) << "), resumed on " << load_n << " ("
                        << std::string(load_xfer) << "): worst relative loss difference " << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("SGD with and without momentum resumes bit for bit") {
  for (const char* momentum : {"0.9", "0.0"}) {
    SharedDir dir;
    const Config config = tiny(dir.path, {"optim.name=sgd", std::string("optim.momentum=") + momentum,
                                          "optim.lr=0.05", "optim.weight_decay=0.0"}, world_size());
    auto comm = make_mpi_comm(MPI_COMM_WORLD);
    std::vector<double> straight;
    {
      TrainSession a(config, *comm);
      straight = train(a, 0, 6).losses;
    }
    {
      TrainSession b(config, *comm);
      train(b, 0, 3);
      REQUIRE(save_checkpoint(b, MPI_COMM_WORLD, 3, 0).ok);
    }
    TrainSession c(config, *comm);
    REQUIRE(resume(c, MPI_COMM_WORLD).step == 3);
    const std::vector<double> resumed = train(c, 3, 6).losses;
    for (int i = 0; i < 3; ++i) CHECK(resumed[i] == straight[3 + i]);
    if (world_rank() == 0) {
      const CheckpointInfo info = read_checkpoint_info(dir.ckpt() / "step_3.h5");
      CHECK(info.optimizer == "sgd");
      CHECK(info.optimizer_states ==
            (std::string(momentum) == "0.9" ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{}));
    }
  }
}

TEST_CASE("Muon resumes bit for bit, with one state on its matrices and two elsewhere") {
  // On rank 0 alone: TrainSession builds Muon for one rank until it takes the trainers' Comm.
  SharedDir dir;
  SubComm solo(1);
  if (solo.member()) {
    Config config = tiny(dir.path, {}, 1);
    config.optim.name = "muon";  // set here: the deck refuses muon until it is enabled
    auto comm = make_mpi_comm(solo.comm);
    std::vector<double> straight;
    {
      TrainSession a(config, *comm);
      straight = train(a, 0, 6).losses;
    }
    {
      TrainSession b(config, *comm);
      train(b, 0, 3);
      REQUIRE(save_checkpoint(b, solo.comm, 3, 0).ok);
    }
    TrainSession c(config, *comm);
    REQUIRE(resume(c, solo.comm).step == 3);
    const std::vector<double> resumed = train(c, 3, 6).losses;
    for (int i = 0; i < 3; ++i) CHECK(resumed[i] == straight[3 + i]);
    {
      h5::Handle f(H5Fopen((dir.ckpt() / "step_3.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
      REQUIRE(f.get() >= 0);
      auto exists = [&](const char* p) { return H5Lexists(f, p, H5P_DEFAULT) > 0; };
      CHECK(exists("/optim/model.layers.0.mlp.up_proj.weight/momentum_buffer"));
      CHECK_FALSE(exists("/optim/model.layers.0.mlp.up_proj.weight/exp_avg_sq"));
      CHECK(exists("/optim/model.norm.weight/exp_avg"));
      CHECK(exists("/optim/model.norm.weight/exp_avg_sq"));
    }
    int rc = -1;
    capture_inspect(dir.ckpt() / "step_3.h5", &rc);
    CHECK(rc == 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a checkpoint of another model shape or optimizer is refused, listing every mismatch") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  {
    TrainSession s(tiny(dir.path, {}, world_size()), *comm);
    REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 2, 0).ok);
  }
  TrainSession other(tiny(dir.path,
                          {"model.num_layers=3", "model.intermediate_size=192", "optim.name=sgd",
                           "optim.momentum=0.9", "data.seq_len=32"},
                          world_size()),
                     *comm);
  std::string message;
  bool mismatch = false;
  try {
    resume(other, MPI_COMM_WORLD);  // "latest": a mismatch is not skipped like damage
  } catch (const CheckpointMismatch& e) {
    mismatch = true;
    message = e.what();
  }
  REQUIRE(mismatch);
  MESSAGE(message);
  CHECK(contains(message, "step_2.h5"));
  CHECK(contains(message, "model.num_layers: 2 in the checkpoint, 3 in this run"));
  CHECK(contains(message, "model.intermediate_size: 176 in the checkpoint, 192 in this run"));
  CHECK(contains(message, "optim.name: adamw in the checkpoint, sgd in this run"));
  CHECK(contains(message, "/model/model.layers.2.self_attn.q_proj.weight: missing in the checkpoint"));
  CHECK(contains(message, "/model/model.layers.0.mlp.up_proj.weight: shape [176, 64] in the checkpoint, [192, 64]"));
  CHECK(contains(message, "data.seq_len was 64 then and is 32 now"));

  // A file from a newer format is refused too, not passed over as damaged.
  if (world_rank() == 0) {
    h5::Handle f(H5Fopen((dir.ckpt() / "step_2.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
    REQUIRE(f.get() >= 0);
    h5::Handle a(H5Aopen(f, "format_version", H5P_DEFAULT), H5Aclose);
    const int64_t newer = kCheckpointFormat + 1;
    REQUIRE(H5Awrite(a, H5T_NATIVE_INT64, &newer) >= 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  TrainSession same(tiny(dir.path, {}, world_size()), *comm);
  message.clear();
  try {
    resume(same, MPI_COMM_WORLD);
  } catch (const CheckpointMismatch& e) {
    message = e.what();
  }
  CHECK(contains(message, fmt("step_2.h5 is in format %lld; this shardlm", (long long)kCheckpointFormat + 1)));
}

TEST_CASE("a damaged latest checkpoint is reported by name and the previous one is used") {
  SharedDir dir;
  const Config config = tiny(dir.path, {}, world_size());
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  std::vector<double> original;
  {
    TrainSession s(config, *comm);
    original = train(s, 0, 3).losses;
    REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 3, 0).ok);
    const auto more = train(s, 3, 6).losses;
    original.insert(original.end(), more.begin(), more.end());
    REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 6, 0).ok);
  }
  const fs::path step3 = dir.ckpt() / "step_3.h5", step6 = dir.ckpt() / "step_6.h5";

  SUBCASE("flipped bytes in tensor data: checksum") {
    if (world_rank() == 0) {
      CHECK(read_text(dir.ckpt() / "latest") == "step_6.h5\n");
      corrupt_raw_data(step6, "/optim/model.layers.1.mlp.down_proj.weight/exp_avg_sq");
      int rc = 0;
      const std::string out = capture_inspect(step6, &rc);
      CHECK(rc == 1);
      CHECK(contains(out, "/optim/model.layers.1.mlp.down_proj.weight/exp_avg_sq: checksum mismatch"));
      CHECK(contains(out, "DAMAGED"));
      CHECK(capture_inspect(step3, &rc).find("OK") != std::string::npos);
      CHECK(rc == 0);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    TrainSession s(config, *comm);
    const ResumePoint p = resume(s, MPI_COMM_WORLD);
    CHECK(p.path == step3);
    REQUIRE(p.skipped.size() == 1);
    MESSAGE(p.skipped[0]);
    CHECK(contains(p.skipped[0], step6.string()));
    CHECK(contains(p.skipped[0], "checksum mismatch in 1 dataset: /optim/model.layers.1.mlp.down_proj.weight/exp_avg_sq"));
    const auto resumed = train(s, 3, 6).losses;  // and the trajectory is the saved one
    for (int i = 0; i < 3; ++i) CHECK(resumed[i] == original[3 + i]);
  }
  // Damage HDF5 reads without complaint: the file's own layout (by name) and
  // the attributes' checksum catch it; inspect says DAMAGED, resume falls back.
  auto tampered = [&](const char* what, const std::function<void(hid_t)>& edit, const std::string& inspect_says,
                      const std::string& resume_says) {
    const std::string label = what;
    if (world_rank() == 0) {
      {
        h5::Handle f(H5Fopen(step6.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
        REQUIRE(f.get() >= 0);
        edit(f);
      }
      int rc = 0;
      const std::string out = capture_inspect(step6, &rc);
      INFO(label << ": " << out);
      CHECK(rc == 1);
      CHECK(contains(out, inspect_says));
      CHECK(contains(out, "DAMAGED"));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    TrainSession s(config, *comm);
    const ResumePoint p = resume(s, MPI_COMM_WORLD);
    CHECK(p.path == step3);
    CHECK(p.step == 3);
    REQUIRE(p.skipped.size() == 1);
    MESSAGE(label << ": " << p.skipped[0]);
    CHECK(contains(p.skipped[0], step6.string() + " is damaged or unreadable"));
    CHECK(contains(p.skipped[0], resume_says));
  };
  const std::string sq = "/optim/model.layers.1.mlp.down_proj.weight/exp_avg_sq";
  SUBCASE("a renamed dataset (one flipped byte in its name)") {
    tampered("renamed", [&](hid_t f) {
      REQUIRE(H5Lmove(f, sq.c_str(), f, "/optim/model.layers.1.mlp.down_proj.weight/exp_a\x89g_sq", H5P_DEFAULT,
                      H5P_DEFAULT) >= 0);
    }, sq + ": missing", sq + ": missing");
  }
  SUBCASE("a deleted dataset") {
    tampered("deleted", [&](hid_t f) { REQUIRE(H5Ldelete(f, "/model/model.norm.weight", H5P_DEFAULT) >= 0); },
             "/model/model.norm.weight: missing", "/model/model.norm.weight: missing");
  }
  SUBCASE("a root attribute changed: step = 999") {
    tampered("step=999", [&](hid_t f) {
      h5::Handle a(H5Aopen(f, "step", H5P_DEFAULT), H5Aclose);
      const int64_t v = 999;
      REQUIRE(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    }, "do not match attributes_checksum", "do not match attributes_checksum");
  }
  SUBCASE("a group attribute changed: steps_taken = 0") {
    tampered("steps_taken=0", [&](hid_t f) {
      h5::Handle g(H5Gopen2(f, "optim", H5P_DEFAULT), H5Gclose);
      REQUIRE(g.get() >= 0);
      h5::Handle a(H5Aopen(g, "steps_taken", H5P_DEFAULT), H5Aclose);
      REQUIRE(a.get() >= 0);
      const int64_t v = 0;
      REQUIRE(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    }, "do not match attributes_checksum", "do not match attributes_checksum");
  }
  SUBCASE("truncated file: HDF5 error") {
    if (world_rank() == 0) fs::resize_file(step6, fs::file_size(step6) / 2);
    MPI_Barrier(MPI_COMM_WORLD);
    TrainSession s(config, *comm);
    const ResumePoint p = resume(s, MPI_COMM_WORLD);
    CHECK(p.path == step3);
    REQUIRE(p.skipped.size() == 1);
    MESSAGE(p.skipped[0]);
    CHECK(contains(p.skipped[0], "checkpoint " + step6.string() + " is damaged or unreadable"));
  }
  SUBCASE("every checkpoint damaged: an error naming each, not a silent fresh start") {
    if (world_rank() == 0) {
      fs::resize_file(step6, 1000);
      corrupt_raw_data(step3, "/model/model.embed_tokens.weight");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    TrainSession s(config, *comm);
    std::string message;
    try {
      resume(s, MPI_COMM_WORLD);
    } catch (const Error& e) {
      message = e.what();
    }
    MESSAGE(message);
    CHECK(contains(message, "every checkpoint in " + dir.ckpt().string() + " is damaged"));
    CHECK(contains(message, step6.string()));
    CHECK(contains(message, step3.string()));
    CHECK(contains(message, "/model/model.embed_tokens.weight"));
  }
  SUBCASE("a damaged file named by ckpt.resume is an error, with no fallback") {
    if (world_rank() == 0) corrupt_raw_data(step6, "/model/model.norm.weight");
    MPI_Barrier(MPI_COMM_WORLD);
    Config by_path = config;
    by_path.ckpt.resume = step6.string();
    TrainSession s(by_path, *comm);
    CHECK_THROWS_AS(resume(s, MPI_COMM_WORLD), CheckpointDamaged);
  }
}

TEST_CASE("inspect of a path that does not exist says so (exit 2), not DAMAGED") {
  if (world_rank() != 0) return;
  int rc = 0;
  const std::string out = capture_inspect("/tmp/shardlm-no-such-checkpoint-here.h5", &rc);
  CHECK(rc == 2);
  CHECK(contains(out, "/tmp/shardlm-no-such-checkpoint-here.h5: no such file or directory"));
  CHECK(!contains(out, "DAMAGED"));
}

TEST_CASE("retention keeps keep_last and every keep_interval-th; stale .tmp files go; latest names the newest") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  Config config = tiny(dir.path, {}, world_size());
  config.ckpt.keep_last = 2;  // set here, not by --set: works before and after the deck enables these keys
  config.ckpt.keep_interval = 3;
  TrainSession s(config, *comm);
  if (world_rank() == 0) {  // what a killed save leaves behind
    fs::create_directories(dir.ckpt());
    std::ofstream(dir.ckpt() / "step_99.h5.tmp") << "partial";
    std::ofstream(dir.ckpt() / "latest.tmp") << "step_9";
    std::ofstream(dir.ckpt() / "notes.txt") << "a user's file";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (int step = 1; step <= 7; ++step) REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, step, 0).ok);
  if (world_rank() == 0) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir.ckpt())) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{"latest", "notes.txt", "step_3.h5", "step_6.h5", "step_7.h5"});
    CHECK(read_text(dir.ckpt() / "latest") == "step_7.h5\n");
  }
}

TEST_CASE("a save that fails leaves the older checkpoints and latest untouched, on every rank's word") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession s(tiny(dir.path, {}, world_size()), *comm);
  REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 1, 0).ok);

  SUBCASE("an I/O error on the last rank in the middle of the write") {
    const std::string fault = "write:2@" + std::to_string(world_size() - 1);
    setenv("SHARDLM_CKPT_FAULT", fault.c_str(), 1);
    const SaveResult r = save_checkpoint(s, MPI_COMM_WORLD, 2, 0);
    unsetenv("SHARDLM_CKPT_FAULT");
    CHECK_FALSE(r.ok);  // on every rank
    MESSAGE(r.error);
    CHECK(contains(r.error, "No space left on device"));
    CHECK(contains(r.error, "writing /model/model.embed_tokens.weight failed on rank " + std::to_string(world_size() - 1)));
  }
  SUBCASE("not enough free space: refused before writing") {
    setenv("SHARDLM_CKPT_FAKE_FREE_BYTES", "100000", 1);  // statvfs says 100 kB free
    const SaveResult r = save_checkpoint(s, MPI_COMM_WORLD, 2, 0);
    unsetenv("SHARDLM_CKPT_FAKE_FREE_BYTES");
    CHECK_FALSE(r.ok);
    MESSAGE(r.error);
    CHECK(contains(r.error, "not enough free space in " + dir.ckpt().string()));
  }
  if (world_rank() == 0) {
    CHECK_FALSE(fs::exists(dir.ckpt() / "step_2.h5"));
    CHECK_FALSE(fs::exists(dir.ckpt() / "step_2.h5.tmp"));
    CHECK(read_text(dir.ckpt() / "latest") == "step_1.h5\n");
    int rc = -1;
    capture_inspect(dir.ckpt() / "step_1.h5", &rc);
    CHECK(rc == 0);
  }
  // And the next save works.
  CHECK(save_checkpoint(s, MPI_COMM_WORLD, 3, 0).ok);
}

TEST_CASE("an unwritable checkpoint directory fails the save with a clear message") {
  SharedDir dir;
  if (world_rank() == 0) std::ofstream(dir.path / "checkpoints") << "a file where the directory should be";
  MPI_Barrier(MPI_COMM_WORLD);
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession s(tiny(dir.path, {}, world_size()), *comm);
  const SaveResult r = save_checkpoint(s, MPI_COMM_WORLD, 1, 0);
  CHECK_FALSE(r.ok);
  MESSAGE(r.error);
  CHECK(contains(r.error, "cannot create the checkpoint directory " + dir.ckpt().string()));
}

// Every dataset's bits and every attribute of a checkpoint as text, but for
// saved_at and the deck (its run.dir and ckpt.async differ between the runs compared).
std::string file_contents(const fs::path& file) {
  h5::Handle f(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  REQUIRE(f.get() >= 0);
  std::string out;
  std::istringstream attrs(ckpt::attributes_text(f));
  for (std::string line; std::getline(attrs, line);)
    if (line.rfind("/:saved_at=", 0) != 0 && line.rfind("dir = ", 0) != 0 && line.rfind("async", 0) != 0)
      out += line + "\n";
  std::vector<std::string> names = ckpt::datasets_under(f, "model");
  for (const auto& n : ckpt::datasets_under(f, "optim")) names.push_back(n);
  names.push_back("/data/position");
  for (const auto& n : names) {
    h5::Handle d(H5Dopen2(f, n.c_str(), H5P_DEFAULT), H5Dclose);
    REQUIRE(d.get() >= 0);
    h5::Handle type(H5Dget_type(d), H5Tclose);
    const size_t bytes = static_cast<size_t>(H5Dget_storage_size(d));
    std::string data(bytes, '\0');
    REQUIRE(H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0);
    out += n + " checksum " + std::to_string(ckpt::read_u64(d, "checksum")) + " bytes " + std::to_string(bytes) +
           " sum " + std::to_string(checksum_text(data)) + "\n";
  }
  return out;
}

TEST_CASE("ckpt.async: the background save writes the same file as the synchronous one; resumes match") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  // A slow writer (20 ms per tensor) so that training runs on during the write
  // and changes the live state the snapshot must not see.
  setenv("SHARDLM_CKPT_SLOW_MS", "20", 1);
  std::vector<double> straight;
  {
    TrainSession a(tiny(dir.path / "straight", {"ckpt.async=false"}, world_size()), *comm);
    straight = train(a, 0, 10).losses;
  }
  {
    TrainSession b(tiny(dir.path / "sync", {"ckpt.async=false"}, world_size()), *comm);
    const int64_t tokens = train(b, 0, 5).tokens;
    REQUIRE(save_checkpoint(b, MPI_COMM_WORLD, 5, tokens).ok);
  }
  const fs::path sync_file = dir.path / "sync/checkpoints/step_5.h5";
  // Whole snapshot, then a pool smaller than the state (staged in pieces).
  for (const char* bound : {"ckpt.async_host_gib=0", "ckpt.async_host_gib=0.00001"}) {
    const std::string bound_text = bound;
    CAPTURE(bound_text);
    const std::string run = std::string("async-") + (std::string(bound).back() == '0' ? "whole" : "staged");
    const Config config = tiny(dir.path / run, {"ckpt.async=true", bound}, world_size());
    {
      TrainSession c(config, *comm);
      Checkpointer checkpointer(c, MPI_COMM_WORLD);
      const int64_t tokens = train(c, 0, 5).tokens;
      if (world_rank() == 0) setenv("SHARDLM_CKPT_FAULT", "slow:5@0", 1);  // read by save(), on this thread
      const SaveResult pending = checkpointer.save(5, tokens);
      unsetenv("SHARDLM_CKPT_FAULT");
      REQUIRE(pending.ok);
      CHECK(pending.background);
      CHECK(checkpointer.in_flight());
      int steps_during_write = 0;
      std::optional<SaveResult> done;
      for (int64_t step = 5; step < 10; ++step) {
        c.step(step);
        if (!done) done = checkpointer.poll();
        if (!done) ++steps_during_write;
      }
      if (!done) done = checkpointer.wait();
      REQUIRE(done);
      CHECK(done->ok);
      CHECK(done->background);
      CHECK(done->bytes > 0);
      CHECK_FALSE(checkpointer.in_flight());
      MESSAGE(run << ": " << steps_during_write << " steps trained while the file was written; loop blocked "
                  << 1e3 * done->seconds << " ms, background write " << done->write_s << " s");
      if (run == "async-whole") CHECK(steps_during_write >= 1);  // staged: the pool held one piece at a time
    }
    const fs::path async_file = dir.path / run / "checkpoints/step_5.h5";
    CHECK(read_text(dir.path / run / "checkpoints/latest") == "step_5.h5\n");
    if (world_rank() == 0) {
      const std::string a = file_contents(async_file), b = file_contents(sync_file);
      CHECK(a.size() > 1000);
      CHECK(a == b);
      int rc = -1;
      capture_inspect(async_file, &rc);
      CHECK(rc == 0);
    }
    TrainSession d(config, *comm);
    const ResumePoint p = resume(d, MPI_COMM_WORLD);
    CHECK(p.step == 5);
    const std::vector<double> resumed = train(d, 5, 10).losses;
    int identical = 0;
    for (int i = 0; i < 5; ++i) identical += resumed[i] == straight[5 + i];
    CHECK(identical == 5);
  }
  unsetenv("SHARDLM_CKPT_SLOW_MS");
}

TEST_CASE("ckpt.async: a failed background write is reported at the next poll; nothing older is touched") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession s(tiny(dir.path, {"ckpt.async=true"}, world_size()), *comm);
  Checkpointer checkpointer(s, MPI_COMM_WORLD);
  train(s, 0, 2);
  REQUIRE(checkpointer.save(2, 0).ok);
  REQUIRE(checkpointer.wait()->ok);
  train(s, 2, 4);
  if (world_rank() == world_size() - 1) setenv("SHARDLM_CKPT_FAULT", ("write:4@" + std::to_string(world_size() - 1)).c_str(), 1);
  const SaveResult pending = checkpointer.save(4, 0);
  CHECK(pending.ok);  // the blocking part went well; the write fails in the background
  std::optional<SaveResult> done;
  for (int i = 0; i < 600 && !done; ++i) {
    done = checkpointer.poll();
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  unsetenv("SHARDLM_CKPT_FAULT");
  REQUIRE(done);
  CHECK_FALSE(done->ok);
  MESSAGE(done->error);
  CHECK(contains(done->error, fmt("failed on rank %d: injected write error", world_size() - 1)));
  CHECK(contains(done->error, "No space left on device"));
  MPI_Barrier(MPI_COMM_WORLD);  // rank 0 removes the .tmp after the failure is agreed
  CHECK_FALSE(fs::exists(dir.ckpt() / "step_4.h5.tmp"));
  CHECK_FALSE(fs::exists(dir.ckpt() / "step_4.h5"));
  CHECK(read_text(dir.ckpt() / "latest") == "step_2.h5\n");
  if (world_rank() == 0) {
    int rc = -1;
    capture_inspect(dir.ckpt() / "step_2.h5", &rc);
    CHECK(rc == 0);
  }
  // And the next save works.
  CHECK(checkpointer.save(5, 0).ok);
  CHECK(checkpointer.wait()->ok);
  CHECK(read_text(dir.ckpt() / "latest") == "step_5.h5\n");
}

TEST_CASE("a stop signal on one rank is seen by every rank at the end of the step") {
  install_stop_signal_handlers();
  clear_stop_request();
  CHECK_FALSE(stop_requested(MPI_COMM_WORLD));
  if (world_rank() == world_size() - 1) raise(SIGUSR1);
  CHECK(stop_requested(MPI_COMM_WORLD));
  CHECK(stop_signal() == SIGUSR1);
  clear_stop_request();
  if (world_rank() == 0) raise(SIGTERM);
  CHECK(stop_requested(MPI_COMM_WORLD));
  CHECK(stop_signal() == SIGTERM);
  clear_stop_request();
  // Through the Comm (the training loop's, watched): the same answer, the highest signal seen.
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  CHECK_FALSE(stop_requested(*comm));
  if (world_rank() == world_size() - 1) raise(SIGUSR1);
  CHECK(stop_requested(*comm));
  CHECK(stop_signal() == SIGUSR1);
  clear_stop_request();
  if (world_rank() == world_size() - 1) raise(SIGUSR1);
  if (world_rank() == 0) raise(SIGTERM);
  CHECK(stop_requested(*comm));
  // A rank keeps the signal it saw itself; the others take the highest (SIGTERM).
  const bool saw_only_usr1 = world_size() > 1 && world_rank() == world_size() - 1;
  CHECK(stop_signal() == (saw_only_usr1 ? SIGUSR1 : SIGTERM));
  clear_stop_request();
  signal(SIGUSR1, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
}

// One row of the Checkpointer's decision table: run.max_steps = 4,
// ckpt.interval = 2, ckpt.save_final = true, so step 3 saves only when
// signalled, step 2 is a due save and step 4 the final one.
struct DecisionRow {
  bool async;
  const char* on_error;  // "stop" | "continue" | "*" (either: nothing failed, or nothing saved)
  int64_t step;
  bool signalled, save_fails;
  // Expected: what after_step(step) says, then what finish() says.
  bool step_stop;
  int step_exit;
  bool run_stopped, final_save_failed;
  int run_exit;
};

// Sync: a failed save is known in after_step. Async: the blocking part goes
// well and the write fails in the background, known when the save is waited
// for: by the stop signal, or by finish().
constexpr DecisionRow kDecisions[] = {
    // async on_error   step sig fail | stop exit | stopped final exit
    {false, "*",        3, false, false, false, 0,  false, false, 0},   // nothing due
    {false, "*",        3, false, true,  false, 0,  false, false, 0},   // nothing saved, nothing fails
    {false, "*",        3, true,  false, true,  75, true,  false, 75},  // signalled: saved, requeue
    {false, "stop",     3, true,  true,  true,  74, true,  false, 74},
    {false, "continue", 3, true,  true,  true,  75, true,  false, 75},  // the requeued job resumes an older one
    {false, "*",        2, false, false, false, 0,  false, false, 0},
    {false, "stop",     2, false, true,  true,  74, true,  false, 74},
    {false, "continue", 2, false, true,  false, 0,  false, false, 0},   // trains on; the final save matters
    {false, "stop",     2, true,  true,  true,  74, true,  false, 74},
    {false, "continue", 2, true,  true,  true,  75, true,  false, 75},
    {false, "*",        4, false, false, false, 0,  false, false, 0},
    {false, "stop",     4, false, true,  true,  74, true,  false, 74},
    {false, "continue", 4, false, true,  false, 0,  false, true,  74},  // the report, then exit 74
    {false, "*",        4, true,  false, false, 0,  false, false, 0},   // signalled on the last step: completes
    {false, "stop",     4, true,  true,  true,  74, true,  false, 74},
    {false, "continue", 4, true,  true,  false, 0,  false, true,  74},  // as unsignalled: the report, exit 74
    {true,  "*",        3, false, false, false, 0,  false, false, 0},
    {true,  "*",        3, true,  false, true,  75, true,  false, 75},
    {true,  "stop",     3, true,  true,  true,  74, true,  false, 74},  // the signal waits for the write
    {true,  "continue", 3, true,  true,  true,  75, true,  false, 75},
    {true,  "*",        2, false, false, false, 0,  false, false, 0},
    {true,  "stop",     2, false, true,  false, 0,  true,  false, 74},  // pending at the step; finish() finds it
    {true,  "continue", 2, false, true,  false, 0,  false, false, 0},
    {true,  "*",        4, false, false, false, 0,  false, false, 0},
    {true,  "stop",     4, false, true,  false, 0,  true,  false, 74},
    {true,  "continue", 4, false, true,  false, 0,  false, true,  74},
    {true,  "*",        4, true,  false, false, 0,  false, false, 0},
    {true,  "stop",     4, true,  true,  true,  74, true,  false, 74},
    {true,  "continue", 4, true,  true,  false, 0,  false, true,  74},
};

// What rank 0 prints to stdout while `body` runs (the other ranks run it as is).
template <class F>
std::string rank0_stdout(const fs::path& file, F body) {
  if (world_rank() != 0) return body(), std::string();
  std::fflush(stdout);
  const int saved = dup(STDOUT_FILENO);
  FILE* f = std::fopen(file.c_str(), "w");
  dup2(fileno(f), STDOUT_FILENO);
  body();
  std::fflush(stdout);
  dup2(saved, STDOUT_FILENO);
  close(saved);
  std::fclose(f);
  return read_text(file);
}

TEST_CASE("the Checkpointer decides: save when due or signalled, ckpt.on_error, exit 74 or 75, the final save") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  install_stop_signal_handlers();
  const int last = world_size() - 1;
  int rows = 0;
  for (const bool async : {false, true}) {
    for (const std::string on_error : {"stop", "continue"}) {
      const std::string run = std::string(async ? "async-" : "sync-") + on_error;
      TrainSession s(tiny(dir.path / run,
                          {async ? "ckpt.async=true" : "ckpt.async=false", "ckpt.on_error=" + on_error,
                           "run.max_steps=4", "sched.warmup=1", "ckpt.interval=2", "ckpt.save_final=true"},
                          world_size()),
                     *comm);
      for (const DecisionRow& row : kDecisions) {
        if (row.async != async || (std::string(row.on_error) != "*" && row.on_error != on_error)) continue;
        CAPTURE(run);
        CAPTURE(row.step);
        CAPTURE(row.signalled);
        CAPTURE(row.save_fails);
        MPI_Barrier(MPI_COMM_WORLD);  // each row starts with no checkpoint
        if (world_rank() == 0) fs::remove_all(dir.path / run / "checkpoints");
        MPI_Barrier(MPI_COMM_WORLD);
        Checkpointer checkpointer(s, MPI_COMM_WORLD);
        clear_stop_request();
        if (row.signalled && world_rank() == last) raise(SIGUSR1);
        if (row.save_fails && world_rank() == last)
          setenv("SHARDLM_CKPT_FAULT", fmt("write:%lld@%d", (long long)row.step, last).c_str(), 1);
        StepEnd end;
        const std::string said = rank0_stdout(dir.path / "said.txt", [&] { end = checkpointer.after_step(row.step, 0); });
        unsetenv("SHARDLM_CKPT_FAULT");  // read when the save starts
        // A stop whose save failed under "continue" says so, not "requeue and resume".
        if (world_rank() == 0 && row.step_exit == 75) {
          const bool lost = row.save_fails;
          CHECK((said.find("(requeue and resume)") != std::string::npos) == !lost);
          CHECK((said.find("but the checkpoint of step") != std::string::npos) == lost);
        }
        CHECK(end.stop == row.step_stop);
        CHECK(end.exit_code == row.step_exit);
        const RunEnd run_end = checkpointer.finish();
        CHECK_FALSE(checkpointer.in_flight());
        CHECK(run_end.stopped == row.run_stopped);
        CHECK(run_end.final_save_failed == row.final_save_failed);
        CHECK(run_end.exit_code == row.run_exit);
        CHECK(std::string(run_end.status()) ==
              (row.run_exit == 0 ? "done" : row.run_exit == 75 ? "stopped" : "checkpoint_failed"));
        // A save that went well is on disk and named by `latest` once finish() returns.
        const bool saved = !row.save_fails && (row.signalled || row.step % 2 == 0);
        MPI_Barrier(MPI_COMM_WORLD);
        CHECK(fs::exists(dir.path / run / "checkpoints" / fmt("step_%lld.h5", (long long)row.step)) == saved);
        if (saved) CHECK(read_text(dir.path / run / "checkpoints/latest") == fmt("step_%lld.h5\n", (long long)row.step));
        ++rows;
      }
    }
  }
  clear_stop_request();
  signal(SIGUSR1, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  signal(SIGINT, SIG_DFL);
  // Each row runs once per on_error it matches ("*": twice).
  CHECK(rows == 40);
}

TEST_CASE("the Checkpointer: a background save that failed stops the run at the step that finds it (on_error = stop)") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  const int last = world_size() - 1;
  for (const std::string on_error : {"stop", "continue"}) {
    CAPTURE(on_error);
    TrainSession s(tiny(dir.path / on_error,
                        {"ckpt.async=true", "ckpt.on_error=" + on_error, "run.max_steps=100", "ckpt.interval=2"},
                        world_size()),
                   *comm);
    Checkpointer checkpointer(s, MPI_COMM_WORLD);
    if (world_rank() == last) setenv("SHARDLM_CKPT_FAULT", fmt("write:2@%d", last).c_str(), 1);
    REQUIRE_FALSE(checkpointer.after_step(2, 0).stop);  // the write fails in the background
    unsetenv("SHARDLM_CKPT_FAULT");
    // Step 3 saves nothing: each end of step polls until the failure is known on every rank.
    StepEnd end;
    for (int i = 0; i < 600 && checkpointer.in_flight(); ++i) {
      end = checkpointer.after_step(3, 0);
      if (checkpointer.in_flight()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE_FALSE(checkpointer.in_flight());
    CHECK(end.stop == (on_error == "stop"));
    CHECK(end.exit_code == (on_error == "stop" ? 74 : 0));
    const RunEnd run_end = checkpointer.finish();
    CHECK(run_end.exit_code == (on_error == "stop" ? 74 : 0));
    CHECK_FALSE(run_end.final_save_failed);  // step 2 was not the run's end
  }
}

TEST_CASE("h5dump, h5py and export read the checkpoint with its real shapes and values") {
  SharedDir dir;
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession s(tiny(dir.path, {}, world_size()), *comm);
  train(s, 0, 2);
  REQUIRE(save_checkpoint(s, MPI_COMM_WORLD, 2, 0).ok);
  const auto params = gather_all_params(s.model, *comm);
  const fs::path file = dir.ckpt() / "step_2.h5";

  // export on every rank's word (rank 0 does the work)
  export_checkpoint(file, dir.path / "hf32", "fp32", MPI_COMM_WORLD);
  export_checkpoint(file, dir.path / "hf16", "bf16", MPI_COMM_WORLD);
  if (world_rank() != 0) return;

  const auto dump = shardlm_test::run("h5dump -H " + file.string());
  REQUIRE(dump.status == 0);
  // The type and dataspace lines that follow a dataset's name in h5dump -H.
  auto described = [&](const std::string& name) {
    const size_t at = dump.output.find("DATASET \"" + name + "\" {");
    if (at == std::string::npos) return std::string("(absent)");
    const size_t type = dump.output.find("DATATYPE", at), space = dump.output.find("DATASPACE", at);
    auto line = [&](size_t from) { return dump.output.substr(from, dump.output.find('\n', from) - from); };
    return line(type) + " | " + line(space);
  };
  CHECK(described("model.embed_tokens.weight") ==
        "DATATYPE  H5T_IEEE_F32LE | DATASPACE  SIMPLE { ( 258, 64 ) / ( 258, 64 ) }");
  CHECK(described("model.layers.1.mlp.down_proj.weight") ==
        "DATATYPE  H5T_IEEE_F32LE | DATASPACE  SIMPLE { ( 64, 176 ) / ( 64, 176 ) }");
  CHECK(described("model.norm.weight") == "DATATYPE  H5T_IEEE_F32LE | DATASPACE  SIMPLE { ( 64 ) / ( 64 ) }");
  CHECK(described("exp_avg_sq") == "DATATYPE  H5T_IEEE_F32LE | DATASPACE  SIMPLE { ( 258, 64 ) / ( 258, 64 ) }");
  CHECK(contains(dump.output, "ATTRIBUTE \"world_size_at_save\""));

  // h5py, when the interpreter has it: shape and three elements of one weight, exactly.
  const char* py = std::getenv("PYTHON");
  const std::string python = py && *py ? py : "/usr/bin/python3";
  if (shardlm_test::run(python + " -c 'import h5py'").status == 0) {
    const ModelLayout& layout = s.model.layout;
    size_t index = 0;
    for (const auto& [unit, p] : layout.all_params()) {
      if (p->name == "model.layers.1.mlp.down_proj.weight") break;
      ++index;
    }
    const auto& want = params.at(index);
    const auto r = shardlm_test::run(
        python + " -c \"import h5py; f = h5py.File('" + file.string() +
        "', 'r'); d = f['model']['model.layers.1.mlp.down_proj.weight'][()].ravel(); "
        "print(f['model']['model.layers.1.mlp.down_proj.weight'].shape, f.attrs['step'], repr(float(d[0])), "
        "repr(float(d[4321])), repr(float(d[-1])), f.attrs['deck'].splitlines()[0])\"");
    REQUIRE(r.status == 0);
    char expect[256];
    std::snprintf(expect, sizeof(expect), "(64, 176) 2 %s %s %s", fmt("%.17g", double(want[0])).c_str(),
                  fmt("%.17g", double(want[4321])).c_str(), fmt("%.17g", double(want.back())).c_str());
    // Python's repr is the shortest round-trip form; compare parsed values.
    double a = 0, b = 0, c = 0;
    long step = 0;
    int d0 = 0, d1 = 0;
    REQUIRE(std::sscanf(r.output.c_str(), "(%d, %d) %ld %lf %lf %lf", &d0, &d1, &step, &a, &b, &c) == 6);
    CHECK(d0 == 64);
    CHECK(d1 == 176);
    CHECK(step == 2);
    CHECK(float(a) == want[0]);
    CHECK(float(b) == want[4321]);
    CHECK(float(c) == want.back());
    CHECK(contains(r.output, "resolved shardlm deck"));
  } else {
    MESSAGE("h5py not available to " << python << ": skipped the h5py check");
  }

  // export: fp32 exactly, bf16 rounded; config.json gives the same layout
  const ModelConfig arch32 = read_hf_config(dir.path / "hf32");
  CHECK(arch32.num_layers == 2);
  CHECK(arch32.hidden_size == 64);
  CHECK(arch32.tie_word_embeddings);
  const SafetensorsReader r32(dir.path / "hf32"), r16(dir.path / "hf16");
  size_t i = 0;
  int exact = 0, rounded = 0, total = 0;
  for (const auto& [unit, p] : s.model.layout.all_params()) {
    std::vector<float> a(p->numel), b(p->numel);
    r32.read_f32(p->name, 0, p->numel, a.data());
    r16.read_f32(p->name, 0, p->numel, b.data());
    CHECK(r16.info(p->name).dtype == "BF16");
    exact += a == params[i];
    bool ok = true;
    for (int64_t j = 0; j < p->numel; ++j) ok = ok && b[j] == bf16_to_f32(f32_to_bf16_rne(params[i][j]));
    rounded += ok;
    ++total;
    ++i;
  }
  CHECK(exact == total);
  CHECK(rounded == total);
  CHECK_FALSE(r32.has("lm_head.weight"));  // tied

  // A damaged file is not exported, and leaves no half-written safetensors behind.
  corrupt_raw_data(file, "/model/model.layers.0.self_attn.v_proj.weight");
  std::string message;
  try {
    export_checkpoint(file, dir.path / "bad", "fp32", MPI_COMM_SELF);
  } catch (const CheckpointDamaged& e) {
    message = e.what();
  }
  CHECK(contains(message, "/model/model.layers.0.self_attn.v_proj.weight: checksum mismatch"));
  CHECK_FALSE(fs::exists(dir.path / "bad" / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir.path / "bad" / "model.safetensors.tmp"));
}

}  // TEST_SUITE

// tools/bench_checkpoint.sh runs this (`make test` skips it): save and load of a
// large model + AdamW state on this job's ranks, timed. Sizes and the directory
// come from SHARDLM_BENCH_{DIR,LAYERS,HIDDEN,INTERMEDIATE,VOCAB}.
TEST_SUITE("checkpoint-bench") {
TEST_CASE("checkpoint I/O benchmark" * doctest::skip()) {
  auto env = [](const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return std::string(v && *v ? v : fallback);
  };
  const fs::path dir = env("SHARDLM_BENCH_DIR", "/tmp/shardlm-bench");
  const int W = world_size();
  const Config config = tiny(dir, {"model.vocab_size=" + env("SHARDLM_BENCH_VOCAB", "32000"),
                                   "model.hidden_size=" + env("SHARDLM_BENCH_HIDDEN", "2048"),
                                   "model.intermediate_size=" + env("SHARDLM_BENCH_INTERMEDIATE", "5632"),
                                   "model.num_layers=" + env("SHARDLM_BENCH_LAYERS", "10"), "model.num_heads=16",
                                   "model.num_kv_heads=16", "data.seq_len=64", "data.global_batch=12",
                                   "model.tie_word_embeddings=false"},
                             W);
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  TrainSession s(config, *comm);
  // Optimizer moments that are not all zero, as after real training.
  for (int k = 0; k < s.optimizer.states(); ++k)
    for (size_t u = 0; u < s.model.param.size(); ++u) {
      float* m = s.optimizer.state(k)[u].data();
      const float* p = s.model.param[u].data();
      for (int64_t i = 0; i < s.model.param[u].size(); ++i) m[i] = k == 0 ? 0.1f * p[i] : 1e-4f * p[i] * p[i];
    }
  const double params = double(s.model.layout.parameter_count());

  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  uint64_t sink = 0;
  for (int k = -1; k < s.optimizer.states(); ++k)
    for (size_t u = 0; u < s.model.param.size(); ++u)
      sink += checksum_f32(k < 0 ? s.model.param[u].data() : s.optimizer.state(k)[u].data(), 0,
                           s.model.param[u].size());
  MPI_Barrier(MPI_COMM_WORLD);
  const double checksum_s = MPI_Wtime() - t0;

  const SaveResult saved = save_checkpoint(s, MPI_COMM_WORLD, 1, 0);
  REQUIRE(saved.ok);
  if (world_rank() == 0) {  // read from the disk, not from the page cache
    const int fd = ::open(saved.path.c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    CHECK(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
    ::close(fd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = MPI_Wtime();
  const CheckpointInfo info = load_checkpoint(s, MPI_COMM_WORLD, saved.path);
  MPI_Barrier(MPI_COMM_WORLD);
  const double load_s = MPI_Wtime() - t0;
  CHECK(info.step == 1);
  if (world_rank() == 0) {
    const double gb = double(saved.bytes) / 1e9;
    std::printf("BENCH ranks=%d params=%.3e file_bytes=%lld checksum_s=%.3f save_s=%.3f save_GBps=%.3f "
                "load_s=%.3f load_GBps=%.3f (sink %llx)\n",
                W, params, (long long)saved.bytes, checksum_s, saved.seconds, gb / saved.seconds, load_s,
                gb / load_s, (unsigned long long)(sink & 0xf));
    std::fflush(stdout);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) fs::remove_all(dir);
}
}  // TEST_SUITE
