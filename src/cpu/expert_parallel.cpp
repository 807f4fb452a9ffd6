// expert_parallel.cpp — expert parallelism's exchange on the CPU; see expert_parallel.hpp.
#include "cpu/expert_parallel.hpp"

#include "cpu/moe.hpp"
#include "shardlm/error.hpp"

namespace shardlm::cpu {

void plan_expert_exchange(ExpertExchange& x, const int32_t* rows_per_expert, int rank, int P, int64_t E, int64_t C) {
  SHARDLM_CHECK(P >= 1 && E % P == 0 && rank >= 0 && rank < P,
                "internal: an expert exchange of %lld experts over %d ranks (rank %d)", (long long)E, P, rank);
  const int64_t Ep = E / P;
  x.P = P, x.rank = rank, x.experts_per_rank = Ep;
  for (auto* v : {&x.send_counts, &x.send_displs, &x.recv_counts, &x.recv_displs}) v->assign(size_t(P), 0);
  x.groups.assign(size_t(P * Ep + 1), 0);
  const int32_t* mine = rows_per_expert + int64_t(rank) * E;
  int64_t sent = 0, received = 0;
  for (int p = 0; p < P; ++p) {
    int64_t to_p = 0, from_p = 0;
    for (int64_t j = 0; j < Ep; ++j) {
      to_p += mine[p * Ep + j];  // this rank's rows of p's experts
      const int64_t rows = rows_per_expert[int64_t(p) * E + int64_t(rank) * Ep + j];  // p's rows of this rank's
      x.groups[size_t(p * Ep + j + 1)] = x.groups[size_t(p * Ep + j)] + rows;
      from_p += rows;
    }
    x.send_counts[size_t(p)] = to_p * C, x.send_displs[size_t(p)] = sent * C;
    x.recv_counts[size_t(p)] = from_p * C, x.recv_displs[size_t(p)] = received * C;
    sent += to_p, received += from_p;
  }
  x.rows_received = received;
}

void rows_to_owners(Comm& group, const ExpertExchange& x, const float* local, float* owned) {
  group.all_to_all_v(local, x.send_counts.data(), x.send_displs.data(), owned, x.recv_counts.data(),
                     x.recv_displs.data());
}

void rows_from_owners(Comm& group, const ExpertExchange& x, const float* owned, float* local) {
  group.all_to_all_v(owned, x.recv_counts.data(), x.recv_displs.data(), local, x.send_counts.data(),
                     x.send_displs.data());
}

void ExpertScratch::add_rows(const ModelConfig& c, int64_t N, int64_t P, std::vector<BufferRow>& rows) {
  const int64_t R = N * c.num_experts_per_tok;
  rows.push_back({"ep.local_rows", &local_rows, R * c.hidden_size, Mem::Workspace});
  rows.push_back({"ep.owned_out", &owned_out, P * R * c.hidden_size, Mem::Workspace});
}

ExpertParallel::ExpertParallel(Comm& group, const ModelConfig& c, ExpertScratch& scratch)
    : group_(group),
      s_(scratch),
      C_(c.hidden_size),
      Im_(c.moe_intermediate_size),
      E_(c.num_experts),
      K_(c.num_experts_per_tok),
      Ep_(c.num_experts / group.size()),
      own_rows_(size_t(c.num_experts)) {
  SHARDLM_CHECK(c.num_experts % group.size() == 0, "internal: %lld experts over %d ranks", (long long)c.num_experts,
                group.size());
}

void ExpertParallel::forward(float* out, LayerActs& a, const LayerWeights<const float>& w, int64_t N) {
  const MoeRouting<float> r = a.routing();
  const int P = group_.size();
  // Every rank's rows per expert (int32 moved as 4-byte words): each rank plans
  // both directions of the exchange from them, and the backward reuses them.
  for (int64_t e = 0; e < E_; ++e) own_rows_[size_t(e)] = int32_t(r.offsets[e + 1] - r.offsets[e]);
  group_.all_gather(own_rows_.data(), a.ep_rows.data(), E_, DType::F32).wait();
  plan_expert_exchange(plan_, a.ep_rows.data(), group_.rank(), P, E_, C_);
  moe_gather_rows(s_.local_rows.data(), a.xn2.data(), r, N, C_, K_);
  rows_to_owners(group_, plan_, s_.local_rows.data(), a.xs.data());
  moe_expert_gemms_forward(a.e_gate.data(), a.e_up.data(), a.e_h.data(), s_.owned_out.data(), a.xs.data(),
                           plan_.groups.data(), P * Ep_, Ep_, w.e_gate, w.e_up, w.e_down, expert_stride(), C_, Im_);
  rows_from_owners(group_, plan_, s_.owned_out.data(), a.y.data());
  moe_combine(out, a.y.data(), r, N, C_, K_);
}

void ExpertParallel::backward(float* dx, float* dweight, const float* dout, const LayerActs& a,
                              const LayerWeights<const float>& w, const LayerWeights<float>& g, LayerGradScratch& s,
                              int64_t N) {
  const MoeRouting<float> r = a.routing();
  const int P = group_.size();
  plan_expert_exchange(plan_, a.ep_rows.data(), group_.rank(), P, E_, C_);  // the forward's rows
  moe_rows_backward(s_.local_rows.data(), dweight, dout, a.y.data(), r, N, C_, K_);
  rows_to_owners(group_, plan_, s_.local_rows.data(), s.d_y.data());
  moe_expert_gemms_backward(s.d_xs.data(), g.e_gate, g.e_up, g.e_down, s.d_eh.data(), s.d_egate.data(),
                            s.d_eup.data(), s.d_y.data(), a.xs.data(), a.e_gate.data(), a.e_up.data(), a.e_h.data(),
                            plan_.groups.data(), P * Ep_, Ep_, w.e_gate, w.e_up, w.e_down, expert_stride(), C_, Im_);
  rows_from_owners(group_, plan_, s.d_xs.data(), s_.local_rows.data());
  moe_scatter_rows(dx, s_.local_rows.data(), r, N, C_, K_);
}

}  // namespace shardlm::cpu
