// engine.cpp — the sharded unit loop: gather, compute, release, reduce-scatter.
#include "train/engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "shardlm/cuda.hpp"
#include "shardlm/error.hpp"
#include "train/reference_pass.hpp"
#include "train/sequence_pass.hpp"

namespace shardlm {

// The version a backend's weight caches (FP8 codes) are told during a pass on
// other weights: never one of the training weights' (0, 1, ...).
constexpr int64_t kOtherWeightsVersion = -2;
namespace {

// Expert parallelism's units (each rank's own experts) are never gathered nor
// reduced: the gather and gradient slots are sized by the other units.
bool gathered(const Unit& u) { return u.kind != UnitKind::Experts; }
int64_t max_padded(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units)
    if (gathered(u)) n = std::max(n, u.padded_numel);
  return n;
}
int64_t max_shard(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units)
    if (gathered(u)) n = std::max(n, u.shard_numel);
  return n;
}
// The largest experts unit's shard: the one buffer their gradients are computed in.
int64_t max_experts_shard(const ModelLayout& layout) {
  int64_t n = 0;
  for (const auto& u : layout.units)
    if (!gathered(u)) n = std::max(n, u.shard_numel);
  return n;
}

// Gathered parameter slots: current + prefetch, plus the embedding that a tied
// head re-gathers; every unit when nothing is resharded after forward.
int param_slot_count(const ModelLayout& layout, bool reshard) {
  return reshard ? 3 : static_cast<int>(std::count_if(layout.units.begin(), layout.units.end(), gathered));
}
// Gradient slots: one being computed, one being reduced, plus the embedding's
// when the tied head writes into it long before the embedding's own backward.
int grad_slot_count() { return 3; }

// Gradients go straight into the host shards (CPU, one rank) or the device
// accumulators (device state or the offload pipeline, one rank); otherwise
// through full-unit slots that are reduced (world > 1) and handed over.
bool grad_slots_needed(int world, const Backend& backend, StatePlacement state) {
  return world > 1 || (!backend.host_resident() && state == StatePlacement::Host);
}

// model.reduce_dtype = "bf16": gradients cross the wire in bf16 (world > 1).
bool bf16_gradients(int world, const EngineOptions& o) { return o.reduce_bf16 && world > 1; }

}  // namespace

int64_t norm_pieces(const Unit& unit, int world, std::vector<NormPiece>* out) {
  std::vector<int64_t> held(size_t(world), 0);
  for (const NormSlot& slot : norm_slots(unit)) {
    const int64_t begin = slot.param->offset, end = begin + slot.param->numel;
    for (int64_t lo = begin; lo < end;) {
      const int r = static_cast<int>(lo / unit.shard_numel);
      const int64_t hi = std::min(end, (int64_t(r) + 1) * unit.shard_numel);
      if (out) out->push_back({r, lo - r * unit.shard_numel, slot.packed + (lo - begin), hi - lo, held[size_t(r)]});
      held[size_t(r)] += hi - lo;
      lo = hi;
    }
  }
  return *std::max_element(held.begin(), held.end());
}

void owned_rows(float* out, const int32_t* ids, int64_t n, const float* shard, int64_t shard_begin,
                int64_t shard_numel, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t e = int64_t(ids[t]) * C + c - shard_begin;
      out[t * C + c] = ids[t] >= 0 && e >= 0 && e < shard_numel ? shard[e] : 0.0f;
    }
}

int64_t chunk_row_ids(const int32_t* all_ids, int world, int64_t max_tokens, int64_t k, int32_t* out) {
  const int64_t W = world, M = max_tokens;
  int64_t used = 0;
  for (int64_t q = 0; q < W; ++q) {
    const int32_t* ids = all_ids + q * M;
    used = std::max(used, int64_t(std::find(ids, ids + M, -1) - ids));
  }
  std::fill(out, out + W * M, -1);
  for (int64_t q = 0; q < W; ++q)
    for (int64_t t = 0; t < used; ++t) {
      const int64_t j = t / k, kk = std::min(k, M - j * k);
      out[j * W * k + q * kk + t % k] = all_ids[q * M + t];
    }
  return used;
}

RowChunks fp32_row_chunks(int world, int64_t max_tokens, int64_t hidden, int64_t max_part_bytes) {
  RowChunks r;
  r.tokens = max_tokens;
  if (world > 1) {
    const int64_t bound = std::min(kRowPartsBytes, max_part_bytes);
    r.tokens = std::clamp<int64_t>(bound / (4 * int64_t(world) * hidden), 1, max_tokens);
    if (const char* e = std::getenv("SHARDLM_TEST_ROW_CHUNK"); e && std::atoll(e) > 0)  // tests: several chunks
      r.tokens = std::min<int64_t>(std::atoll(e), max_tokens);
    r.part_floats = int64_t(world) * r.tokens * hidden;
  }
  r.count = (max_tokens + r.tokens - 1) / r.tokens;
  r.id_count = int64_t(world) * max_tokens;
  return r;
}

namespace {

// Router replay's routes come from a rollout file: each recorded expert must
// be one of this model's and a token's K distinct (a row of -1 is a position
// nothing was recorded for). Checked before any backend indexes with them.
void check_routes(const ModelConfig& c, const TokenBatch& b) {
  SHARDLM_CHECK(c.moe(), "internal: router replay's routes for a model without experts");
  const int64_t R = c.route_width(), K = c.num_experts_per_tok, E = c.num_experts;
  for (int64_t n = 0; n < b.N; ++n)
    for (int64_t at = 0; at < R; at += K) {
      const int32_t* e = b.routes + n * R + at;
      if (e[0] < 0) continue;
      for (int64_t j = 0; j < K; ++j)
        SHARDLM_CHECK(e[j] >= 0 && e[j] < E && std::find(e, e + j, e[j]) == e + j,
                      "router replay: token %lld of the micro-batch, layer of experts %lld, was routed to experts "
                      "[%s] by the sampler: each of the K = %lld must be distinct and in [0, %lld) (was the "
                      "rollout file written for another model?)",
                      (long long)n, (long long)(at / K), [&] {
                        std::string list;
                        for (int64_t i = 0; i < K; ++i) list += (i ? ", " : "") + std::to_string(e[i]);
                        return list;
                      }().c_str(), (long long)K, (long long)E);
    }
}

// What bounds one reduce-scatter of the fp32 rows' parts: a staged device Comm
// (ranks sharing a GPU, comm.backend = "mpi") copies through pinned buffers of
// one fp32 unit (make_device_comm's staging below); NCCL and the host Comm take any size.
int64_t row_part_bound(const ModelLayout& layout, int world, bool device, const EngineOptions& o) {
  return device && world > 1 && o.comm_backend == "mpi" ? 4 * max_padded(layout) : kRowPartsBytes;
}
}  // namespace

MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& o, int optim_states,
                       const Backend& backend) {
  // Every product below stays in int64 for sizes that pass this.
  if (std::string e = model_scale_error(config, o.max_tokens, o.chunk_tokens); !e.empty())
    SHARDLM_FAIL("memory plan: %s", e.c_str());
  const ModelLayout layout(config, world, o.expert_parallel);
  MemoryPlan plan;
  plan.device = !backend.host_resident();
  plan_state_memory(plan, o, layout, optim_states, backend);
  if (plan.device)  // the backend's own copy of every shard
    for (const auto& u : layout.units) plan.param_copies += u.shard_numel * backend.param_bytes();
  if (world > 1)
    plan.gathered += backend.param_bytes() * param_slot_count(layout, o.reshard_after_forward) * max_padded(layout);
  if (grad_slots_needed(world, backend, o.state)) {
    // One rank hands the whole unit over: no reduced slice to receive.
    plan.gathered += 4 * grad_slot_count() * (max_padded(layout) + (world > 1 ? max_shard(layout) : 0));
    if (bf16_gradients(world, o)) plan.gathered += 2 * grad_slot_count() * max_padded(layout);
  }
  plan.gathered += 4 * max_experts_shard(layout);  // expert parallelism: the owned experts' gradients
  // Several ranks on one GPU: two pinned host buffers of one full fp32 unit each.
  if (plan.device && world > 1 && o.comm_backend == "mpi") plan.comm_staging = 2 * 4 * max_padded(layout);
  if (plan.device && o.residual_fp32) {  // the fp32 embedding rows' ids and parts (Engine::embed_rows_fp32)
    const RowChunks r =
        fp32_row_chunks(world, o.max_tokens, config.hidden_size, row_part_bound(layout, world, plan.device, o));
    plan.workspace += 4 * r.id_count + 4 * r.part_floats;
    EngineOptions bf16 = o;
    bf16.residual_fp32 = false;
    plan.fp32_stream = 4 * r.id_count + 4 * r.part_floats + backend.activation_bytes(config, o) -
                       backend.activation_bytes(config, bf16) + backend.workspace_bytes(config, o) -
                       backend.workspace_bytes(config, bf16);
  }
  if (plan.device && world > 1 && o.norm_fp32) {  // the fp32 norm weights' gather buffers (Engine::refresh_norms)
    int64_t share = 0;
    for (const auto& u : layout.units) share = std::max(share, norm_pieces(u, world, nullptr));
    plan.workspace += 4 * share * (1 + world);
  }
  // The context-parallel ring's own staged Comm (cuda/ring_attention.hpp,
  // RingBuffers::staging_bytes): two pinned buffers of its largest message, the
  // block's fp32 dk | dv accumulators (2 x N x KV x D x 4 bytes).
  if (plan.device && o.context_parallel > 1 && o.comm_backend == "mpi")
    plan.comm_staging += 2 * 2 * o.max_tokens * config.num_kv_heads * config.head_dim * 4;
  // Expert parallelism's device Comm (CudaBackend::set_expert_parallel): two
  // pinned buffers of its largest exchange, every rank's rows to one owner (P N K rows of C bf16).
  if (plan.device && o.expert_parallel > 1 && o.comm_backend == "mpi")
    plan.comm_staging += 2 * 2 * o.expert_parallel * o.max_tokens * config.num_experts_per_tok * config.hidden_size;
  plan.activations = backend.activation_bytes(config, o);
  plan.workspace += backend.workspace_bytes(config, o);
  // A loss over whole samples: the forward-only pass's host buffers (train/sequence_pass.hpp).
  (plan.device ? plan.host_workspace : plan.workspace) += sequence_pass_bytes(o);
  // The KL term against the starting weights: their frozen copy (train/reference_pass.hpp).
  plan.reference_weights += reference_weights_bytes(o, layout);
  plan.reference_copies += reference_copies_bytes(o, layout, backend);
  return plan;
}

Engine::Engine(ShardedModel& model, Comm& comm, const EngineOptions& options, std::unique_ptr<Backend> backend)
    : model_(model),
      comm_(comm),
      options_(options),
      backend_(std::move(backend)),
      config_(model.layout.config),
      sharded_(comm.size() > 1) {
  SHARDLM_CHECK(comm.size() == model.world, "the communicator has %d ranks but the model is sharded %d ways",
                comm.size(), model.world);
  const ModelLayout& layout = model.layout;
  SHARDLM_CHECK(!options.reduce_bf16 || !backend_->host_resident(),
                "model.reduce_dtype = \"bf16\" needs a GPU backend (the CPU backend is the fp32 reference)");
  grad_slots_used_ = grad_slots_needed(comm.size(), *backend_, options.state);
  reduce_type_ = bf16_gradients(comm.size(), options) ? DType::BF16 : DType::F32;
  gather_type_ = backend_->param_bytes() == 2 ? DType::BF16 : DType::F32;
  slot_floats_ = max_padded(layout);
  recv_floats_ = max_shard(layout);
  if (sharded_) {
    param_slots_.resize(param_slot_count(layout, options.reshard_after_forward));
    for (auto& s : param_slots_) s.full = backend_->allocate(Mem::Gathered, backend_->param_bytes() * slot_floats_);
  }
  if (grad_slots_used_) {
    grad_slots_.resize(grad_slot_count());
    for (auto& s : grad_slots_) {
      s.full = static_cast<float*>(backend_->allocate(Mem::Gathered, 4 * slot_floats_));
      if (sharded_) s.recv = backend_->allocate(Mem::Gathered, 4 * recv_floats_);
      if (reduce_type_ == DType::BF16) s.full_bf16 = backend_->allocate(Mem::Gathered, 2 * slot_floats_);
    }
  }
  // A device backend gathers and reduces device buffers: NCCL, or MPI staged
  // through host memory; the host Comm keeps the small collectives.
  if (sharded_ && !backend_->host_resident())
    device_comm_ = make_device_comm(comm, options.comm_backend, backend_->stream(), 4 * slot_floats_,
                                    options.comm_timeout_s);
  unit_comm_ = device_comm_ ? device_comm_.get() : &comm_;
  experts_grad_floats_ = max_experts_shard(layout);
  if (experts_grad_floats_ > 0)
    experts_grad_ = static_cast<float*>(backend_->allocate(Mem::Gathered, 4 * experts_grad_floats_));
  backend_->attach_shards(layout);
  backend_->prepare(config_, options);
  plan_norm_copies();
  if (backend_->embedding_rows_fp32()) {
    row_chunks_ = fp32_row_chunks(comm.size(), options.max_tokens, config_.hidden_size,
                                  row_part_bound(layout, comm.size(), !backend_->host_resident(), options));
    row_ids_.assign(size_t(row_chunks_.id_count), -1);
    own_ids_.assign(size_t(options.max_tokens), -1);
    if (sharded_) all_ids_.assign(size_t(comm.size()) * options.max_tokens, -1);
    row_ids_dev_ = static_cast<int32_t*>(backend_->allocate(Mem::Workspace, 4 * row_chunks_.id_count));
    if (sharded_) row_parts_ = static_cast<float*>(backend_->allocate(Mem::Workspace, 4 * row_chunks_.part_floats));
  }
}

// The fp32 stream starts from the masters' embedding rows. At one rank they
// come straight from the master shard; at several, each rank writes the
// elements of every rank's rows that its shard holds (zeros elsewhere) and a
// reduce-scatter sums them: one nonzero term per element, so the sum is exact.
// The rows go in chunks of row_chunks_.tokens tokens a rank (the last one
// shorter), the same on every rank, so the parts buffer is world x chunk x
// hidden, not world x max_tokens x hidden; only the chunks up to the longest
// rank's batch run.
void Engine::embed_rows_fp32(const TokenBatch& b, float* rows) {
  const Unit& u = model_.layout.embed();
  const int64_t C = config_.hidden_size, M = options_.max_tokens, W = comm_.size();
  state_->param_ready(0);
  const float* master = this->master(0);
  void* stream = backend_->stream();
  const int64_t k = row_chunks_.tokens;
  auto chunk_tokens = [&](int64_t j) { return std::min(k, M - j * k); };
  int64_t used = b.N;  // tokens a rank: the longest rank's batch
  if (sharded_) {  // every rank's ids, each padded to M with -1, laid out by chunk: chunk j at j W k, [rank][its tokens]
    std::fill(own_ids_.begin(), own_ids_.end(), -1);
    std::copy(b.tokens, b.tokens + b.N, own_ids_.begin());
    comm_.all_gather(own_ids_.data(), all_ids_.data(), M, DType::F32).wait();  // 4-byte words, moved as they are
    used = chunk_row_ids(all_ids_.data(), int(W), M, k, row_ids_.data());
  } else {
    std::copy(b.tokens, b.tokens + b.N, row_ids_.begin());
  }
  const int64_t chunks = sharded_ ? (used + k - 1) / k : 1;
  const int64_t begin = comm_.rank() * u.shard_numel;
  const bool on_device = master_on_device(0);
  if (on_device) cuda_copy_async(row_ids_dev_, row_ids_.data(), 4 * (sharded_ ? W * std::min(chunks * k, M) : b.N),
                                 stream);
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t kk = sharded_ ? chunk_tokens(j) : b.N, n = sharded_ ? W * kk : b.N;  // rows built
    const int64_t first = j * W * k;  // the chunk's ids
    float* out = sharded_ ? row_parts_ : rows;
    if (on_device) {
      cuda_owned_rows(out, row_ids_dev_ + first, n, master, begin, u.shard_numel, C, stream);
    } else {  // the masters in host memory (offload): the rows built here, then copied up
      row_staging_.resize(size_t(n * C));
      owned_rows(row_staging_.data(), row_ids_.data() + first, n, master, begin, u.shard_numel, C);
      cuda_copy_async(out, row_staging_.data(), 4 * n * C, stream);
    }
    if (sharded_) unit_comm_->reduce_scatter(row_parts_, rows + j * k * C, kk * C, DType::F32).wait();
  }
}

void Engine::plan_norm_copies() {
  const ModelLayout& layout = model_.layout;
  if (!backend_->norm_weights_fp32(0)) return;
  const int world = comm_.size();
  norm_pieces_.assign(layout.units.size(), {});
  norm_share_.assign(layout.units.size(), 0);
  norm_version_.assign(layout.units.size(), -1);
  for (size_t u = 0; u < layout.units.size(); ++u) {
    norm_share_[u] = norm_pieces(layout.units[u], world, &norm_pieces_[u]);
    norm_share_max_ = std::max(norm_share_max_, norm_share_[u]);
  }
  if (sharded_ && norm_share_max_ > 0) {
    norm_send_ = static_cast<float*>(backend_->allocate(Mem::Workspace, 4 * norm_share_max_));
    norm_recv_ = static_cast<float*>(backend_->allocate(Mem::Workspace, 4 * norm_share_max_ * world));
  }
}

// At one rank each piece goes straight from the master shard (host or device
// memory) to the backend's copy; at several, each rank's pieces travel in one
// fp32 all-gather of the unit's largest share. Queued on the backend's stream.
void Engine::refresh_norms(int unit) {
  if (norm_pieces_.empty() || norm_pieces_[size_t(unit)].empty()) return;
  const int64_t version = state_->param_version();
  if (norm_version_[size_t(unit)] == version) return;
  norm_version_[size_t(unit)] = version;
  float* dst = backend_->norm_weights_fp32(unit);
  const float* master = this->master(unit);
  void* stream = backend_->stream();
  const std::vector<NormPiece>& pieces = norm_pieces_[size_t(unit)];
  if (!sharded_) {
    for (const NormPiece& p : pieces) cuda_copy_async(dst + p.packed, master + p.shard_offset, 4 * p.count, stream);
    return;
  }
  const int64_t share = norm_share_[size_t(unit)];
  for (const NormPiece& p : pieces)
    if (p.rank == comm_.rank())
      cuda_copy_async(norm_send_ + p.send_offset, master + p.shard_offset, 4 * p.count, stream);
  unit_comm_->all_gather(norm_send_, norm_recv_, share, DType::F32).wait();
  for (const NormPiece& p : pieces)
    cuda_copy_async(dst + p.packed, norm_recv_ + p.rank * share + p.send_offset, 4 * p.count, stream);
}

void Engine::set_state(TrainingState& state) {
  // The gradient slots (and the plan) were sized for options.state.
  SHARDLM_CHECK(state.placement() == options_.state, "internal: the engine was planned for the %s state, not %s",
                placement_name(options_.state), state.name());
  state_ = &state;
  own_state_.reset();
}

TrainingState& Engine::state() {
  // Used on its own (forward passes, tests), the engine keeps its gradients in
  // the model's host shards, as the host placement does.
  if (!state_) own_state_ = make_host_state(model_, nullptr, *backend_), state_ = own_state_.get();
  return *state_;
}

Engine::~Engine() {
  for (auto& s : param_slots_) {
    s.request.wait();
    backend_->deallocate(Mem::Gathered, s.full, backend_->param_bytes() * slot_floats_);
  }
  for (auto& s : grad_slots_) {
    s.request.wait();
    backend_->deallocate(Mem::Gathered, s.full, 4 * slot_floats_);
    if (s.recv) backend_->deallocate(Mem::Gathered, s.recv, 4 * recv_floats_);
    if (s.full_bf16) backend_->deallocate(Mem::Gathered, s.full_bf16, 2 * slot_floats_);
  }
  if (experts_grad_) backend_->deallocate(Mem::Gathered, experts_grad_, 4 * experts_grad_floats_);
  // The device Comm's collectives are done before it goes.
  backend_->synchronize();
  if (row_ids_dev_) backend_->deallocate(Mem::Workspace, row_ids_dev_, 4 * row_chunks_.id_count);
  if (row_parts_) backend_->deallocate(Mem::Workspace, row_parts_, 4 * row_chunks_.part_floats);
  if (norm_send_) backend_->deallocate(Mem::Workspace, norm_send_, 4 * norm_share_max_);
  if (norm_recv_) backend_->deallocate(Mem::Workspace, norm_recv_, 4 * norm_share_max_ * comm_.size());
}

// ---------------------------------------------------------------- gathering

const void* Engine::shard(int unit) const {
  return weights_ ? weights_->shards[size_t(unit)] : backend_->param_shard(unit);
}
const float* Engine::master(int unit) {
  return weights_ && !weights_->masters.empty() ? weights_->masters[size_t(unit)] : state_->master_shard(unit);
}
bool Engine::master_on_device(int unit) const {
  return weights_ && !weights_->masters.empty() ? false : state_->master_on_device(unit);
}

void Engine::prefetch(int unit) {
  if (!sharded_) return;
  for (auto& s : param_slots_)
    if (s.unit == unit) return;
  for (auto& s : param_slots_) {
    if (s.unit != -1) continue;
    s.unit = unit;
    state_->param_ready(unit);
    // In the backend's own precision: fp32 on the CPU, bf16 on GPUs.
    s.request = unit_comm_->all_gather(shard(unit), s.full, model_.layout.units[unit].shard_numel, gather_type_);
    return;
  }
  // No free slot: the unit is gathered when it is needed instead.
}

const void* Engine::params(int unit) {
  state_->param_ready(unit);
  refresh_norms(unit);
  if (!sharded_) return shard(unit);  // one rank: the shard is the whole unit
  prefetch(unit);
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      return s.full;
    }
  SHARDLM_FAIL("internal: no gather slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::gather_unit_bf16(int unit, void* device_out) {
  SHARDLM_CHECK(!backend_->host_resident() && gather_type_ == DType::BF16,
                "internal: gather_unit_bf16 needs a GPU backend (bf16 device parameter shards)");
  // optim_cpu_offload: the unit's shard is current only once its update has been uploaded.
  state().param_ready(unit);
  const Unit& u = model_.layout.units[unit];
  if (sharded_) unit_comm_->all_gather(backend_->param_shard(unit), device_out, u.shard_numel, DType::BF16).wait();
  else cuda_copy_async(device_out, backend_->param_shard(unit), 2 * u.shard_numel, backend_->stream());
}

void Engine::release(int unit) {
  for (auto& s : param_slots_)
    if (s.unit == unit) {
      s.request.wait();
      s.unit = -1;
    }
}

// ---------------------------------------------------------------- gradients

float* Engine::grads(int unit) {
  if (!grad_slots_used_) return state_->direct_grad(unit);  // accumulate straight into the shard
  for (auto& s : grad_slots_)
    if (s.unit == unit) return s.full;
  // Take the oldest slot in turn; a slot whose reduction started is finished first.
  for (size_t tries = 0; tries < grad_slots_.size(); ++tries) {
    GradSlot& s = grad_slots_[next_grad_slot_];
    next_grad_slot_ = (next_grad_slot_ + 1) % static_cast<int>(grad_slots_.size());
    if (s.unit != -1 && !s.reducing) continue;  // held (tied embedding), still being written
    if (s.unit != -1) finish_grad(s);
    s.unit = unit;
    backend_->zero(s.full, sizeof(float) * model_.layout.units[unit].padded_numel);
    return s.full;
  }
  SHARDLM_FAIL("internal: no gradient slot free for unit %s", model_.layout.units[unit].name.c_str());
}

void Engine::reduce_grads(int unit) {
  if (!grad_slots_used_) {  // one rank: the accumulator is the shard
    state_->unit_done(unit);
    return;
  }
  for (auto& s : grad_slots_)
    if (s.unit == unit) {
      s.reducing = true;
      const Unit& u = model_.layout.units[unit];
      const void* full = s.full;
      if (reduce_type_ == DType::BF16) {  // round once here, then half the bytes on the wire (or the link)
        backend_->cast_to_bf16(s.full_bf16, s.full, u.padded_numel);
        full = s.full_bf16;
      }
      if (sharded_) s.request = unit_comm_->reduce_scatter(full, s.recv, u.shard_numel, reduce_type_);
      return;
    }
}

void Engine::finish_grad(GradSlot& s) {
  s.request.wait();
  // One rank: the whole unit's gradient is the shard's.
  const void* reduced = sharded_ ? s.recv : reduce_type_ == DType::BF16 ? s.full_bf16 : s.full;
  const DType type = reduce_type_;
  const int64_t n = model_.layout.units[s.unit].shard_numel;
  state_->add_reduced(s.unit, reduced, n, type);
  state_->unit_done(s.unit);
  s.unit = -1;
  s.reducing = false;
}

// Offload at world > 1: finish a unit's reduction a unit after it started (it
// has had that unit's compute to finish), so that its copy to the host overlaps
// the next units' backward instead of waiting for the slot's reuse.
void Engine::finish_reductions_early(int unit) {
  if (!state_->finishes_reductions_early()) return;
  for (auto& s : grad_slots_)
    if (s.unit != -1 && s.reducing && s.unit != unit) finish_grad(s);
}

void Engine::finish_all_grads() {
  if (!grad_slots_used_) return;
  // In unit order, so the accumulation into each shard is the same every run.
  for (auto& s : grad_slots_)
    if (s.unit != -1) finish_grad(s);
}

// ---------------------------------------------------------------- forward / backward

int Engine::own_experts(int layer, float* grads) {
  const int unit = model_.layout.experts_unit.empty() ? -1 : model_.layout.experts_unit[size_t(layer)];
  if (unit < 0) return -1;
  state_->param_ready(unit);
  if (grads) backend_->zero(grads, sizeof(float) * model_.layout.units[size_t(unit)].shard_numel);
  backend_->set_layer_experts(layer, model_.layout.units[size_t(unit)], shard(unit), grads);
  return unit;
}

const void* Engine::lm_head_weights() {
  const int head = model_.layout.num_layers() + 1;
  if (config_.tie_word_embeddings) return params(0);
  return param_at(*backend_, params(head), model_.layout.head().param("lm_head.weight").offset);
}

// forward: for u in units: gather(u) [prefetch u+1]; compute; release(u)
void Engine::forward(const TokenBatch& b, bool keep_for_backward) {
  const ModelLayout& layout = model_.layout;
  const bool release_after = !keep_for_backward || options_.reshard_after_forward;
  // Caches of the weights (FP8 codes) hold for one version of the training weights; other weights are none.
  backend_->set_params_version(weights_ ? kOtherWeightsVersion : state_->param_version());
  if (b.routes) check_routes(config_, b);
  backend_->load_batch(b);
  prefetch(1);  // the first layer's gather overlaps the embedding lookup
  if (float* rows = backend_->embedding_rows_fp32()) {
    embed_rows_fp32(b, rows);  // the fp32 stream's start: no gather of the bf16 table
  } else {
    backend_->embed_forward(params(0));
    if (release_after) release(0);
  }
  for (int l = 0; l < layout.num_layers(); ++l) {
    const int unit = 1 + l;
    const void* w = params(unit);
    prefetch(unit + 1);
    own_experts(l, nullptr);
    backend_->layer_forward(l, layout.units[unit], w);
    if (release_after) release(unit);
  }
}

LossStats Engine::forward_backward(const TokenBatch& b, float grad_scale) {
  const ModelLayout& layout = model_.layout;
  const int L = layout.num_layers(), head = L + 1;
  state();  // the engine's own host state when none was set
  state_->begin_micro_batch();
  forward(b, /*keep_for_backward=*/true);

  // loss: chunked lm-head + CE, whose backward gives d_x at the last layer's output
  const Unit& hu = layout.head();
  const int64_t norm_off = hu.param("model.norm.weight").offset;
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  state_->after_forward();
  float* hg = grads(head);
  float* lm_g = config_.tie_word_embeddings ? grads(0) : hg + hu.param("lm_head.weight").offset;
  const LossStats loss =
      backend_->head_loss_backward(param_at(*backend_, hw, norm_off), lm_w, hg + norm_off, lm_g, grad_scale);
  reduce_grads(head);
  release(head);
  if (config_.tie_word_embeddings && options_.reshard_after_forward) release(0);

  // backward: for u reversed: gather(u); grads; reduce_scatter -> grad shard; release(u)
  for (int l = L - 1; l >= 0; --l) {
    const int unit = 1 + l;
    const void* w = params(unit);
    prefetch(l > 0 ? unit - 1 : 0);
    const int experts = own_experts(l, experts_grad_);
    backend_->layer_backward(l, layout.units[unit], w, grads(unit));
    if (experts >= 0) {  // the owner's gradients are every rank's rows' already: nothing to reduce
      state_->add_reduced(experts, experts_grad_, layout.units[experts].shard_numel, DType::F32);
      state_->unit_done(experts);
    }
    reduce_grads(unit);
    finish_reductions_early(unit);
    release(unit);
  }
  backend_->embed_backward(grads(0));
  reduce_grads(0);
  release(0);
  finish_all_grads();
  return loss;
}

LossStats Engine::forward_loss(const TokenBatch& b) {
  const int head = model_.layout.num_layers() + 1;
  state();
  forward(b, /*keep_for_backward=*/false);
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  const LossStats loss =
      backend_->head_loss(param_at(*backend_, hw, model_.layout.head().param("model.norm.weight").offset), lm_w);
  release(head);
  release(0);
  return loss;
}

void Engine::forward_logits(const TokenBatch& b, float* logits) {
  const int head = model_.layout.num_layers() + 1;
  state();
  forward(b, /*keep_for_backward=*/false);
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  backend_->head_logits(param_at(*backend_, hw, model_.layout.head().param("model.norm.weight").offset), lm_w,
                        logits);
  release(head);
  release(0);
}

void Engine::forward_token_logprobs(const TokenBatch& b, float* logprobs, const OtherWeights* weights) {
  const int head = model_.layout.num_layers() + 1;
  state();
  if (weights) {
    const size_t units = model_.layout.units.size();
    SHARDLM_CHECK(weights->shards.size() == units && (backend_->host_resident() || weights->masters.size() == units),
                  "internal: a forward pass on other weights needs a shard per unit (and on a GPU their fp32 masters)");
    // A gathered unit of the training weights must not stand in for the other weights'.
    for (const auto& slot : param_slots_)
      SHARDLM_CHECK(slot.unit == -1, "internal: unit %d still gathered before a pass on other weights", slot.unit);
  }
  // The fp32 norm weights copied from one set of masters are stale for the other.
  std::fill(norm_version_.begin(), norm_version_.end(), -1);
  weights_ = weights;
  struct Restore {
    Engine& e;
    ~Restore() {
      e.weights_ = nullptr;
      std::fill(e.norm_version_.begin(), e.norm_version_.end(), -1);
    }
  } restore{*this};
  forward(b, /*keep_for_backward=*/false);
  const void* hw = params(head);
  const void* lm_w = lm_head_weights();
  backend_->head_token_logprobs(param_at(*backend_, hw, model_.layout.head().param("model.norm.weight").offset), lm_w,
                                logprobs);
  release(head);
  release(0);
}

}  // namespace shardlm
