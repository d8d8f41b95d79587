#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh needs on a machine without network into .whl/.
#
# Usage: benchmarks/fetch_gpu_wheels.sh [DEST]      (default DEST: .whl at the repo root)
#
# The GPU machine has Python 3.12, torch and Triton but may lack Optuna, networkx, transformers,
# matplotlib or torchao (fp8). This takes those five plus their runtime dependency closure, pinned to
# the versions installed in this checkout's venv (PY, default .venv/bin/python, so what was
# tested here is what runs there), and downloads cp312 manylinux / pure-python wheels, one
# package at a time with --no-deps. gpu_check.sh installs only those not already installed there.
# EXCLUDE (space-separated names, default "hf-xet": only used for hub downloads) leaves packages
# out; the full set is ~70 MB, so where the copy to the GPU machine is limited (e.g. 64 MiB) and
# its Python already has numpy, use EXCLUDE="hf-xet numpy" (~55 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
EXCLUDE=${EXCLUDE-hf-xet}
mkdir -p "$DEST"
mapfile -t PINS < <(EXCLUDE="$EXCLUDE" "$PY" - <<'PY'
import importlib.metadata as md
import os
import re
from packaging.markers import default_environment
from packaging.requirements import Requirement

env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.0",
                               "sys_platform": "linux", "platform_system": "Linux",
                               "platform_machine": "x86_64", "extra": ""}
roots = ["optuna", "networkx", "transformers", "matplotlib", "torchao"]  # plots; torchao: fp8
skip = {"torch", "triton", *os.environ.get("EXCLUDE", "").split()}  # the GPU machine brings torch
seen, todo = {}, list(roots)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in skip:
        continue
    try:
        seen[name] = md.version(name)
    except md.PackageNotFoundError:
        seen[name] = None  # not installed here: download the newest
    for r in md.requires(name) or [] if seen[name] else []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
for n, v in sorted(seen.items()):
    print(f"{n}=={v}" if v else n)
PY
)
echo "fetching ${#PINS[@]} packages into $DEST: ${PINS[*]}"
for pin in "${PINS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 -d "$DEST" "$pin"
done
ls -1 "$DEST"
