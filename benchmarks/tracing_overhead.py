"""What OpenTelemetry tracing costs: output tokens/s of the same `pdserve serve` stack with
tracing on (every span exported over OTLP/gRPC to a receiver in this process) and off (no
OTEL_* variables: the no-op tracer), measured with `pdserve bench serve`.

Both stacks (gateway + 1 prefill + 1 decode node, one torch thread per node) run side by side
for the whole benchmark, and the runs interleave (off, on, on, off, off, on, ...), so drifting
load on a shared machine hits both modes alike; the result is each mode's median, and the
median of the per-repeat ratios. Because throughput on a shared machine swings by more than
the effect measured, the stack's own CPU time per output token (gateway + nodes, from
/proc) is reported as well: it is what tracing adds, whatever else the machine runs. The
receiver only counts what it gets (a real collector runs elsewhere). Prompts are long enough
to be prefilled remotely, so a request makes every span of a full trace. Writes
benchmarks/results/tracing_overhead.json.

    .venv/bin/python benchmarks/tracing_overhead.py --model models/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_disagg import free_port, wait_healthy  # noqa: E402
from tests.observability.otlp_receiver import OtlpReceiver  # noqa: E402

logger = logging.getLogger("tracing_overhead")

MODES = ("off", "on")
STACK_FLAGS = [
    "--num-prefill", "1", "--num-decode", "1", "--num-threads", "1", "--dtype", "float32",
    "--grpc-port", "0", "--remote-prefill-min-tokens", "32",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per mode")
    p.add_argument("--num-prompts", type=int, default=160, help="requests per run")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--random-input-len", type=int, default=192, help="prompt tokens")
    p.add_argument("--random-output-len", type=int, default=48, help="output tokens")
    p.add_argument("--kv-transport", default="tcp", choices=["ucx", "tcp"], help="KV transport")
    p.add_argument(
        "--out",
        default=str(ROOT / "benchmarks/results/tracing_overhead.json"),
        help="result JSON",
    )
    return p.parse_args()


class Stack:
    """One `pdserve serve` process group."""

    def __init__(self, mode: str, args: argparse.Namespace, otel: dict[str, str], tmp: Path):
        self.mode = mode
        self.port = free_port()
        self._state_file = tmp / f"{mode}-state.json"
        log = tmp / f"{mode}.log"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model]
        cmd += ["--port", str(self.port), "--kv-transport", args.kv_transport, *STACK_FLAGS]
        cmd += ["--state-file", str(self._state_file)]
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            # this process's OTEL_* settings do not leak into the untraced stack
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | otel,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,  # same session as the client: see serve_vs_vllm.start_vllm_server
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.pids: list[int] = []

    def wait_ready(self) -> None:
        wait_healthy(f"{self.base_url}/health", self.proc, timeout_s=300)
        deadline = time.monotonic() + 30
        while not self._state_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.pids = [p["pid"] for p in json.loads(self._state_file.read_text())]

    def cpu_s(self) -> float:
        """CPU seconds used so far by the gateway and the nodes (user + system)."""
        return sum(_process_cpu_s(pid) for pid in self.pids)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _process_cpu_s(pid: int) -> float:
    # /proc/PID/stat: utime and stime are fields 14 and 15, after the parenthesised name
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(stack: Stack, args: argparse.Namespace, num_prompts: int, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", stack.base_url]
    cmd += ["--dataset", "random", "--num-prompts", str(num_prompts), "--seed", str(seed)]
    cmd += ["--random-input-len", str(args.random_input_len)]
    cmd += ["--random-output-len", str(args.random_output_len)]
    cmd += ["--max-concurrency", str(args.max_concurrency), "--tokenizer", args.model]
    cmd += ["--result-file", str(out), "--disable-tqdm", "--label", stack.mode]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    if result["failed"]:
        raise RuntimeError(f"{stack.mode}: {result['failed']} requests failed")
    return result


def timed_bench(stack: Stack, args: argparse.Namespace, repeat: int, out: Path) -> dict:
    """One timed run, with the stack's CPU seconds per 1000 output tokens added."""
    cpu_before = stack.cpu_s()
    result = bench(stack, args, args.num_prompts, repeat, out)
    cpu_s = stack.cpu_s() - cpu_before
    result["stack_cpu_s_per_1k_output_tokens"] = 1000 * cpu_s / result["total_output_tokens"]
    return result


def run(args: argparse.Namespace, tmp: Path, receiver: OtlpReceiver) -> dict:
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    stacks = {"off": Stack("off", args, {}, tmp), "on": Stack("on", args, traced, tmp)}
    try:
        for stack in stacks.values():
            stack.wait_ready()
        for mode, stack in stacks.items():  # warm-up: first-touch of the KV cache, lazy init
            bench(stack, args, 8, 99, tmp / f"{mode}-warmup.json")
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                result = timed_bench(stacks[mode], args, repeat, tmp / "run.json")
                logger.info(
                    "repeat %d %-3s: %.1f output tok/s, %.3f stack CPU s per 1k tokens",
                    repeat,
                    mode,
                    result["output_throughput"],
                    result["stack_cpu_s_per_1k_output_tokens"],
                )
                runs[mode].append(result)
        return runs
    finally:
        for stack in stacks.values():
            stack.stop()


def summarize(
    runs: dict[str, list[dict]], receiver: OtlpReceiver, args: argparse.Namespace
) -> dict:
    def medians(key: str) -> dict[str, float]:
        return {mode: statistics.median(r[key] for r in runs[mode]) for mode in MODES}

    throughput = medians("output_throughput")
    cpu = medians("stack_cpu_s_per_1k_output_tokens")
    # Each repeat ran both modes back to back: their ratio cancels slow drifts of the machine.
    paired = [
        1.0 - on["output_throughput"] / off["output_throughput"]
        for on, off in zip(runs["on"], runs["off"], strict=True)
    ]
    return {
        "what": "output tokens/s of pdserve serve with OpenTelemetry tracing on vs off",
        "overhead_fraction": 1.0 - throughput["on"] / throughput["off"],
        "paired_overhead_fraction_median": statistics.median(paired),
        "paired_overhead_fractions": paired,
        "target_fraction": 0.03,
        "median_stack_cpu_s_per_1k_output_tokens": cpu,
        "cpu_overhead_fraction": cpu["on"] / cpu["off"] - 1.0,
        "median_output_throughput": throughput,
        "median_ttft_ms": medians("median_ttft_ms"),
        "median_itl_ms": medians("median_itl_ms"),
        "runs_output_throughput": {m: [r["output_throughput"] for r in runs[m]] for m in MODES},
        "runs_stack_cpu_s_per_1k_output_tokens": {
            m: [r["stack_cpu_s_per_1k_output_tokens"] for r in runs[m]] for m in MODES
        },
        "otlp_exports_received": receiver.num_exports,
        "otlp_bytes_received": receiver.num_bytes,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args()
    receiver = OtlpReceiver(keep_spans=False).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = run(args, Path(tmp), receiver)
    finally:
        receiver.stop()
    result = summarize(runs, receiver, args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    t = result["median_output_throughput"]
    logger.info(
        "tracing off %.1f tok/s, on %.1f tok/s (medians): throughput overhead %.1f%%, median of "
        "paired runs %.1f%%; stack CPU per token +%.1f%% (%d OTLP exports, %d bytes)",
        t["off"],
        t["on"],
        100 * result["overhead_fraction"],
        100 * result["paired_overhead_fraction_median"],
        100 * result["cpu_overhead_fraction"],
        result["otlp_exports_received"],
        result["otlp_bytes_received"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
