#!/usr/bin/env bash
# Runs parts of `python -m jaxcomp.bench suite` side by side, one process of 8 CPU devices per shard,
# each pinned to its own cores, and merges what they wrote.
#   benchmarks/suite_shards.sh OUT SECONDS "SUITE ARGS" SHARDS ["SUITE ARGS" SHARDS ...]
# Every process stops after SECONDS; what finished is in OUT/<part>_<shard>/suite.json and OUT/merged.md.
set -u
out=$1 limit=$2; shift 2
cores=$(nproc); procs=0; jobs=()
args=("$@")
for ((i = 1; i < ${#args[@]}; i += 2)); do procs=$((procs + args[i])); done
per=$(( cores / procs > 0 ? cores / procs : 1 )); core=0; part=0
for ((i = 0; i < ${#args[@]}; i += 2)); do
  for ((s = 0; s < args[i + 1]; s++)); do
    dir=$out/p${part}_$s; mkdir -p "$dir"
    first=$(( core % cores )); last=$(( (core + per - 1) % cores ))
    PJRT_NPROC=16 timeout "$limit" taskset -c "$first-$last" python3 -m jaxcomp.bench suite ${args[i]} \
      --shard "$s/${args[i + 1]}" --out "$dir" >"$dir/log" 2>&1 &
    jobs+=($!); core=$((core + per))
  done
  part=$((part + 1))
done
wait "${jobs[@]}"
files=$(ls "$out"/p*/suite.json 2>/dev/null | paste -sd, -)
[ -n "$files" ] && python3 -m jaxcomp.bench suite --merge "$files" >"$out/merged.md" 2>&1
exit 0
