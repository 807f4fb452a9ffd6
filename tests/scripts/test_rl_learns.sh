#!/usr/bin/env bash
# test_rl_learns.sh — RL end to end on the CPU, and the reward rises.
#   warm start: inputs/copy-sft.toml, 60 SFT steps on "repeat the last digit of
#     the prompt" (tools/make_copy_task.py): the model samples the right digit
#     about one time in six;
#   RL: `mpirun -np 2 shardlm train copy-rl.toml : -np 1 shardlm generate
#     copy-rl.toml`, weights broadcast (MPI) every step, strictly on-policy
#     (data.max_async = 0), the clipped surrogate, 32 prompts x 8 samples per
#     step, 60 steps: the mean reward of the last 10 rollout steps is well above
#     that of the first 5 (seeded: the same numbers every run);
#   the same with loss.objective = "gspo" and "cispo", loss.normalize = "constant",
#     loss.is_level = "sequence" with an entropy bonus, and two epochs over two parts a
#     step (four updates): the reward rises under each; with several updates the clip
#     acts from the second update of a step on, never in the first (on-policy);
#     CISPO's rewards equal the clipped surrogate's while no weight is truncated;
#     on-policy the importance ratio stays near 1;
#   a mixture of experts (qwen3_moe, the load-balancing loss on, router replay on) learns the same way,
#     its rollout files carrying every fed token's experts;
#   the filesystem broadcast with two inference ranks, data.max_async = 2,
#     broadcast.interval = 3 and a reward program: every file's policy step is
#     within the lag, the program's rewards are the exact verifier's;
#   the rollout metrics (rewards, lengths, sampling speed) in the trainer's
#     metrics.jsonl, equal to the rollout file's; two reward components weighted;
#   an inference rank that dies ends the job naming it, and the trainers'
#     checkpoint resumes the job;
#   bad input ends the job with a message naming it: a missing prompt file, a
#     reward program that fails, one that hangs; `generate DECK` without
#     trainers; `check` refuses data.max_async < broadcast.interval - 1.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
PY=${PYTHON:-/usr/bin/python3}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
if [ ! -x "$BIN" ]; then echo "FAIL rl_learns: $BIN is not built"; exit 1; fi

T=$(mktemp -d /tmp/shardlm-rl-XXXXXX)
cleanup() { [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"; }
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has
MPI=($MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY)

"$PY" tools/make_copy_task.py --out-dir "$T/task" > "$T/task.log" 2>&1 || { fail "make_copy_task.py"; cat "$T/task.log"; }
timeout 120 "$BIN" train inputs/copy-sft.toml --set "data.path=$T/task/sft.h5" --set "run.dir=$T/sft" \
  --set "run.export_dir=$T/sft/export" > "$T/sft.log" 2>&1
check "SFT warm start: 60 steps, exported" test -f "$T/sft/export/model.safetensors"

# rl RUN_DIR EXTRA...: ARGS = the deck and its settings for a run in RUN_DIR, then EXTRA (--set pairs).
rl() {
  local dir=$1
  shift
  ARGS=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$dir" --set "data.rollout_dir=$dir/rollouts"
        --set "rollout.prompts=$T/task/prompts.h5" "$@")
}

# --- the reward rises
start=$(date +%s.%N)
rl "$T/rl"
timeout 300 "${MPI[@]}" -np 2 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/rl.log" 2>&1
rc=$?
seconds=$("$PY" -c "import time; print(f'{time.time() - $start:.1f}')")
check "RL job (2 trainers + 1 inference rank, MPI broadcast every step) exits 0 ($seconds s)" test $rc = 0
summary=$("$PY" - "$T/rl" <<'EOF'
import json, sys, h5py
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/rollouts.jsonl")]
r = [row["reward_mean"] for row in rows]
lag = [row["step"] - row["policy_step"] for row in rows]
files = []
for s in range(60):
    with h5py.File(f"{d}/rollouts/step_{s}.h5") as f:
        files.append((int(f.attrs["step"]), int(f.attrs["policy_step"]), len(f["offsets"]) - 1))
ok_files = all(st == s and ps == s and n == 256 for s, (st, ps, n) in enumerate(files))
m = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step"' in l]
clip = [row.get("clip_fraction") for row in m if "clip_fraction" in row]
print(len(r), f"{sum(r[:5]) / 5:.4f}", f"{sum(r[-10:]) / 10:.4f}", max(lag), int(ok_files), len(clip),
      f"{max(clip) if clip else -1:.4f}")
EOF
)
read -r steps before after max_lag files_ok clip_rows clip_max <<< "${summary:-0 0 0 0 0 0 0}"
echo "reward: first 5 rollout steps $before, last 10 $after ($steps steps, $seconds s)"
check "60 rollout steps scored" test "$steps" = 60
check "reward before RL is low: mean of the first 5 steps $before < 0.30" "$PY" -c "assert $before < 0.30"
check "reward rises: mean of the last 10 steps $after >= 0.45 and >= first 5 + 0.25" \
  "$PY" -c "assert $after >= 0.45 and $after >= $before + 0.25"
check "on-policy: every file's policy_step is its step, 32 x 8 samples each" test "$files_ok" = 1
check "on-policy, the clip is (almost) never active: clip_fraction <= 0.05 (max $clip_max over $clip_rows logged steps)" \
  "$PY" -c "assert $clip_rows >= 12 and 0 <= $clip_max <= 0.05"
check "the trainer's log line names the clip fraction" has "$T/rl.log" "clip fraction"
check "the banner counts the inference rank" has "$T/rl.log" "inference: 1 of the receivers run \`shardlm generate\`"
received=$(grep -c '^receive\[0\]: step ' "$T/rl.log")
split=$(grep -cE '^receive\[0\]: step .* \(transfer [0-9.]+, check [0-9.]+, load [0-9.]+ ms\), checksums ok$' "$T/rl.log")
check "each of the $received receive lines splits its time into transfer, check and load ($split do)" \
  test "$received" = 61 -a "$split" = 61
check "the trainer's end says where its broadcasts' time went: 61 sends (the start and 60 steps)" \
  grep -qE "^broadcast: 61 sends, [0-9.]+ s each: gathering the units [0-9.]+, rank 0's host copy and checksums [0-9.]+, over the MPI communicator \(waits for the receivers included\) [0-9.]+ s$" "$T/rl.log"
check "the rollout metrics reach the trainer's metrics.jsonl with the step that trains on them" "$PY" - "$T/rl" <<'EOF'
import json, sys, h5py
d = sys.argv[1]
ro = {r["step"]: r for r in (json.loads(l) for l in open(f"{d}/rollouts.jsonl"))}
rows = [r for r in (json.loads(l) for l in open(f"{d}/metrics.jsonl")) if "event" not in r]
assert len(rows) == 12, len(rows)  # log.interval = 5 over 60 steps
for row in rows:
    s = row["step"] - 1  # the 0-based step, whose rollout file it trained on
    with h5py.File(f"{d}/rollouts/step_{s}.h5") as f:
        rewards = f["rewards"][:]
        file_mean = float(rewards.mean())
        assert abs(f["metrics"].attrs["reward_mean"] - file_mean) < 1e-12
    assert len(rewards) == 256
    assert abs(row["rollout_reward_mean"] - file_mean) < 1e-6, (row, file_mean)
    assert abs(row["rollout_reward_mean"] - ro[s]["reward_mean"]) < 1e-5, (row, ro[s])
    assert row["rollout_reward_exact"] == row["rollout_reward_mean"]  # one component, weight 1
    assert 1 <= row["rollout_response_length_mean"] <= 2 and row["rollout_response_length_max"] == 2, row
    assert row["rollout_sampling_tokens_per_s"] > 0 and row["rollout_generated_tokens"] >= 256, row
print(f"{len(rows)} rows: rollout_reward_mean = mean of the file's rewards")
EOF
check "... and the trainer's progress line shows the rollout reward" has "$T/rl.log" "| rollout reward "

# --- the other objectives and Dr. GRPO's aggregation learn too: the same job (seeded, 60 steps)
# with loss.objective = "gspo", "cispo", and loss.normalize = "constant" (the default divisor,
# max_new_tokens x prompts_per_step x n = 512). GSPO keeps the deck's clip 0.2 / 0.28: its paper's
# 3e-4 / 4e-4 suit completions of thousands of tokens, whose mean log-ratio averages the bf16
# broadcast's per-token mismatch (|log r| ~ 2e-3 here) away; these are 2 tokens long, and with
# 3e-4 / 4e-4 a fifth of them stay clipped. CISPO has no lower bound (clip_low = 1). And
# sequence-level importance sampling (masked outside [1/2, 2]) with an entropy bonus.
variants=('gspo:loss.objective="gspo"' 'cispo:loss.objective="cispo" loss.clip_low=1.0'
          'constant:loss.normalize="constant"'
          'is_sequence:loss.is_level="sequence" loss.is_mask=2.0 loss.entropy_coef=0.001'
          'updates:loss.epochs=2 loss.mini_batches=2')
for v in "${variants[@]}"; do
  name=${v%%:*}
  sets=()
  for kv in ${v#*:}; do sets+=(--set "$kv"); done
  start=$(date +%s.%N)
  rl "$T/$name" "${sets[@]}"
  timeout 300 "${MPI[@]}" -np 2 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/$name.log" 2>&1
  rc=$?
  seconds=$("$PY" -c "import time; print(f'{time.time() - $start:.1f}')")
  read -r steps before after <<< "$("$PY" - "$T/$name" <<'EOF'
import json, sys
r = [json.loads(l)["reward_mean"] for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
print(len(r), f"{sum(r[:5]) / 5:.4f}", f"{sum(r[-10:]) / 10:.4f}")
EOF
)"
  echo "$name: reward first 5 rollout steps ${before:-?}, last 10 ${after:-?} (${steps:-0} steps, $seconds s)"
  check "$name: the job exits 0 after 60 scored steps ($seconds s)" test $rc = 0 -a "${steps:-0}" = 60
  check "$name: the reward rises from ${before:-?} (< 0.30) to ${after:-?} (>= 0.45 and >= first 5 + 0.25)" \
    "$PY" -c "assert ${before:-1} < 0.30 and ${after:-0} >= 0.45 and ${after:-0} >= ${before:-1} + 0.25"
done
check "the trainer's progress line names its clip fraction under gspo and cispo" \
  test "$(grep -l "clip fraction" "$T/gspo.log" "$T/cispo.log" | wc -l)" = 2
check "constant: the deck echo has the divisor 2 x 32 x 8 = 512" has "$T/constant.log" "normalize_constant = 512"
# PPO's several updates on one batch (Schulman et al. 2017, arXiv:1707.06347, Algorithm 1): the ratio is
# against the sampling policy's logprobs, so the first update of a step is on-policy (its clip idle, up to
# the bf16 broadcast's mismatch) and the later ones have moved the weights past the clip on some tokens.
check "updates: 4 updates a step; the first's clip fraction <= 0.05 at every logged step; through step 30 a later \
one clips at every logged step and the later ones clip more than the first (the clip acts once the weights moved)" \
  "$PY" - "$T/updates" <<'EOF'
import json, sys
m = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"update_clip_fraction"' in l]
assert len(m) == 12 and all(r["updates"] == 4 for r in m), m
clip = [r["update_clip_fraction"] for r in m]
first, later = [c[0] for c in clip[:6]], [x for c in clip[:6] for x in c[1:]]
assert all(c[0] <= 0.05 for c in clip), clip
assert all(max(c[1:]) > 0 for c in clip[:6]), clip
assert sum(later) / len(later) > sum(first) / len(first), clip
print(f"steps 5..30: first update mean {sum(first) / len(first):.4f}, later updates mean {sum(later) / len(later):.4f}")
EOF
check "is_sequence: on-policy without top-k / top-p the importance ratio stays within 1e-2 of 1, nothing capped or \
masked, at every logged step" "$PY" - "$T/is_sequence" <<'EOF'
import json, sys
m = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"is_ratio"' in l]
assert len(m) == 12, len(m)
assert all(abs(r["is_ratio"] - 1) < 1e-2 and r["is_capped_fraction"] == 0 and r["is_masked_fraction"] == 0
           for r in m), [(r["is_ratio"], r["is_capped_fraction"], r["is_masked_fraction"]) for r in m]
EOF
check "cispo: while no weight is truncated (on-policy, clip_fraction 0) its gradient is the clipped surrogate's, \
-A r d logp: the same rewards at every step; its loss, -clip(r) A logp, is another number" "$PY" - "$T/cispo" "$T/rl" <<'EOF'
import json, sys
cispo, clipped = ([json.loads(l) for l in open(f"{d}/rollouts.jsonl")] for d in sys.argv[1:])
assert [r["reward_mean"] for r in cispo] == [r["reward_mean"] for r in clipped]
m = [[json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"clip_fraction"' in l] for d in sys.argv[1:]]
assert len(m[0]) == 12 and all(r["clip_fraction"] == 0 for r in m[0]), m[0]
assert all(abs(a["loss"] - b["loss"]) > 1e-3 for a, b in zip(*m)), [(a["loss"], b["loss"]) for a, b in zip(*m)]
EOF

# --- a mixture of experts learns too: the warm start as qwen3_moe (4 experts, 2 a token, the
# load-balancing loss on; 30 SFT steps, as the experts' model learns the copy faster), then the same RL job from its export (trainers and inference rank on
# the experts): the reward rises and the trainers log the load-balancing loss.
MOE=(--set model.arch=qwen3_moe --set model.qk_norm=true --set model.num_experts=4 --set model.num_experts_per_tok=2
     --set model.moe_intermediate_size=32 --set model.norm_topk_prob=true --set model.router_aux_loss=true
     --set model.router_aux_loss_coef=0.01)
timeout 120 "$BIN" train inputs/copy-sft.toml --set "data.path=$T/task/sft.h5" --set "run.dir=$T/moe-sft" \
  --set "run.export_dir=$T/moe-sft/export" --set run.max_steps=30 "${MOE[@]}" > "$T/moe-sft.log" 2>&1
check "experts: the warm start as qwen3_moe, exported as Qwen3MoeForCausalLM" \
  grep -q '"Qwen3MoeForCausalLM"' "$T/moe-sft/export/config.json"
start=$(date +%s.%N)
rl "$T/moe" --set "model.hf=$T/moe-sft/export" --set loss.router_replay=true
timeout 300 "${MPI[@]}" -np 2 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/moe.log" 2>&1
rc=$?
seconds=$("$PY" -c "import time; print(f'{time.time() - $start:.1f}')")
read -r steps before after aux_rows aux_first aux_last <<< "$("$PY" - "$T/moe" <<'EOF'
import json, sys
d = sys.argv[1]
r = [json.loads(l)["reward_mean"] for l in open(f"{d}/rollouts.jsonl")]
aux = [row["router_aux_loss"] for row in (json.loads(l) for l in open(f"{d}/metrics.jsonl")) if "router_aux_loss" in row]
print(len(r), f"{sum(r[:5]) / 5:.4f}", f"{sum(r[-10:]) / 10:.4f}", len(aux), f"{aux[0]:.4f}", f"{aux[-1]:.4f}")
EOF
)"
echo "experts: reward first 5 rollout steps ${before:-?}, last 10 ${after:-?} (${steps:-0} steps, $seconds s); \
load-balancing loss ${aux_first:-?} -> ${aux_last:-?}"
check "experts: the job exits 0 after 60 scored steps ($seconds s)" test $rc = 0 -a "${steps:-0}" = 60
check "experts: the reward rises from ${before:-?} (< 0.30) to ${after:-?} (>= 0.45 and >= first 5 + 0.25)" \
  "$PY" -c "assert ${before:-1} < 0.30 and ${after:-0} >= 0.45 and ${after:-0} >= ${before:-1} + 0.25"
check "experts: every logged step has the load-balancing loss, between 1 and 4 (K = 2 of E = 4: 2 when balanced)" \
  "$PY" -c "assert ${aux_rows:-0} == 12 and 1 <= ${aux_first:-0} <= 4 and 1 <= ${aux_last:-0} <= 4"
check "experts with router replay: every rollout file records each fed token's 2 of 4 experts at both layers (-1 on \
a sample's last token), the trainers log mismatch_kl" "$PY" - "$T/moe" <<'EOF'
import json, sys, h5py
import numpy as np
d = sys.argv[1]
for s in range(60):
    with h5py.File(f"{d}/rollouts/step_{s}.h5") as f:
        routes, offsets = f["routes"][:], f["offsets"][:]
        assert routes.dtype == np.int32 and routes.shape == (len(f["tokens"]), 4), routes.shape
        fed = np.ones(len(routes), bool)
        fed[offsets[1:] - 1] = False
        assert (routes[~fed] == -1).all()
        r = routes[fed].reshape(-1, 2, 2)
        assert ((r >= 0) & (r < 4)).all() and (r[:, :, 0] != r[:, :, 1]).all()
kl = [row["mismatch_kl"] for row in (json.loads(l) for l in open(f"{d}/metrics.jsonl")) if "mismatch_kl" in row]
assert len(kl) == 12 and all(0 <= k < 1e-2 for k in kl), kl
print(f"experts with router replay: mismatch_kl mean {sum(kl) / len(kl):.2e}, max {max(kl):.2e}")
EOF

# --- filesystem broadcast, two inference ranks, lag 2, a reward program
cat > "$T/reward.py" <<'EOF'
import json, sys
for line in sys.stdin:
    c = json.loads(line)
    print(1.0 if c["completion"].split()[-1:] == [c["answer"]] else 0.0)
EOF
fs_sets=(--set run.max_steps=9 --set 'broadcast.backend="filesystem"' --set "broadcast.dir=$T/fs/bcast"
         --set broadcast.interval=3 --set data.max_async=2 --set 'rollout.reward=["program", "exact"]'
         --set 'rollout.reward_weights=[1, 0.5]' --set "rollout.reward_program=\"$PY $T/reward.py\"")
rl "$T/fs" "${fs_sets[@]}"
timeout 300 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 2 "$BIN" generate "${ARGS[@]}" > "$T/fs.log" 2>&1
check "filesystem broadcast, 2 inference ranks, reward program: exit 0" test $? = 0
check "policy steps within data.max_async = 2 of each step, broadcast every 3" "$PY" - "$T/fs" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
assert [r["step"] for r in rows] == list(range(9)), rows
assert all(r["step"] - 2 <= r["policy_step"] <= r["step"] and r["policy_step"] % 3 == 0 for r in rows), rows
assert all(r["reward"] == "program+exact" and 0 <= r["reward_program"] <= 1 for r in rows), rows
EOF
check "two components weighted 1 and 0.5: the program's and the exact verifier's means agree, the total is 1.5 x" \
  "$PY" - "$T/fs" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
assert all(r["reward_program"] == r["reward_exact"] for r in rows), rows
assert all(abs(r["reward_mean"] - 1.5 * r["reward_exact"]) < 1e-5 for r in rows), rows
assert any(r["reward_exact"] > 0 for r in rows), rows
EOF
check "up to 2 steps off-policy the clip is active: clip_fraction > 0 in the trainer's metrics" "$PY" - "$T/fs" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"clip_fraction"' in l]
assert rows and max(r["clip_fraction"] for r in rows) > 0, rows
EOF
check "the program's rewards equal the exact verifier's on the same samples (step 0)" "$PY" - "$T/fs" "$T/rl" <<'EOF'
import json, sys
fs = [json.loads(l) for l in open(f"{sys.argv[1]}/rollouts.jsonl")]
rl = [json.loads(l) for l in open(f"{sys.argv[2]}/rollouts.jsonl")]
assert fs[0]["reward_program"] == rl[0]["reward_mean"], (fs[0], rl[0])  # same seed, same weights at step 0
EOF

# --- an inference rank that dies ends the job, naming it; the trainers' checkpoint resumes
rl "$T/die" --set run.max_steps=8 --set ckpt.interval=2
SHARDLM_FAULT=generate_crash@1 timeout 120 "${MPI[@]}" -x SHARDLM_FAULT -np 1 "$BIN" train "${ARGS[@]}" : \
  -np 1 "$BIN" generate "${ARGS[@]}" > "$T/die.log" 2>&1
rc=$?
check "an inference rank dying before rollout step 4 ends the job (exit $rc)" test $rc != 0 -a $rc != 124
check "... with a message naming the rank and its role" has "$T/die.log" "rank 1 of 2 (inference rank 0 of 1, "
check "... and the trainers left a checkpoint (step 2 at least)" test -f "$T/die/checkpoints/step_2.h5"
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/resume.log" 2>&1
rc=$?
check "the same job again resumes from it and finishes (exit $rc)" test $rc = 0
check "... from the checkpoint" grep -qE "checkpoint: resumed from .*/step_[24]\.h5" "$T/resume.log"
check "... and every step up to 8 has a rollout file" test -f "$T/die/rollouts/step_7.h5"

# --- bad input ends the job, naming it
rl "$T/bad1" --set "rollout.prompts=$T/none.h5"
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/bad1.log" 2>&1
rc=$?
check "a missing prompt file ends the job (exit $rc)" test $rc != 0 -a $rc != 124
check "... with a message naming the file" has "$T/bad1.log" "prompt file '$T/none.h5' does not exist"
prog=(--set 'rollout.reward="program"' --set 'rollout.reward_program="cat > /dev/null; exit 3"')
rl "$T/bad2" "${prog[@]}"
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/bad2.log" 2>&1
rc=$?
check "a failing reward program ends the job (exit $rc)" test $rc != 0 -a $rc != 124
check "... with a message naming it and the step" has "$T/bad2.log" \
  "reward program 'cat > /dev/null; exit 3' (rollout.reward_program, rollout step 0) exited with status 3"
hang=(--set 'rollout.reward="program"' --set 'rollout.reward_program="sleep 60"' --set rollout.reward_timeout_s=1)
t0=$(date +%s)
rl "$T/bad3" "${hang[@]}"
timeout 120 "${MPI[@]}" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}" > "$T/bad3.log" 2>&1
rc=$?
check "a hanging reward program ends the job after rollout.reward_timeout_s (exit $rc, $(( $(date +%s) - t0 )) s)" \
  test $rc != 0 -a $rc != 124 -a $(( $(date +%s) - t0 )) -lt 60
check "... with a message naming it" has "$T/bad3.log" \
  "reward program 'sleep 60' (rollout.reward_program, rollout step 0) gave no complete answer within rollout.reward_timeout_s = 1 s"
rl "$T/bad4"
"$BIN" generate "${ARGS[@]}" > "$T/bad4.log" 2>&1
rc=$?
check "generate DECK without trainers: exit 1 (got $rc) and says how to launch it" \
  test $rc = 1 -a "$(grep -c 'needs trainer ranks in the same job: mpirun -np T shardlm train DECK' "$T/bad4.log")" = 1
"$BIN" check inputs/tiny-rl.toml > "$T/check-ok.log" 2>&1
check "the shipped tiny-rl.toml passes check (max_async 4, broadcast.interval 5)" test $? = 0
"$BIN" check inputs/tiny-rl.toml --set data.max_async=1 > "$T/check-bad.log" 2>&1
rc=$?
check "check refuses data.max_async = 1 with broadcast.interval = 5 (exit $rc)" test $rc = 1
check "... saying why" has "$T/check-bad.log" "data.max_async = 1 is smaller than broadcast.interval - 1 = 4"

exit $((failures > 0))
