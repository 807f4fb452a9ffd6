#!/usr/bin/env bash
# test_multirank.sh — sharded training on the CUDA backend at world > 1, run by
# `make test-gpu` on a GPU machine. One GPU cannot host two NCCL ranks, so the
# two ranks here share it through the staged MPI device communicator
# (comm.backend = "mpi"): the same engine path as NCCL (bf16 all-gathers of
# device shards, reduce-scatters of device gradients into device-resident fp32
# state) with the wire in host memory. On a machine with 2+ GPUs the NCCL case
# runs too. Prints one PASS/FAIL line per check.
#
#   bash tests/gpu/test_multirank.sh        (after make test-gpu has built build/shardlm)
source "$(dirname "$0")/lib.sh" multirank
steps=30

# train NAME NP SETS...: tiny-sft on the GPU for $steps steps into $out/NAME (lib.sh).
train() {
  local name=$1 np=$2
  shift 2
  train_tiny "$name" "$np" "$steps" ckpt.resume=none "$@"
}
# compare A B TOL WHAT: every step's loss within TOL, and the run learns (lib.sh).
compare() { compare_losses "$1" "$2" "$3" 1 "$steps" "$4" descent; }

train np1 1 || exit 1
train np2 2 comm.backend=mpi || exit 1
train np2-again 2 comm.backend=mpi || exit 1
train np2-bf16 2 comm.backend=mpi model.reduce_dtype=bf16 || exit 1
train np2-offload 2 comm.backend=mpi model.optim_cpu_offload=true model.optim_gpu_state_gib=0 || exit 1
train np2-noreshard 2 comm.backend=mpi model.reshard_after_forward=false model.activation_checkpointing=full || exit 1
# The residual stream is fp32 by default (model.residual_dtype); the bf16 one beside it.
train np1-bf16res 1 model.residual_dtype=bf16 || exit 1
train np2-bf16res 2 comm.backend=mpi model.residual_dtype=bf16 || exit 1
train np1-bf16norm 1 model.norm_dtype=bf16 || exit 1
train np1-fp32norm 1 model.norm_dtype=fp32 || exit 1
train np2-fp32norm 2 comm.backend=mpi model.norm_dtype=fp32 || exit 1
# The fp32 rows in chunks of 7 tokens a rank (the parts buffer bounded; docs/memory.md):
# each element's sum has one nonzero term, so the chunks change no bit.
SHARDLM_TEST_ROW_CHUNK=7 train np2-chunk 2 comm.backend=mpi || exit 1
SHARDLM_TEST_ROW_CHUNK=7 train np2-chunk-offload 2 comm.backend=mpi model.optim_cpu_offload=true \
  model.optim_gpu_state_gib=0 || exit 1
train np2-fp32norm-offload 2 comm.backend=mpi model.norm_dtype=fp32 model.optim_cpu_offload=true model.optim_gpu_state_gib=0 || exit 1

# bf16 parameters and activations: the two world sizes sum the same gradients in
# another order, which moves bf16 roundings; measured about 1e-3 (docs/testing.md).
compare np2 np1 2e-2 "-np 2 on one GPU (staged MPI) vs -np 1"
compare np2-again np2 0 "-np 2 twice: bit-identical losses"
compare np2-bf16 np2 2e-2 "-np 2 with model.reduce_dtype = bf16 vs fp32 reduction"
compare np2-offload np2 2e-2 "-np 2 with optim_cpu_offload vs device-resident state"
compare np2-noreshard np2 2e-2 "-np 2 without resharding, with activation checkpointing"
compare np2-bf16res np1-bf16res 2e-2 "model.residual_dtype = bf16: -np 2 on one GPU (staged MPI) vs -np 1"
compare np2-chunk np2 0 "the fp32 stream's first rows in chunks of 7 tokens vs one chunk: bit-identical"
compare np2-chunk-offload np2-offload 0 "the fp32 stream's first rows built on the host (offload) in chunks of 7 tokens vs one chunk: bit-identical"
compare np1 np1-bf16res 2e-2 "model.residual_dtype = fp32 (default) vs bf16 at -np 1 (bf16 tolerance)"
# The fp32 norm weights at two ranks come through an all-gather of each rank's pieces.
compare np2-fp32norm np1-fp32norm 2e-2 "model.norm_dtype = fp32: -np 2 on one GPU (staged MPI) vs -np 1"
compare np2-fp32norm-offload np2-fp32norm 2e-2 "model.norm_dtype = fp32: -np 2 with optim_cpu_offload vs device-resident state"
compare np1-fp32norm np1-bf16norm 2e-2 "model.norm_dtype = fp32 vs bf16 at -np 1 (bf16 tolerance)"

# The resolved deck records the communicator the run chose.
if grep -q "backend = 'mpi'" "$out/np2/config.toml"; then echo "PASS config.toml records comm.backend = \"mpi\""
else echo "FAIL config.toml does not record the staged MPI communicator"; fi
# auto on one GPU with two ranks resolves to the staged communicator, and nccl is refused with the reason.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
if [ "$gpus" -le 1 ]; then
  train np2-auto 2 && grep -q "backend = 'mpi'" "$out/np2-auto/config.toml" \
    && echo "PASS comm.backend = auto with 2 ranks on 1 GPU resolves to mpi" \
    || echo "FAIL comm.backend = auto with 2 ranks on 1 GPU did not resolve to mpi"
  if train np2-nccl 2 comm.backend=nccl > /dev/null; then echo "FAIL comm.backend = nccl on one shared GPU was accepted"
  elif grep -q "NCCL refuses two ranks on one GPU" "$out/np2-nccl.log"; then
    echo "PASS comm.backend = nccl with 2 ranks on 1 GPU is refused with the reason"
  else echo "FAIL comm.backend = nccl on one GPU failed without the reason:"; tail -3 "$out/np2-nccl.log"; fi
else
  train np2-nccl 2 comm.backend=nccl || exit 1
  compare np2-nccl np1 2e-2 "-np 2 on two GPUs (NCCL) vs -np 1"
fi

# The NCCL watchdog: a collective stuck behind a stalled stream ends the process
# with a message naming the collective and comm.timeout_s, instead of hanging.
wd=$(SHARDLM_FAULT=nccl_stall@0 timeout 120 "$BUILD/test_gpu" --test-case="NCCL device communicator*" 2>&1); rc=$?
if [ $rc != 0 ] && [ $rc != 124 ] && grep -q "has not completed after" <<< "$wd"; then
  echo "PASS a stalled NCCL collective aborts with: $(grep -o 'NCCL [a-z-]* of [0-9]* bytes has not completed[^:]*' <<< "$wd" | head -1)"
else
  echo "FAIL a stalled NCCL collective did not abort with the watchdog's message (exit $rc):"; tail -3 <<< "$wd"
fi

# The RL weight broadcast from GPU memory (broadcast.backend = "nccl" on the CUDA
# backend; docs/rollouts.md, "Weight broadcast"): every trainer rank gathers each
# unit in bf16 on the device from the backend's parameter shards, rank 0
# broadcasts that device buffer through the broadcast communicator's device Comm,
# and `shardlm receive` takes it into device memory, checks its checksum on the
# host and writes the last weights, which must equal the trainer's bf16 export
# bit for bit. Trainer rank 0 is on GPU 0 and the receiver (local rank NP) on
# GPU NP % gpus: where they share one the device Comm is CUDA IPC on a one-GPU
# machine (the default there) or the staged MPI one (SHARDLM_BROADCAST_IPC=0,
# and where they share one of several GPUs), else NCCL.
rollouts="$out/rollouts"
if ! "$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$rollouts" --steps 10 > "$out/rollouts.log" 2>&1; then
  echo "FAIL RL broadcast from the GPU: tools/make_rollouts.py failed:"; tail -3 "$out/rollouts.log"
else
  # rl_broadcast NAME NP SETS...: NP trainers + 1 receiver, 10 steps, a broadcast every 5.
  rl_broadcast() {
    local name=$1 np=$2
    shift 2
    local sets=(--set device.backend=cuda --set run.max_steps=10 --set ckpt.interval=0 --set ckpt.resume=none
                --set data.rollout_dir="$rollouts" --set broadcast.backend=nccl --set broadcast.interval=5
                --set log.interval=5 --set run.dir="$out/$name" --set run.export_dir="$out/$name-trainer"
                --set run.export_dtype=bf16)
    for s in "$@"; do sets+=(--set "$s"); done
    local kind=nccl
    if [ "$gpus" -le 1 ] || [ $((np % gpus)) = 0 ]; then kind=${BCAST_KIND:-mpi}; fi
    local what="RL broadcast from the GPU, -np $np + 1 receiver${*:+, $*} ($kind device communicator)"
    if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE \
        -np "$np" "$BUILD/shardlm" train inputs/tiny-rl.toml "${sets[@]}" : \
        -np 1 "$BUILD/shardlm" receive inputs/tiny-rl.toml "${sets[@]}" --out "$out/$name-receiver" \
        > "$out/$name.log" 2>&1; then
      echo "FAIL $what: the run failed:"; tail -5 "$out/$name.log"
      return
    fi
    # The device path ran (both ends say so, with the communicator), the RL loss
    # ran on the GPU, and both broadcasts arrived with their checksums verified.
    local missing="" line
    for line in "rl | entropy " "broadcast: bf16 units gathered on the GPU, sent over the $kind device communicator" \
                "receive[0]: units arrive in GPU memory" "over the $kind device communicator" \
                "receive[0]: step 5: 20 tensors" "receive[0]: step 10: 20 tensors" "2 broadcasts received"; do
      grep -qF "$line" "$out/$name.log" || missing+=" '$line'"
    done
    if [ -n "$missing" ]; then
      echo "FAIL $what: the log lacks$missing"; tail -5 "$out/$name.log"
      return
    fi
    if cmp "$out/$name-trainer/model.safetensors" "$out/$name-receiver/model.safetensors" > "$out/$name.cmp" 2>&1; then
      echo "PASS $what: the receiver's weights equal the trainer's bf16 export bit for bit" \
           "($(stat -c %s "$out/$name-receiver/model.safetensors") bytes)"
    else
      echo "FAIL $what: the receiver's weights differ from the trainer's bf16 export: $(head -1 "$out/$name.cmp")"
    fi
  }
  SHARDLM_BROADCAST_IPC=0 rl_broadcast bcast-np1 1
  SHARDLM_BROADCAST_IPC=0 rl_broadcast bcast-offload 1 model.optim_cpu_offload=true
  SHARDLM_BROADCAST_IPC=0 rl_broadcast bcast-np2 2
  # Ranks sharing the one GPU, by default: the receiver copies the root's buffer
  # device to device through a CUDA IPC handle.
  if [ "$gpus" -le 1 ]; then
    BCAST_KIND=ipc rl_broadcast bcast-ipc-np1 1
    BCAST_KIND=ipc rl_broadcast bcast-ipc-np2 2
  fi
fi
