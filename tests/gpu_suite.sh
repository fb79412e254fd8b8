#!/usr/bin/env bash
# The GPU suite in its two named halves (docs/testing.md), from the repository root:
#   tests/gpu_suite.sh OUT_DIR [HALF...]      HALF: library, kernels (default: both)
# With two GPUs visible the two halves run at once, one per GPU, and then the tests marked
# two_gpus (skipped in a half, which sees one GPU) run with both GPUs visible
# (OUT_DIR/two_gpus.*); with one GPU the halves run one after the other.  Each half writes
# OUT_DIR/<half>.log (pytest output with --durations=40), OUT_DIR/<half>.jsonl
# (--results-log) and a last line "rc=<exit status> wall=<seconds>".
# LIMIT_S (default 480) stops a half that runs longer; WORKERS (default 8) test processes per GPU.
set -uo pipefail
out=${1:?usage: tests/gpu_suite.sh OUT_DIR [library] [kernels]}
shift
halves=("$@")
[ ${#halves[@]} -eq 0 ] && halves=(library kernels)
mkdir -p "$out"
declare -A paths=([library]="tests/jax_prefix_attn tests/fuzz"
                  [kernels]="tests/pallas_kernels tests/models tests/bench")
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || { echo "no GPU visible" >&2; exit 2; }

run_half() {   # half gpu
  local start=$SECONDS
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$2 timeout "${LIMIT_S:-480}" python3 -m pytest -m gpu -q \
      -n "${WORKERS:-8}" --dist worksteal -p no:benchmark --durations=40 \
      --results-log "$out/$1.jsonl" ${paths[$1]} > "$out/$1.log" 2>&1
  echo "rc=$? wall=$((SECONDS - start))" >> "$out/$1.log"
}

i=0
for half in "${halves[@]}"; do
  [ -n "${paths[$half]:-}" ] || { echo "unknown half: $half (library, kernels)" >&2; exit 2; }
  if [ "$gpus" -ge 2 ]; then run_half "$half" $((i % gpus)) & else run_half "$half" 0; fi
  i=$((i + 1))
done
wait
if [ "$gpus" -ge 2 ]; then
  start=$SECONDS
  timeout "${LIMIT_S:-480}" python3 -m pytest -m "gpu and two_gpus" -q -p no:benchmark \
      --results-log "$out/two_gpus.jsonl" tests > "$out/two_gpus.log" 2>&1
  echo "rc=$? wall=$((SECONDS - start))" >> "$out/two_gpus.log"
  halves+=(two_gpus)
fi
for half in "${halves[@]}"; do echo "$half: $(tail -n 1 "$out/$half.log")"; done
