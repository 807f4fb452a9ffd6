// test_checkpoint_unit.cpp — the checkpoint's pieces that need no MPI: flat
// ranges as hyperslab boxes, the world-size-independent checksum, retention,
// the order resume tries files in, when a checkpoint is due, and the
// async snapshot in `shardlm check`'s plan.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "run_command.hpp"
#include "checkpoint/checkpoint.hpp"
#include "train/engine.hpp"

using namespace shardlm;
using shardlm_test::run;
using shardlm_test::shardlm_bin;
namespace fs = std::filesystem;

namespace {

// Marks every element the boxes cover; returns false if one is covered twice.
bool paint(const std::vector<int64_t>& shape, const std::vector<Box>& boxes, std::vector<int>& hits) {
  for (const Box& b : boxes) {
    if (b.start.size() != shape.size() || b.count.size() != shape.size()) return false;
    std::vector<int64_t> idx(shape.size(), 0);
    int64_t total = 1;
    for (int64_t c : b.count) total *= c;
    for (int64_t k = 0; k < total; ++k) {
      int64_t rem = k, flat = 0;
      for (size_t d = shape.size(); d-- > 0;) {
        idx[d] = b.start[d] + rem % b.count[d];
        rem /= b.count[d];
      }
      for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
      if (++hits[flat] > 1) return false;
    }
  }
  return true;
}

struct TempDir {
  fs::path path;
  TempDir() {
    char templ[] = "/tmp/shardlm-ckunit-XXXXXX";
    REQUIRE(mkdtemp(templ) != nullptr);
    path = templ;
  }
  ~TempDir() { fs::remove_all(path); }
  void touch(const std::string& name, const std::string& text = "x") const { std::ofstream(path / name) << text; }
};

}  // namespace

TEST_SUITE("checkpoint") {

TEST_CASE("every flat range of 1-D, 2-D and 3-D arrays is covered exactly once by at most 2n-1 boxes") {
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{7}, {3, 5}, {4, 1}, {1, 6}, {2, 3, 4}}) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    int ranges = 0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t e = b + 1; e <= n; ++e) {
        const auto boxes = flat_range_boxes(shape, b, e - b);
        std::vector<int> hits(static_cast<size_t>(n), 0);
        REQUIRE(paint(shape, boxes, hits));
        for (int64_t i = 0; i < n; ++i) REQUIRE(hits[i] == (i >= b && i < e ? 1 : 0));
        REQUIRE(boxes.size() <= 2 * shape.size() - 1);
        ++ranges;
      }
    CHECK(ranges == n * (n + 1) / 2);
  }
  CHECK(flat_range_boxes({3, 5}, 4, 0).empty());
  // A range of whole rows is one box; a shard boundary mid-row gives three.
  CHECK(flat_range_boxes({4, 64}, 64, 128).size() == 1);
  const auto three = flat_range_boxes({4, 64}, 10, 150);
  REQUIRE(three.size() == 3);
  CHECK(three[0].start == std::vector<int64_t>{0, 10});
  CHECK(three[0].count == std::vector<int64_t>{1, 54});
  CHECK(three[1].start == std::vector<int64_t>{1, 0});
  CHECK(three[1].count == std::vector<int64_t>{1, 64});
  CHECK(three[2].start == std::vector<int64_t>{2, 0});
  CHECK(three[2].count == std::vector<int64_t>{1, 32});
}

TEST_CASE("the checksum of any partition adds up to the whole; it sees one changed bit, a swap, -0.0") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(100000);
  for (auto& x : v) x = normal(rng);
  const int64_t n = static_cast<int64_t>(v.size());
  const uint64_t whole = checksum_f32(v.data(), 0, n);
  for (int parts : {2, 3, 7, 64}) {  // the slices ranks of any world size would hold
    uint64_t sum = 0;
    for (int r = 0; r < parts; ++r) {
      const int64_t lo = n * r / parts, hi = n * (r + 1) / parts;
      sum += checksum_f32(v.data() + lo, lo, hi - lo);
    }
    CHECK(sum == whole);
  }
  std::vector<float> w = v;
  uint32_t bits;
  std::memcpy(&bits, &w[54321], 4);
  bits ^= 1u;  // the lowest mantissa bit
  std::memcpy(&w[54321], &bits, 4);
  CHECK(checksum_f32(w.data(), 0, n) != whole);
  w = v;
  std::swap(w[10], w[20]);
  CHECK(checksum_f32(w.data(), 0, n) != whole);
  w = v;
  w[5] = 0.0f;
  const uint64_t plus_zero = checksum_f32(w.data(), 0, n);
  w[5] = -0.0f;
  CHECK(checksum_f32(w.data(), 0, n) != plus_zero);
  // The same values at another offset are another dataset slice: a different sum.
  CHECK(checksum_f32(v.data(), 1, n) != whole);
  const std::vector<int64_t> q = {1, 2, 3, 4};
  CHECK(checksum_i64(q.data(), 0, 2) + checksum_i64(q.data() + 2, 2, 2) == checksum_i64(q.data(), 0, 4));
}

TEST_CASE("retention keeps the newest keep_last, every keep_interval-th, and never a newer timeline") {
  using V = std::vector<int64_t>;
  CHECK(checkpoints_to_delete({1, 2, 3, 4, 5, 6, 7}, 7, 2, 3) == V{1, 2, 4, 5});
  CHECK(checkpoints_to_delete({1, 2, 3, 4, 5, 6, 7}, 7, 2, 0) == V{1, 2, 3, 4, 5});
  CHECK(checkpoints_to_delete({100, 200, 300}, 300, 5, 0).empty());
  // keep_last 1: only the new one (and multiples of keep_interval).
  CHECK(checkpoints_to_delete({10, 20, 30}, 30, 1, 20) == V{10});
  // Resumed from 20 of a run that had reached 40: 30 and 40 belong to the
  // abandoned future and are left alone; the new 25 is never deleted.
  CHECK(checkpoints_to_delete({10, 20, 25, 30, 40}, 25, 1, 0) == V{10, 20});
  // keep_last 0 (or less) still keeps the file just written.
  CHECK(checkpoints_to_delete({1, 2}, 2, 0, 0) == V{1});
}

TEST_CASE("resume tries the file latest names, then older ones newest first") {
  TempDir d;
  for (const char* f : {"step_5.h5", "step_10.h5", "step_15.h5", "step_20.h5", "step_7.h5.tmp", "other.h5"})
    d.touch(f);
  std::string note;

  d.touch("latest", "step_15.h5\n");
  auto c = resume_candidates(d.path, &note);
  CHECK(c == std::vector<fs::path>{d.path / "step_15.h5", d.path / "step_10.h5", d.path / "step_5.h5"});
  CHECK(note.empty());

  d.touch("latest", "step_99.h5\n");  // names a file that is gone
  c = resume_candidates(d.path, &note);
  CHECK(c.front() == d.path / "step_20.h5");
  CHECK(c.size() == 4);
  CHECK(note.find("names 'step_99.h5'") != std::string::npos);

  fs::remove(d.path / "latest");  // killed between the rename and the pointer update of the first save
  note.clear();
  c = resume_candidates(d.path, &note);
  CHECK(c.front() == d.path / "step_20.h5");
  CHECK(note.find("missing") != std::string::npos);

  TempDir empty;
  CHECK(resume_candidates(empty.path).empty());
  CHECK(resume_candidates(empty.path / "does-not-exist").empty());
}

TEST_CASE("a checkpoint is due every ckpt.interval steps and at the end (unless ckpt.save_final = false)") {
  CkptSection ckpt;
  ckpt.interval = 0;
  CHECK_FALSE(checkpoint_due(ckpt, 5, 10));
  CHECK(checkpoint_due(ckpt, 10, 10));
  ckpt.interval = 4;
  CHECK(checkpoint_due(ckpt, 4, 10));
  CHECK(checkpoint_due(ckpt, 8, 10));
  CHECK_FALSE(checkpoint_due(ckpt, 9, 10));
  CHECK(checkpoint_due(ckpt, 10, 10));
  CHECK_FALSE(checkpoint_due(ckpt, 0, 10));
  ckpt.save_final = false;  // benchmarks: the interval still holds, the end does not
  CHECK(checkpoint_due(ckpt, 8, 10));
  CHECK_FALSE(checkpoint_due(ckpt, 10, 10));
  CHECK(checkpoint_path("runs/x/checkpoints", 120) == fs::path("runs/x/checkpoints/step_120.h5"));
}

}  // TEST_SUITE

TEST_CASE("shardlm check plans the async snapshot: the whole state, or a bounded pool and what a staged save costs") {
  auto mib_of = [](const std::string& out, const std::string& row) {
    const size_t at = out.find(row);
    REQUIRE(at != std::string::npos);
    return std::stod(out.substr(at + 25));
  };
  const auto whole = run(shardlm_bin() + " check inputs/tiny-sft.toml", 300);
  REQUIRE(whole.status == 0);
  // AdamW: parameters + two moments, one copy of each (world 1).
  CHECK(mib_of(whole.output, "ckpt snapshot      host") ==
        doctest::Approx(3 * mib_of(whole.output, "parameter shards   host")).epsilon(2e-3));  // printed to 0.001
  CHECK(whole.output.find("is staged") == std::string::npos);
  const auto off = run(shardlm_bin() + " check inputs/tiny-sft.toml --set ckpt.async=false", 300);
  REQUIRE(off.status == 0);
  CHECK(off.output.find("ckpt snapshot") == std::string::npos);
  // 0.0005 GiB (0.512 MiB) is less than the state (1.25 MiB) and more than the
  // largest shard (a decoder layer, 46208 floats = 0.176 MiB): staged.
  const auto bounded = run(shardlm_bin() + " check inputs/tiny-sft.toml --set ckpt.async_host_gib=0.0005", 300);
  REQUIRE(bounded.status == 0);
  CHECK(mib_of(bounded.output, "ckpt snapshot      host") == doctest::Approx(0.0005 * 1024).epsilon(2e-3));
  CHECK(bounded.output.find("each save is staged and blocks the loop for the write of the other") != std::string::npos);
  // No save due (the benchmarks' ckpt.interval = 0, save_final = false): a stop
  // signal's save is synchronous and no pool is held for it.
  const auto none_due = run(shardlm_bin() + " check inputs/tiny-sft.toml --set ckpt.interval=0 --set ckpt.save_final=false", 300);
  REQUIRE(none_due.status == 0);
  CHECK(none_due.output.find("ckpt snapshot") == std::string::npos);
}

TEST_CASE("the default async snapshot pool never makes a plan too large for the host: it shrinks and stages") {
  const int64_t gib = int64_t(1) << 30;
  MemoryPlan p;
  p.param_shards = 4 * gib, p.optim_state = 8 * gib;
  p.checkpoint_snapshot = 12 * gib;                              // the whole state
  p.checkpoint_snapshot_flexible = 12 * gib - gib / 4;          // down to one shard of 256 MiB
  const MachineMemory host{20 * gib, "test"};
  CHECK(plan_fit_error(p, 1, host, 1, 0).empty());              // 12.25 GiB of 20 without the pool's room
  CHECK(plan_fit_error(p, 2, host, 1, 0).find("12.25 GiB of host memory per rank x 2 ranks") != std::string::npos);
  p.checkpoint_snapshot_flexible = 0;                           // ckpt.async_host_gib given: counted whole
  CHECK(plan_fit_error(p, 1, host, 1, 0).find("24.00 GiB of host memory per rank x 1 rank") != std::string::npos);
}

TEST_CASE("a plan too large for the GPU names the bf16 residual stream and what it gives back, when the stream is fp32") {
  const int64_t gib = int64_t(1) << 30;
  MemoryPlan p;
  p.device = true;
  p.device_state = 16 * gib, p.activations = 120 * gib, p.workspace = 8 * gib;
  p.fp32_stream = 39 * gib + gib / 2;  // of activations + workspace
  const MachineMemory host{64 * gib, "test"};
  const std::string e = plan_fit_error(p, 1, host, 1, 140 * gib);
  CHECK(e.find("144.00 GiB of GPU memory per rank x 1 rank") != std::string::npos);
  CHECK(e.find("model.residual_dtype = \"bf16\" (39.50 GiB less per rank)") != std::string::npos);
  p.fp32_stream = 0;  // a bf16 stream already: not offered
  CHECK(plan_fit_error(p, 1, host, 1, 140 * gib).find("residual_dtype") == std::string::npos);
  CHECK(plan_fit_error(p, 1, host, 1, 150 * gib).empty());
}
