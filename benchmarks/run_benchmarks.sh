#!/usr/bin/env bash
# Tune + bench the Qwen2 examples on this machine and write the results under benchmarks/results/.
#
# Usage: benchmarks/run_benchmarks.sh [tiny] [medium]     (default: both)
#
# Per size it writes benchmarks/results/<size>/: machine.json (date, CPU model and bf16/fp16
# flags, torch version, load average), policy.json (the tuned policy), tune.log, bench.json,
# bench.md (the table) and bench.log. Environment overrides: PY (python), TUNE_ARGS_<SIZE>,
# BENCH_ARGS_<SIZE>, RESULTS (output root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RESULTS=${RESULTS:-benchmarks/results}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(tiny medium)

# The 4-layer example: full tune (compiled finalists), all eight bench configs, slow ones capped.
TUNE_ARGS_TINY=${TUNE_ARGS_TINY:---trials 8}
BENCH_ARGS_TINY=${BENCH_ARGS_TINY:---steps 5 --warmup 2}
# 8 layers, hidden 1024: eager screening only and fewer steps; on a CPU without native bf16 the
# bf16 baselines (minutes per step) are skipped by --skip-slow, with the measured reason.
TUNE_ARGS_MEDIUM=${TUNE_ARGS_MEDIUM:---trials 4 --no-compile}
BENCH_ARGS_MEDIUM=${BENCH_ARGS_MEDIUM:---steps 3 --warmup 1 --skip-slow}

for size in "${SIZES[@]}"; do
  case "$size" in
    tiny) model=examples/qwen2_tiny.py; tune_args=$TUNE_ARGS_TINY; bench_args=$BENCH_ARGS_TINY ;;
    medium) model=examples/qwen2_medium.py; tune_args=$TUNE_ARGS_MEDIUM; bench_args=$BENCH_ARGS_MEDIUM ;;
    *) echo "run_benchmarks.sh: unknown size '$size' (tiny, medium)" >&2; exit 2 ;;
  esac
  out="$RESULTS/$size"
  mkdir -p "$out"
  tmp=$(mktemp -d)
  "$PY" - "$out/machine.json" "$model" <<'PY'
import datetime, json, sys, torch
from autoprec.bench import describe_machine
m = describe_machine(torch.device("cpu"))
m.update(torch=torch.__version__, model=sys.argv[2],
         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
json.dump(m, open(sys.argv[1], "w"), indent=2)
PY
  echo "== $size: tune $model $tune_args"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$PY" -m autoprec.cli tune "$model" --out "$out/policy.json" --storage "sqlite:///$tmp/study.db" \
      $tune_args 2>&1 | tee "$out/tune.log"
  echo "tune wall: $(( $(date +%s) - start )) s" | tee -a "$out/tune.log"
  echo "== $size: bench $model $bench_args"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$PY" -m autoprec.cli bench "$model" --policy "$out/policy.json" --json "$out/bench.json" \
      --md "$out/bench.md" $bench_args 2>&1 | tee "$out/bench.log"
  echo "bench wall: $(( $(date +%s) - start )) s" | tee -a "$out/bench.log"
  rm -rf "$tmp"
done
