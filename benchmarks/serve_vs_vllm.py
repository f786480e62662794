"""Online serving load generators side by side: `pdserve bench serve` vs `vllm bench serve`, same
server, same workload.

    .venv/bin/python benchmarks/serve_vs_vllm.py --model models/tiny       # starts a vLLM server
    .venv/bin/python benchmarks/serve_vs_vllm.py --base-url http://127.0.0.1:8000 \\
        --tokenizer models/tiny --only-pdserve-client                      # an already-running one

Without --base-url it starts vLLM's OpenAI server (CPU build, `--vllm-dir`) on 127.0.0.1 for
--model and waits for /health; then, on that server or the --base-url one, it makes one untimed
warm-up run of the whole workload (--no-warmup-run to skip it: the first run after start-up is
slower), runs the clients of --clients one after the other, and always kills the started
server's process group at the end. Workload (vLLM's `random` dataset flags): --input-len prompt
tokens, --output-len generated tokens (ignore_eos, greedy), --num-prompts requests, at most
--max-concurrency in flight, --request-rate inf. Both clients run on this machine's cores next to
the server: their own CPU use (ours ~1.7x vLLM's aiohttp client per SSE event) slows the server
a little.

Results: benchmarks/results/serve_vs_vllm_TAG_{pdserve,vllm}[_N]_client.json (each run's own
result file) and serve_vs_vllm_TAG.json (the settings and the key numbers side by side).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

logger = logging.getLogger("serve_vs_vllm")

KEY_NUMBERS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="models/tiny",
        help="HF model directory served by the vLLM server this script starts (default: "
        "%(default)s); with --base-url, the model name to request (default: /v1/models)",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory for the prompts (default: --model)"
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="benchmark this already-running server instead of starting vLLM's",
    )
    p.add_argument(
        "--only-pdserve-client",
        action="store_true",
        help="run only `pdserve bench serve` (e.g. against pdserve's own server): "
        "--clients pdserve",
    )
    p.add_argument(
        "--clients",
        default="pdserve,vllm",
        help="measured runs in order, comma-separated, names may repeat (a repeat uses the next "
        "seed so its prompts are not prefix-cached), e.g. pdserve,vllm,pdserve,vllm "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--warmup-run",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first an untimed run of the whole workload (pdserve client, other prompts), so "
        "that no measured run meets a cold server (default: on)",
    )
    p.add_argument("--tag", default=None, help="result file name part (default: model dir name)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    p.add_argument("--max-concurrency", type=int, default=16, help="in flight (default: 16)")
    p.add_argument("--request-rate", default="inf", help="requests/s (default: inf)")
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="each client's own untimed requests (copies of its first prompt) before its run "
        "(default: 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--vllm-dir", default="/work/peers/vllm", help="vLLM CPU install holding env.sh")
    p.add_argument(
        "--server-args",
        default="",
        help="extra flags for `vllm serve`, one shell-quoted string (default: none)",
    )
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=600.0,
        help="deadline for the started server's /health (default: 600)",
    )
    p.add_argument(
        "--client-timeout-s",
        type=float,
        default=900.0,
        help="deadline for each client run (default: 900)",
    )
    args = p.parse_args(argv)
    if args.only_pdserve_client:
        args.clients = "pdserve"
    if not set(args.clients.split(",")) <= {"pdserve", "vllm"}:
        p.error(f"--clients takes pdserve and vllm, got {args.clients!r}")
    return args


# -- the server -----------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env() -> dict[str, str]:
    """Our environment minus what would leak into vLLM's venv (its env.sh sets the rest)."""
    drop = ("OMP_NUM_THREADS", "PYTHONPATH", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop}


def vllm_command(vllm_dir: str, args: list[str]) -> list[str]:
    """`vllm ARGS` inside vLLM's venv (env.sh sourced)."""
    cli = Path(vllm_dir) / "vllm_cli.py"
    env_sh = Path(vllm_dir) / "env.sh"
    return [
        "bash",
        "-c",
        f"source {shlex.quote(str(env_sh))} && exec python {cli} {shlex.join(args)}",
    ]


def start_vllm_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    """vLLM's OpenAI server in a process group of its own (so it can be killed whole), but in
    this process's session. Every benchmark here starts its servers that way: Linux schedules
    each session as one group ("autogroup"), and with the server in a session of its own the
    load generator's session got so little of a core busy with the server that it waited up to
    1-3 s to run (a probe task's /proc/self/schedstat run delay on the decode node's core).
    Those waits showed up as ITL spikes of every stream at once: disaggregated pdserve's p99
    ITL was 230-364 ms with the stack in a session of its own, 50 ms in the same one."""
    serve = ["serve", args.model, "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    serve += shlex.split(args.server_args)
    logger.info("starting vLLM server on port %d (log: %s)", port, log_path)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            vllm_command(args.vllm_dir, serve),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_env(),
            process_group=0,
        )


def wait_for_health(base_url: str, proc: subprocess.Popen | None, timeout_s: float) -> float:
    """Poll GET /health until 200; raises if the server dies or the deadline passes.
    Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(base_url + "/health", timeout=5.0).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url}/health not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if still alive after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    logger.info("server stopped (exit code %s)", proc.returncode)


def served_model(base_url: str) -> str:
    """The first model id of GET /v1/models."""
    return httpx.get(base_url + "/v1/models", timeout=30.0).json()["data"][0]["id"]


# -- the clients ----------------------------------------------------------------------------------


def workload_flags(args: argparse.Namespace, base_url: str, model: str, seed: int) -> list[str]:
    """The flags both clients spell the same way."""
    return [
        "--base-url", base_url, "--backend", "openai", "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", args.tokenizer,
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--request-rate", str(args.request_rate), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--num-warmups", str(args.num_warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm",
    ]  # fmt: skip


def run_client(name: str, cmd: list[str], env: dict[str, str] | None, timeout_s: float) -> None:
    """Run one client to completion, its output passed through."""
    logger.info("running the %s client", name)
    start = time.monotonic()
    subprocess.run(cmd, check=True, timeout=timeout_s, env=env, cwd=REPO)
    logger.info("%s client done in %.1f s", name, time.monotonic() - start)


def run_pdserve_client(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pdserve.bench", "serve", *flags, "--dataset", "random"]
    cmd += ["--label", "pdserve-client", "--result-file", str(out)]
    run_client("pdserve", cmd, None, args.client_timeout_s)
    return json.loads(out.read_text())


def run_vllm_client(args: argparse.Namespace, flags: list[str], out: Path) -> dict[str, Any]:
    bench = ["bench", "serve", *flags, "--dataset-name", "random", "--label", "vllm-client"]
    bench += ["--save-result", "--save-detailed", "--result-dir", str(out.parent)]
    bench += ["--result-filename", out.name]
    run_client("vllm", vllm_command(args.vllm_dir, bench), vllm_env(), args.client_timeout_s)
    return json.loads(out.read_text())


# -- report ---------------------------------------------------------------------------------------


def key_numbers(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result.get(k) for k in KEY_NUMBERS}


def medians_by_client(numbers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per client, the median of each key number over its runs ("pdserve", "pdserve#2", ...):
    on a shared machine single runs differ by tens of percent, so compare medians."""
    by_client: dict[str, list[dict[str, Any]]] = {}
    for name, run in numbers.items():
        by_client.setdefault(name.split("#")[0], []).append(run)
    return {
        client: {k: statistics.median(run[k] for run in runs) for k in KEY_NUMBERS}
        for client, runs in by_client.items()
    }


def side_by_side(numbers: dict[str, dict[str, Any]]) -> str:
    """A table: one row per key number, one column per client, and pdserve / vllm."""
    names = list(numbers)
    lines = [
        f"{'':<26}" + "".join(f"{n:>16}" for n in names) + ("  ratio" if len(names) == 2 else "")
    ]
    for key in KEY_NUMBERS:
        values = [numbers[n].get(key) for n in names]
        cells = "".join(f"{v:>16.2f}" if isinstance(v, float) else f"{v!s:>16}" for v in values)
        ratio = ""
        if len(values) == 2 and all(isinstance(v, (int, float)) for v in values) and values[1]:
            ratio = f"  {values[0] / values[1]:.3f}"
        lines.append(f"{key:<26}{cells}{ratio}")
    return "\n".join(lines)


def run_clients(args: argparse.Namespace, base_url: str, tag: str) -> dict[str, dict[str, Any]]:
    """The optional untimed warm-up run, then the measured runs in --clients order.
    Returns each run's key numbers by run name ("pdserve", "vllm", "pdserve#2", ...)."""
    model = served_model(base_url) if args.base_url else args.model
    if args.warmup_run:
        # other prompts than every measured run's, so that none of them finds its prefix cached
        flags = workload_flags(args, base_url, model, seed=args.seed + 1000)
        run_pdserve_client(args, flags, Path(tempfile.mkdtemp()) / "warmup.json")
    numbers: dict[str, dict[str, Any]] = {}
    for client in args.clients.split(","):
        nth = sum(name.split("#")[0] == client for name in numbers) + 1
        name = client if nth == 1 else f"{client}#{nth}"
        out = RESULTS / f"serve_vs_vllm_{tag}_{name.replace('#', '_')}_client.json"
        flags = workload_flags(args, base_url, model, seed=args.seed + nth - 1)
        run = run_pdserve_client if client == "pdserve" else run_vllm_client
        numbers[name] = key_numbers(run(args, flags, out))
    return numbers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args.tokenizer = args.tokenizer or args.model
    tag = args.tag or Path(args.model).name
    RESULTS.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"settings": vars(args).copy()}
    if args.base_url:
        wait_for_health(args.base_url, None, args.startup_timeout_s)
        summary["server"] = args.base_url
        summary["key_numbers"] = run_clients(args, args.base_url, tag)
    else:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        log_path = Path(tempfile.mkdtemp(prefix="serve_vs_vllm_")) / "vllm_server.log"
        server = start_vllm_server(args, port, log_path)
        try:
            summary["server_startup_s"] = wait_for_health(base_url, server, args.startup_timeout_s)
            summary["server"] = f"vllm serve {args.model} {args.server_args}".strip()
            logger.info("server ready after %.1f s", summary["server_startup_s"])
            summary["key_numbers"] = run_clients(args, base_url, tag)
        except Exception:
            tail = log_path.read_text(errors="replace")[-3000:]
            logger.error("server log tail (%s):\n%s", log_path, tail)
            raise
        finally:
            stop_server(server)
    report = "\n" + side_by_side(summary["key_numbers"]) + "\n"
    if len(summary["key_numbers"]) > 2:
        summary["medians"] = medians_by_client(summary["key_numbers"])
        report += "\nmedians over runs:\n" + side_by_side(summary["medians"]) + "\n"
    (RESULTS / f"serve_vs_vllm_{tag}.json").write_text(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
