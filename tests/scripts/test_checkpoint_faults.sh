#!/usr/bin/env bash
# test_checkpoint_faults.sh — checkpoints survive what real jobs do to them,
# through the shardlm command line on 2 MPI ranks:
#   kill -9 in the middle of a write (synchronous, and a background write while
#   training goes on), a corrupted or truncated latest, an
#   unwritable directory (refused at start), a failed save with on_error = continue, a full disk (when tmpfs can be mounted), a stop signal
#   (exit 75 and requeue), a checkpoint of another model shape, inspect/export.
# Prints PASS/FAIL lines; exits non-zero when anything failed. Prints SKIP and
# exits 0 while `shardlm train` does not take ckpt.interval yet.
set -u
cd "$(dirname "$0")/../.."
BIN=${SHARDLM:-${BUILD:-build}/shardlm}
MPIRUN=${MPIRUN:-mpirun}
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive

if [ ! -x "$BIN" ]; then echo "SKIP checkpoint faults: $BIN is not built"; exit 0; fi
if ! "$BIN" check inputs/tiny-sft.toml --set ckpt.interval=5 --set ckpt.keep_last=2 >/dev/null 2>&1 ||
   ! "$BIN" --help 2>&1 | grep -q "inspect"; then
  echo "SKIP checkpoint faults: this shardlm does not checkpoint from the command line yet (ckpt.interval, inspect)"
  exit 0
fi

T=$(mktemp -d /tmp/shardlm-ckfault-XXXXXX)
mounted=""
cleanup() {
  [ -n "$mounted" ] && umount "$mounted" 2>/dev/null
  [ -n "${KEEP:-}" ] && { echo "logs in $T"; return; }; rm -rf "$T"
}
trap cleanup EXIT
source tests/scripts/lib/checks.sh  # failures, pass, fail, check, has, tree_pids

# train DIR LOG [--set ...]: 2 ranks, tiny deck, every step logged; returns mpirun's
# status (124 when it hangs for 3 minutes: a hang is a failure, never a stuck suite).
train() {
  local dir=$1 log=$2
  shift 2
  timeout --kill-after=10 180 $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x SHARDLM_CKPT_FAULT -x SHARDLM_CKPT_SLOW_MS \
    -x SHARDLM_CKPT_SKIP_SPACE_CHECK -x SHARDLM_CKPT_FAKE_FREE_BYTES -np 2 "$BIN" train inputs/tiny-sft.toml --set "run.dir=$dir" \
    --set log.interval=1 "$@" > "$log" 2>&1
}
export SHARDLM_CKPT_FAULT="" SHARDLM_CKPT_SKIP_SPACE_CHECK="" SHARDLM_CKPT_FAKE_FREE_BYTES=""

# "step loss" for every step in a run's metrics.jsonl (the last line of each step wins).
losses() {
  sed -n 's/.*"step": \([0-9]*\), "loss": \([^,]*\),.*/\1 \2/p' "$1/metrics.jsonl" |
    awk '{l[$1] = $2} END {for (s in l) print s, l[s]}' | sort -n
}

# ---- reference: 20 steps straight
train "$T/ref" "$T/ref.log" --set run.max_steps=20 --set ckpt.interval=0
check "20-step reference run (exit 0, final checkpoint)" test $? = 0 -a -f "$T/ref/checkpoints/step_20.h5"

# ---- kill -9 of the whole job in the middle of writing step 10 (a synchronous save)
B=$T/kill
SHARDLM_CKPT_FAULT="stall:10@0" setsid $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
  -x SHARDLM_CKPT_FAULT -np 2 "$BIN" train inputs/tiny-sft.toml --set "run.dir=$B" --set log.interval=1 \
  --set run.max_steps=20 --set ckpt.interval=5 --set ckpt.async=false > "$T/kill.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do [ -e "$B/checkpoints/step_10.h5.tmp" ] && break; sleep 0.1; done
sleep 1  # the stalled rank has written its first tensor; the other waits for it
pids=$(tree_pids "$job")
kill -9 $pids 2>/dev/null
wait "$job" 2>/dev/null
check "kill -9 mid-write: the partial step_10.h5.tmp is there" test -e "$B/checkpoints/step_10.h5.tmp"
check "kill -9 mid-write: no step_10.h5" test ! -e "$B/checkpoints/step_10.h5"
check "kill -9 mid-write: latest still names step_5.h5" test "$(cat "$B/checkpoints/latest" 2>/dev/null)" = "step_5.h5"
"$BIN" inspect "$B/checkpoints/step_5.h5" > "$T/inspect5.log" 2>&1
check "kill -9 mid-write: step_5.h5 verifies (inspect exit 0)" test $? = 0
train "$B" "$T/kill-resume.log" --set run.max_steps=20 --set ckpt.interval=5
rc=$?
check "resume after kill -9: exit 0" test $rc = 0
check "resume after kill -9: resumed from step_5.h5 at step 5" has "$T/kill-resume.log" "resumed from $B/checkpoints/step_5.h5 at step 5"
check "resume after kill -9: the stale .tmp was removed by the next save" test ! -e "$B/checkpoints/step_10.h5.tmp"
check "resume after kill -9: the .tmp removal was reported" has "$T/kill-resume.log" "removed $B/checkpoints/step_10.h5.tmp"
losses "$T/ref" | awk '$1 > 5' > "$T/ref.losses"
losses "$B" | awk '$1 > 5' > "$T/kill.losses"
check "resume after kill -9: losses of steps 6-20 bit-identical to the straight run" \
  test -s "$T/ref.losses" -a "$(wc -l < "$T/kill.losses")" = 15 -a "$(cat "$T/ref.losses")" = "$(cat "$T/kill.losses")"

# ---- kill -9 during a background write (ckpt.async): training goes on meanwhile
A=$T/killasync
SHARDLM_CKPT_FAULT="slow:10@0" SHARDLM_CKPT_SLOW_MS=200 setsid $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS \
  -x OMP_WAIT_POLICY -x SHARDLM_CKPT_FAULT -x SHARDLM_CKPT_SLOW_MS -np 2 "$BIN" train inputs/tiny-sft.toml \
  --set "run.dir=$A" --set log.interval=1 --set run.max_steps=20 --set ckpt.interval=5 > "$T/killasync.log" 2>&1 &
job=$!
for _ in $(seq 1 900); do
  [ -e "$A/checkpoints/step_10.h5.tmp" ] && grep -q "step     13/20" "$T/killasync.log" && break
  sleep 0.1
done
check "async kill -9: steps 11-13 trained while step_10.h5.tmp was being written" \
  test -e "$A/checkpoints/step_10.h5.tmp" -a -n "$(grep 'step     13/20' "$T/killasync.log")"
kill -9 $(tree_pids "$job") 2>/dev/null
wait "$job" 2>/dev/null
check "async kill -9: no step_10.h5" test ! -e "$A/checkpoints/step_10.h5"
check "async kill -9: latest still names step_5.h5" test "$(cat "$A/checkpoints/latest" 2>/dev/null)" = "step_5.h5"
train "$A" "$T/killasync-resume.log" --set run.max_steps=20 --set ckpt.interval=5
rc=$?
check "async kill -9: resume exits 0 from step_5.h5" \
  test $rc = 0 -a -n "$(grep "resumed from $A/checkpoints/step_5.h5 at step 5" "$T/killasync-resume.log")"
check "async saves log the loop-blocked time and the background write" \
  has "$T/killasync-resume.log" "checkpoint: saved $A/checkpoints/step_20.h5"
check "async saves: the line says loop blocked ... background write ... MB/s (async)" \
  test -n "$(grep -E 'loop blocked [0-9]+ ms .*background write [0-9.]+ s, [0-9]+ MB/s \(async\)' "$T/killasync-resume.log")"
losses "$A" | awk '$1 > 5' > "$T/killasync.losses"
check "async kill -9: losses of steps 6-20 bit-identical to the straight run" \
  test "$(wc -l < "$T/killasync.losses")" = 15 -a "$(cat "$T/ref.losses")" = "$(cat "$T/killasync.losses")"

# ---- the async snapshot of host state runs beside training: a copier slower
# than the steps (SHARDLM_CKPT_FAULT=slowcopy, 20 ms per unit's array on rank 0)
# makes the next updates wait for it unit by unit; every checkpoint must hold the
# bits of the same steps saved synchronously, and the losses must not move.
train "$T/copy-sync" "$T/copy-sync.log" --set run.max_steps=20 --set ckpt.interval=5 --set ckpt.keep_last=10 \
  --set ckpt.async=false
SHARDLM_CKPT_FAULT=slowcopy@0 SHARDLM_CKPT_SLOW_MS=20 train "$T/copy-slow" "$T/copy-slow.log" --set run.max_steps=20 \
  --set ckpt.interval=5 --set ckpt.keep_last=10 --set ckpt.async=true
check "slow snapshot copier: exit 0" test $? = 0
same=$("${PYTHON:-/usr/bin/python3}" - "$T/copy-slow/checkpoints" "$T/copy-sync/checkpoints" <<'PYEOF'
import glob, os, sys
import h5py, numpy as np
a_dir, b_dir = sys.argv[1:3]
files, n, bad = sorted(os.path.basename(f) for f in glob.glob(a_dir + "/step_*.h5")), 0, 0
for f in files:
    with h5py.File(os.path.join(a_dir, f), "r") as a, h5py.File(os.path.join(b_dir, f), "r") as b:
        names = []
        for top in ("model", "optim"):
            a[top].visititems(lambda k, v: names.append(f"{top}/{k}") if isinstance(v, h5py.Dataset) else None)
        for k in names:
            n += 1
            bad += not np.array_equal(a[k][()].view(np.uint32), b[k][()].view(np.uint32))
print(f"{len(files)} {n} {bad}")
PYEOF
)
check "slow snapshot copier: 4 checkpoints, every dataset the synchronous saves' bits (files datasets differing: $same)" \
  test "$(cut -d' ' -f1,3 <<< "$same")" = "4 0"
check "slow snapshot copier: losses of steps 6-20 bit-identical to the straight run" \
  test "$(losses "$T/copy-slow" | awk '$1 > 5')" = "$(cat "$T/ref.losses")"

# ---- saves due faster than the writer writes them (40 ms per tensor on rank 0,
# a save every 2 steps): said once, with an interval that would not stall
SHARDLM_CKPT_FAULT=slow@0 SHARDLM_CKPT_SLOW_MS=40 train "$T/behind" "$T/behind.log" --set run.max_steps=8 \
  --set ckpt.interval=2 --set ckpt.async=true
said=$(grep -c "checkpoint: saves come faster than the writer" "$T/behind.log")
enough=$(sed -n 's/.*ckpt.interval = \([0-9]*\) or more would not stall.*/\1/p' "$T/behind.log" | head -1)
check "saves faster than the writer: said once ($said), with an interval above 2 (${enough:-none})" \
  test "$said" = 1 -a "${enough:-0}" -gt 2

# ---- corrupted latest: flipped bytes (checksum), then truncated (HDF5 error)
C=$B/checkpoints
size=$(stat -c %s "$C/step_20.h5")
printf '\377\377\377\377\377\377\377\377' | dd of="$C/step_20.h5" bs=1 seek=$((size / 2)) conv=notrunc status=none
"$BIN" inspect "$C/step_20.h5" > "$T/inspect20.log" 2>&1
rc=$?
check "flipped bytes: inspect exits 1" test $rc = 1
check "flipped bytes: inspect names the dataset with a checksum mismatch" has "$T/inspect20.log" "checksum mismatch"
train "$B" "$T/corrupt-resume.log" --set run.max_steps=22 --set ckpt.interval=5
rc=$?
check "flipped bytes: resume exits 0" test $rc = 0
check "flipped bytes: the damaged file is reported by name" has "$T/corrupt-resume.log" "checkpoint $C/step_20.h5 is damaged"
check "flipped bytes: the previous checkpoint is used" has "$T/corrupt-resume.log" "resumed from $C/step_15.h5 at step 15"
check "flipped bytes: the run finished and latest names step_22.h5" test "$(cat "$C/latest")" = "step_22.h5"

truncate -s $(( $(stat -c %s "$C/step_22.h5") / 2 )) "$C/step_22.h5"
"$BIN" inspect "$C/step_22.h5" > "$T/inspect22.log" 2>&1
check "truncated: inspect exits 1 and says DAMAGED" test $? = 1 -a -n "$(grep DAMAGED "$T/inspect22.log")"
train "$B" "$T/trunc-resume.log" --set run.max_steps=23 --set ckpt.interval=5
rc=$?
check "truncated: resume exits 0" test $rc = 0
check "truncated: reported with the file name and HDF5's reason" has "$T/trunc-resume.log" "checkpoint $C/step_22.h5 is damaged or unreadable: HDF5"
check "truncated: the previous checkpoint (step_20.h5, rewritten after the damaged one) is used" \
  has "$T/trunc-resume.log" "resumed from $C/step_20.h5 at step 20"

# ---- a checkpoint of another model shape is refused, listing the mismatches
train "$B" "$T/mismatch.log" --set run.max_steps=30 --set model.num_layers=3 --set model.hidden_size=128
rc=$?
check "another model shape: refused (exit non-zero)" test $rc != 0
check "another model shape: the message names the file" has "$T/mismatch.log" "does not fit this run"
check "another model shape: num_layers listed" has "$T/mismatch.log" "model.num_layers: 2 in the checkpoint, 3 in this run"
check "another model shape: hidden_size listed" has "$T/mismatch.log" "model.hidden_size: 64 in the checkpoint, 128 in this run"

# ---- unwritable checkpoint directory: refused at start, before any step (run_start.cpp)
D=$T/unwritable
mkdir -p "$D" && echo "not a directory" > "$D/checkpoints"
train "$D" "$T/unwritable.log" --set run.max_steps=10 --set ckpt.interval=5
rc=$?
check "unwritable dir: refused at start (exit $rc, not 0 or 75)" test $rc != 0 -a $rc != 75
check "unwritable dir: a clear message" has "$T/unwritable.log" "the checkpoint directory $D/checkpoints"
check "unwritable dir: no step trained" test -z "$(grep 'step      1/10' "$T/unwritable.log")"

# ---- a background write that fails, ckpt.on_error = continue: training goes on, the next save works
E=$T/continue
SHARDLM_CKPT_FAULT="write:5@1" train "$E" "$T/continue.log" --set run.max_steps=10 --set ckpt.interval=5 \
  --set ckpt.on_error=continue
rc=$?
check "failed save, on_error = continue: exit 0" test $rc = 0
check "failed save, on_error = continue: trained to step 10" has "$T/continue.log" "step     10/10"
check "failed save, on_error = continue: step 5 reported FAILED on rank 1" \
  has "$T/continue.log" "checkpoint $E/checkpoints/step_5.h5 FAILED: writing"
check "failed save, on_error = continue: no step_5.h5, latest names step_10.h5" \
  test ! -e "$E/checkpoints/step_5.h5" -a "$(cat "$E/checkpoints/latest" 2>/dev/null)" = "step_10.h5"

# ---- full disk (a 3 MiB tmpfs; needs mount, skipped without it)
F=$T/full
mkdir -p "$F"
if mount -t tmpfs -o size=3m tmpfs "$F" 2>/dev/null; then
  mounted=$F
  train "$F/run" "$T/full1.log" --set run.max_steps=5 --set ckpt.interval=5
  check "full disk: first save fits" test $? = 0 -a -f "$F/run/checkpoints/step_5.h5"
  # Fill the disk, leaving ~600 kB: less than one checkpoint (1.3 MiB).
  dd if=/dev/zero of="$F/filler" bs=64k status=none 2>/dev/null
  truncate -s $(( $(stat -c %s "$F/filler") - 600 * 1024 )) "$F/filler"
  # Three ways a full disk is met: the space check before writing, the block
  # reservation (fallocate) after the metadata, and ENOSPC in the raw writes.
  # "writes" meets ENOSPC in the background writer (ckpt.async, the default), "writes-sync" in a synchronous save.
  for how in writes writes-sync reserve check; do
    sync_set=ckpt.async=true
    case $how in
      writes) export SHARDLM_CKPT_SKIP_SPACE_CHECK=1 SHARDLM_CKPT_FAKE_FREE_BYTES= ; expect="FAILED: writing /" ;;
      writes-sync) export SHARDLM_CKPT_SKIP_SPACE_CHECK=1 SHARDLM_CKPT_FAKE_FREE_BYTES= ; expect="FAILED: writing /"
        sync_set=ckpt.async=false ;;
      reserve) export SHARDLM_CKPT_SKIP_SPACE_CHECK= SHARDLM_CKPT_FAKE_FREE_BYTES=1000000000000 ; expect="FAILED: cannot reserve" ;;
      check) export SHARDLM_CKPT_SKIP_SPACE_CHECK= SHARDLM_CKPT_FAKE_FREE_BYTES= ; expect="FAILED: not enough free space" ;;
    esac
    train "$F/run" "$T/full-$how.log" --set run.max_steps=10 --set ckpt.interval=5 --set $sync_set
    rc=$?
    check "full disk, $how: exit 74 (no hang)" test $rc = 74
    check "full disk, $how: reported" has "$T/full-$how.log" "checkpoint $F/run/checkpoints/step_10.h5 $expect"
    check "full disk, $how: no .tmp left behind" test -z "$(ls "$F/run/checkpoints" | grep tmp)"
    check "full disk, $how: latest still names step_5.h5" test "$(cat "$F/run/checkpoints/latest")" = "step_5.h5"
    "$BIN" inspect "$F/run/checkpoints/step_5.h5" > /dev/null 2>&1
    check "full disk, $how: step_5.h5 untouched (verifies)" test $? = 0
  done
  export SHARDLM_CKPT_SKIP_SPACE_CHECK= SHARDLM_CKPT_FAKE_FREE_BYTES=
  umount "$F" && mounted=""
else
  echo "SKIP full disk: cannot mount a tmpfs here (the unwritable-directory and injected-error tests cover the path)"
fi

# ---- stop signal: SIGUSR1 to mpirun (forwarded to the ranks) -> save, exit 75, resume
S=$T/signal
setsid $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -np 2 "$BIN" train \
  inputs/tiny-sft.toml --set "run.dir=$S" --set log.interval=1 --set run.max_steps=100000 > "$T/signal.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do grep -q "step      3/" "$T/signal.log" 2>/dev/null && break; sleep 0.1; done
kill -USR1 "$job"
for _ in $(seq 1 300); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$job" 2>/dev/null; then kill -9 $(tree_pids "$job") 2>/dev/null; fi
wait "$job"
rc=$?
check "SIGUSR1: exit 75 (requeue)" test $rc = 75
stopped=$(sed -n 's/.*stopped by signal [0-9]* after step \([0-9]*\).*/\1/p' "$T/signal.log")
check "SIGUSR1: the stop was logged with its step" test -n "$stopped"
check "SIGUSR1: the checkpoint of that step exists and latest names it" \
  test -n "$stopped" -a -f "$S/checkpoints/step_$stopped.h5" -a "$(cat "$S/checkpoints/latest" 2>/dev/null)" = "step_$stopped.h5"
train "$S" "$T/signal-resume.log" --set run.max_steps=$(( ${stopped:-0} + 2 ))
rc=$?
check "SIGUSR1: the requeued run resumes at that step and finishes" \
  test $rc = 0 -a -n "$(grep "resumed from $S/checkpoints/step_$stopped.h5 at step $stopped" "$T/signal-resume.log")"

# ---- inspect and export from the command line
"$BIN" inspect "$T/ref" > "$T/inspect-ref.log" 2>&1
check "inspect RUN_DIR: exit 0, step 20, world size 2, checksums" \
  test $? = 0 -a -n "$(grep 'step 20 (steps completed)' "$T/inspect-ref.log")" -a -n "$(grep 'world size at save 2' "$T/inspect-ref.log")" -a -n "$(grep 'checksums: all' "$T/inspect-ref.log")"
"$BIN" export "$T/ref/checkpoints/step_20.h5" --out "$T/hf" --dtype fp32 > "$T/export.log" 2>&1
check "export: exit 0, config.json and model.safetensors" test $? = 0 -a -f "$T/hf/config.json" -a -f "$T/hf/model.safetensors"

if [ $failures != 0 ]; then
  echo "checkpoint fault logs kept in $T.keep"
  cp -r "$T" "$T.keep" 2>/dev/null
fi
[ $failures = 0 ]
