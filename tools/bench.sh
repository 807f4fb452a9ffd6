#!/usr/bin/env bash
# bench.sh — run named benchmark configurations on a GPU and print one line each:
# tokens/s, TFLOP/s, MFU (vs 989 TFLOP/s H100 dense bf16), step-time breakdown, peak memory.
#
#   tools/bench.sh [NAME...]      names: 125m 1b 1b-8k 1b-32k 3b (default: all)
#                                 moe-4l (on request: the Qwen3-30B-A3B shape, 4 layers)
#                                 1b-mb2 1b-mb4 (on request: 1b's step as 2 / 1 micro-batches)
#                                 1b-muon 1b-muon-ns1 1b-offload-adamw (on request: Muon's share
#                                 of the step at 1B, docs/muon.md "GPU"); 1b-64k 1b-offload-64k
#                                 3b-offload 6b-offload 7b 1b-256k 1b-offload-256k (on request:
#                                 docs/benchmarks.md "Offload"); 4b-80g 5b-80g-over 7b-offload-80g
#                                 (the largest models under device.memory_limit_gib = 78, an 80 GB H100);
#                                 1b-offload-devgrads 10b-offload-80g (model.optim_offload_grads = "device");
#                                 1b-32k-selective 8b-32k-offload 8b-32k-offload-selective 8b-131k-offload
#                                 8b-131k-offload-selective (LAYERS=K: model.selective_layers)
#                                 8b-32k-offload-selective-pipeline 8b-64k-offload 8b-64k-offload-pipeline
#                                 8b-131k-offload-pipeline (-pipeline = model.optim_gpu_state_gib = 0,
#                                 every unit offloaded; without it the split is automatic)
#                                 8b-32k-offload-selective-speculate 8b-64k-offload-speculate (-speculate: and
#                                 model.optim_offload_speculate = true)
#                                 (long context on one GPU, docs/benchmarks.md "Attention")
#                                 ckpt-1b ckpt-1b-offload ckpt-8b4-offload (on request: checkpoints every 2 steps sync,
#                                 every 80 / 40 steps async, against dd on the same disk;
#                                 docs/benchmarks.md "Asynchronous checkpoints"; ~3 min each)
#                                 1b-bf16-residual 1b-32k-selective-bf16-residual (on request:
#                                 model.residual_dtype = bf16; beside 1b / 1b-32k-selective, whose
#                                 fp32 stream is the default; the 8b-131k cases run a bf16 stream: an fp32 one
#                                 adds 39 GiB there and does not fit one H200)
#                                 1b-fp32-norms 1b-32k-selective-fp32-norms (model.norm_dtype = fp32, the default);
#                                 1b-bf16-norms (model.norm_dtype = bf16: what the fp32 norm weights cost, beside 1b)
#                                 1b-fp8-cache 1b-32k-fp8-cache (model.fp8_weight_cache = true);
#                                 8b-131k-offload-selective-fp8 (beside 8b-131k-offload-selective)
#                                 1b-fp8 1b-mb4-fp8 1b-fp8-rowwise 1b-32k-fp8 8b-32k-offload-selective-fp8 (on request:
#                                 model.fp8 = tensorwise / rowwise; compare with 1b / 1b-32k /
#                                 8b-32k-offload-selective in the same call)
#   ATTN=flash tools/bench.sh 1b  (device.attention for every run: auto | cudnn | flash)
#   FP8_ATTENTION=1 tools/bench.sh 8b-131k-offload-selective-fp8  (model.fp8_attention = true for every run,
#                                 its name and log with -fp8attn)
#   SHARDLM=path/to/shardlm tools/bench.sh 1b
#   BENCH_TIMEOUT=120 tools/bench.sh 7b     (kill each run after 120 s)
#
# Data: random tokens made on the fly (tools/make_synthetic_data.py, needs h5py).
# Results go to docs/benchmarks.md by hand, with date, GPU and command.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDLM=${SHARDLM:-build/shardlm}
PY=$(tools/find_python.sh)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
[ -f runs/bench-data/random-128k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-128k.h5 --vocab 128256 --tokens 600000 --doc-len 32769
[ -f runs/bench-data/random-32k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-32k.h5 --vocab 32000 --tokens 600000 --doc-len 2049
# Wait (at most 2 min) until host memory stops coming back: a killed run that had
# pinned ~100 GB is still being torn down for seconds, and a run started beside
# that measured 15-27% slow.
settle_host_memory() {
  local prev=0 cur i
  for i in $(seq 120); do
    cur=$(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo)
    [ $((cur - prev)) -lt 256 ] && [ $((prev - cur)) -lt 256 ] && return
    prev=$cur; sleep 1
  done
}
run() {
  local name=$1 deck=$2; shift 2
  [ -n "${FP8_ATTENTION:-}" ] && { name=$name-fp8attn; set -- "$@" --set model.fp8_attention=true; }
  echo "== $name: $SHARDLM train $deck $*"
  # A fresh run each time, no checkpoints (a 7B one is ~80 GB); the whole log in
  # runs/bench-NAME.log. BENCH_TIMEOUT=S kills the trainer after S seconds with
  # SIGKILL: SIGTERM would make it save a checkpoint before it stops.
  rm -rf "runs/bench-$name"
  settle_host_memory
  ${BENCH_TIMEOUT:+timeout -s KILL $BENCH_TIMEOUT} "$SHARDLM" train "$deck" --set run.dir=runs/bench-$name \
    --set ckpt.resume=none --set ckpt.interval=0 --set ckpt.save_final=false ${ATTN:+--set device.attention=$ATTN} \
    "$@" > "runs/bench-$name.log" 2>&1 || true
  grep -E "^(attention|setup|throughput|step time|memory|muon|offload|shardlm: error)|update redone" "runs/bench-$name.log" |
    sed "s/^/$name: /" || true
  grep -q "^throughput" "runs/bench-$name.log" ||
    { echo "$name: no result (failed or timed out); the log ends:"; tail -3 "runs/bench-$name.log" | sed "s/^/$name:   /"; }
}
# Checkpoints while training (ckpt-*): the 1B deck saving every INTERVAL steps,
# ckpt.async off and on; per save the trainer's own line (loop blocked ms, write s,
# MB/s), then the mean step time of the steps right after each save (up to 3,
# fewer than the interval) against the other steps (step 1 left out: warm-up). keep_last = 1: one 14 GiB file plus the one
# being written.
ckpt_run() {
  local name=$1 interval=$2 steps=$3; shift 3
  local deck=${CKPT_DECK:-inputs/bench/llama-1b.toml}
  echo "== $name: $SHARDLM train $deck (ckpt.interval=$interval, run.max_steps=$steps) $*"
  rm -rf "runs/bench-$name"
  settle_host_memory
  ${BENCH_TIMEOUT:+timeout -s KILL $BENCH_TIMEOUT} "$SHARDLM" train "$deck" \
    --set run.dir=runs/bench-$name --set ckpt.resume=none --set ckpt.interval=$interval --set ckpt.keep_last=1 \
    --set run.max_steps=$steps "$@" > "runs/bench-$name.log" 2>&1 || true
  grep -E "^(checkpoint: saved|checkpoint: async|shardlm: checkpoint|throughput|memory|shardlm: error)" \
    "runs/bench-$name.log" | sed "s/^/$name: /" || true
  $PY - "runs/bench-$name" "$interval" "$name" <<'PYEOF'
import json, re, sys
run, interval, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for line in open(run + "/metrics.jsonl"):
    r = json.loads(line)
    if "step" in r and "step_time_s" in r: rows[r["step"]] = r["step_time_s"]
w = max(1, min(3, interval - 1))  # the steps right after a save: up to 3, never all of them
is_near = lambda s: s > interval and (s - 1) % interval < w
near = [t for s, t in rows.items() if is_near(s)]
other = [t for s, t in rows.items() if s > 1 and not is_near(s)]
blocked = [float(m) for m in re.findall(r"loop blocked (\d+) ms", open(run + ".log").read())]
mean = lambda v: sum(v) / len(v) if v else float("nan")
print(f"{name}: {len(blocked)} saves, loop blocked per save: mean {mean(blocked):.0f} ms, max {max(blocked, default=0):.0f} ms;"
      f" step time: {mean(near) * 1e3:.1f} ms in the {w} step(s) after each save ({len(near)}),"
      f" {mean(other) * 1e3:.1f} ms in the others ({len(other)}), {100 * (mean(near) / mean(other) - 1):+.1f}%")
PYEOF
}
# dd of one checkpoint's size (the newest one of the last ckpt run) on the same disk.
ckpt_dd() {
  local file bytes count
  file=$(ls -t runs/bench-ckpt-*/checkpoints/step_*.h5 2>/dev/null | head -1)
  [ -n "$file" ] || { echo "dd: no checkpoint to size it by"; return; }
  bytes=$(stat -c %s "$file"); count=$(( (bytes + (16 << 20) - 1) / (16 << 20) ))
  echo "== dd: $count x 16 MiB ($bytes bytes, the size of $file) in runs/"
  dd if=/dev/zero of=runs/bench-dd bs=16M count=$count oflag=direct 2>&1 | tail -1 | sed 's/^/dd O_DIRECT: /'
  dd if=/dev/zero of=runs/bench-dd bs=16M count=$count conv=fdatasync 2>&1 | tail -1 | sed 's/^/dd buffered + fdatasync: /'
  local t0=$(date +%s.%N)
  rm -f runs/bench-dd
  echo "rm of that file: $(awk "BEGIN {printf \"%.2f\", $(date +%s.%N) - $t0}") s"
}
names=${*:-"125m 1b 1b-8k 1b-32k 3b"}
for n in $names; do
  case $n in
    125m) run 125m inputs/bench/llama-125m.toml ;;
    1b) run 1b inputs/bench/llama-1b.toml ;;
    # A model of experts: the Qwen3-30B-A3B shape with 4 layers, 8 x 4096 tokens a step
    # (docs/benchmarks.md "Mixture of experts"; tools/moe_vs_hf.py runs it beside transformers).
    moe-4l) run moe-4l inputs/bench/qwen3-30b-a3b-4l.toml ;;
    # The same 16K tokens a step as micro-batches of 2 and 4 sequences: fewer, larger
    # GEMMs and half / a quarter of the fp32 gradient accumulations.
    1b-mb2) run 1b-mb2 inputs/bench/llama-1b.toml --set data.micro_batch=2 ;;
    1b-mb4) run 1b-mb4 inputs/bench/llama-1b.toml --set data.micro_batch=4 ;;
    # model.fp8: the decoder blocks' linears in FP8; against 1b / 1b-32k run in the same call.
    # model.residual_dtype = "bf16": what the default fp32 stream costs, beside 1b and 1b-32k-selective.
    1b-bf16-residual) run 1b-bf16-residual inputs/bench/llama-1b.toml --set model.residual_dtype=bf16 ;;
    1b-32k-selective-bf16-residual)
      run 1b-32k-selective-bf16-residual inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
        --set model.activation_checkpointing=selective --set run.max_steps=5 --set model.residual_dtype=bf16 ;;
    1b-fp32-norms) run 1b-fp32-norms inputs/bench/llama-1b.toml --set model.norm_dtype=fp32 ;;
    1b-bf16-norms) run 1b-bf16-norms inputs/bench/llama-1b.toml --set model.norm_dtype=bf16 ;;
    1b-32k-selective-fp32-norms)
      run 1b-32k-selective-fp32-norms inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
        --set model.activation_checkpointing=selective --set run.max_steps=5 --set model.norm_dtype=fp32 ;;
    1b-fp8) run 1b-fp8 inputs/bench/llama-1b.toml --set model.fp8=tensorwise ;;
    1b-fp8-cache) run 1b-fp8-cache inputs/bench/llama-1b.toml --set model.fp8=tensorwise --set model.fp8_weight_cache=true ;;
    1b-32k-fp8-cache) run 1b-32k-fp8-cache inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
        --set model.activation_checkpointing=full --set run.max_steps=5 --set model.fp8=tensorwise \
        --set model.fp8_weight_cache=true ;;
    1b-mb4-fp8) run 1b-mb4-fp8 inputs/bench/llama-1b.toml --set data.micro_batch=4 --set model.fp8=tensorwise ;;
    1b-fp8-rowwise) run 1b-fp8-rowwise inputs/bench/llama-1b.toml --set model.fp8=rowwise ;;
    1b-32k-fp8) run 1b-32k-fp8 inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
                  --set model.activation_checkpointing=full --set run.max_steps=5 --set model.fp8=tensorwise ;;
    1b-8k) run 1b-8k inputs/bench/llama-1b.toml --set data.seq_len=8192 --set data.global_batch=2 ;;
    1b-32k) run 1b-32k inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
              --set model.activation_checkpointing=full --set run.max_steps=5 ;;
    # selective checkpointing keeps each layer's attention output: the recompute skips attention.
    1b-32k-selective) run 1b-32k-selective inputs/bench/llama-1b.toml --set data.seq_len=32768 --set data.global_batch=1 \
                        --set model.activation_checkpointing=selective --set run.max_steps=5 ;;
    3b) run 3b inputs/bench/llama-3b.toml --set model.activation_checkpointing=full --set run.max_steps=6 ;;
    # Muon needs the offload (its momentum and exchange run on the host, Newton–Schulz
    # in bf16 on the GPU); ns1 against the default 5 steps separates the GEMMs from the
    # transfers; the AdamW run is the same offloaded deck without Muon.
    1b-muon) run 1b-muon inputs/bench/llama-1b.toml --set optim.name=muon --set model.optim_cpu_offload=true ;;
    1b-muon-ns1) run 1b-muon-ns1 inputs/bench/llama-1b.toml --set optim.name=muon --set model.optim_cpu_offload=true \
                   --set optim.ns_steps=1 ;;
    1b-offload-adamw) run 1b-offload-adamw inputs/bench/llama-1b.toml --set model.optim_cpu_offload=true ;;
    # optim_cpu_offload: the step at 16K and 64K tokens, 3B on and off, and the
    # largest Llama-3.1-8B-shaped models that fit one H200 box (141 GB GPU,
    # 128 GiB host) each way: the plan (shardlm check) says why these sizes.
    1b-64k) run 1b-64k inputs/bench/llama-1b.toml --set data.global_batch=16 --set run.max_steps=6 ;;
    1b-offload-64k) run 1b-offload-64k inputs/bench/llama-1b.toml --set model.optim_cpu_offload=true \
                      --set data.global_batch=16 --set run.max_steps=6 ;;
    3b-offload) run 3b-offload inputs/bench/llama-3b.toml --set model.activation_checkpointing=full \
                  --set model.optim_cpu_offload=true --set run.max_steps=6 ;;
    6b-offload) run 6b-offload inputs/bench/llama-8b.toml --set model.num_layers=24 --set run.max_steps=4 ;;
    7b) run 7b inputs/bench/llama-8b.toml --set model.num_layers=30 --set model.optim_cpu_offload=false \
          --set run.max_steps=4 ;;
    # 256K tokens per step (64 sequences of 4096): where the offloaded update is a
    # small part of the step.
    1b-256k) run 1b-256k inputs/bench/llama-1b.toml --set data.global_batch=64 --set run.max_steps=4 ;;
    1b-offload-256k) run 1b-offload-256k inputs/bench/llama-1b.toml --set model.optim_cpu_offload=true \
                       --set data.global_batch=64 --set run.max_steps=4 ;;
    # An 80 GB H100 stood in for by a GPU memory cap of 78 GiB (the CUDA context,
    # cuBLAS and NCCL take the rest): the largest Llama-3.1-8B-shaped models at
    # sequence 4096 with activation checkpointing, without offload (15 layers; 16 is
    # refused by the cap) and with it (LAYERS, default 29: the host's 125 GiB binds).
    4b-80g) run 4b-80g inputs/bench/llama-8b.toml --set model.num_layers=15 --set model.optim_cpu_offload=false \
              --set device.memory_limit_gib=78 --set run.max_steps=4 ;;
    5b-80g-over) run 5b-80g-over inputs/bench/llama-8b.toml --set model.num_layers=16 --set model.optim_cpu_offload=false \
                   --set device.memory_limit_gib=78 --set run.max_steps=2 ;;
    7b-offload-80g) run 7b-offload-80g inputs/bench/llama-8b.toml --set model.num_layers=${LAYERS:-29} \
                      --set device.memory_limit_gib=78 --set run.max_steps=4 ;;
    # model.optim_offload_grads = "device": no host gradient shards (-4 B per
    # parameter of host), so the host binds later: 40 layers (9.77e9) by the plan.
    1b-offload-devgrads) run 1b-offload-devgrads inputs/bench/llama-1b.toml --set model.optim_cpu_offload=true \
                           --set model.optim_offload_grads=device ;;
    10b-offload-80g) run 10b-offload-80g inputs/bench/llama-8b.toml --set model.num_layers=${LAYERS:-40} \
                       --set model.optim_offload_grads=device --set device.memory_limit_gib=78 --set run.max_steps=4 ;;
    # Long context on one H200: the Llama-3.1-8B shape at 32K and 131K tokens, one
    # document per step, offloaded optimizer without host gradient shards (the host's
    # 125 GiB binds otherwise).
    8b-32k-offload) run 8b-32k-offload inputs/bench/llama-8b.toml --set data.seq_len=32768 --set data.global_batch=1 \
                      --set model.optim_offload_grads=device --set run.max_steps=4 ;;
    8b-32k-offload-selective) run 8b-32k-offload-selective inputs/bench/llama-8b.toml --set data.seq_len=32768 \
                                --set data.global_batch=1 --set model.optim_offload_grads=device \
                                --set model.activation_checkpointing=selective --set run.max_steps=4 ;;
    8b-32k-offload-selective-fp8) run 8b-32k-offload-selective-fp8 inputs/bench/llama-8b.toml \
                                    --set data.seq_len=32768 --set data.global_batch=1 \
                                    --set model.optim_offload_grads=device --set model.activation_checkpointing=selective \
                                    --set run.max_steps=4 --set model.fp8=tensorwise ;;
    # The first units' optimizer state on the GPU (model.optim_gpu_state_gib,
    # automatic) against every unit offloaded (= 0, the pipeline alone), in one
    # call: `tools/bench.sh 8b-32k-offload-selective 8b-32k-offload-selective-pipeline
    # 8b-64k-offload 8b-64k-offload-pipeline 8b-131k-offload 8b-131k-offload-pipeline`.
    8b-32k-offload-selective-pipeline)
      run 8b-32k-offload-selective-pipeline inputs/bench/llama-8b.toml --set data.seq_len=32768 \
        --set data.global_batch=1 --set model.optim_offload_grads=device \
        --set model.activation_checkpointing=selective --set run.max_steps=4 --set model.optim_gpu_state_gib=0 ;;
    # 64K tokens a step as 16 micro-batches of 4096.
    8b-64k-offload) run 8b-64k-offload inputs/bench/llama-8b.toml --set data.global_batch=16 \
                      --set model.optim_offload_grads=device --set run.max_steps=4 ;;
    8b-64k-offload-pipeline) run 8b-64k-offload-pipeline inputs/bench/llama-8b.toml --set data.global_batch=16 \
                               --set model.optim_offload_grads=device --set run.max_steps=4 \
                               --set model.optim_gpu_state_gib=0 ;;
    # ... and with the update of the offloaded rest under the backward (12 B per
    # offloaded parameter of host memory for the copies; refused by the plan
    # where the host has no room). A clipped step is redone: the step line says
    # how often; MAX_NORM=0 turns clipping off to measure the unclipped step.
    8b-32k-offload-selective-speculate)
      run 8b-32k-offload-selective-speculate inputs/bench/llama-8b.toml --set data.seq_len=32768 \
        --set data.global_batch=1 --set model.optim_offload_grads=device \
        --set model.activation_checkpointing=selective --set run.max_steps=4 --set model.optim_offload_speculate=true \
        --set optim.max_norm=${MAX_NORM:-1.0} ;;
    8b-64k-offload-speculate) run 8b-64k-offload-speculate inputs/bench/llama-8b.toml --set data.global_batch=16 \
                                --set model.optim_offload_grads=device --set run.max_steps=4 \
                                --set model.optim_offload_speculate=true --set optim.max_norm=${MAX_NORM:-1.0} ;;
    8b-131k-offload-pipeline)
      [ -f runs/bench-data/random-128k-131k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-128k-131k.h5 \
        --vocab 128256 --tokens 600000 --doc-len 131073
      run 8b-131k-offload-pipeline inputs/bench/llama-8b.toml --set data.path=runs/bench-data/random-128k-131k.h5 \
        --set data.seq_len=131072 --set data.global_batch=1 --set model.optim_offload_grads=device --set run.max_steps=3 \
        --set model.residual_dtype=bf16 \
        --set model.optim_gpu_state_gib=0 ;;
    8b-131k-offload)
      [ -f runs/bench-data/random-128k-131k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-128k-131k.h5 \
        --vocab 128256 --tokens 600000 --doc-len 131073
      run 8b-131k-offload inputs/bench/llama-8b.toml --set data.path=runs/bench-data/random-128k-131k.h5 \
        --set data.seq_len=131072 --set data.global_batch=1 --set model.optim_offload_grads=device --set run.max_steps=3 \
        --set model.residual_dtype=bf16 ;;
    # Selective checkpointing at 131K: 1 GiB of attention output a layer; LAYERS of
    # the 32 keep theirs (default all: 139,190 MiB planned on the 143,771 MiB H200).
    8b-131k-offload-selective)
      [ -f runs/bench-data/random-128k-131k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-128k-131k.h5 \
        --vocab 128256 --tokens 600000 --doc-len 131073
      run 8b-131k-offload-selective inputs/bench/llama-8b.toml --set data.path=runs/bench-data/random-128k-131k.h5 \
        --set data.seq_len=131072 --set data.global_batch=1 --set model.optim_offload_grads=device --set run.max_steps=3 \
        --set model.residual_dtype=bf16 \
        --set model.activation_checkpointing=selective ${LAYERS:+--set model.selective_layers=$LAYERS} ;;
    8b-131k-offload-selective-fp8)  # the 8B shape's 131K step with FP8 linears (bf16: 41.7 s)
      [ -f runs/bench-data/random-128k-131k.h5 ] || $PY tools/make_synthetic_data.py runs/bench-data/random-128k-131k.h5 \
        --vocab 128256 --tokens 600000 --doc-len 131073
      run 8b-131k-offload-selective-fp8 inputs/bench/llama-8b.toml --set data.path=runs/bench-data/random-128k-131k.h5 \
        --set data.seq_len=131072 --set data.global_batch=1 --set model.optim_offload_grads=device --set run.max_steps=3 \
        --set model.residual_dtype=bf16 \
        --set model.activation_checkpointing=selective --set model.fp8=tensorwise \
        ${LAYERS:+--set model.selective_layers=$LAYERS} ;;
    # Saves every 2 steps synchronously (the loop waits for each), then async saves
    # spaced wider than one background write (12-15 s on the H200 machine's disk:
    # 80 steps of 0.26 s with device state, 40 of 0.62 s offloaded), so none waits
    # for the one before; the last is the end of the run, which waits for its write.
    ckpt-1b|ckpt-1b-offload)
      extra=(); interval=80
      [ $n = ckpt-1b-offload ] && extra=(--set model.optim_cpu_offload=true) && interval=40
      # CKPT_ONLY=async: the async run alone. Its last save is the run's end, a whole
      # interval after the one before (else that one's write is waited for there).
      [ "${CKPT_ONLY:-}" = async ] || ckpt_run $n-sync-i2 2 6 --set ckpt.async=false "${extra[@]}"
      ckpt_run $n-async-i$interval $interval $((interval * 3)) --set ckpt.async=true "${extra[@]}"
      [ "${CKPT_ONLY:-}" = async ] || ckpt_dd
      rm -rf runs/bench-$n-* ;;
    ckpt-8b4-offload)
      # The 8B shape's layers (4 of its 32: a 96 GiB checkpoint of all 32 does not
      # fit twice on a 64 GiB disk), 32K tokens a step, optim_cpu_offload: a 23 GB
      # state whose host copy takes longer than a step, so updates wait for it.
      CKPT_DECK=inputs/bench/llama-8b.toml ckpt_run $n-async-i25 25 75 --set ckpt.async=true \
        --set model.num_layers=4 --set data.seq_len=32768 --set data.global_batch=1 --set model.optim_offload_grads=device
      rm -rf runs/bench-$n-* ;;
    *) echo "unknown benchmark '$n'" >&2; exit 2 ;;
  esac
done
