#!/usr/bin/env bash
# One prepared GPU check: tune a Qwen2-0.5B-shaped model, time the autocast twin's compile options
# against torch.autocast + torch.compile, bench the policy, write JSON and logs.
#
# Usage: benchmarks/gpu_check.sh OUTDIR [--dry-run] [--fp8] [--global-batch N]
#
# For a CUDA machine (H200) whose Python has torch and Triton but no Optuna/networkx/transformers
# and no network: wheels brought in .whl/ at the repo root (benchmarks/fetch_gpu_wheels.sh) are
# installed with pip --no-index --no-deps into a temporary site folder on PYTHONPATH; only the
# distributions not already installed. Every step runs under `timeout`, its limit also clipped to
# what is left of a 560 s deadline, so the whole script ends within 10 minutes; it always writes
# OUTDIR/summary.json. With --fp8, after the main tune and bench, an fp8 tune (--dtypes
# bf16,fp8_e4m3: fp8 scaled matmuls, torch._scaled_mm, kept where the probe measures them faster)
# and its bench, in what is left of the deadline (on the H200 the probe excluded fp8 at these
# shapes twice, 2.08x and 2.31x fp32's time, and the bench needs ~260 s: left out by default).
#
# --global-batch N: instead of the twin rows, bench and fp8 (a second call, the device's remaining
# minutes), the micro-batch within the device's memory (issue "Tokens/s within a memory budget"):
# `tune --global-batch N` (eager screening as above; on CUDA the budget defaults to 90% of the
# device's memory), then `bench --global-batch N` of its policy against fp32 + torch.compile and
# torch.autocast + torch.compile, each at its own largest fitting micro-batch. Writes
# OUTDIR/batch/{policy.json, tune.log, bench.json, bench.md, bench.log}. Not yet run on a GPU: the
# step limits are guesses (the 0.5B model's file batch is 8 x 512 tokens; N=32 measures micro-batches
# 8, 16 and 32).
#
# --dry-run: the same steps on the CPU with a tiny model (AUTOPREC_QWEN2_05B_TINY=1) and tiny
# budgets, eager configurations only (~1.5 min), to check the script before spending GPU time
# (tests/project/test_gpu_check.py runs it in make test).
#
# Writes into OUTDIR: gpu_check.log (everything), env.json (device, torch, CUDA), nvidia-smi.txt,
# policy.json, tune.log, twin/twin_vs_autocast.json, twin.log, bench.json (partial if the budget cut
# it), bench.md, bench.log,
# fp8/{policy.json, tune.log, bench.json, bench.md, bench.log},
# summary.json ({"dry_run", "steps": {name: {"rc", "seconds"}}, "policy_source"}).
set -uo pipefail
# usage [WHY]: the usage line, after WHY (which argument was wrong) where given; exit 2.
usage() {
  [ $# -ge 1 ] && echo "$0: $1" >&2
  echo "usage: $0 OUTDIR [--dry-run] [--fp8] [--global-batch N]" >&2; exit 2
}
[ $# -ge 1 ] || usage "no OUTDIR given"
case "$1" in -*) usage "the first argument must be OUTDIR, got option $1" ;; esac
OUT=$1; shift
DRY=0
FP8=0
GB=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --fp8) FP8=1 ;;
    --global-batch)
      [ $# -ge 2 ] || usage "--global-batch needs a value (a positive integer)"
      [[ "$2" =~ ^[1-9][0-9]*$ ]] || usage "--global-batch must be a positive integer, got '$2'"
      GB=$2; shift ;;
    *) usage "unknown argument '$1'" ;;
  esac
  shift
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
export PYTHONUNBUFFERED=1  # logs survive a timeout kill
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$REPO"

if [ "$DRY" = 1 ]; then
  export AUTOPREC_QWEN2_05B_TINY=1
  DEVICE=cpu
  # Idle 2-core CPU: ~60 s in all. The limits are generous for a loaded CI box.
  T_WHEELS=60; T_ENV=60; T_TUNE=150; T_TWIN=120; T_BENCH=120; T_FP8=120; T_FP8_BENCH=60; DEADLINE=600
  TUNE_ARGS=(--trials 1 --timeout 5 --no-compile --traj-steps 0 --finalists 1)
  BENCH_ARGS=(--steps 1 --warmup 0 --configs fp32_eager policy_eager autocast_eager pure_low_eager)
  TWIN_ARGS=(--steps 1 --warmup 0 --rows autocast_eager twin_eager)  # the wiring: no compile on a CPU
  FP8_BENCH_ARGS=(--steps 1 --warmup 0 --configs fp32_eager policy_eager)
  T_TUNE_BATCH=200; T_BENCH_BATCH=200
  BENCH_BATCH_ARGS=(--no-compile)  # the wiring: no compile on a CPU
else
  DEVICE=cuda
  # Sized on an H200 (benchmarks/results/gpu_h200_2026-12-04): the tune of the 24-layer model takes
  # ~35 s to start (imports, 358M parameters built) and ~95 s of phases; bench's compiles take
  # 40 s (policy, regional), 77 s (torch.autocast, whole model), 26 s (fp32) before its timing.
  # The second run (gpu_h200_2026-12-04b): bench's three compiles took 54, 72 and 43 s, its start and
  # eager drift ~40 s, so its timing rounds began after ~210 s: 230 s cut them off.
  # The twin rows (issue 52): not yet run on a GPU; 4 compiles of the 24-layer model at the 40-77 s
  # bench measured each, then 13 interleaved rounds. bench gets what is left of the deadline.
  T_WHEELS=45; T_ENV=45; T_TUNE=160; T_TWIN=220; T_BENCH=300; T_FP8=100; T_FP8_BENCH=60; DEADLINE=560
  # Tune screens and picks eagerly (seconds per trial on an H200; each Inductor compile of the
  # 24-layer graph costs 1-2 minutes, spent in bench instead), sampling for at most 45 s.
  TUNE_ARGS=(--trials 24 --timeout 45 --no-compile --finalists 2 --traj-steps 10)
  # The rows of the bar (the faster of torch.autocast + torch.compile and fp32 + torch.compile),
  # the policy's and fp32 eager. Eager rows first, then the compiled ones: a bench cut short keeps
  # the drift of the rows it finished (bench.json is rewritten after each), but its timings come
  # only after every row's compile (interleaved rounds), so no more rows than fit the budget.
  BENCH_ARGS=(--steps 10 --warmup 3 --configs fp32_eager policy_eager autocast_eager
              policy_compiled autocast_compiled fp32_compiled)
  FP8_BENCH_ARGS=(--steps 10 --warmup 3 --configs fp32_eager policy_eager autocast_eager)
  # The autocast twin compiled as torch.compile would (no say), as tune records it (regions, emulated
  # casts) and flat with emulated casts, against torch.autocast + torch.compile.
  TWIN_ARGS=(--steps 10 --warmup 3 --rows autocast_compiled twin_compiled twin_tuned twin_tuned_flat)
  # --global-batch: guesses (not yet run on a GPU). The tune's micro-batch phase measures each
  # configuration's peak at two or three micro-batches (eager, a few steps each), then times them;
  # bench compiles three sides (40-77 s each on an H200) before its rounds.
  T_TUNE_BATCH=250; T_BENCH_BATCH=300
  BENCH_BATCH_ARGS=()
fi
MODEL=examples/qwen2_05b.py
STEPS_JSON=""
step() {  # step NAME SECONDS CMD...: run CMD under timeout, record rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    echo "== $name: skipped, no time left"
    STEPS_JSON+="\"$name\": {\"rc\": -1, \"seconds\": 0}, "
    return 1
  fi
  local cmd="$*"
  echo "== $name (limit ${limit}s): ${cmd:0:200}"
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "== $name: timed out after ${limit}s"
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  STEPS_JSON+="\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0))}, "
  return $rc
}

echo "gpu_check: $(date -u +%FT%TZ) out=$OUT dry_run=$DRY repo=$REPO"

# 1. Wheels: install the ones whose distribution is missing here.
SITE=$(mktemp -d "${TMPDIR:-/tmp}/autoprec-site.XXXXXX")
install_wheels() {
  shopt -s nullglob
  local whls=("$REPO"/.whl/*.whl)
  [ ${#whls[@]} -gt 0 ] || { echo "wheels: no .whl/ folder, using what is installed"; return 0; }
  # Wheel names start with the distribution name; keep the ones not installed here.
  mapfile -t need < <("$PY" - "${whls[@]}" <<'PYEOF'
import importlib.metadata as m, os, sys
for w in sys.argv[1:]:
    try:
        m.version(os.path.basename(w).split("-")[0])
    except m.PackageNotFoundError:
        print(w)
PYEOF
)
  echo "wheels: ${#whls[@]} in .whl/, ${#need[@]} to install"
  [ ${#need[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${need[@]}"
}
export -f install_wheels; export REPO PY SITE
step wheels "$T_WHEELS" bash -c install_wheels
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 2. Environment.
[ "$DRY" = 1 ] || (timeout 10 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed")
step env "$T_ENV" "$PY" - "$OUT/env.json" "$DEVICE" <<'PY'
import json, sys, torch
import optuna, networkx, transformers, autoprec  # noqa: F401  (fail here, not mid-tune)
from autoprec.commands.bench import describe_machine
dev = torch.device(sys.argv[2])
if dev.type == "cuda":
    assert torch.cuda.is_available(), "CUDA not available"
env = describe_machine(dev) | {"torch": torch.__version__, "cuda": torch.version.cuda,
      "optuna": optuna.__version__, "networkx": networkx.__version__, "transformers": transformers.__version__,
      "autoprec": autoprec.__version__, "bf16_supported": dev.type == "cuda" and torch.cuda.is_bf16_supported()}
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
PY
env_rc=$?

# 2b. --global-batch: the micro-batch within the device's memory, and nothing else.
if [ -n "$GB" ]; then  # the micro-batch within the device's memory, and nothing else
  mkdir -p "$OUT/batch"
  if [ $env_rc -eq 0 ]; then
    step tune_batch "$T_TUNE_BATCH" "$PY" -m autoprec.cli tune "$MODEL" --device "$DEVICE" \
        --out "$OUT/batch/policy.json" --storage "sqlite:///$OUT/batch/study.db" --global-batch "$GB" \
        "${TUNE_ARGS[@]}" > >(tee "$OUT/batch/tune.log") 2>&1
  fi
  if [ -s "$OUT/batch/policy.json" ]; then
    step bench_batch "$T_BENCH_BATCH" "$PY" -m autoprec.cli bench "$MODEL" --device "$DEVICE" \
        --policy "$OUT/batch/policy.json" --global-batch "$GB" --json "$OUT/batch/bench.json" \
        --md "$OUT/batch/bench.md" "${BENCH_BATCH_ARGS[@]}" > >(tee "$OUT/batch/bench.log") 2>&1
  fi
  cat > "$OUT/summary.json" <<JSON
{"dry_run": $([ "$DRY" = 1 ] && echo true || echo false), "device": "$DEVICE", "global_batch": $GB,
 "steps": {${STEPS_JSON%, }}, "total_seconds": $SECONDS}
JSON
  rm -rf "$SITE"
  echo "gpu_check: done in $SECONDS s; results in $OUT"
  [ -s "$OUT/batch/bench.json" ]
  exit
fi

# 3. Tune within a fixed budget.
POLICY_SOURCE=tune
if [ $env_rc -eq 0 ]; then
  step tune "$T_TUNE" "$PY" -m autoprec.cli tune "$MODEL" --device "$DEVICE" --out "$OUT/policy.json" \
      --storage "sqlite:///$OUT/study.db" "${TUNE_ARGS[@]}" > >(tee "$OUT/tune.log") 2>&1
fi
if [ ! -s "$OUT/policy.json" ]; then  # tune failed or ran out of time: bench the default policy
  POLICY_SOURCE=default_bf16_fallback
  "$PY" -c "import sys, autoprec; autoprec.Policy.default('bf16').save(sys.argv[1])" "$OUT/policy.json"
fi

# 4. The compile options' costs: the twin against torch.autocast + torch.compile, one factor at a time.
if [ $env_rc -eq 0 ]; then
  step twin "$T_TWIN" "$PY" benchmarks/twin_vs_autocast.py "$OUT/twin" --device "$DEVICE" "${TWIN_ARGS[@]}" \
      > >(tee "$OUT/twin.log") 2>&1
fi

# 5. Bench (JSON written after every configuration).
step bench "$T_BENCH" "$PY" -m autoprec.cli bench "$MODEL" --device "$DEVICE" --policy "$OUT/policy.json" \
    --json "$OUT/bench.json" --md "$OUT/bench.md" "${BENCH_ARGS[@]}" > >(tee "$OUT/bench.log") 2>&1

# 6. --fp8: the same tune with fp8 matmuls searched beside bf16, then its bench (eager rows first).
mkdir -p "$OUT/fp8"
if [ $env_rc -eq 0 ] && [ "$FP8" = 1 ]; then
  step tune_fp8 "$T_FP8" "$PY" -m autoprec.cli tune "$MODEL" --device "$DEVICE" --out "$OUT/fp8/policy.json" \
      --storage "sqlite:///$OUT/fp8/study.db" --dtypes bf16,fp8_e4m3 "${TUNE_ARGS[@]}" > >(tee "$OUT/fp8/tune.log") 2>&1
fi
if [ -s "$OUT/fp8/policy.json" ]; then
  step bench_fp8 "$T_FP8_BENCH" "$PY" -m autoprec.cli bench "$MODEL" --device "$DEVICE" --policy "$OUT/fp8/policy.json" \
      --json "$OUT/fp8/bench.json" --md "$OUT/fp8/bench.md" "${FP8_BENCH_ARGS[@]}" > >(tee "$OUT/fp8/bench.log") 2>&1
fi

cat > "$OUT/summary.json" <<JSON
{"dry_run": $([ "$DRY" = 1 ] && echo true || echo false), "device": "$DEVICE", "policy_source": "$POLICY_SOURCE",
 "steps": {${STEPS_JSON%, }}, "total_seconds": $SECONDS}
JSON
rm -rf "$SITE"
echo "gpu_check: done in $SECONDS s; results in $OUT"
[ -s "$OUT/bench.json" ]
