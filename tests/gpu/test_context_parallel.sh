#!/usr/bin/env bash
# test_context_parallel.sh — context parallelism (model.context_parallel = C) on the
# CUDA backend: the ring of cuda/ring_attention.hpp inside the trainer. One GPU
# cannot host two NCCL ranks, so the ranks share it through the staged MPI device
# communicator (comm.backend = "mpi"): the ring's blocks travel through pinned host
# memory, the same ring code as with NCCL. Prints one PASS/FAIL line per check.
#
#   bash tests/gpu/test_context_parallel.sh          tiny decks, ~1 minute
#   bash tests/gpu/test_context_parallel.sh 1b-32k   the long-context case: the 1B shape
#        (inputs/bench/llama-1b.toml) at data.seq_len = 32768, C = 2 on two ranks
#        sharing the GPU against C = 1 on one rank, 10 steps: both loss sequences,
#        each run's activation memory (measured and planned), and the checks that
#        they agree (bf16) and that C = 2's activations are half of C = 1's.
#
# Needs build/shardlm (make CUDA=1; BUILD=dir for another build folder).
source "$(dirname "$0")/lib.sh" context-parallel
mode=${1:-small}

# train_deck NAME NP DECK STEPS SETS...: like lib.sh's train_tiny, any deck.
train_deck() {
  local dir=$1 np=$2 deck=$3 steps=$4
  shift 4
  local sets=(--set device.backend="${SHARDLM_TEST_DEVICE:-cuda}" --set run.deterministic=true
              --set run.max_steps="$steps" --set log.interval=1 --set ckpt.interval=0 --set ckpt.resume=none
              --set run.dir="$out/$dir")
  for s in "$@"; do sets+=(--set "$s"); done
  if ! $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY -x NCCL_NVLS_ENABLE -np "$np" \
      "$BUILD/shardlm" train "$deck" "${sets[@]}" >> "$out/$dir.log" 2>&1; then
    echo "FAIL $dir: the run failed:"; tail -5 "$out/$dir.log"
    return 1
  fi
}

# activations NAME: the measured and planned MiB of the run's "memory: activations" line.
activations() { sed -n 's/^memory: activations peak \([0-9.]*\) MiB .* planned \([0-9.]*\) MiB$/\1 \2/p' "$out/$1.log"; }

# check_half C1 C2: C2's activations are half of C1's, and each run's equal its plan.
check_half() {
  local a b
  a=$(activations "$1"); b=$(activations "$2")
  if [ -z "$a" ] || [ -z "$b" ]; then echo "FAIL no 'memory: activations' line in $1 or $2"; return; fi
  "$PY" - "$1" "$a" "$2" "$b" <<'PYEOF'
import sys
n1, (m1, p1), n2, (m2, p2) = sys.argv[1], map(float, sys.argv[2].split()), sys.argv[3], map(float, sys.argv[4].split())
for name, m, p in ((n1, m1, p1), (n2, m2, p2)):
    ok = abs(m - p) <= 1e-3 * p
    print(f"{'PASS' if ok else 'FAIL'} {name}: activations per rank measured {m:.3f} MiB, planned {p:.3f} MiB")
r = m2 / m1
print(f"{'PASS' if abs(r - 0.5) <= 1e-3 else 'FAIL'} {n2} vs {n1}: activations per rank {m2:.3f} / {m1:.3f} MiB "
      f"= {r:.4f} (expected 0.5)")
PYEOF
}

# print_losses NAME...: each run's loss sequence, one line a run.
print_losses() {
  for n in "$@"; do
    "$PY" - "$out/$n/metrics.jsonl" "$n" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
loss = {r["step"]: r["loss"] for r in rows if "event" not in r}
print(f"losses {sys.argv[2]}: " + " ".join(f"{loss[s]:.5f}" for s in sorted(loss)))
PYEOF
  done
}

if [ "$mode" = 1b-32k ]; then
  # The 1B shape, one 32K-token document a row (tools/bench.sh's data), one row a step.
  data=runs/bench-data/random-128k.h5
  [ -f "$data" ] || "$PY" tools/make_synthetic_data.py "$data" --vocab 128256 --tokens 600000 --doc-len 32769 \
    > "$out/data.log" 2>&1 || { echo "FAIL tools/make_synthetic_data.py:"; tail -3 "$out/data.log"; exit 1; }
  steps=10
  big=(data.path="$data" data.seq_len=32768 data.micro_batch=1 data.global_batch=1 loss.chunk_tokens=4096)
  train_deck 1b-c1 1 inputs/bench/llama-1b.toml $steps "${big[@]}" || exit 1
  train_deck 1b-c2 2 inputs/bench/llama-1b.toml $steps "${big[@]}" comm.backend=mpi model.context_parallel=2 || exit 1
  print_losses 1b-c1 1b-c2
  grep -h "^memory: \|^attention: " "$out/1b-c1.log" | sed 's/^/1b-c1 /'
  grep -h "^memory: \|^attention: " "$out/1b-c2.log" | sed 's/^/1b-c2 /'
  # bf16 activations, attention merged by blocks: ~1e-3 expected (docs/testing.md's bound for world sizes).
  compare_losses 1b-c2 1b-c1 2e-2 1 $steps "1B shape, 32K tokens: C = 2 (2 ranks sharing the GPU, staged MPI) vs C = 1"
  check_half 1b-c1 1b-c2
  exit 0
fi

steps=10
# The tiny deck (head_dim 16: the generic masked kernels), and a head_dim 64 variant
# at seq_len 256 (the tensor-core kernels; chunks of 64 tokens at C = 2, 32 at C = 4).
d64=(model.hidden_size=128 model.num_heads=2 model.num_kv_heads=1 data.seq_len=256 data.global_batch=16)
train_deck c1 2 inputs/tiny-sft.toml $steps comm.backend=mpi || exit 1
train_deck c2 2 inputs/tiny-sft.toml $steps comm.backend=mpi model.context_parallel=2 || exit 1
train_deck c2-again 2 inputs/tiny-sft.toml $steps comm.backend=mpi model.context_parallel=2 || exit 1
train_deck d64-c1 4 inputs/tiny-sft.toml $steps comm.backend=mpi "${d64[@]}" || exit 1
train_deck d64-c2 4 inputs/tiny-sft.toml $steps comm.backend=mpi model.context_parallel=2 "${d64[@]}" || exit 1
train_deck d64-c4 4 inputs/tiny-sft.toml $steps comm.backend=mpi model.context_parallel=4 "${d64[@]}" || exit 1

if grep -q "attention: context-parallel ring over 2 ranks" "$out/c2.log"; then
  echo "PASS the C = 2 run says it runs the ring: $(grep -m1 '^attention: ' "$out/c2.log")"
else echo "FAIL the C = 2 run does not name the context-parallel ring:"; grep -m1 '^attention: ' "$out/c2.log"; fi
# bf16 activations; the ring merges attention by blocks and the loss is summed
# over other ranks: the bound of test_multirank.sh's world-size comparisons.
compare_losses c2 c1 2e-2 1 $steps "tiny deck (head_dim 16, generic kernels): C = 2 vs C = 1 at 2 ranks"
compare_losses c2-again c2 0 1 $steps "tiny deck, C = 2 twice (run.deterministic): bit-identical losses"
compare_losses d64-c2 d64-c1 2e-2 1 $steps "head_dim 64 (tensor cores), seq 256: C = 2 vs C = 1 at 4 ranks (dp x cp = 2 x 2)"
compare_losses d64-c4 d64-c1 2e-2 1 $steps "head_dim 64 (tensor cores), seq 256: C = 4 vs C = 1 at 4 ranks"
check_half c1 c2
print_losses c1 c2 d64-c1 d64-c2 d64-c4

# The ring's waits are watched: a rank that stops mid-ring (SIGSTOP at its third
# exchange) ends the job with the watchdog's line naming the ring exchange.
if SHARDLM_FAULT=ring_stop@1 timeout 120 $MPIRUN --oversubscribe --bind-to none -x SHARDLM_FAULT -x OMP_NUM_THREADS \
    -np 2 "$BUILD/shardlm" train inputs/tiny-sft.toml --set device.backend="${SHARDLM_TEST_DEVICE:-cuda}" --set comm.backend=mpi \
    --set model.context_parallel=2 --set comm.timeout_s=5 --set run.dir="$out/stopped" > "$out/stopped.log" 2>&1; then
  echo "FAIL a rank stopped mid-ring: the job succeeded"
elif grep -q "collective ring_exchange (#3 of a communicator of 2 ranks) has not completed after 5" "$out/stopped.log"; then
  echo "PASS a rank stopped mid-ring on the GPU: $(grep -o 'collective ring_exchange[^:]*' "$out/stopped.log" | head -1)"
else
  echo "FAIL a rank stopped mid-ring: no watchdog line naming the ring exchange:"; tail -3 "$out/stopped.log"
fi
