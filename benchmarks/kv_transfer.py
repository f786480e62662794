"""KV transfer bandwidth and per-request latency: UCX (ucxx) vs TCP, sender and receiver in
separate processes on 127.0.0.1.

    .venv/bin/python benchmarks/kv_transfer.py            # the default run (~1 min)
    .venv/bin/python benchmarks/kv_transfer.py --transports tcp --repeats 5 --requests 20
    .venv/bin/python benchmarks/kv_transfer.py --help

What it measures, for every configuration (TCP, and UCX once per --ucx-progress-modes):
  * bandwidth: one message of each --sizes-kib payload per transfer; GB/s = bytes / (time
    from the sender's send() call to the receiver's wait() returning), median of --repeats
    after --warmup transfers. The receiver's on_blocks copies every payload into a
    preallocated "KV cache" array, as the decode node's scatter would;
  * request latency: a 256-token prompt of the `small` model (8 layers, 4 KV heads, head_dim
    64, block_size 16: 16 blocks of 256 KiB = 4 MiB in float32, 2 MiB in bfloat16) sent as
    --messages-per-request concurrent messages; median and p99 over --requests;
  * CPU: cores used by each process during the bandwidth phase, and by each process while
    idle for --idle-seconds with the connection open (the receiver has a receive posted).
Both processes read time.perf_counter() (CLOCK_MONOTONIC, shared by all processes on Linux),
so "send() called" and "wait() returned" are compared on one clock.

UCX progress modes: "thread" is the transport's default (progress thread + Python futures);
"thread-nofuture" is ucxx's own default (progress thread, requests awaited by yielding);
"polling" and "blocking" progress the worker from the event loop. Each runs in fresh
processes (ucxx is initialised once per process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import astuple, dataclass
from importlib import metadata, util
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

# Spawned children re-import this file; kvtransfer is a top-level package of the repository.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

logger = logging.getLogger("kv_transfer_bench")

SMALL_MODEL = ("small", 8, 4, 64, 16)  # model, num_layers, num_kv_heads, head_dim, block_size
REQUEST_BLOCKS = 16  # a 256-token prompt at block_size 16
UCX_MODES = {  # name -> (UCXPY_PROGRESS_MODE, UCXPY_ENABLE_PYTHON_FUTURE or None = default)
    "thread": ("thread", None),
    "thread-nofuture": ("thread", "0"),
    "polling": ("polling", None),
    "blocking": ("blocking", None),
}
CHILD_DEADLINE_S = 90.0


@dataclass(frozen=True)
class Config:
    """One measured setup and the workload it runs."""

    transport: str
    progress_mode: str | None
    sizes_kib: tuple[int, ...]
    repeats: int
    warmup: int
    requests: int
    messages_per_request: int
    idle_seconds: float

    @property
    def name(self) -> str:
        return self.transport if self.progress_mode is None else f"ucx/{self.progress_mode}"


def layout(dtype: str) -> Any:
    from pdserve.kvtransfer.wire import LayoutSignature

    model, num_layers, num_kv_heads, head_dim, block_size = SMALL_MODEL
    return LayoutSignature(model, dtype, num_layers, num_kv_heads, head_dim, block_size)


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def configure_child(config: Config) -> None:
    """Environment that must be set before ucxx is imported or initialised."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if config.progress_mode is not None:
        mode, python_future = UCX_MODES[config.progress_mode]
        os.environ["UCXPY_PROGRESS_MODE"] = mode
        if python_future is not None:
            os.environ["UCXPY_ENABLE_PYTHON_FUTURE"] = python_future


# -- receiver process -------------------------------------------------------------------------


def receiver_process(ctrl: Connection, config: Config) -> None:
    configure_child(config)
    asyncio.run(asyncio.wait_for(serve_commands(ctrl, config), CHILD_DEADLINE_S))


async def serve_commands(ctrl: Connection, config: Config) -> None:
    """Obey the sender's commands until "stop": expect a transfer, report CPU, idle."""
    from pdserve.kvtransfer.transport import make_receiver
    from pdserve.kvtransfer.wire import LayoutSignature

    receiver = make_receiver(config.transport)
    await receiver.start()
    kv_cache = np.empty(max(config.sizes_kib) * 1024, dtype=np.uint8)

    def on_blocks(header: Any, payload: np.ndarray) -> None:
        start = header.first_block * header.layout.block_bytes
        kv_cache[start : start + payload.nbytes] = payload

    ctrl.send(receiver.address)
    try:
        while True:
            command, *args = await asyncio.to_thread(ctrl.recv)
            if command == "expect":
                transfer_id, layout_fields, num_blocks = args
                lay = LayoutSignature(*layout_fields)
                token = receiver.expect(transfer_id, lay, num_blocks, on_blocks)
                ctrl.send(("ready", token))  # a transfer's messages carry the token it issued
                stats = await receiver.wait(transfer_id, timeout_s=30)
                ctrl.send((time.perf_counter(), stats.bytes))
            elif command == "cpu":
                ctrl.send(cpu_seconds())
            elif command == "idle":
                before = cpu_seconds()
                await asyncio.sleep(args[0])
                ctrl.send(cpu_seconds() - before)
            else:
                break
    finally:
        await receiver.close()


# -- sender process ---------------------------------------------------------------------------


def sender_process(ctrl: Connection, config: Config, results: Any) -> None:
    configure_child(config)
    try:
        report = asyncio.run(asyncio.wait_for(drive(ctrl, config), CHILD_DEADLINE_S))
    except Exception as e:  # the parent reports it; a traceback in a child is easy to miss
        logger.exception("%s failed", config.name)
        report = {"error": repr(e)}
    results.put(report)


class Driver:
    """Runs transfers against the receiver process, timing each on the shared clock."""

    def __init__(self, ctrl: Connection, sender: Any, address: str) -> None:
        self.ctrl = ctrl
        self.sender = sender
        self.address = address
        self.count = 0

    async def ask(self, *command: Any) -> Any:
        self.ctrl.send(command)
        return await asyncio.to_thread(self.ctrl.recv)

    async def transfer(self, lay: Any, data: np.ndarray, num_messages: int) -> float:
        """Push data (whole blocks of lay) as num_messages concurrent messages; returns the
        seconds from the first send() call to the receiver's wait() returning."""
        from pdserve.kvtransfer.wire import TransferHeader

        self.count += 1
        transfer_id = f"bench-{self.count}"
        num_blocks = data.nbytes // lay.block_bytes
        answer, token = await self.ask("expect", transfer_id, astuple(lay), num_blocks)
        assert answer == "ready"
        per_message = num_blocks // num_messages
        sends = []
        for first in range(0, num_blocks, per_message):
            n = min(per_message, num_blocks - first)
            header = TransferHeader(transfer_id, lay, first, n, n * lay.block_bytes, token=token)
            chunk = data[first * lay.block_bytes : (first + n) * lay.block_bytes]
            sends.append((header, chunk))
        started = time.perf_counter()
        await asyncio.gather(*(self.sender.send(self.address, h, p) for h, p in sends))
        finished, received_bytes = await asyncio.to_thread(self.ctrl.recv)
        assert received_bytes == data.nbytes
        return finished - started


async def drive(ctrl: Connection, config: Config) -> dict[str, Any]:
    from pdserve.kvtransfer.transport import make_sender

    address = await asyncio.to_thread(ctrl.recv)
    sender = make_sender(config.transport)
    driver = Driver(ctrl, sender, address)
    data = np.random.default_rng(0).integers(0, 256, max(config.sizes_kib) * 1024, np.uint8)
    try:
        report = {"config": config.name, **await measure_bandwidth(driver, config, data)}
        report["latency"] = await measure_latency(driver, config, data)
        report["idle_cpu_cores"] = await measure_idle(driver, config)
        report["ucx_version"] = ucx_version() if config.progress_mode else None
    finally:
        ctrl.send(("stop",))
        await sender.close()
    return report


async def measure_bandwidth(driver: Driver, config: Config, data: np.ndarray) -> dict[str, Any]:
    lay = layout("float32")
    bandwidth = {}
    sender_cpu, receiver_cpu, wall = cpu_seconds(), await driver.ask("cpu"), time.perf_counter()
    for size_kib in config.sizes_kib:
        payload = data[: size_kib * 1024]
        for _ in range(config.warmup):
            await driver.transfer(lay, payload, 1)
        seconds = [await driver.transfer(lay, payload, 1) for _ in range(config.repeats)]
        bandwidth[str(size_kib)] = {
            "median_gbps": payload.nbytes / float(np.median(seconds)) / 1e9,
            "max_gbps": payload.nbytes / min(seconds) / 1e9,
        }
    wall = time.perf_counter() - wall
    receiver_cpu = await driver.ask("cpu") - receiver_cpu
    cpu = {"sender": (cpu_seconds() - sender_cpu) / wall, "receiver": receiver_cpu / wall}
    return {"bandwidth": bandwidth, "bandwidth_phase_cpu_cores": cpu}


async def measure_latency(driver: Driver, config: Config, data: np.ndarray) -> dict[str, Any]:
    latency = {}
    for dtype in ("float32", "bfloat16"):
        lay = layout(dtype)
        request = data[: REQUEST_BLOCKS * lay.block_bytes]
        for _ in range(config.warmup):
            await driver.transfer(lay, request, config.messages_per_request)
        ms = [
            1e3 * await driver.transfer(lay, request, config.messages_per_request)
            for _ in range(config.requests)
        ]
        latency[dtype] = {
            "request_bytes": request.nbytes,
            "median_ms": float(np.median(ms)),
            "p99_ms": float(np.percentile(ms, 99)),
        }
    return latency


async def measure_idle(driver: Driver, config: Config) -> dict[str, float]:
    before = cpu_seconds()
    receiver_cpu = await driver.ask("idle", config.idle_seconds)
    sender_cpu = cpu_seconds() - before
    return {
        "receiver": receiver_cpu / config.idle_seconds,
        "sender": sender_cpu / config.idle_seconds,
    }


def ucx_version() -> str:
    import ucxx

    return ".".join(map(str, ucxx.get_ucx_version()))


# -- parent -----------------------------------------------------------------------------------


def run_config(config: Config) -> dict[str, Any]:
    """Spawn the receiver and sender processes for one configuration and collect the report."""
    ctx = mp.get_context("spawn")
    receiver_end, sender_end = ctx.Pipe()
    results = ctx.Queue()
    receiver = ctx.Process(target=receiver_process, args=(receiver_end, config), daemon=True)
    sender = ctx.Process(target=sender_process, args=(sender_end, config, results), daemon=True)
    receiver.start()
    sender.start()
    try:
        report = results.get(timeout=CHILD_DEADLINE_S + 15)
    except Exception as e:
        report = {"config": config.name, "error": f"no report: {e!r}"}
    for process in (sender, receiver):
        process.join(timeout=10)
        if process.is_alive():
            logger.warning("%s: terminating a stuck child", config.name)
            process.terminate()
            process.join(timeout=5)
    report["config"] = config.name
    return report


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("numpy", "ucxx-cu12"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "packages": versions,
        "loadavg_at_start": os.getloadavg(),
    }


def ratios(reports: list[dict[str, Any]], ucx_name: str) -> dict[str, Any]:
    """UCX (the default progress mode) over TCP: >1 means UCX is faster (bandwidth) or
    slower (latency, as ms)."""
    by_name = {r["config"]: r for r in reports if "error" not in r}
    ucx, tcp = by_name.get(ucx_name), by_name.get("tcp")
    if ucx is None or tcp is None:
        return {}
    return {
        "bandwidth_ucx_over_tcp": {
            size: ucx["bandwidth"][size]["median_gbps"] / tcp["bandwidth"][size]["median_gbps"]
            for size in tcp["bandwidth"]
        },
        "latency_median_ucx_over_tcp": {
            dtype: ucx["latency"][dtype]["median_ms"] / tcp["latency"][dtype]["median_ms"]
            for dtype in tcp["latency"]
        },
    }


def markdown(reports: list[dict[str, Any]], sizes_kib: tuple[int, ...]) -> str:
    size_cols = [f"{s // 1024} MiB" if s >= 1024 else f"{s} KiB" for s in sizes_kib]
    head = ["config", *(f"GB/s {c}" for c in size_cols)]
    head += ["f32 4 MiB req ms p50/p99", "bf16 2 MiB req ms p50/p99", "idle CPU recv/send"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error']} |")
            continue
        row = [r["config"], *(f"{r['bandwidth'][str(s)]['median_gbps']:.2f}" for s in sizes_kib)]
        for dtype in ("float32", "bfloat16"):
            lat = r["latency"][dtype]
            row.append(f"{lat['median_ms']:.2f} / {lat['p99_ms']:.2f}")
        idle = r["idle_cpu_cores"]
        row.append(f"{100 * idle['receiver']:.0f}% / {100 * idle['sender']:.0f}%")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ucx_available = util.find_spec("ucxx") is not None
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=["ucx", "tcp"],
        default=["ucx", "tcp"] if ucx_available else ["tcp"],
        help="transports to measure (default: ucx if ucxx is installed, and tcp)",
    )
    parser.add_argument(
        "--ucx-progress-modes",
        nargs="+",
        choices=list(UCX_MODES),
        default=["thread", "thread-nofuture", "polling", "blocking"],
        help="UCX progress modes, each in fresh processes; the first is the one compared "
        "with TCP in the ratios (default: all four, 'thread' being the transport's default)",
    )
    parser.add_argument(
        "--sizes-kib",
        nargs="+",
        type=int,
        default=[256, 4096, 32768],
        help="bandwidth payload sizes in KiB, multiples of 256 (one small-model float32 "
        "block); default: 256 4096 32768",
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed transfers per payload size (median)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed transfers before each measurement"
    )
    parser.add_argument(
        "--requests", type=int, default=60, help="timed requests per dtype for the latency"
    )
    parser.add_argument(
        "--messages-per-request",
        type=int,
        default=4,
        help="messages one request's 16 blocks are split into, sent concurrently (default 4)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=2.0,
        help="how long each process measures its CPU use while the connection is idle",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results" / "kv_transfer.json",
        help="where the JSON results go (default: benchmarks/results/kv_transfer.json)",
    )
    args = parser.parse_args()
    if any(size % 256 for size in args.sizes_kib):
        parser.error("--sizes-kib must be multiples of 256 (whole small-model blocks)")
    if REQUEST_BLOCKS % args.messages_per_request:
        parser.error(f"--messages-per-request must divide {REQUEST_BLOCKS}")
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    workload = dict(
        sizes_kib=tuple(args.sizes_kib),
        repeats=args.repeats,
        warmup=args.warmup,
        requests=args.requests,
        messages_per_request=args.messages_per_request,
        idle_seconds=args.idle_seconds,
    )
    configs = [
        Config(transport, mode, **workload)
        for transport in args.transports
        for mode in (args.ucx_progress_modes if transport == "ucx" else [None])
    ]
    info = machine_info()
    reports = []
    for config in configs:
        started = time.perf_counter()
        reports.append(run_config(config))
        logger.info("%s done in %.1fs", config.name, time.perf_counter() - started)
    info["loadavg_at_end"] = os.getloadavg()
    result = {
        "machine": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": reports,
        "ratios_compare": f"ucx/{args.ucx_progress_modes[0]} over tcp",
        "ratios": ratios(reports, f"ucx/{args.ucx_progress_modes[0]}"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(reports, tuple(args.sizes_kib)))
    for key, values in result["ratios"].items():
        print(f"{key}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
