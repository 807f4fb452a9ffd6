// test_offload.cpp — the host side of the optim_cpu_offload pipeline
// (src/train/offload.cpp) without a GPU: an OffloadDevice whose "device" is host memory
// and whose copies are memcpys with tickets. What is checked is the pipeline's own
// logic: which micro-batch is the step's first and last, gradients handed over
// only in the last one and landing in the grad shard, the update refused until
// every unit is handed over, the per-unit update against Optimizer::step on a copy of
// the model (bit for bit), the bf16 shards it uploads, and the ordering waits.
// tests/gpu/test_offload.sh runs the same pipeline on a GPU inside training.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "cpu/adamw.hpp"
#include "cpu/ops.hpp"
#include "app/plan.hpp"
#include "shardlm/backend.hpp"
#include "shardlm/config.hpp"
#include "shardlm/dtype.hpp"
#include "shardlm/offload_device.hpp"
#include "train/offload.hpp"
#include "train/optim.hpp"
#include "train/shard.hpp"
#include "train/state.hpp"

using namespace shardlm;

namespace {

// The tiny deck's model (inputs/tiny-sft.toml): 3 units, tied embeddings.
ModelConfig small_arch() {
  const DeckResult deck = parse_deck("inputs/tiny-sft.toml", {}, 1);
  REQUIRE(deck.ok());
  return deck.config.model.arch;
}

// Copies are memcpys done at once; a ticket only names them. Counts the waits
// so the test can see the pipeline order the "compute stream" after uploads.
class HostCopies final : public OffloadDevice {
 public:
  explicit HostCopies(const ModelLayout& layout) {
    for (const auto& u : layout.units) shards.emplace_back(u.shard_numel, 0xffff);
  }
  std::vector<std::vector<uint16_t>> shards;  // [unit] the "device" bf16 shards
  int64_t tickets = 0, host_waits = 0, compute_waits = 0;
  std::mutex m;

  // Where the pipeline uploads each unit's updated bf16 shard.
  std::vector<void*> device_shards() {
    std::vector<void*> out;
    for (auto& s : shards) out.push_back(s.data());
    return out;
  }

  void bind_thread() override {}
  bool pin_host(void*, size_t) override { return false; }
  void unpin_host(void*) override {}
  int64_t copy_to_host(void* host, const void* src, size_t bytes) override { return copy(host, src, bytes); }
  int64_t copy_to_device(void* dst, const void* host, size_t bytes) override { return copy(dst, host, bytes); }
  void host_wait(int64_t) override {
    std::lock_guard<std::mutex> lock(m);
    ++host_waits;
  }
  void compute_wait(int64_t) override {
    std::lock_guard<std::mutex> lock(m);
    ++compute_waits;
  }
  void synchronize() override {}
  void queue_sumsq(int, const float*, int64_t) override {}
  double read_sumsq(int) override { return 0; }
  Totals totals() override { return {}; }

 private:
  int64_t copy(void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    std::lock_guard<std::mutex> lock(m);
    return tickets++;
  }
};

uint16_t bf16_bits(float f) { return f32_to_bf16_rne(f); }

OptimSection adamw_section() {
  OptimSection o;
  o.name = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  return o;
}

// A model and its reference twin with the same seeded weights, AdamW on each,
// and a host "device" for the model's pipeline.
struct Twins {
  explicit Twins(const ModelConfig& arch, bool host_grads = true)
      : model(arch, 0, 1, host_grads), reference(arch, 0, 1), opt(adamw_section(), model),
        ref_opt(adamw_section(), reference), device(model.layout) {
    model.init_seeded(11, 0.05);
    reference.init_seeded(11, 0.05);
  }
  // Arrays (fp32 masters, moments) of any unit that differ from the reference's by a bit.
  int64_t differing() {
    int64_t n_differing = 0;
    for (size_t u = 0; u < model.layout.units.size(); ++u) {
      const size_t bytes = 4 * size_t(model.layout.units[u].shard_numel);
      n_differing += std::memcmp(model.param[u].data(), reference.param[u].data(), bytes) != 0;
      for (int s = 0; s < opt.states(); ++s)
        n_differing += std::memcmp(opt.state(s)[u].data(), ref_opt.state(s)[u].data(), bytes) != 0;
    }
    return n_differing;
  }
  ShardedModel model, reference;
  Optimizer opt, ref_opt;
  HostCopies device;
};

}  // namespace

TEST_SUITE("offload") {

TEST_CASE("offload pipeline on the host: micro-batch flags, landing, per-unit update bit for bit, bf16 uploads") {
  Twins t(small_arch());
  ShardedModel &model = t.model, &reference = t.reference;
  Optimizer &opt = t.opt, &ref_opt = t.ref_opt;
  HostCopies& device = t.device;
  OffloadPipeline pipeline(model, opt, device, device.device_shards());
  const int units = static_cast<int>(model.layout.units.size());

  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  const int steps = 2, micro = 3;
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    pipeline.begin_step(micro);
    for (int k = 0; k < micro; ++k) {
      const OffloadPipeline::MicroBatch mb = pipeline.next_micro_batch();
      CHECK(mb.first == (k == 0));
      CHECK(mb.last == (k == micro - 1));
      // Only the last micro-batch hands gradients over (the device summed them).
      if (!mb.last) CHECK_THROWS_WITH(pipeline.grad_ready(0, nullptr, model.layout.units[0].shard_numel),
                                      doctest::Contains("before the step's last micro-batch"));
    }
    CHECK_THROWS_WITH(pipeline.next_micro_batch(), doctest::Contains("micro-batch 4 of a 3-micro-batch step"));
    for (int u = units - 1; u >= 0; --u) {  // backward order
      if (u == 0) {
        const std::string want = "update with " + std::to_string(units - 1) + " of " + std::to_string(units) + " units";
        CHECK_THROWS_WITH(pipeline.update(3e-3, 0.5f), doctest::Contains(want.c_str()));
      }
      const int64_t n = model.layout.units[u].shard_numel;
      std::vector<float> g(n);
      for (int64_t i = 0; i < n; ++i) g[i] = reference.grad[u][i] = normal(rng);
      const int64_t ticket = pipeline.grad_ready(u, g.data(), n);
      CHECK(ticket >= 0);
    }
    for (int u = 0; u < units; ++u)  // landed in the grad shards, where the update reads them
      CHECK(std::memcmp(model.grad[u].data(), reference.grad[u].data(), model.grad[u].bytes()) == 0);

    const float clip = 0.5f;
    pipeline.update(3e-3, clip);
    for (int u = 0; u < units; ++u) pipeline.param_ready(u);  // the next forward
    pipeline.finish();
    ref_opt.step(3e-3, clip);
    CHECK(opt.steps_taken() == ref_opt.steps_taken());
    int64_t bf16_wrong = 0, padding_written = 0;
    for (int u = 0; u < units; ++u) {
      const auto& seg = model.segments(model.layout.units[u]);
      const int64_t n = model.layout.units[u].shard_numel;
      int64_t covered = 0;
      for (const auto& sg : seg) {
        for (int64_t i = sg.shard_offset; i < sg.shard_offset + sg.count; ++i)
          bf16_wrong += device.shards[u][i] != bf16_bits(model.param[u][i]);
        covered = std::max(covered, sg.shard_offset + sg.count);
      }
      for (int64_t i = covered; i < n; ++i) padding_written += device.shards[u][i] != 0xffff;
    }
    CHECK(t.differing() == 0);
    CHECK(bf16_wrong == 0);
    CHECK(padding_written == 0);  // uploads carry the parameters only; the device padding stays as it was
  }
  // The worker waited for every unit's gradient copy (and its previous upload);
  // the compute stream waited once per update for each unit's upload.
  CHECK(device.host_waits >= steps * units);
  CHECK(device.compute_waits == steps * units);
}

TEST_CASE("offload pipeline, gradients on the device: copied one unit ahead of the update, the same bits") {
  Twins t(small_arch(), /*host_grads=*/false);
  ShardedModel &model = t.model, &reference = t.reference;
  Optimizer &opt = t.opt, &ref_opt = t.ref_opt;
  HostCopies& device = t.device;
  for (const auto& g : model.grad) CHECK(g.size() == 0);  // no host gradient shards
  const OptimSection o = adamw_section();
  OffloadPipeline pipeline(model, opt, device, device.device_shards(), 0, /*device_grads=*/true);
  const int units = static_cast<int>(model.layout.units.size());
  // Host bytes: the upload slots plus two fp32 landing buffers of the largest shard.
  int64_t largest = 0;
  for (const auto& u : model.layout.units) largest = std::max(largest, u.shard_numel);
  CHECK(OffloadPipeline::host_bytes(model.layout, true) - OffloadPipeline::host_bytes(model.layout) == 8 * largest);

  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::vector<std::vector<float>> accum(units);  // the engine's "device" accumulators, read until the update
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    pipeline.begin_step(1);
    pipeline.next_micro_batch();
    const int64_t tickets_before = device.tickets;
    for (int u = units - 1; u >= 0; --u) {
      accum[u].resize(model.layout.units[u].shard_numel);
      for (auto& x : accum[u]) x = normal(rng);
      std::copy(accum[u].begin(), accum[u].end(), reference.grad[u].data());
      CHECK(pipeline.grad_ready(u, accum[u].data(), int64_t(accum[u].size())) == -1);
    }
    CHECK(device.tickets == tickets_before);  // nothing crossed during backward
    const float clip = step == 1 ? 0.25f : 1.0f;
    pipeline.update(3e-3, clip);
    for (int u = 0; u < units; ++u) pipeline.param_ready(u);
    pipeline.finish();
    CHECK(device.tickets - tickets_before >= 2 * units);  // each unit's gradient down, its bf16 shard up
    ref_opt.step(3e-3, clip);
    int64_t bf16_wrong = 0;
    for (int u = 0; u < units; ++u) {
      for (const auto& sg : model.segments(model.layout.units[u]))
        for (int64_t i = sg.shard_offset; i < sg.shard_offset + sg.count; ++i)
          bf16_wrong += device.shards[u][i] != bf16_bits(model.param[u][i]);
    }
    CHECK(t.differing() == 0);
    CHECK(bf16_wrong == 0);
  }
  // A pipeline for host gradients refuses a model without them.
  Optimizer other(o, model);
  CHECK_THROWS_WITH(OffloadPipeline(model, other, device, device.device_shards()), doctest::Contains("needs host gradient shards"));
}

// model.optim_gpu_state_gib: units [0, k) keep their state on the device and
// are updated there (emulated here by Optimizer::step_unit on the same step, as
// the device kernel does bit for bit); the pipeline takes, updates and uploads
// only units [k, U), and the forward waits for none of the device units.
TEST_CASE("offload pipeline with device units: only the offloaded units go through it, the same bits") {
  const ModelConfig arch = small_arch();
  const int units = static_cast<int>(ModelLayout(arch, 1).units.size());
  for (int device_units : {1, units - 1, units}) {
    INFO("device units " << device_units);
    Twins t(arch);
    ShardedModel &model = t.model, &reference = t.reference;
    Optimizer &opt = t.opt, &ref_opt = t.ref_opt;
    HostCopies& device = t.device;
    OffloadPipeline pipeline(model, opt, device, device.device_shards(), 0, false, nullptr, device_units);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      pipeline.begin_step(1);
      pipeline.next_micro_batch();
      const int64_t tickets_before = device.tickets, waits_before = device.compute_waits;
      for (int u = units - 1; u >= 0; --u) {
        const int64_t n = model.layout.units[u].shard_numel;
        for (int64_t i = 0; i < n; ++i) model.grad[u][i] = reference.grad[u][i] = normal(rng);
        if (u >= device_units) {
          std::vector<float> g(model.grad[u].data(), model.grad[u].data() + n);
          pipeline.grad_ready(u, g.data(), n);
        } else if (u == 0) {
          CHECK_THROWS_WITH(pipeline.grad_ready(u, model.grad[u].data(), n), doctest::Contains("on the device"));
        }
      }
      const float clip = step == 1 ? 0.5f : 1.0f;
      pipeline.update(3e-3, clip);  // counts the step: the device units take its number
      CHECK(opt.steps_taken() == step + 1);
      for (int u = 0; u < device_units; ++u) opt.step_unit(u, 3e-3, clip);
      for (int u = 0; u < units; ++u) pipeline.param_ready(u);
      pipeline.finish();
      ref_opt.step(3e-3, clip);
      // Uploads (and the compute stream's waits) only for the offloaded units.
      CHECK(device.tickets - tickets_before == 2 * (units - device_units));
      CHECK(device.compute_waits - waits_before == units - device_units);
      int64_t bf16_wrong = 0, device_units_uploaded = 0;
      for (int u = 0; u < units; ++u) {
        for (const auto& sg : model.segments(model.layout.units[u]))
          for (int64_t i = sg.shard_offset; i < sg.shard_offset + sg.count; ++i) {
            if (u >= device_units) bf16_wrong += device.shards[u][i] != bf16_bits(model.param[u][i]);
            else device_units_uploaded += device.shards[u][i] != 0xffff;
          }
      }
      CHECK(t.differing() == 0);
      CHECK(bf16_wrong == 0);
      CHECK(device_units_uploaded == 0);  // the device kernel writes those bf16 shards itself
    }
  }
}

// The update under the backward: each offloaded unit is updated as its
// gradient is handed over, as if the step were neither clipped nor skipped;
// update() confirms it (clip 1) or redoes every unit from the copy of its
// state with the clip factor; discard() (a NaN/Inf step) restores them. Every
// case ends bit for bit where Optimizer::step on a reference model does (the
// exact path), with clipping never, always and sometimes active, a skipped
// step, device units in front, gradients on the device, and each rank's
// shards of a world of 2.
TEST_CASE("speculative offload pipeline: the update under the backward, redone or discarded exactly") {
  const ModelConfig arch = small_arch();
  const int all_units = static_cast<int>(ModelLayout(arch, 1).units.size());
  const float kSkip = -1.0f;  // a NaN/Inf step
  struct Case {
    const char* name;
    std::vector<float> clips;  // per step: 1 (no clipping), a factor, or kSkip
    int64_t redone;
  };
  const Case cases[] = {{"clipping never active", {1, 1, 1, 1}, 0},
                        {"clipping always active", {0.5f, 0.25f, 0.7f, 0.5f}, 4},
                        {"clipping sometimes active, a skipped step", {1, 0.5f, 1, kSkip, 0.25f, 1, 1}, 3}};
  for (const Case& c : cases)
    for (int world : {1, 2})
      for (int rank = 0; rank < world; ++rank)
        for (bool device_grads : {false, true})
          for (int device_units : {0, 1}) {
            INFO(c.name << ", world " << world << " rank " << rank << (device_grads ? ", device grads" : "")
                        << ", device units " << device_units);
            ShardedModel model(arch, rank, world, !device_grads), reference(arch, rank, world);
            model.init_seeded(11, 0.05);
            reference.init_seeded(11, 0.05);
            Optimizer opt(adamw_section(), model), ref_opt(adamw_section(), reference);
            HostCopies device(model.layout);
            OffloadPipeline pipeline(model, opt, device, device.device_shards(), 0, device_grads, nullptr, device_units,
                                     /*speculative=*/true);
            std::mt19937 rng(3 + rank);
            std::normal_distribution<float> normal(0.0f, 0.1f);
            std::vector<std::vector<float>> grads(all_units);  // the "device" accumulators
            for (size_t step = 0; step < c.clips.size(); ++step) {
              INFO("step " << step);
              const double lr = 3e-3 * double(step + 1);  // a schedule: each step its own lr
              pipeline.begin_step(1);
              pipeline.next_micro_batch();
              pipeline.speculate(lr);
              for (int u = all_units - 1; u >= 0; --u) {  // backward order
                auto& g = grads[size_t(u)];
                g.resize(size_t(model.layout.units[u].shard_numel));
                for (auto& x : g) x = normal(rng);
                std::copy(g.begin(), g.end(), reference.grad[u].data());
                if (!device_grads) std::copy(g.begin(), g.end(), model.grad[u].data());  // the device units' gradients
                if (u >= device_units) pipeline.grad_ready(u, g.data(), int64_t(g.size()));
              }
              const float clip = c.clips[step];
              if (clip == kSkip) {
                pipeline.discard();
              } else {
                pipeline.update(lr, clip);
                ref_opt.step(lr, clip);
                for (int u = 0; u < device_units; ++u)  // the device kernel, emulated
                  opt.step_unit(u, lr, clip, nullptr, device_grads ? grads[size_t(u)].data() : nullptr);
              }
              for (int u = 0; u < all_units; ++u) pipeline.param_ready(u);  // the next forward
              pipeline.finish();
              CHECK(opt.steps_taken() == ref_opt.steps_taken());
              int64_t differing = 0, bf16_wrong = 0;
              for (int u = 0; u < all_units; ++u) {
                const int64_t n = model.layout.units[u].shard_numel;
                differing += std::memcmp(model.param[u].data(), reference.param[u].data(), 4 * n) != 0;
                for (int k = 0; k < opt.states(); ++k)
                  differing += std::memcmp(opt.state(k)[u].data(), ref_opt.state(k)[u].data(), 4 * n) != 0;
                if (u < device_units) continue;
                for (const auto& sg : model.segments(model.layout.units[u]))
                  for (int64_t i = sg.shard_offset; i < sg.shard_offset + sg.count; ++i)
                    bf16_wrong += device.shards[u][i] != bf16_bits(model.param[u][i]);
              }
              CHECK(differing == 0);
              CHECK(bf16_wrong == 0);  // what the next forward reads: the final update's shard
            }
            CHECK(pipeline.redone_steps() == c.redone);
          }
  // A pipeline built without the copies refuses to speculate.
  Twins t(small_arch());
  OffloadPipeline plain(t.model, t.opt, t.device, t.device.device_shards());
  plain.begin_step(1);
  CHECK_THROWS_WITH(plain.speculate(1e-3), doctest::Contains("without copies of the state"));
}

// The split: the most units, from the embedding on, whose fp32 masters and
// moments fit the budget; and model.optim_gpu_state_gib resolved against the
// plan (app/plan.hpp) for a given GPU size.
TEST_CASE("offload split: device units from the embedding on, within the cap and what the plan leaves") {
  const ModelConfig arch = small_arch();
  const ModelLayout layout(arch, 1);
  const int units = static_cast<int>(layout.units.size());
  REQUIRE(units >= 3);
  const int64_t one = offload_device_unit_bytes(layout, 2, 1), two = offload_device_unit_bytes(layout, 2, 2);
  CHECK(one == 12 * layout.units[0].shard_numel);  // AdamW: master + 2 moments, fp32
  CHECK(two - one == 12 * layout.units[1].shard_numel);
  CHECK(offload_device_units_within(layout, 2, 0) == 0);
  CHECK(offload_device_units_within(layout, 2, one - 1) == 0);
  CHECK(offload_device_units_within(layout, 2, one) == 1);
  CHECK(offload_device_units_within(layout, 2, two - 1) == 1);
  CHECK(offload_device_units_within(layout, 2, two) == 2);
  CHECK(offload_device_units_within(layout, 2, INT64_MAX) == units);

  auto split = [&](std::vector<std::string> sets, int64_t gpu_bytes) {
    sets.push_back("model.optim_cpu_offload=true");
    sets.push_back("device.backend=cuda");
    const DeckResult deck = parse_deck("inputs/tiny-sft.toml", sets, 1);
    REQUIRE(deck.ok());
    // The CPU backend's plan puts nothing on a device: the GPU's room is gpu_bytes less the margin.
    return offload_gpu_units(deck.config, layout, *make_cpu_backend(), gpu_bytes);
  };
  CHECK(split({}, 0) == 0);                     // automatic without a GPU to size against: all offloaded
  CHECK(split({}, int64_t(1) << 40) == units);  // a large GPU: all of it on the device
  // The margin is 4 GiB + 1/32 of the GPU: a GPU that leaves exactly the first
  // unit's state past it takes that unit, a few bytes less none.
  const int64_t fixed = int64_t(4) << 30;
  CHECK(split({}, ((one + fixed) * 32 + 30) / 31) == 1);
  CHECK(split({}, ((one - 2 + fixed) * 32) / 31) == 0);
  CHECK(split({}, fixed) == 0);
  CHECK(split({"model.optim_gpu_state_gib=0"}, int64_t(1) << 40) == 0);  // the cap: every unit offloaded
  const double one_gib = double(one) / 1073741824.0;
  CHECK(split({"model.optim_gpu_state_gib=" + std::to_string(one_gib * 1.0001)}, 0) == 1);  // a cap alone places units
  CHECK(split({"model.optim_gpu_state_gib=" + std::to_string(one_gib * 1.0001)}, int64_t(1) << 40) == 1);
  // Without the offload pipeline nothing is split.
  const DeckResult plain = parse_deck("inputs/tiny-sft.toml", {"device.backend=cuda"}, 1);
  REQUIRE(plain.ok());
  CHECK(offload_gpu_units(plain.config, layout, *make_cpu_backend(), int64_t(1) << 40) == 0);
}

TEST_CASE("model.optim_gpu_state_gib and optim_offload_speculate: refused without optim_cpu_offload and with Muon") {
  DeckResult r = parse_deck("inputs/tiny-sft.toml", {"model.optim_gpu_state_gib=4"}, 1);
  REQUIRE(r.errors.size() == 1);
  CHECK(r.errors[0].find("model.optim_gpu_state_gib caps the optimizer state that model.optim_cpu_offload keeps on the "
                         "GPU: it needs model.optim_cpu_offload = true") != std::string::npos);
  r = parse_deck("inputs/tiny-sft.toml",
                 {"model.optim_gpu_state_gib=4", "model.optim_cpu_offload=true", "optim.name=\"muon\""}, 1);
  REQUIRE(!r.ok());
  bool named = false;
  for (const auto& e : r.errors) named |= e.find("model.optim_gpu_state_gib is for AdamW and SGD") != std::string::npos;
  CHECK(named);
  CHECK(parse_deck("inputs/tiny-sft.toml", {"model.optim_gpu_state_gib=0"}, 1).ok());  // 0 is today's offload: no error
  r = parse_deck("inputs/tiny-sft.toml", {"model.optim_gpu_state_gib=-2", "model.optim_cpu_offload=true"}, 1);
  CHECK(!r.ok());
  // The update under the backward: the same two rules.
  r = parse_deck("inputs/tiny-sft.toml", {"model.optim_offload_speculate=true"}, 1);
  REQUIRE(r.errors.size() == 1);
  CHECK(r.errors[0].find("model.optim_offload_speculate updates the offloaded units during the backward: it needs "
                         "model.optim_cpu_offload = true") != std::string::npos);
  r = parse_deck("inputs/tiny-sft.toml",
                 {"model.optim_offload_speculate=true", "model.optim_cpu_offload=true", "optim.name=\"muon\""}, 1);
  named = false;
  for (const auto& e : r.errors) named |= e.find("model.optim_offload_speculate is for AdamW and SGD") != std::string::npos;
  CHECK(named);
  CHECK(parse_deck("inputs/tiny-sft.toml", {"model.optim_offload_speculate=true", "model.optim_cpu_offload=true"}, 1).ok());
}

TEST_CASE("zero_shard_first_touch zeroes segments, the gaps between them and the padding") {
  const int64_t numel = 5 * cpu::kAdamWBlock + 123;
  std::vector<float> shard(numel, std::nanf(""));
  ParamInfo a, b;
  // Two segments with a gap between them and padding after: 1.5 blocks, then 3 blocks.
  const std::vector<ShardSegment> segs = {{&a, 0, 7, cpu::kAdamWBlock + cpu::kAdamWBlock / 2},
                                          {&b, 0, 2 * cpu::kAdamWBlock, 3 * cpu::kAdamWBlock}};
  zero_shard_first_touch(shard.data(), segs, numel);
  int64_t nonzero = 0;
  for (float x : shard) nonzero += !(x == 0.0f);
  CHECK(nonzero == 0);
}

TEST_CASE("Optimizer::step_unit writes the bf16 copy of every updated element (AdamW and SGD)") {
  const ModelConfig arch = small_arch();
  for (const char* name : {"adamw", "sgd"}) {
    INFO(name);
    ShardedModel model(arch, 0, 1);
    model.init_seeded(2, 0.05);
    OptimSection o;
    o.name = name;
    o.momentum = 0.9;
    Optimizer opt(o, model);
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (auto& g : model.grad)
      for (int64_t i = 0; i < g.size(); ++i) g[i] = normal(rng);
    opt.begin_step();
    int64_t wrong = 0, moved = 0;
    for (int u = 0; u < static_cast<int>(model.layout.units.size()); ++u) {
      const int64_t n = model.layout.units[u].shard_numel;
      std::vector<float> before(model.param[u].data(), model.param[u].data() + n);
      std::vector<uint16_t> bf16(n, 0xffff);
      opt.step_unit(u, 1e-2, 1.0f, bf16.data());
      for (const auto& sg : model.segments(model.layout.units[u]))
        for (int64_t i = sg.shard_offset; i < sg.shard_offset + sg.count; ++i) {
          wrong += bf16[i] != bf16_bits(model.param[u][i]);
          moved += model.param[u][i] != before[i];
        }
    }
    CHECK(wrong == 0);
    CHECK(moved > 1000);
  }
}

}  // TEST_SUITE

// An async save's writer reads the device state's host mirror
// while training goes on; pull_state() (the filesystem broadcast pulls every
// broadcast step) must not overwrite it before the writer's last read.
TEST_CASE("HostShardReader: pull waits until the reader has read the mirror, following its progress") {
  HostShardReader reader;
  std::atomic<int64_t> progress{0};
  std::vector<float> mirror(1024, 1.0f);  // step N's state
  double sum_read = 0;
  reader.begin(&progress);
  std::thread writer([&] {
    for (int piece = 0; piece < 8; ++piece) {  // a slow writer: 8 pieces, 25 ms each
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      for (int i = piece * 128; i < (piece + 1) * 128; ++i) sum_read += mirror[size_t(i)];
      progress.fetch_add(1);
    }
    reader.end();
  });
  reader.wait_done();
  std::fill(mirror.begin(), mirror.end(), 2.0f);  // what pull() would do: step N + k
  writer.join();
  CHECK(sum_read == 1024.0);  // every element the writer read was step N's
  CHECK(progress.load() == 8);
  reader.wait_done();  // no reader: returns at once
}
