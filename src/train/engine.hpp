// engine.hpp — forward and backward of one micro-batch over sharded units.
//
// Owns: the unit loop of DESIGN.md's solver (gather u with u+1's gather in
// flight; compute; release; backward in reverse with each unit's gradients
// reduce-scattered into the gradient shards as soon as it is done), the
// gathered-unit and gradient buffers, the activations, and their sizes (the
// memory plan). The arithmetic goes to a Backend, the collectives to a Comm;
// knows nothing about the deck, the data file or the optimizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/backend.hpp"
#include "shardlm/comm.hpp"
#include "shardlm/memory.hpp"
#include "train/offload.hpp"
#include "train/shard.hpp"

namespace shardlm {

// Bytes per rank the engine and the shards will allocate (host, fp32 CPU backend).
struct MemoryPlan {
  // The fp32 master, gradient and optimizer shards live in host memory today on
  // every backend; a device backend adds its bf16 parameter copies, gradient
  // slots, activations and workspace in device memory.
  bool device = false;
  int64_t param_shards = 0, grad_shards = 0, optim_state = 0;  // host
  int64_t param_copies = 0;                                     // device: bf16 shards
  int64_t gathered = 0, activations = 0, workspace = 0;         // device when `device`, else host
  int64_t host_workspace = 0;                                   // host: broadcast / export staging
  int64_t comm_staging = 0;                                     // host: pinned buffers of the staged MPI device Comm
  int64_t offload_buffers = 0;                                  // host: the offload pipeline's bf16 shards
  int64_t device_state = 0;  // GPU: fp32 masters + gradients + optimizer state (their host shards become mirrors)
  int64_t device_grads = 0;  // GPU: the offload pipeline's fp32 gradient accumulators
  int64_t data_reader = 0;   // host: token readers of data.path and eval.path (data.hpp's DataMemory)
  int64_t checkpoint_snapshot = 0;  // host: the async checkpoint's copy of the state (ckpt.async)
  // Of which the pool gives up on a host without room (ckpt.async_host_gib = 0:
  // it then takes half of what is left and stages saves); the plan fits without it.
  int64_t checkpoint_snapshot_flexible = 0;
  int64_t host_total() const {
    return param_shards + grad_shards + optim_state + host_workspace + comm_staging + offload_buffers + data_reader +
           checkpoint_snapshot +
           (device ? 0 : gathered + activations + workspace);
  }
  int64_t device_total() const {
    return device ? device_state + device_grads + param_copies + gathered + activations + workspace : 0;
  }
  int64_t total() const { return host_total() + device_total(); }
};
MemoryPlan plan_memory(const ModelConfig& config, int world, const EngineOptions& options, int optim_states,
                       const Backend& backend);
std::string format_memory_plan(const MemoryPlan& plan, int world);
// The plan against the machine, before anything large is built: "" when
// `ranks_on_node` ranks' host plans fit `host` and `ranks_per_gpu` ranks'
// device plans fit `gpu_bytes` (0: not checked); else a sentence with the
// numbers and what makes the plan smaller.
std::string plan_fit_error(const MemoryPlan& plan, int ranks_on_node, const MachineMemory& host, int ranks_per_gpu,
                           int64_t gpu_bytes);

class Engine {
 public:
  // The backend is the engine's own; the model and comm are borrowed.
  Engine(ShardedModel& model, Comm& comm, const EngineOptions& options,
         std::unique_ptr<Backend> backend = make_cpu_backend());
  ~Engine();

  // Forward, loss and backward; gradients (scaled by grad_scale) are added into
  // model.grad. Returns this rank's loss sums (SFT: sum of weight * NLL).
  LossStats forward_backward(const TokenBatch& batch, float grad_scale);

  // Forward only: the micro-batch's cross-entropy sums (loss = sum of weight *
  // NLL, loss_tokens), computed as forward_backward computes the SFT loss.
  // Collective over the ranks like forward_backward; gradients are untouched.
  LossStats forward_loss(const TokenBatch& batch);

  // Forward only: logits (N, V) for every position.
  void forward_logits(const TokenBatch& batch, float* logits);

  const Backend& backend() const { return *backend_; }
  Backend& backend() { return *backend_; }
  const EngineOptions& options() const { return options_; }
  // Refresh the backend's parameter shards from the fp32 masters (a no-op copy
  // on the CPU backend); the session calls it after every change to model.param
  // that the offload pipeline did not make.
  void sync_params();
  // optim_cpu_offload on a GPU: the micro-batches' gradients add up on the
  // device, the last one's go to the pipeline as each unit's reduction
  // finishes, and a unit's shard is read only after its upload.
  void set_offload(OffloadPipeline* pipeline) { offload_ = pipeline; }
  // This rank's sum of squares of the step's gradients (the offload pipeline's
  // clip norm), summed per unit on the device as each unit was handed over.
  double offload_grad_sumsq();
  // The RL weight broadcast on a GPU backend (broadcast.hpp): unit `unit`'s bf16
  // parameters gathered from every rank's device shard into `device_out`
  // (padded_numel bf16, device memory) through the unit loop's device Comm; at
  // one rank, a device copy of the shard. Collective over the trainer ranks.
  // Queued on the backend's stream (no host synchronisation). Between steps
  // only: it reads the shards the last update wrote and holds no gather slot.
  void gather_unit_bf16(int unit, void* device_out);

 private:
  struct ParamSlot {
    int unit = -1;
    void* full = nullptr;    // (max padded numel) backend memory, backend precision
    CommRequest request;
  };
  struct GradSlot {
    int unit = -1;
    bool reducing = false;   // backward of the unit done; its reduction started
    float* full = nullptr;   // (max padded numel) this unit's gradient, all of it
    void* recv = nullptr;    // (max shard numel) the reduced slice (reduce type), added into the grad shard
    void* full_bf16 = nullptr;  // (max padded numel) bf16 copy of `full` when gradients reduce in bf16
    CommRequest request;
  };

  const void* params(int unit);         // gathered weights of `unit` (waits)
  void prefetch(int unit);              // start gathering `unit` if a slot is free
  void release(int unit);
  float* grads(int unit);               // a zeroed full gradient buffer for `unit`
  void reduce_grads(int unit);          // start reduce-scatter of `unit`'s gradient
  void finish_grad(GradSlot& slot);
  void finish_all_grads();
  void hand_over(int unit);             // offload: copy `unit`'s step gradient to the host
  void hand_over_reduced(int unit);     // offload, world > 1: start the copies to the host early
  void begin_offload_micro_batch();
  void zero_offload_accumulators();
  void forward(const TokenBatch& b, bool keep_head);
  const void* lm_head_weights();

  ShardedModel& model_;
  Comm& comm_;
  EngineOptions options_;
  std::unique_ptr<Backend> backend_;
  const ModelConfig& config_;
  const bool sharded_;                  // world > 1: gather and reduce through comm
  std::unique_ptr<Comm> device_comm_;   // device backends at world > 1: device-buffer collectives
  OffloadPipeline* offload_ = nullptr;  // optim_cpu_offload on a GPU (not owned)
  Comm* unit_comm_ = nullptr;           // device_comm_, or comm_ for host buffers
  DType gather_type_ = DType::F32, reduce_type_ = DType::F32;
  bool grad_slots_used_ = false;        // sharded, or gradients outside host memory
  int64_t slot_floats_ = 0, recv_floats_ = 0;
  std::vector<ParamSlot> param_slots_;
  std::vector<GradSlot> grad_slots_;
  int next_grad_slot_ = 0;
  std::vector<float*> offload_grads_;   // [unit] offload: fp32 step gradient shards (device), micro-batches summed
  std::vector<int64_t> offload_copy_;   // [unit] ticket of their last copy to the host, -1: none
  bool last_micro_batch_ = true;        // offload: this micro-batch is the step's last
  bool first_micro_batch_ = true;       // offload: ... and the step's first
};

}  // namespace shardlm
