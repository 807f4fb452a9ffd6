// muon.cpp — Newton–Schulz, owner assignment and the sharded Muon step.
#include "train/muon.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include "cpu/ops.hpp"
#include "shardlm/error.hpp"

namespace shardlm {

bool is_muon_param(const Unit& unit, const ParamInfo& param) {
  return unit.kind == UnitKind::Layer && param.kind == ParamKind::Matrix && param.shape.size() == 2;
}

int64_t newton_schulz_workspace_numel(int64_t rows, int64_t cols) {
  const int64_t k = std::min(rows, cols);
  return rows * cols + 2 * k * k;
}

void newton_schulz(float* out, const float* G, int64_t rows, int64_t cols, int steps, float* workspace) {
  const int64_t n = rows * cols;
  const bool tall = rows > cols;
  const int64_t k = tall ? cols : rows;  // the Gram matrix is (k, k), the smaller one
  float* other = workspace;              // (rows, cols)
  float* gram = workspace + n;           // (k, k) A = X X^T, or X^T X when tall
  float* poly = gram + k * k;            // (k, k) b A + c A^2
  // X and the next X alternate between `other` and `out`; start where the last
  // step lands in `out`, so no copy is needed at the end.
  float* x = (steps % 2) ? other : out;
  float* next = (steps % 2) ? out : other;

  const double norm = std::sqrt(cpu::sum_squares(G, n));
  const float inv_norm = static_cast<float>(1.0 / (norm + kNsEps));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = G[i] * inv_norm;

  for (int s = 0; s < steps; ++s) {
    if (tall) cpu::gemm<float>(true, false, k, k, rows, 1.0f, x, cols, x, cols, 0.0f, gram, k);
    else cpu::gemm<float>(false, true, k, k, cols, 1.0f, x, cols, x, cols, 0.0f, gram, k);
    std::memcpy(poly, gram, sizeof(float) * k * k);
    cpu::gemm<float>(false, false, k, k, k, kNsC, gram, k, gram, k, kNsB, poly, k);  // c A A + b A
    std::memcpy(next, x, sizeof(float) * n);
    // a X + (b A + c A^2) X, or its transpose X (b A + c A^2) + a X when tall (the
    // polynomial is symmetric).
    if (tall) cpu::gemm<float>(false, false, rows, cols, cols, 1.0f, x, cols, poly, k, kNsA, next, cols);
    else cpu::gemm<float>(false, false, rows, cols, rows, 1.0f, poly, k, x, cols, kNsA, next, cols);
    std::swap(x, next);
  }
}

double muon_update_scale(int64_t rows, int64_t cols) {
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

std::vector<MuonMatrix> assign_muon_owners(const ModelLayout& layout, int world) {
  std::vector<MuonMatrix> out;
  std::vector<int64_t> load(static_cast<size_t>(world), 0);  // elements owned so far, per rank
  for (size_t ui = 0; ui < layout.units.size(); ++ui) {
    const Unit& u = layout.units[ui];
    const size_t first = out.size();
    for (const auto& p : u.params)
      if (is_muon_param(u, p)) out.push_back({static_cast<int>(ui), &p, p.shape[0], p.shape[1], 0});
    std::vector<size_t> order(out.size() - first);
    std::iota(order.begin(), order.end(), first);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return out[a].param->numel > out[b].param->numel; });
    for (size_t m : order) {
      const int owner = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      out[m].owner = owner;
      load[static_cast<size_t>(owner)] += out[m].param->numel;
    }
  }
  return out;
}

int64_t MuonUnitPlan::send_numel() const {
  return std::accumulate(send_counts.begin(), send_counts.end(), int64_t(0));
}
int64_t MuonUnitPlan::recv_numel() const {
  return std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0));
}

MuonExchangePlan plan_muon_exchange(const ModelLayout& layout, const std::vector<MuonMatrix>& matrices, int rank,
                                    int world) {
  MuonExchangePlan out;
  out.units.resize(layout.units.size());
  int64_t max_send = 0, max_recv = 0, max_matrix = 0, max_ns = 0;
  for (size_t ui = 0; ui < layout.units.size(); ++ui) {
    const int64_t S = layout.units[ui].shard_numel;
    std::vector<int> in_unit;
    for (size_t k = 0; k < matrices.size(); ++k)
      if (matrices[k].unit == static_cast<int>(ui)) in_unit.push_back(static_cast<int>(k));
    if (in_unit.empty()) continue;
    MuonUnitPlan& plan = out.units[ui];
    plan.has_matrices = true;
    for (auto* v : {&plan.send_counts, &plan.send_displs, &plan.recv_counts, &plan.recv_displs})
      v->assign(static_cast<size_t>(world), 0);
    // The part of matrix k in rank s's shard: [lo, hi) of the unit's flat buffer.
    auto slice = [&](int k, int s, int64_t& lo, int64_t& hi) {
      const ParamInfo& p = *matrices[static_cast<size_t>(k)].param;
      lo = std::max(p.offset, s * S);
      hi = std::min(p.offset + p.numel, (s + 1) * S);
      return lo < hi;
    };
    // Send: to each owner in rank order, this rank's slices of its matrices in
    // parameter order. Receive: from each sender in rank order, its slices of the
    // matrices this rank owns in parameter order: the sequence that sender built.
    int64_t offset = 0;
    for (int o = 0; o < world; ++o) {
      plan.send_displs[o] = offset;
      for (int k : in_unit) {
        int64_t lo, hi;
        if (matrices[k].owner != o || !slice(k, rank, lo, hi)) continue;
        plan.send.push_back({k, lo - rank * S, lo - matrices[k].param->offset, hi - lo, offset});
        offset += hi - lo;
      }
      plan.send_counts[o] = offset - plan.send_displs[o];
      if (o != rank) out.floats_sent_per_step += plan.send_counts[o];  // directions out
    }
    max_send = std::max(max_send, offset);
    offset = 0;
    for (int s = 0; s < world; ++s) {
      plan.recv_displs[s] = offset;
      for (int k : in_unit) {
        int64_t lo, hi;
        if (matrices[k].owner != rank || !slice(k, s, lo, hi)) continue;
        plan.recv.push_back({k, lo - s * S, lo - matrices[k].param->offset, hi - lo, offset});
        offset += hi - lo;
      }
      plan.recv_counts[s] = offset - plan.recv_displs[s];
      if (s != rank) out.floats_sent_per_step += plan.recv_counts[s];  // updates back out
    }
    max_recv = std::max(max_recv, offset);
    for (int k : in_unit) {
      const MuonMatrix& m = matrices[k];
      if (m.owner != rank) continue;
      plan.owned.push_back(k);
      max_matrix = std::max(max_matrix, m.rows * m.cols);
      max_ns = std::max(max_ns, newton_schulz_workspace_numel(m.rows, m.cols));
    }
  }
  out.workspace_numel = max_send + max_recv + max_matrix + max_ns;
  return out;
}

int64_t muon_workspace_numel(const ModelLayout& layout, int world) {
  // The plan's buffer sizes without building its pieces (world ranks x units x matrices).
  const std::vector<MuonMatrix> matrices = assign_muon_owners(layout, world);
  int64_t most = 0;
  for (int r = 0; r < world; ++r) {
    int64_t held_max = 0, owned_max = 0, matrix = 0, ns = 0;
    for (size_t ui = 0; ui < layout.units.size(); ++ui) {
      const int64_t S = layout.units[ui].shard_numel;
      int64_t held = 0, owned = 0;
      for (const auto& m : matrices) {
        if (m.unit != static_cast<int>(ui)) continue;
        held += std::max<int64_t>(0, std::min(m.param->offset + m.param->numel, (r + 1) * S) -
                                         std::max(m.param->offset, r * S));
        if (m.owner != r) continue;
        owned += m.param->numel;
        matrix = std::max(matrix, m.param->numel);
        ns = std::max(ns, newton_schulz_workspace_numel(m.rows, m.cols));
      }
      held_max = std::max(held_max, held);
      owned_max = std::max(owned_max, owned);
    }
    most = std::max(most, held_max + owned_max + matrix + ns);
  }
  return most;
}

NsCapacity muon_ns_capacity(const std::vector<MuonMatrix>& matrices, int rank) {
  NsCapacity out;
  for (const MuonMatrix& m : matrices) {
    if (rank >= 0 && m.owner != rank) continue;
    out.numel = std::max(out.numel, m.rows * m.cols);
    out.gram_side = std::max(out.gram_side, std::min(m.rows, m.cols));
  }
  return out;
}

MuonStep::MuonStep(ShardedModel& model, Comm& comm, int ns_steps)
    : model_(&model), comm_(&comm), ns_steps_(ns_steps) {
  SHARDLM_CHECK(comm.rank() == model.rank && comm.size() == model.world,
                "Muon: the Comm (rank %d of %d) is not the one the shards were made for (rank %d of %d)",
                comm.rank(), comm.size(), model.rank, model.world);
  SHARDLM_CHECK(ns_steps >= 0, "Muon: ns_steps = %d must be >= 0", ns_steps);
  matrices_ = assign_muon_owners(model.layout, comm.size());
  plan_ = plan_muon_exchange(model.layout, matrices_, comm.rank(), comm.size());
  int64_t max_send = 0, max_recv = 0, max_matrix = 0, max_ns = 0;
  for (const auto& u : plan_.units) {
    max_send = std::max(max_send, u.send_numel());
    max_recv = std::max(max_recv, u.recv_numel());
    for (int k : u.owned) {
      const MuonMatrix& m = matrices_[static_cast<size_t>(k)];
      max_matrix = std::max(max_matrix, m.rows * m.cols);
      max_ns = std::max(max_ns, newton_schulz_workspace_numel(m.rows, m.cols));
    }
  }
  direction_ = Buffer<float>(Mem::Workspace, max_send);
  gathered_ = Buffer<float>(Mem::Workspace, max_recv);
  matrix_ = Buffer<float>(Mem::Workspace, max_matrix);
  ns_workspace_ = Buffer<float>(Mem::Workspace, max_ns);
}

void MuonStep::set_orthogonalizer(std::unique_ptr<Orthogonalizer> o) { orthogonalizer_ = std::move(o); }

const char* MuonStep::orthogonalizer_name() const {
  return orthogonalizer_ ? orthogonalizer_->name() : "host fp32";
}

void MuonStep::step(double lr, double weight_decay, double mu, float grad_scale,
                    std::vector<Buffer<float>>& momentum) {
  using clock = std::chrono::steady_clock;
  const clock::time_point t_step = clock::now();
  double orthogonalize_s = 0;
  const float lr_f = static_cast<float>(lr), mu_f = static_cast<float>(mu);
  for (size_t ui = 0; ui < plan_.units.size(); ++ui) {
    const MuonUnitPlan& plan = plan_.units[ui];
    if (!plan.has_matrices) continue;
    float* p = model_->param[ui].data();
    const float* g = model_->grad[ui].data();
    float* m = momentum[ui].data();
    float* d = direction_.data();
    float* gathered = gathered_.data();

    // 1. momentum and the Nesterov direction on this rank's slices
    for (const MuonPiece& piece : plan.send) {
      const int64_t so = piece.shard_offset, bo = piece.buffer_offset;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < piece.count; ++i) {
        const float gi = g[so + i] * grad_scale;
        const float mi = mu_f * m[so + i] + gi;
        m[so + i] = mi;
        d[bo + i] = gi + mu_f * mi;
      }
    }
    // 2. each owner receives the whole direction of its matrices
    comm_->all_to_all_v(d, plan.send_counts.data(), plan.send_displs.data(), gathered, plan.recv_counts.data(),
                        plan.recv_displs.data());
    // 3. orthogonalise and scale at the owner, back into the exchange buffer
    for (int k : plan.owned) {
      const MuonMatrix& mat = matrices_[static_cast<size_t>(k)];
      float* full = matrix_.data();  // (rows, cols)
      for (const MuonPiece& piece : plan.recv)
        if (piece.matrix == k)
          cpu::copy(full + piece.matrix_offset, gathered + piece.buffer_offset, piece.count);
      const clock::time_point t_ns = clock::now();
      if (orthogonalizer_) orthogonalizer_->orthogonalize(full, full, mat.rows, mat.cols, ns_steps_);
      else newton_schulz(full, full, mat.rows, mat.cols, ns_steps_, ns_workspace_.data());
      orthogonalize_s += std::chrono::duration<double>(clock::now() - t_ns).count();
      const float scale = static_cast<float>(muon_update_scale(mat.rows, mat.cols));
      for (const MuonPiece& piece : plan.recv) {
        if (piece.matrix != k) continue;
        float* dst = gathered + piece.buffer_offset;
        const float* src = full + piece.matrix_offset;
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < piece.count; ++i) dst[i] = src[i] * scale;
      }
    }
    // 4. every rank receives the update on its slices
    comm_->all_to_all_v(gathered, plan.recv_counts.data(), plan.recv_displs.data(), d, plan.send_counts.data(),
                        plan.send_displs.data());
    // 5. decoupled weight decay, then the update
    for (const MuonPiece& piece : plan.send) {
      const ParamInfo& info = *matrices_[static_cast<size_t>(piece.matrix)].param;
      const float wd = info.weight_decay() ? static_cast<float>(weight_decay) : 0.0f;
      const int64_t so = piece.shard_offset, bo = piece.buffer_offset;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < piece.count; ++i) {
        p[so + i] -= lr_f * wd * p[so + i];
        p[so + i] -= lr_f * d[bo + i];
      }
    }
  }
  if (steps_seen_++ > 0) {
    ++timing_.steps;
    timing_.step_s += std::chrono::duration<double>(clock::now() - t_step).count();
    timing_.orthogonalize_s += orthogonalize_s;
  }
}

}  // namespace shardlm
