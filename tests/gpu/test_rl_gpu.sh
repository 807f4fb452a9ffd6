#!/usr/bin/env bash
# test_rl_gpu.sh — the RL job on one GPU (make test-gpu): a trainer and an
# inference rank of one mpirun share the GPU, the weights travel every step
# from the trainer's GPU memory to the inference rank's (staged through host
# memory with SHARDLM_BROADCAST_IPC=0: NCCL refuses two ranks on one GPU), and
# the GPU decoder takes them device to device (WeightReceiver::DeviceSink). The
# same job with the weights brought to the host first (SHARDLM_RECEIVE_TO_HOST=1,
# the path of `shardlm receive` and the CPU decoder) must give the same rollouts
# and losses bit for bit: both load the same bf16 bits, and every part is
# deterministic; so must the same job over CUDA IPC (the default on one GPU). The
# checksums of both ends are computed on the GPUs (cuda_bf16_checksum): a
# mismatch would end the job. Prints PASS/FAIL lines.
#
#   bash tests/gpu/test_rl_gpu.sh        (after make test-gpu has built build/shardlm)
source "$(dirname "$0")/lib.sh" rl-gpu
steps=8
dev=${SHARDLM_TEST_DEVICE:-cuda}
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE)

"$PY" tools/make_copy_task.py --out-dir "$out/task" > "$out/task.log" 2>&1 || { echo "FAIL make_copy_task.py"; exit 1; }
# A warm start with head dim 32 (a size every GPU attention path takes).
if ! timeout 300 "$BUILD/shardlm" train inputs/copy-sft.toml --set device.backend="$dev" --set "data.path=$out/task/sft.h5" \
    --set "run.dir=$out/sft" --set "run.export_dir=$out/sft/export" --set run.max_steps=20 \
    --set model.hidden_size=64 --set model.intermediate_size=128 --set model.num_heads=2 --set model.num_kv_heads=1 \
    > "$out/sft.log" 2>&1; then
  echo "FAIL SFT warm start on the GPU:"; tail -5 "$out/sft.log"; exit 1
fi

# rl NAME [ENV=VALUE ...]: 1 trainer + 1 inference rank on the GPU, $steps steps into $out/NAME.
rl() {
  local name=$1
  shift
  local args=(inputs/copy-rl.toml --set "model.hf=$out/sft/export" --set "run.dir=$out/$name"
              --set "data.rollout_dir=$out/$name/rollouts" --set "rollout.prompts=$out/task/prompts.h5"
              --set device.backend="$dev" --set run.deterministic=true --set run.max_steps=$steps
              --set ckpt.interval=0 --set ckpt.save_final=false --set log.interval=1)
  local e extra=()
  for e in "$@"; do [[ $e == ARGS_EXTRA=* ]] && read -ra extra <<< "${e#ARGS_EXTRA=}"; done
  args+=("${extra[@]}")
  local envs=()
  for e in "$@"; do [[ $e == ARGS_EXTRA=* ]] || envs+=("$e"); done
  if ! env "${envs[@]}" timeout 600 "${MPI[@]}" -np 1 "$BUILD/shardlm" train "${args[@]}" : -np 1 "$BUILD/shardlm" generate \
      "${args[@]}" > "$out/$name.log" 2>&1; then
    echo "FAIL $name: the RL job failed:"; tail -8 "$out/$name.log"
    return 1
  fi
}
rl device SHARDLM_BROADCAST_IPC=0 || exit 1
rl host SHARDLM_RECEIVE_TO_HOST=1 SHARDLM_BROADCAST_IPC=0 || exit 1
# The weights through a CUDA IPC handle (the default on a one-GPU machine).
rl ipc || exit 1
# In-flight updates on the GPU decoder: weights taken between decode steps
# (the copy task's steps are short: the sampler is slowed, as in
# tests/scripts/test_rl_in_flight.sh, so that they arrive mid-step).
rl in-flight SHARDLM_FAULT=sample_slow@1 SHARDLM_SAMPLE_SLOW_MS=100 ARGS_EXTRA="--set data.max_async=2 --set rollout.batch=64 --set rollout.in_flight_updates=true" || exit 1
"$PY" - "$out/in-flight" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
loads = sum(r["in_flight_updates"] for r in rows)
ok = loads >= 1 and all(0 <= r["step"] - r["policy_step"] <= 2 for r in rows)
print(f"{'PASS' if ok else 'FAIL'} in-flight updates on the GPU decoder: {loads} weights taken mid-step over {len(rows)} "
      "steps, every file within data.max_async")
PYEOF
# The KL term against the starting weights: the frozen reference's forward pass
# on the GPU (its bf16 copy, the fp32 masters' norms). At step 0 it reads the
# same bits as the policy, so the term is 0 to rounding (3.8e-15 on an H100:
# the forward-only reference pass may pick other GEMM algorithms than the
# training forward) and the loss is the ipc run's; later the policy moves away.
rl ref-kl ARGS_EXTRA="--set loss.ref_kl_coef=0.1" || exit 1
"$PY" - "$out" <<'PYEOF'
import json, math, sys
out = sys.argv[1]
def steps(d):
    rows = [json.loads(l) for l in open(f"{out}/{d}/metrics.jsonl") if l.strip()]
    return {r["step"]: r for r in rows if "event" not in r and "loss" in r}
ref, base = steps("ref-kl"), steps("ipc")
kl = [ref[s].get("ref_kl") for s in sorted(ref)]
first = min(ref)  # the first step's row: its update at the starting weights
ok = kl and abs(kl[0]) < 1e-9 and ref[first]["loss"] == base[first]["loss"]
print(f"{'PASS' if ok else 'FAIL'} reference KL on the GPU: below 1e-9 at the first step (the frozen copy is the policy's "
      f"bits), the loss there equal to the run without the term: ref_kl {kl[:1]}, loss {ref[first]['loss']!r} vs "
      f"{base[first]['loss']!r}")
later = kl[1:]
ok = len(later) >= 3 and all(k is not None and math.isfinite(k) and k > 0 for k in later)
print(f"{'PASS' if ok else 'FAIL'} ... then above 0 as the policy moves: {['%.3g' % k for k in later]}")
PYEOF

if [ "$dev" = cuda ]; then
  if grep -q "units arrive in GPU memory" "$out/device.log"; then
    echo "PASS the inference rank receives the weights in GPU memory"
  else
    echo "FAIL the inference rank did not say the weights arrive in GPU memory"
  fi
  if grep -q "over the ipc device communicator" "$out/ipc.log"; then
    echo "PASS by default on one GPU the weights travel over the CUDA IPC device communicator"
  else
    echo "FAIL by default on one GPU the log does not name the CUDA IPC device communicator"
  fi
  if grep -q "over the mpi device communicator" "$out/device.log"; then
    echo "PASS SHARDLM_BROADCAST_IPC=0: the weights travel over the staged MPI device communicator"
  else
    echo "FAIL SHARDLM_BROADCAST_IPC=0: the log does not name the staged MPI device communicator"
  fi
fi
# Every rollout step's rewards and every trainer step's loss, the three paths.
"$PY" - "$out" "$steps" <<'PYEOF'
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
def rows(d, f, key):
    return [json.loads(l).get(key) for l in open(f"{out}/{d}/{f}") if f'"{key}"' in l]
for other, what in (("host", "through the host"), ("ipc", "over CUDA IPC")):
    for f, key in (("rollouts.jsonl", "reward_mean"), ("metrics.jsonl", "loss"), ("metrics.jsonl", "mismatch_kl")):
        x, y = rows("device", f, key), rows(other, f, key)
        ok = len(x) >= steps and x == y
        print(f"{'PASS' if ok else 'FAIL'} {key} of {len(x)} steps: the decoder loaded device to device = {what}"
              + ("" if ok else f": {x} against {y}"))
PYEOF
