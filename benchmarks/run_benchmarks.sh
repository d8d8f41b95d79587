#!/usr/bin/env bash
# Tune + bench the Qwen2 examples on this machine and write the results under benchmarks/results/.
#
# Usage: benchmarks/run_benchmarks.sh [tiny] [medium]     (default: both)
#
# Per size it writes benchmarks/results/<size>/: machine.json (date, CPU model and bf16/fp16
# flags, torch version, load average), policy.json (the tuned policy), tune.log, bench.json,
# bench.md (the table) and bench.log. Environment overrides: PY (python), TUNE_ARGS_<SIZE>,
# BENCH_ARGS_<SIZE>, POLICY_<SIZE> (bench this policy file, skip tune: e.g. the tiny example's
# tuned policy for medium; its rules are per op class, so they transfer), RESULTS (output root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RESULTS=${RESULTS:-benchmarks/results}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(tiny medium)

# The 4-layer example: the default tune (what `make tune` runs), all eight bench configs; a config
# > 3x slower than fp32 eager is timed on one step. The policy rows come first so that a run cut
# short still has them (bench.json is progressive).
TUNE_ARGS_TINY=${TUNE_ARGS_TINY:-}
BENCH_ARGS_TINY=${BENCH_ARGS_TINY:---steps 3 --warmup 1 --max-step-ratio 3 --configs fp32_eager policy_eager
  policy_compiled fp32_compiled autocast_eager autocast_compiled pure_low_eager pure_low_compiled}
# 8 layers, hidden 1024: eager screening only and fewer steps. On a CPU without native bf16 one
# bf16 forward/backward of this model takes minutes, so tune's autocast baseline alone exceeds a
# short run (use POLICY_MEDIUM to bench the tiny example's policy), and the bf16 bench baselines
# are skipped by --skip-slow, with the measured reason.
TUNE_ARGS_MEDIUM=${TUNE_ARGS_MEDIUM:---trials 2 --no-compile --traj-steps 0 --finalists 1}
BENCH_ARGS_MEDIUM=${BENCH_ARGS_MEDIUM:---steps 2 --warmup 1 --skip-slow}

for size in "${SIZES[@]}"; do
  case "$size" in
    tiny) model=examples/qwen2_tiny.py; tune_args=$TUNE_ARGS_TINY; bench_args=$BENCH_ARGS_TINY ;;
    medium) model=examples/qwen2_medium.py; tune_args=$TUNE_ARGS_MEDIUM; bench_args=$BENCH_ARGS_MEDIUM ;;
    *) echo "run_benchmarks.sh: unknown size '$size' (tiny, medium)" >&2; exit 2 ;;
  esac
  out="$RESULTS/$size"
  mkdir -p "$out"
  tmp=$(mktemp -d)
  policy_var=POLICY_${size^^}
  "$PY" - "$out/machine.json" "$model" <<'PY'
import datetime, json, sys, torch
from autoprec.commands.bench import describe_machine
m = describe_machine(torch.device("cpu"))
m.update(torch=torch.__version__, model=sys.argv[2],
         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
json.dump(m, open(sys.argv[1], "w"), indent=2)
PY
  if [ -n "${!policy_var:-}" ]; then
    cp "${!policy_var}" "$out/policy.json.tmp" && mv "$out/policy.json.tmp" "$out/policy.json"
    echo "tune skipped: bench uses the policy tuned for ${!policy_var}" | tee "$out/tune.log"
  else
    echo "== $size: tune $model $tune_args"
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$PY" -m autoprec.cli tune "$model" --out "$out/policy.json" --storage "sqlite:///$tmp/study.db" \
        $tune_args 2>&1 | tee "$out/tune.log"
    echo "tune wall: $(( $(date +%s) - start )) s" | tee -a "$out/tune.log"
  fi
  echo "== $size: bench $model $bench_args"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$PY" -m autoprec.cli bench "$model" --policy "$out/policy.json" --json "$out/bench.json" \
      --md "$out/bench.md" $bench_args 2>&1 | tee "$out/bench.log"
  echo "bench wall: $(( $(date +%s) - start )) s" | tee -a "$out/bench.log"
  rm -rf "$tmp"
done
