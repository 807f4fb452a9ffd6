#!/usr/bin/env bash
# test_offload.sh — model.optim_cpu_offload on the GPU (the offload pipeline of
# src/train/offload.cpp) against device-resident state, run by `make test-gpu`:
# losses with gradient accumulation (tiny-sft has 4 micro-batches per step), at
# -np 2 on one GPU, and checkpoints crossing the two: saved with offload and
# resumed without, and the reverse, continue the straight run's trajectory.
# Partial residency (model.optim_gpu_state_gib): the first units' state on the
# GPU, the rest through the pipeline, bit-identical to the pipeline alone, and
# checkpoints crossing full offload, partial and all-device.
# Prints one PASS/FAIL line per check.
source "$(dirname "$0")/lib.sh" offload

train_tiny device 1 20 || exit 1
# The pipeline for every unit: model.optim_gpu_state_gib = 0 (the tiny model's
# state fits the GPU, where the automatic split would put all of it).
OFF=(model.optim_cpu_offload=true model.optim_gpu_state_gib=0)
train_tiny offload 1 20 "${OFF[@]}" || exit 1
train_tiny offload-again 1 20 "${OFF[@]}" || exit 1
train_tiny offload-np2 2 20 "${OFF[@]}" comm.backend=mpi || exit 1
# bf16 parameters from fp32 masters updated by the same formula on another
# processor (AdamW on the host vs the GPU kernel: the same operation order, no FMA
# on either side), so the steps agree to bf16 rounding of the uploads.
compare_losses offload device 2e-2 1 20 "offload pipeline vs device-resident state (4 micro-batches per step)"
compare_losses offload-again offload 0 1 20 "offload pipeline twice: bit-identical losses"
compare_losses offload-np2 offload 2e-2 1 20 "offload pipeline at -np 2 (staged MPI) vs -np 1"
# model.optim_offload_grads = "device": the same gradients reach the same update,
# copied just before it instead of during backward: the same bits.
train_tiny offload-devgrads 1 20 "${OFF[@]}" model.optim_offload_grads=device || exit 1
train_tiny offload-devgrads-np2 2 20 "${OFF[@]}" model.optim_offload_grads=device comm.backend=mpi ||
  exit 1
compare_losses offload-devgrads offload 0 1 20 "gradients on the device until their update vs host gradient shards"
compare_losses offload-devgrads-np2 offload-np2 0 1 20 "gradients on the device at -np 2 vs host gradient shards"

# Checkpoints: the straight runs again, saving at step 10; then steps 11..20
# resumed from that file with the other setting (same max_steps: same schedule).
train_tiny device-ckpt 1 20 ckpt.interval=10 || exit 1
train_tiny offload-ckpt 1 20 ckpt.interval=10 "${OFF[@]}" || exit 1
train_tiny dev-then-off 1 20 ckpt.resume="$out/device-ckpt/checkpoints/step_10.h5" "${OFF[@]}" || exit 1
train_tiny off-then-dev 1 20 ckpt.resume="$out/offload-ckpt/checkpoints/step_10.h5" || exit 1
# The first step after a resume reads only the saved weights, cast to bf16 the
# same way on both sides: the same bits as the straight run. Later steps update
# with the other optimizer placement and drift by bf16 roundings.
compare_losses dev-then-off device 0 11 11 "saved with device state, resumed with offload: first step bit-identical"
compare_losses dev-then-off device 2e-2 11 20 "saved with device state, resumed with offload: continues the trajectory"
compare_losses off-then-dev offload 0 11 11 "saved with offload, resumed with device state: first step bit-identical"
compare_losses off-then-dev offload 2e-2 11 20 "saved with offload, resumed with device state: continues the trajectory"

# Partial residency: a cap that keeps the first unit's state on the GPU (the
# embedding: 258 x 64 elements, 12 B each for the fp32 master and AdamW's
# moments, with room for the shard's padding; a decoder layer is 3x larger).
one=$("$PY" -c "print((258 * 64 + 4096) * 12 / 2**30)")
line=$("$BUILD/shardlm" check inputs/tiny-sft.toml --set device.backend=cuda --set model.optim_cpu_offload=true \
         --set model.optim_gpu_state_gib="$one" | grep '^offload split: optimizer state of')
units=$(sed -n 's/.*optimizer state of 1 of \([0-9]*\) units on the GPU (model.optim_gpu_state_gib = .*): units 0\.\.0 (.*) on the GPU, .* MiB, units 1\.\..* offloaded to the CPU optimizer$/\1/p' <<< "$line")
if [ -n "$units" ]; then
  echo "PASS check prints the split: $line"
else
  echo "FAIL check prints the split (cap $one GiB): got \"$line\""; units=0
fi
PART=(model.optim_cpu_offload=true model.optim_gpu_state_gib="$one")
train_tiny partial 1 20 "${PART[@]}" || exit 1
train_tiny partial-np2 2 20 "${PART[@]}" comm.backend=mpi || exit 1
train_tiny partial-devgrads 1 20 "${PART[@]}" model.optim_offload_grads=device || exit 1
train_tiny all-device 1 20 model.optim_cpu_offload=true || exit 1  # automatic: all of tiny on the GPU
grep -q "optimizer state of units 0..0 on the GPU, $((units - 1)) of $units offloaded" "$out/partial.log" &&
  echo "PASS the run summary names the split" || { echo "FAIL the run summary names the split:"; grep '^offload' "$out/partial.log"; }
grep -q "optimizer state of units 0..$((units - 1)) on the GPU, 0 of $units offloaded" "$out/all-device.log" &&
  echo "PASS automatic split: the whole tiny model on the GPU" || { echo "FAIL automatic split:"; grep '^offload' "$out/all-device.log"; }
# The device kernel is the CPU AdamW bit for bit and the norm is summed the
# same way: the split does not change a bit.
compare_losses partial offload 0 1 20 "one unit's state on the GPU, two offloaded vs all offloaded: bit-identical"
compare_losses partial-np2 offload-np2 0 1 20 "the same at -np 2: bit-identical"
compare_losses partial-devgrads offload 0 1 20 "partial with optim_offload_grads = device: bit-identical"
compare_losses all-device offload 0 1 20 "every unit's state on the GPU under offload vs all offloaded: bit-identical"
compare_losses all-device device 2e-2 1 20 "every unit's state on the GPU under offload vs the device placement"
# Checkpoints across the splits: saved partial, resumed all-offloaded and on
# the device placement; saved all-offloaded and on the device, resumed partial.
train_tiny partial-ckpt 1 20 ckpt.interval=10 "${PART[@]}" || exit 1
train_tiny partial-then-off 1 20 ckpt.resume="$out/partial-ckpt/checkpoints/step_10.h5" "${OFF[@]}" || exit 1
train_tiny partial-then-dev 1 20 ckpt.resume="$out/partial-ckpt/checkpoints/step_10.h5" || exit 1
train_tiny off-then-partial 1 20 ckpt.resume="$out/offload-ckpt/checkpoints/step_10.h5" "${PART[@]}" || exit 1
train_tiny dev-then-partial 1 20 ckpt.resume="$out/device-ckpt/checkpoints/step_10.h5" "${PART[@]}" || exit 1
train_tiny partial-then-all 1 20 ckpt.resume="$out/partial-ckpt/checkpoints/step_10.h5" model.optim_cpu_offload=true || exit 1
compare_losses partial-ckpt partial 0 1 20 "partial with a save at step 10: the same losses"
compare_losses partial-then-off offload 0 11 20 "saved partial, resumed all offloaded: the straight run's bits"
compare_losses off-then-partial offload 0 11 20 "saved all offloaded, resumed partial: the straight run's bits"
compare_losses partial-then-all offload 0 11 20 "saved partial, resumed with every unit on the GPU: the straight run's bits"
compare_losses partial-then-dev offload 0 11 11 "saved partial, resumed on the device placement: first step bit-identical"
compare_losses partial-then-dev offload 2e-2 11 20 "saved partial, resumed on the device placement: continues the trajectory"
compare_losses dev-then-partial device 0 11 11 "saved on the device placement, resumed partial: first step bit-identical"
compare_losses dev-then-partial device 2e-2 11 20 "saved on the device placement, resumed partial: continues the trajectory"

# The update under the backward (model.optim_offload_speculate): against the
# exact path with the same clipping, bit-identical at -np 1 and 2, with
# clipping never (optim.max_norm = 0), always (1e-3) and sometimes active
# (MAX_NORM_SOMETIMES: between the tiny run's smaller and larger norms), and
# a NaN step injected at step 7 (SHARDLM_TEST_NAN_STEP: skipped by both).
MAX_NORM_SOMETIMES=${MAX_NORM_SOMETIMES:-1.5}  # the tiny run: 2.48 at step 1, 1.1 by step 20
for np in 1 2; do
  comm=(); [ $np = 2 ] && comm=(comm.backend=mpi)
  for clipping in never always sometimes nan; do
    case $clipping in
      never) norm=0 ;; always) norm=1e-3 ;; sometimes | nan) norm=$MAX_NORM_SOMETIMES ;;
    esac
    nan_step=0; [ $clipping = nan ] && nan_step=7
    SHARDLM_TEST_NAN_STEP=$nan_step train_tiny exact-$clipping-np$np $np 20 "${OFF[@]}" "${comm[@]}" optim.max_norm=$norm ||
      exit 1
    SHARDLM_TEST_NAN_STEP=$nan_step train_tiny spec-$clipping-np$np $np 20 "${OFF[@]}" "${comm[@]}" optim.max_norm=$norm \
      model.optim_offload_speculate=true || exit 1
    compare_losses spec-$clipping-np$np exact-$clipping-np$np 0 1 20 \
      "the update under the backward, clipping $clipping, -np $np: bit-identical to the exact path"
    redone=$(sed -n 's/^step .*20\/20 .*| update redone \([0-9]*\)\/20.*/\1/p' "$out/spec-$clipping-np$np.log" | tail -1)
    clipped=$("$PY" -c "import json; rows = [json.loads(l) for l in open('$out/exact-$clipping-np$np/metrics.jsonl')]
print(sum(1 for r in rows if 'event' not in r and (r['skipped'] or ($norm > 0 and r['grad_norm'] > $norm))))")
    if [ -n "$redone" ] && [ "$redone" = "$clipped" ]; then
      echo "PASS clipping $clipping, -np $np: the step line says the update was redone in $redone of 20 steps (the exact run clipped or skipped $clipped)"
    else
      echo "FAIL clipping $clipping, -np $np: redone '$redone' in the step line, the exact run clipped or skipped $clipped"
    fi
  done
done
# With the first unit's state on the GPU as well.
train_tiny spec-partial 1 20 "${PART[@]}" optim.max_norm=$MAX_NORM_SOMETIMES model.optim_offload_speculate=true || exit 1
compare_losses spec-partial exact-sometimes-np1 0 1 20 "the update under the backward with a device unit: bit-identical"

# The memory plan: offload moves the fp32 masters and moments off the GPU (12 B
# per parameter; the fp32 gradient accumulator stays).
# (check opens the data file: the tracked tiny one, vocab 128256 like the deck's)
plan() { "$BUILD/shardlm" check inputs/bench/llama-1b.toml --set data.path=inputs/data/tiny.h5 --set device.backend=cuda \
           "$@" | awk '/total +GPU/ {print $3}'; }
on=$(plan --set model.optim_cpu_offload=true --set model.optim_gpu_state_gib=0); off=$(plan)
"$PY" -c "import sys; on, off = float('$on'), float('$off'); ok = abs((off - on) - 12 * 1.2358e9 / 2**20) < 0.001 * off
print(('PASS' if ok else 'FAIL') + f' 1B memory plan: GPU {off:.0f} MiB -> {on:.0f} MiB with optim_cpu_offload')"

# device.memory_limit_gib below the plan: the run is refused before anything is
# built (the plan against the cap), naming both, and makes no run directory. (The
# allocator's own cap, for what the plan does not count, is tested on the CPU.)
if "$BUILD/shardlm" train inputs/tiny-sft.toml --set device.backend=cuda --set device.memory_limit_gib=0.01 \
    --set run.dir="$out/cap" > "$out/cap.log" 2>&1; then
  echo "FAIL device.memory_limit_gib = 0.01: the run succeeded"
elif grep -q "GiB of GPU memory per rank x 1 rank on the GPU = .* GiB, more than its 0.01 GiB" "$out/cap.log" &&
     [ ! -e "$out/cap" ]; then
  echo "PASS device.memory_limit_gib = 0.01: refused with \"$(grep -o 'the memory plan needs .* GiB,' "$out/cap.log" | head -1)\""
else
  echo "FAIL device.memory_limit_gib = 0.01: unexpected output:"; tail -3 "$out/cap.log"
fi
