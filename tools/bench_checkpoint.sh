#!/usr/bin/env bash
# bench_checkpoint.sh — checkpoint I/O against the disk's own speed.
#
#   tools/bench_checkpoint.sh [DIR]        (default DIR: runs/bench-checkpoint)
#
# Saves and loads a model + AdamW state (fp32 weights and both moments) with
# shardlm's checkpoint code on NP ranks (build/test_mpi, the skipped
# "checkpoint I/O benchmark" case), REPEAT times for each MPI-IO transfer mode,
# and measures dd on the same directory: O_DIRECT write and read, and a
# buffered write with fdatasync (what a checkpoint does). Loads read from the
# disk: the file is dropped from the page cache first (posix_fadvise).
# Environment: NP (2), REPEAT (3), LAYERS (10), HIDDEN (2048), INTERMEDIATE
# (5632), VOCAB (32000), MODES ("direct independent collective").
# The default model has 0.65e9 parameters, a 7.7 GB checkpoint, and needs
# about 13 GB of host memory (weights, gradients, two moments, engine buffers);
# LAYERS=20 gives 1.2e9 parameters / 14.5 GB / 23 GB.
set -u
cd "$(dirname "$0")/.."
DIR=${1:-runs/bench-checkpoint}
NP=${NP:-2}
REPEAT=${REPEAT:-3}
MODES=${MODES:-direct independent collective}
BUILD=${BUILD:-build}
MPIRUN=${MPIRUN:-mpirun}
TEST_MPI=${TEST_MPI:-$BUILD/test_mpi}
export SHARDLM_BENCH_LAYERS=${LAYERS:-10} SHARDLM_BENCH_HIDDEN=${HIDDEN:-2048}
export SHARDLM_BENCH_INTERMEDIATE=${INTERMEDIATE:-5632} SHARDLM_BENCH_VOCAB=${VOCAB:-32000}
export SHARDLM_BENCH_DIR="$DIR/ckpt" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=passive
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
[ -x "$TEST_MPI" ] || { echo "build first: make all" >&2; exit 1; }
mkdir -p "$DIR"

echo "date:    $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine: $(nproc --all) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, $(uname -r)"
echo "disk:    $(df -h "$DIR" | awk 'NR == 2 {print $1 ", " $2 " total, " $4 " free, mounted on " $6}')"
echo "model:   layers $SHARDLM_BENCH_LAYERS, hidden $SHARDLM_BENCH_HIDDEN, intermediate $SHARDLM_BENCH_INTERMEDIATE, vocab $SHARDLM_BENCH_VOCAB, untied; $NP ranks"

results=$DIR/results.txt
: > "$results"
for mode in $MODES; do
  for i in $(seq 1 "$REPEAT"); do
    out=$(SHARDLM_CKPT_XFER=$mode $MPIRUN --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OMP_WAIT_POLICY \
      -x SHARDLM_CKPT_XFER -x SHARDLM_BENCH_LAYERS -x SHARDLM_BENCH_HIDDEN -x SHARDLM_BENCH_INTERMEDIATE \
      -x SHARDLM_BENCH_VOCAB -x SHARDLM_BENCH_DIR -np "$NP" "$TEST_MPI" -ts=checkpoint-bench --no-skip 2>&1)
    line=$(grep '^BENCH' <<< "$out")
    phases=$(grep -o '(checksums .*fsync [0-9.]* s)' <<< "$out")
    if [ -z "$line" ]; then echo "$out" | tail -20; echo "benchmark run failed" >&2; exit 1; fi
    echo "$mode $line $phases" | tee -a "$results"
  done
done
bytes=$(awk '{for (i = 1; i <= NF; i++) if ($i ~ /^file_bytes=/) {split($i, a, "="); print a[2]; exit}}' "$results")

# dd on the same directory, the same number of bytes.
count=$(( (bytes + 67108863) / 67108864 ))
rate() { sed -n 's/.* copied, \([0-9.]*\) s, .*/\1/p' | awk -v b=$((count * 67108864)) '{printf "%.3f", b / $1 / 1e9}'; }
for i in $(seq 1 "$REPEAT"); do
  w=$(dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=$count oflag=direct 2>&1 | rate)
  r=$(dd if="$DIR/dd.bin" of=/dev/null bs=64M iflag=direct 2>&1 | rate)
  rm -f "$DIR/dd.bin"
  b=$(dd if=/dev/zero of="$DIR/dd.bin" bs=64M count=$count conv=fdatasync 2>&1 | rate)
  rm -f "$DIR/dd.bin"
  echo "dd direct_write_GBps=$w direct_read_GBps=$r buffered_fdatasync_write_GBps=$b" | tee -a "$results"
done

median() { sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
field() { grep "^$1 " "$results" | grep -o "$2=[0-9.e+]*" | cut -d= -f2 | median; }
echo
echo "median of $REPEAT, $((bytes / 1000000)) MB per checkpoint:"
for mode in $MODES; do
  printf '  %-12s save %s GB/s (blocked %s s, checksums %s s alone), load %s GB/s (%s s)\n' "$mode" \
    "$(field "$mode" save_GBps)" "$(field "$mode" save_s)" "$(field "$mode" checksum_s)" \
    "$(field "$mode" load_GBps)" "$(field "$mode" load_s)"
done
printf '  %-12s O_DIRECT write %s GB/s, O_DIRECT read %s GB/s, buffered write + fdatasync %s GB/s\n' dd \
  "$(field dd direct_write_GBps)" "$(field dd direct_read_GBps)" "$(field dd buffered_fdatasync_write_GBps)"
rm -rf "$DIR/ckpt"
