#!/usr/bin/env bash
# The main job: set up .venv, build the demo model if it is missing, and serve it with the
# whole stack on this machine (gateway on :8000 + 1 prefill node + 1 decode node; Ctrl-C stops).
# Extra arguments go to `pdserve serve` (e.g. --num-prefill 2 --num-decode 2 --port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/demo}
[ -f "$MODEL/config.json" ] || .venv/bin/pdserve make-model --arch llama --preset small --out "$MODEL"
exec .venv/bin/pdserve serve --model "$MODEL" --num-prefill 1 --num-decode 1 "$@"
