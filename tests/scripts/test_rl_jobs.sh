#!/usr/bin/env bash
# test_rl_jobs.sh — RL jobs that meet another job's files, and decks that cannot
# train (CPU, the copy task of inputs/copy-rl.toml, a few steps each, -np 1 train
# : -np 1 generate). Each check states what it reproduces:
#   a second job (run.seed 12) with the data.rollout_dir of a finished one (seed
#     11): its trainers say that step_0.h5 belongs to another job, wait for their
#     own inference rank's files (root attribute job_id, one id in every file) and
#     train on those. Without job ids the second job trained on the first job's
#     files, silently: its losses equalled the first job's bit for bit
#       mpirun -np 1 shardlm train copy-rl.toml : -np 1 shardlm generate copy-rl.toml
#       (twice, the second with --set run.seed=12 --set run.dir=B, same rollout_dir);
#   `shardlm check` of that deck did call the other job's step_0.h5 "read and valid";
#   an inference rank that dies before rollout step 4 (checkpoint at step 2), then
#     the job resumed: rollouts.jsonl held steps 2 and 3 twice (8 rows for 6
#     steps), now steps 0..5 once each, and the files of steps 2..5 are the
#     resumed launch's;
#   a job killed (kill -9) after step 5, then run again: its losses equal the
#     uninterrupted run's over the MPI and the filesystem broadcast (the
#     filesystem's resumed inference rank took the dead launch's newest weights);
#   on-policy with top-p / top-k, the trainer's ratio was biased below 1 on every
#     affected token (the file held the truncated distribution's logprob);
#   two trainer ranks reading two versions of a file replaced as they read it
#     trained each on its own, silently; now they agree on one;
#   `check` accepted rollout.n = 1 (every group advantage 0: nothing trains), now
#     refuses it naming rollout.n and rollout.advantage;
#   the clipped objective's deck echo printed `loss.mask_high = ` with no value.
# Prints PASS/FAIL lines; exits non-zero when anything failed.
set -u
cd "$(dirname "$0")/../.."
source tests/scripts/lib/setup.sh rl_jobs  # BIN, PY, MPI, T, checks.sh
start=$(date +%s)

copy_task_warm_start --set run.max_steps=20 --set 'run.export_dtype="bf16"'

# rl RUN_DIR EXTRA...: ARGS = the deck for a run in RUN_DIR, rollouts in $T/shared, then EXTRA.
rl() {
  local dir=$1
  shift
  ARGS=(inputs/copy-rl.toml --set "model.hf=$T/sft/export" --set "run.dir=$dir" --set "data.rollout_dir=$T/shared"
        --set "rollout.prompts=$T/task/prompts.h5" --set run.max_steps=3 --set log.interval=1 "$@")
}
job() { timeout 120 "${MPI[@]}" "$@" -np 1 "$BIN" train "${ARGS[@]}" : -np 1 "$BIN" generate "${ARGS[@]}"; }
losses() { "$PY" -c "import json,sys; print([r['loss'] for r in map(json.loads, open(sys.argv[1])) if 'loss' in r])" "$1"; }

# --- a second job in the same rollout directory
rl "$T/a"
job > "$T/a.log" 2>&1
check "job A (seed 11): exit 0" test $? = 0
check "... its deck echo shows no key without a value (was 'loss.mask_high = ')" \
  bash -c "! grep -qE '^  [a-z_.]+ = \$' '$T/a.log' && grep -qF '  loss.clip_high = 0.28' '$T/a.log'"
rl "$T/b" --set run.seed=12
"$BIN" check "${ARGS[@]}" > "$T/check-b.log" 2>&1
check "check of job B's deck: exit 0 (got $?), and A's step_0.h5 is not called valid" \
  bash -c "! grep -q 'read and valid' '$T/check-b.log'"
check "... it says step_0.h5 belongs to another job" has "$T/check-b.log" "step_0.h5 there belongs to another job (job "
job > "$T/b.log" 2>&1
check "job B (seed 12, A's rollout_dir): exit 0" test $? = 0
check "... its trainers said once that A's step_0.h5 belongs to another job" \
  test "$(grep -c "$T/shared/step_0.h5 belongs to another job" "$T/b.log")" = 1
la=$(losses "$T/a/metrics.jsonl"); lb=$(losses "$T/b/metrics.jsonl")
check "... and trained on its own rollouts: its losses are not A's (A $la, B $lb)" \
  test "$la" != "$lb" -a "$lb" != "[]"
check "every rollout file carries one job id, B's" "$PY" - "$T/shared" <<'EOF'
import sys, h5py
ids = set()
for s in range(3):
    with h5py.File(f"{sys.argv[1]}/step_{s}.h5") as f:
        ids.add(int(f.attrs["job_id"]))
assert len(ids) == 1 and 0 not in ids, ids
EOF

# --- an inference rank dies, the job resumes: rollouts.jsonl without the dead launch's rows past the checkpoint.
# Saves are synchronous here: a background save of step 2 still being written when the crash ends the job (a
# loaded machine) leaves no whole checkpoint, and the job then starts over, which is right but not this case.
rl "$T/die" --set run.max_steps=6 --set ckpt.interval=2 --set ckpt.async=false --set "data.rollout_dir=$T/die/rollouts"
SHARDLM_FAULT=generate_crash@1 job -x SHARDLM_FAULT > "$T/die.log" 2>&1
rc=$?
check "an inference rank dying before rollout step 4 ends the job (exit $rc)" test $rc != 0 -a $rc != 124
job > "$T/resume.log" 2>&1
check "the same job again resumes and finishes (exit $?)" test $? = 0
check "... from step 2" grep -qE "checkpoint: resumed from .*/step_2\.h5" "$T/resume.log"
# Whether the resumed trainers reach step 2 before the resumed inference rank
# replaces the dead launch's step_2.h5 is a race; what holds either way is that
# the files of steps 2..5 are the resumed launch's (one job id, not the dead
# launch's of steps 0 and 1), and the trainers take only their own job's files.
check "... the files of steps 2..5 are the resumed launch's, not the dead launch's" "$PY" - "$T/die/rollouts" <<'EOF'
import os, sys, h5py
def job(s):
    with h5py.File(f"{sys.argv[1]}/step_{s}.h5") as f:
        return int(f.attrs["job_id"])
resumed = {job(s) for s in range(2, 6)}
dead = {job(s) for s in range(2) if os.path.exists(f"{sys.argv[1]}/step_{s}.h5")}
assert len(resumed) == 1 and 0 not in resumed and not (resumed & dead), (resumed, dead)
EOF
check "rollouts.jsonl holds steps 0..5 once each (were steps 2 and 3 twice)" "$PY" - "$T/die/rollouts.jsonl" <<'EOF'
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1])]
assert steps == list(range(6)), steps
EOF

# --- kill -9 mid-run, then the same job again: it trains on exactly the files
# the uninterrupted run does (every loss equal), over the MPI path and the
# filesystem path of the weight broadcast. Reproduction (filesystem): the
# resumed inference rank took the dead launch's newest step directory (weights
# past the checkpoint) and skipped the rollout steps the trainers needed; they
# waited for them until data.rollout_timeout_s.
for path in nccl filesystem; do
  extra=(--set run.max_steps=8 --set ckpt.interval=2 --set "broadcast.backend=\"$path\"")
  rl "$T/full-$path" "${extra[@]}" --set "data.rollout_dir=$T/full-$path/rollouts" \
    --set "broadcast.dir=\"$T/full-$path/weights\""
  job > "$T/full-$path.log" 2>&1
  check "$path: the uninterrupted run finishes (exit $?)" test $? = 0
  rl "$T/kill-$path" "${extra[@]}" --set "data.rollout_dir=$T/kill-$path/rollouts" \
    --set "broadcast.dir=\"$T/kill-$path/weights\"" --set data.rollout_timeout_s=30
  # the trainer holds after step 5 (SHARDLM_TEST_HOLD, a file never made) so
  # the kill lands between the step-4 checkpoint and the step-6 one however
  # slow the machine is
  SHARDLM_TEST_HOLD="5:$T/never" job -x SHARDLM_TEST_HOLD > "$T/kill-$path.log" 2>&1 &
  pid=$!
  wait_for 120 grep -qs "test hold: after step 5" "$T/kill-$path.log"
  kill -9 $(tree_pids "$pid") 2>/dev/null
  wait "$pid" 2>/dev/null
  job > "$T/kill-$path-2.log" 2>&1
  check "$path: killed (kill -9) after step 5, the same job again finishes (exit $?)" test $? = 0
  check "... resumed from the step-4 checkpoint" grep -qE "checkpoint: resumed from .*/step_4\.h5" "$T/kill-$path-2.log"
  [ $path = filesystem ] && check "... and says it removed the dead launch's weights" \
    grep -qE "broadcast: removed [0-9]+ step director(y|ies) an earlier launch left" "$T/kill-$path-2.log"
  lf=$(losses "$T/full-$path/metrics.jsonl"); lk=$(losses "$T/kill-$path/metrics.jsonl")
  check "... its 8 losses are the uninterrupted run's (full $lf, killed $lk)" \
    test "$lf" = "$lk" -a "$(echo "$lf" | tr -cd , | wc -c)" = 7
done

# --- trainer ranks that read two versions of one file: rollouts written from
# outside the job (tools/make_rollouts.py, no job id) and replaced while the
# ranks read them. Reproduction: with equal micro-batch counts each rank trained
# on its own version, silently (different counts: MPI_ERR_TRUNCATE). The race is
# pinned by SHARDLM_FAULT=rollout_other_version@1: trainer rank 1's first read of
# each file comes back as another version (one advantage moved). The ranks now
# compare fingerprints, read again, and train on one version: the losses are
# those of the run without the fault.
"$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$T/offline" --steps 4 > "$T/offline.log" 2>&1
off=(inputs/tiny-rl.toml --set "data.rollout_dir=$T/offline" --set run.max_steps=4 --set log.interval=1
     --set ckpt.interval=0 --set ckpt.save_final=false --set 'broadcast.backend="none"')
timeout 120 "${MPI[@]}" -np 2 "$BIN" train "${off[@]}" --set "run.dir=$T/one" > "$T/one.log" 2>&1
check "two trainers on offline rollouts: exit $?" test $? = 0
timeout 120 "${MPI[@]}" -x SHARDLM_FAULT=rollout_other_version@1 -np 2 "$BIN" train "${off[@]}" \
  --set "run.dir=$T/two" > "$T/two.log" 2>&1
check "... rank 1 reading another version of each file: exit $?" test $? = 0
check "... rank 0 says so and every rank reads again, each of the 4 steps" \
  test "$(grep -c 'rollouts: 1 of 2 trainer ranks read another version of .*: every rank reads it again' "$T/two.log")" = 4
l1=$(losses "$T/one/metrics.jsonl"); l2=$(losses "$T/two/metrics.jsonl")
check "... and they train on one version: the losses are the run's without the fault ($l1, $l2)" \
  test "$l1" = "$l2" -a "$l1" != "[]"

# --- strictly on-policy (data.max_async = 0, every step's weights) with
# rollout.top_p = 0.8 and rollout.top_k = 20: the trainer's ratio r = 1 at the
# first step (weights of the bf16 warm start on both sides). Reproduction: the
# rollout file stored the logprob under the truncated, renormalised sampling
# distribution and the trainer scored the full one: mean k3 = r - log r - 1 was
# 0.018 (log r < 0 on every affected token). Now inference_logprobs is the
# temperature-scaled full softmax's, sampling_logprobs the truncated one's.
rl "$T/topp" --set rollout.top_p=0.8 --set rollout.top_k=20 --set run.max_steps=1 --set "data.rollout_dir=$T/topp/rollouts"
job > "$T/topp.log" 2>&1
check "on-policy with top-p 0.8 and top-k 20: exit $?" test $? = 0
check "... r = 1 at the first step: mean k3 of log r below 5e-13 (|log r| ~ 1e-6)" "$PY" - "$T/topp" <<'EOF'
import json, sys, h5py, numpy as np
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"mismatch_kl"' in l]
assert rows and rows[0]["mismatch_kl"] < 5e-13, rows[:1]
with h5py.File(f"{sys.argv[1]}/rollouts/step_0.h5") as f:
    full, drawn, mask = f["inference_logprobs"][:], f["sampling_logprobs"][:], f["loss_mask"][:] == 1
# the truncated distribution puts at least as much mass on a token it keeps, more on some
assert np.all(drawn[mask] >= full[mask] - 1e-6) and np.any(drawn[mask] > full[mask] + 1e-3)
print("mismatch_kl", rows[0]["mismatch_kl"])
EOF

# --- decks that cannot train
rl "$T/n1" --set rollout.n=1
"$BIN" check "${ARGS[@]}" > "$T/n1.log" 2>&1
rc=$?
check "check refuses rollout.n = 1 with group advantages (exit $rc)" test $rc = 1
check "... naming rollout.n and rollout.advantage" \
  has "$T/n1.log" "rollout.n = 1 with rollout.advantage = \"mean_std\": each prompt's group is one sample"

echo "test_rl_jobs: $(( $(date +%s) - start )) s"
exit $((failures > 0))
