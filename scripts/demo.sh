#!/usr/bin/env bash
# The main job: set up .venv, build the demo model if it is missing, generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${MODEL:-models/demo}
[ -f "$MODEL/config.json" ] || .venv/bin/pdserve make-model --arch llama --preset small --out "$MODEL"
exec .venv/bin/pdserve generate --model "$MODEL" --max-tokens 32 "$@" \
  "def fibonacci(n):" "import os" "class Request:"
