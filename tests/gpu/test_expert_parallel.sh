#!/usr/bin/env bash
# test_expert_parallel.sh — expert parallelism (model.expert_parallel = P) on the
# CUDA backend: each rank holds num_experts / P whole experts of every layer of
# experts, and a layer's routed rows travel to their experts' ranks and back
# (Comm::all_to_all_v_device; cuda/moe.hpp). One GPU cannot host two NCCL ranks,
# so the two ranks share it through the staged MPI device communicator
# (comm.backend = "mpi"): the same exchange code as with NCCL, the wire in pinned
# host memory. Against one rank holding every expert and two ranks sharding them
# FSDP-style: the same model, data and seed, so the losses agree to bf16's
# rounding of sums taken in another order. Prints one PASS/FAIL line per check.
#
#   bash tests/gpu/test_expert_parallel.sh      (after make CUDA=1 has built build/shardlm)
source "$(dirname "$0")/lib.sh" expert-parallel
steps=30

# The tiny model with 12 experts, 2 a token (tests/mpi/test_expert_parallel.cpp's).
qwen3=(model.arch=qwen3_moe model.qk_norm=true model.norm_topk_prob=true model.tie_word_embeddings=false
       model.num_experts=12 model.num_experts_per_tok=2 model.moe_intermediate_size=32 model.router_aux_loss=true
       model.router_aux_loss_coef=0.01)
qwen2=(model.arch=qwen2_moe model.attention_bias=true model.shared_expert_intermediate_size=48
       model.tie_word_embeddings=false model.num_experts=12 model.num_experts_per_tok=2
       model.moe_intermediate_size=32 model.router_aux_loss=true model.router_aux_loss_coef=0.01)
train() {
  local name=$1 np=$2
  shift 2
  train_tiny "$name" "$np" "$steps" ckpt.resume=none "$@"
}
compare() { compare_losses "$1" "$2" "$3" 1 "$steps" "$4" descent; }

train q3-np1 1 "${qwen3[@]}" || exit 1
train q3-fsdp2 2 comm.backend=mpi "${qwen3[@]}" || exit 1
train q3-ep2 2 comm.backend=mpi model.expert_parallel=2 "${qwen3[@]}" || exit 1
train q3-ep2-again 2 comm.backend=mpi model.expert_parallel=2 "${qwen3[@]}" || exit 1
train q3-ep2-ckpt 2 comm.backend=mpi model.expert_parallel=2 model.activation_checkpointing=full "${qwen3[@]}" || exit 1
train q3-ep2-offload 2 comm.backend=mpi model.expert_parallel=2 model.optim_cpu_offload=true \
  model.optim_gpu_state_gib=0 "${qwen3[@]}" || exit 1
train q2-np1 1 "${qwen2[@]}" || exit 1
train q2-ep2 2 comm.backend=mpi model.expert_parallel=2 "${qwen2[@]}" || exit 1

# bf16 operands: the owners' weight gradients sum each source rank's rows in a
# launch of their own, which moves bf16 roundings (as -np 2 does for dense models).
compare q3-ep2 q3-np1 2e-2 "qwen3_moe: experts over 2 ranks (staged MPI) vs one rank holding every expert"
compare q3-ep2 q3-fsdp2 2e-2 "qwen3_moe: experts over 2 ranks vs every expert sharded over both (FSDP)"
compare q3-ep2-again q3-ep2 0 "qwen3_moe: experts over 2 ranks twice: bit-identical losses"
compare q3-ep2-ckpt q3-ep2 2e-2 "qwen3_moe: experts over 2 ranks with activation checkpointing (the exchange recomputed)"
compare q3-ep2-offload q3-ep2 2e-2 "qwen3_moe: experts over 2 ranks with the optimizer offloaded to the CPU"
compare q2-ep2 q2-np1 2e-2 "qwen2_moe with its shared expert: experts over 2 ranks vs one rank"

# The resolved deck records the split.
if grep -q "expert_parallel = 2" "$out/q3-ep2/config.toml"; then echo "PASS config.toml records model.expert_parallel = 2"
else echo "FAIL config.toml does not record model.expert_parallel = 2"; fi
