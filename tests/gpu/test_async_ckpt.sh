#!/usr/bin/env bash
# test_async_ckpt.sh — async checkpoints of device-resident state (the host
# mirror the writer reads, and the snapshot on a copy stream), run by `make test-gpu`:
# an RL job (1 trainer + 1 receiver) whose filesystem weight broadcast pulls the
# state into the host mirror every step while a deliberately slow background
# writer (SHARDLM_CKPT_FAULT=slow) still reads that mirror for the save before.
# Deterministic, so every saved checkpoint must hold exactly the bits of the
# same run with synchronous saves: with the device copy of the state, and
# without it (the next update waits for the download on the GPU).
# The same with optim_cpu_offload against a deliberately slow snapshot copier.
# Prints one PASS/FAIL line per check.
source "$(dirname "$0")/lib.sh" async-ckpt

rollouts="$out/rollouts"
if ! "$PY" tools/make_rollouts.py inputs/data/tiny.h5 --out "$rollouts" --steps 20 > "$out/rollouts.log" 2>&1; then
  echo "FAIL async checkpoints: tools/make_rollouts.py failed:"; tail -3 "$out/rollouts.log"; exit 1
fi
# rl_run NAME SETS...: 20 steps, a save every 5, the filesystem broadcast every step.
rl_run() {
  local name=$1
  shift
  local sets=(--set device.backend="${SHARDLM_TEST_DEVICE:-cuda}" --set run.deterministic=true --set run.max_steps=20 --set ckpt.interval=5
              --set ckpt.keep_last=10 --set ckpt.resume=none --set data.rollout_dir="$rollouts"
              --set broadcast.backend=filesystem --set broadcast.dir="$out/$name/broadcast" --set broadcast.interval=1
              --set log.interval=5
              --set run.dir="$out/$name")
  for s in "$@"; do sets+=(--set "$s"); done
  if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x SHARDLM_CKPT_FAULT \
      -x SHARDLM_CKPT_SLOW_MS -x SHARDLM_CKPT_NO_DEVICE_COPY \
      -np 1 "$BUILD/shardlm" train inputs/tiny-rl.toml "${sets[@]}" : \
      -np 1 "$BUILD/shardlm" receive inputs/tiny-rl.toml "${sets[@]}" > "$out/$name.log" 2>&1; then
    echo "FAIL $name: the run failed:"; tail -5 "$out/$name.log"
    return 1
  fi
}
# same_state A B WHAT: every /model and /optim dataset of every step_N.h5 of run A equals run B's, bit for bit.
same_state() {
  "$PY" - "$out/$1/checkpoints" "$out/$2/checkpoints" "$3" <<'PYEOF'
import glob, os, sys
import h5py, numpy as np
a_dir, b_dir, what = sys.argv[1:4]
files = sorted(os.path.basename(f) for f in glob.glob(a_dir + "/step_*.h5"))
bad, n = [], 0
for f in files:
    with h5py.File(os.path.join(a_dir, f), "r") as a, h5py.File(os.path.join(b_dir, f), "r") as b:
        names = []
        for top in ("model", "optim"):
            a[top].visititems(lambda k, v: names.append(f"{top}/{k}") if isinstance(v, h5py.Dataset) else None)
        for k in names:
            n += 1
            if not np.array_equal(a[k][()].view(np.uint32), b[k][()].view(np.uint32)): bad.append(f"{f}:{k}")
ok = len(files) == 4 and n > 0 and not bad
print(f"{'PASS' if ok else 'FAIL'} {what}: {len(files)} checkpoints ({', '.join(files)}), {n} datasets, "
      f"{len(bad)} differ{(': ' + ', '.join(bad[:4])) if bad else ''}")
PYEOF
}

SHARDLM_CKPT_FAULT= rl_run sync ckpt.async=false || exit 1
SHARDLM_CKPT_FAULT=slow@0 SHARDLM_CKPT_SLOW_MS=40 rl_run async-copy ckpt.async=true || exit 1
SHARDLM_CKPT_FAULT=slow@0 SHARDLM_CKPT_SLOW_MS=40 SHARDLM_CKPT_NO_DEVICE_COPY=1 rl_run async-nocopy ckpt.async=true ||
  exit 1
# optim_cpu_offload: the state is in host memory; the snapshot's copier runs
# beside the next steps and the worker's per-unit updates wait for it (slowcopy:
# a copier slower than the steps). Every unit offloaded (optim_gpu_state_gib = 0:
# the tiny model would otherwise keep all of its state on the GPU); then the
# first unit's state on the GPU (its mirror downloaded at each save and each
# broadcast's pull, after the copier has passed it).
SHARDLM_CKPT_FAULT= rl_run sync-offload ckpt.async=false model.optim_cpu_offload=true model.optim_gpu_state_gib=0 ||
  exit 1
SHARDLM_CKPT_FAULT=slowcopy@0 SHARDLM_CKPT_SLOW_MS=40 rl_run async-offload ckpt.async=true model.optim_cpu_offload=true \
  model.optim_gpu_state_gib=0 || exit 1
one_unit_gib=$("$PY" -c "print((258 * 64 + 4096) * 12 / 2**30)")  # the embedding's state (test_offload.sh)
SHARDLM_CKPT_FAULT=slowcopy@0 SHARDLM_CKPT_SLOW_MS=40 rl_run async-partial ckpt.async=true model.optim_cpu_offload=true \
  model.optim_gpu_state_gib="$one_unit_gib" || exit 1
if grep -q "a device copy of the state" "$out/async-copy.log" && grep -q "no room on the GPU for a device copy" "$out/async-nocopy.log"; then
  echo "PASS async snapshots: the device-copy and the no-room paths both ran (start-up lines)"
else
  echo "FAIL async snapshots: the start-up lines do not show both paths"; grep "checkpoint: async" "$out"/async-*.log
fi
same_state async-copy sync "async saves with a device copy, slow writer, filesystem broadcast every step = sync saves"
same_state async-nocopy sync "async saves without a device copy (update waits), slow writer, broadcast every step = sync saves"
same_state async-offload sync-offload "optim_cpu_offload: async saves, a copier slower than the steps (updates wait per unit) = sync saves"
same_state async-partial sync-offload "optim_cpu_offload, the first unit's state on the GPU: async saves = sync saves with every unit offloaded"
