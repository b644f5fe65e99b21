#!/usr/bin/env bash
# docs/benchmarks.md's GPU tables in one call of a lent GPU machine (run from the repository root):
#   1. every method's programs compiled side by side, PROCS processes per table, into one
#      persistent compilation cache (the kernel table of ResNet-50 and BERT-base with one timed
#      run, and the whole training step of benchmarks/step_time.py with one step); their compile
#      seconds are printed under that load;
#   2. then, one process at a time and reading the cache, the tables timed as docs/benchmarks.md
#      gives them: the whole step (median of 20 after 5 untimed) and the kernels (median of 5).
# Each phase has its own time limit so that the call ends inside the device's; what a phase did
# not reach is missing from its log. The logs land in $OUT (at most 8 files come back).
#   OUT=/tmp/gpu bash benchmarks/gpu_tables.sh        # METHODS=fp16,topk STEP="--width 64" to try it
set -u
OUT=${OUT:-/tmp/gpu_tables}
PY=${PY:-python3}
PROCS=${PROCS:-4}
STEP=${STEP:---width 512 --layers 6 --context 256 --batch 32}
LIMITS=(${LIMITS:-240 100 200})  # seconds: compile phase, step table, kernel table
mkdir -p "$OUT" "$OUT/parts"
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d)}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv 2>&1; "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
METHODS=${METHODS:-$("$PY" -c "import jaxcomp; print(','.join(jaxcomp.METHODS))")}
part() {  # part I: every PROCS-th method from the I-th
  echo "$METHODS" | tr ',' '\n' | awk -v k="$PROCS" -v i="$1" 'NR % k == i' | paste -sd, -
}

start=$SECONDS
for ((i = 0; i < PROCS; i++)); do
  m=$(part "$i")
  [ -z "$m" ] && continue
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${LIMITS[0]}" "$PY" benchmarks/step_time.py $STEP \
    --reps 1 --warmup 0 --methods "$m" >"$OUT/parts/step_$i.txt" 2>&1 &
  for model in resnet50 bert; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${LIMITS[0]}" "$PY" -m jaxcomp.bench kernels \
      --system-malloc --no-memory --reps 1 --models "$model" --methods "$m" \
      >"$OUT/parts/kernels_${model}_$i.txt" 2>&1 &
  done
done
wait
echo "compile phase: $((SECONDS - start)) s, $PROCS processes per table" >>"$OUT/env.txt"
for f in "$OUT"/parts/*.txt; do echo "### $(basename "$f")"; cat "$f"; done >"$OUT/compile_phase.txt"
rm -rf "$OUT/parts"

start=$SECONDS
timeout "${LIMITS[1]}" "$PY" benchmarks/step_time.py $STEP --methods "$METHODS" >"$OUT/step.txt" 2>&1
echo "step table: $((SECONDS - start)) s" >>"$OUT/env.txt"
start=$SECONDS
timeout "${LIMITS[2]}" "$PY" -m jaxcomp.bench kernels --system-malloc --no-memory --reps 5 --methods "$METHODS" \
  >"$OUT/kernels.txt" 2>&1
echo "kernel table: $((SECONDS - start)) s" >>"$OUT/env.txt"
