#!/usr/bin/env bash
# The GPU check (issue 20), for a borrowed GPU machine with no internet: run in a copy of the
# repository root, writes JSON results, a log and a summary table into OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Needs Python with torch (CUDA), triton and transformers; installs nothing. pdserve is made
# importable through a symlink tree that is pyproject.toml's package-dir mapping (pdserve.engine
# -> engine/, ...) on PYTHONPATH: an editable pip install would need setuptools (a Python 3.12
# venv may lack it) and --ignore-requires-python, and would write into the machine's Python.
#
# Sections, each in its own process under its own timeout, the next one running whatever the
# last one did; all of them within BUDGET_S (default 450 s; the whole run stays under 8 minutes):
#   kernels     benchmarks/gpu_kernels.py (Triton kernels: correctness + timings)
#   kv-io       KVBlockIO staging on the device        \
#   vs-hf       greedy fp32 tokens vs transformers      |  benchmarks/gpu_engine_check.py
#   make-1b     make-model --preset gpu-1b --device cuda (timed; the next three use it)
#   throughput  offline bf16 batch vs the rooflines     |
#   graphs      CUDA graphs vs enforce_eager            |
#   disagg      prefill + decode engines, KV over TCP  /
#
# GPU_CHECK_DEVICE=cpu GPU_CHECK_SMOKE=1 runs the same script small on a CPU (a dry run).
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-450}
SMOKE=()
[[ -n "${GPU_CHECK_SMOKE:-}" ]] && SMOKE=(--smoke)
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-gpu-check.XXXXXX")
MODELS="$WORK/models"  # gigabytes of random weights: not in OUT, which travels back
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$REPO"
echo "gpu_check: $(date -u +%FT%TZ) repo $REPO out $OUT device $DEVICE budget ${BUDGET_S}s"

# -- pdserve importable without installing it ----------------------------------------------------
"$PY" - "$REPO" "$WORK/site" <<'EOF'
import pathlib
import sys
import tomllib

repo, site = map(pathlib.Path, sys.argv[1:])
mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in sorted(mapping.items()):  # "pdserve" first: the others live inside it
    target = site.joinpath(*package.split("."))
    if package == "pdserve":
        target.mkdir(parents=True)
        for entry in (repo / folder).iterdir():
            (target / entry.name).symlink_to(entry)
    else:
        target.symlink_to(repo / folder, target_is_directory=True)
EOF
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

# -- the machine ---------------------------------------------------------------------------------
{
  nvidia-smi || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
    --format=csv 2>/dev/null
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "grpc"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "missing:", e)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
import pdserve.engine, pdserve.kvtransfer.tcp  # noqa: E401,F401 - the symlink tree works
print("pdserve importable from", pdserve.engine.__file__)
EOF
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# -- sections ------------------------------------------------------------------------------------
declare -a RESULTS=()

section() {  # NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what is left of the budget)
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  if ((left < 20)); then
    echo "== $name: skipped, the time budget is spent"
    RESULTS+=("$name: skipped")
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (timeout ${limit}s): $*"
  local began=$(date +%s)
  timeout -k 10 "$limit" "$@"
  local rc=$?
  local took=$(($(date +%s) - began))
  local verdict="exit $rc"
  ((rc == 124 || rc == 137)) && verdict="timed out"
  echo "== $name: $verdict after ${took}s"
  RESULTS+=("$name: $verdict after ${took}s")
}

check() {  # SECTION LIMIT_S: one section of gpu_engine_check.py
  section "$1" "$2" "$PY" benchmarks/gpu_engine_check.py "$1" --out "$OUT/engine_$1.json" \
    --device "$DEVICE" --models-dir "$MODELS" "${SMOKE[@]}"
}

KERNEL_ENV=()
[[ $DEVICE == cpu ]] && KERNEL_ENV=(env TRITON_INTERPRET=1)
section kernels 120 "${KERNEL_ENV[@]}" "$PY" benchmarks/gpu_kernels.py --device "${DEVICE%%:*}" \
  --out "$OUT/gpu_kernels.json" --budget-s 100 "${SMOKE[@]}"
check kv-io 40
check vs-hf 80
PRESET=gpu-1b
[[ -n "${GPU_CHECK_SMOKE:-}" ]] && PRESET=tiny
section make-1b 60 "$PY" -m pdserve.cli make-model --arch llama --preset "$PRESET" \
  --device "$DEVICE" --out "$MODELS/llama-$PRESET"
check throughput 70
check graphs 80
check disagg 70

# -- summary -------------------------------------------------------------------------------------
{
  echo "gpu_check: $(($(date +%s) - START))s in all"
  printf '  %s\n' "${RESULTS[@]}"
  "$PY" benchmarks/gpu_engine_check.py summary "$OUT"
} | tee "$OUT/summary.md"
rm -rf "$WORK"
