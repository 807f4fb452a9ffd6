#!/usr/bin/env bash
# test_rl_gpu_faults.sh — the RL job on one GPU where it used to fail (make test-gpu):
#   a sampling step longer than comm.timeout_s (2 s; the reward program takes 8 s
#     at rollout step 2, data.max_async = 1) over the staged MPI device
#     communicator (SHARDLM_BROADCAST_IPC=0) and over CUDA IPC: the job finishes.
#     Trainer rank 0 used to send the header in an unwatched MPI_Bcast that
#     returned at once, then wait in the device broadcast, whose watchdog ended
#     the job after comm.timeout_s while the inference rank was still scoring;
#   kill -9 after step 5 (checkpoints every 2 steps), then the same job again:
#     it trains on exactly the files the uninterrupted run does (run.deterministic:
#     every loss equal);
#   strictly on-policy with top-p 0.8 and top-k 20: the trainer's ratio is as
#     close to 1 as without truncation (mean k3 of log r within 2x of the top-p 1
#     run's, bf16 on both sides); the truncated logprob in its place gave 1e-2.
# Prints PASS/FAIL lines.
#
#   bash tests/gpu/test_rl_gpu_faults.sh   (after make test-gpu has built build/shardlm)
source "$(dirname "$0")/lib.sh" rl-gpu-faults
dev=${SHARDLM_TEST_DEVICE:-cuda}
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE)
source tests/scripts/lib/checks.sh  # check, has, wait_for, tree_pids

"$PY" tools/make_copy_task.py --out-dir "$out/task" > "$out/task.log" 2>&1 || { echo "FAIL make_copy_task.py"; exit 1; }
if ! timeout 300 "$BUILD/shardlm" train inputs/copy-sft.toml --set device.backend="$dev" --set "data.path=$out/task/sft.h5" \
    --set "run.dir=$out/sft" --set "run.export_dir=$out/sft/export" --set run.max_steps=20 \
    --set model.hidden_size=64 --set model.intermediate_size=128 --set model.num_heads=2 --set model.num_kv_heads=1 \
    > "$out/sft.log" 2>&1; then
  echo "FAIL SFT warm start on the GPU:"; tail -5 "$out/sft.log"; exit 1
fi

# args NAME SETS...: the RL deck for a run into $out/NAME
args() {
  local name=$1
  shift
  A=(inputs/copy-rl.toml --set "model.hf=$out/sft/export" --set "run.dir=$out/$name"
     --set "data.rollout_dir=$out/$name/rollouts" --set "rollout.prompts=$out/task/prompts.h5"
     --set device.backend="$dev" --set run.deterministic=true --set log.interval=1 "$@")
}
job() { timeout 300 "${MPI[@]}" -np 1 "$BUILD/shardlm" train "${A[@]}" : -np 1 "$BUILD/shardlm" generate "${A[@]}"; }
losses() { "$PY" -c "import json,sys; print([r['loss'] for r in map(json.loads, open(sys.argv[1])) if 'loss' in r])" "$1"; }

# ---- busy sampling over both device communicators
for path in staged ipc; do
  ipc=1
  [ $path = staged ] && ipc=0
  rm -f "$out/calls-$path"
  cat > "$out/slow-$path.sh" <<EOF
n=\$(wc -l)
echo call >> "$out/calls-$path"
if [ "\$(wc -l < "$out/calls-$path")" -eq 3 ]; then sleep 8; fi
i=0
while [ \$i -lt \$n ]; do echo 1; i=\$((i + 1)); done
EOF
  args "busy-$path" --set run.max_steps=6 --set data.max_async=1 --set comm.timeout_s=2 --set ckpt.interval=0 \
    --set ckpt.save_final=false --set 'rollout.reward="program"' --set "rollout.reward_program=\"sh $out/slow-$path.sh\"" \
    --set rollout.reward_timeout_s=60
  SHARDLM_BROADCAST_IPC=$ipc timeout 300 "${MPI[@]}" -x SHARDLM_BROADCAST_IPC -np 1 "$BUILD/shardlm" train "${A[@]}" : \
    -np 1 "$BUILD/shardlm" generate "${A[@]}" > "$out/busy-$path.log" 2>&1
  rc=$?
  check "$path: a rollout step of 8 s with comm.timeout_s = 2 finishes (exit $rc)" test $rc = 0
  check "... every step trained" grep -q 'step      6/6' "$out/busy-$path.log"
  [ "$dev" = cuda ] && check "... over the $path device communicator" \
    grep -q "over the $([ $path = staged ] && echo mpi || echo ipc) device communicator" "$out/busy-$path.log"
done

# ---- kill -9, then the same job again
args full --set run.max_steps=8 --set ckpt.interval=2
job > "$out/full.log" 2>&1
check "the uninterrupted run finishes (exit $?)" test $? = 0
args kill --set run.max_steps=8 --set ckpt.interval=2
job > "$out/kill.log" 2>&1 &
pid=$!
wait_for 300 grep -qs "step      5/" "$out/kill.log"
kill -9 $(tree_pids "$pid") 2>/dev/null
wait "$pid" 2>/dev/null
job > "$out/kill-2.log" 2>&1
check "killed (kill -9) after step 5, the same job again finishes (exit $?)" test $? = 0
check "... resumed from a checkpoint" grep -qE "checkpoint: resumed from .*/step_[24]\.h5" "$out/kill-2.log"
lf=$(losses "$out/full/metrics.jsonl"); lk=$(losses "$out/kill/metrics.jsonl")
check "... its 8 losses are the uninterrupted run's (full $lf, killed $lk)" \
  test "$lf" = "$lk" -a "$(echo "$lf" | tr -cd , | wc -c)" = 7

# ---- on-policy with top-p / top-k
args topp1 --set run.max_steps=1 --set ckpt.save_final=false
job > "$out/topp1.log" 2>&1
args topp08 --set run.max_steps=1 --set ckpt.save_final=false --set rollout.top_p=0.8 --set rollout.top_k=20
job > "$out/topp08.log" 2>&1
check "on-policy, top-p 0.8 and top-k 20: r as close to 1 as with top-p 1 (mean k3 within 2x)" \
  "$PY" - "$out/topp1/metrics.jsonl" "$out/topp08/metrics.jsonl" <<'EOF'
import json, sys
k = [[json.loads(l)["mismatch_kl"] for l in open(p) if '"mismatch_kl"' in l][0] for p in sys.argv[1:]]
print("mean k3 of log r at the first step: top-p 1 %.3e, top-p 0.8 + top-k 20 %.3e" % tuple(k))
assert k[1] <= 2 * k[0] + 1e-7, k
EOF
exit $((failures > 0))
