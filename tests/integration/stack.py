"""A whole `pdserve serve` stack on 127.0.0.1 for integration tests."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.kvtransfer.transport import available_transports
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.integration.procs import Proc, free_port

BLOCK = 16
STACK_FLAGS = [
    "--block-size", str(BLOCK), "--num-blocks", "512", "--dtype", "float32",
    "--num-threads", "1", "--remote-prefill-min-tokens", "16", "--max-model-len", "512",
]  # fmt: skip


SMOLLM2_NAMES = ("smollm2-135m-instruct", "other-alias")
"""The served model names of the shared SmolLM2 stack (conftest.smollm2_stack)."""


@dataclass
class Stack:
    proc: Proc
    base_url: str
    grpc_address: str
    model: str
    nodes: dict[str, dict]
    """name ("prefill-0", "decode-1", ...) -> {"address", "pid"} from serve's state file."""

    def node_addresses(self, role: str) -> list[str]:
        return [n["address"] for name, n in self.nodes.items() if name.startswith(role)]

    def load(self, name: str) -> node_pb2.NodeLoad:
        with grpc.insecure_channel(self.nodes[name]["address"]) as channel:
            if name.startswith("prefill"):
                stub = node_pb2_grpc.PrefillNodeStub(channel)
            else:
                stub = node_pb2_grpc.DecodeNodeStub(channel)
            return stub.GetLoad(node_pb2.GetLoadRequest(), timeout=5.0)

    def node_counter(self, name: str, metric: str) -> float:
        """A counter from node name's Prometheus /metrics, summed over its series."""
        address = self.nodes[name]["metrics_address"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(metric))

    def wait_all_blocks_free(self, timeout_s: float = 20.0, skip: tuple[str, ...] = ()) -> None:
        """Every live node's pool back to fully free (cached blocks count as free)."""
        deadline = time.monotonic() + timeout_s
        pending: list[str] = []
        while time.monotonic() < deadline:
            pending = []
            for name in self.nodes:
                if name == "gateway" or name in skip:
                    continue
                load = self.load(name)
                if load.num_free_blocks != load.num_total_blocks or load.num_running:
                    pending.append(f"{name}: {load.num_free_blocks}/{load.num_total_blocks} free")
            if not pending:
                return
            time.sleep(0.1)
        raise AssertionError(f"blocks still held: {pending}")


def transport() -> str:
    return "ucx" if "ucx" in available_transports() else "tcp"


def start_stack(
    model: str, log_dir: Path, num_prefill=2, num_decode=2, extra=(), env=None
) -> Stack:
    port, grpc_port = free_port(), free_port()
    state = log_dir / "state.json"
    argv = ["serve", "--model", model, "--num-prefill", str(num_prefill)]
    argv += ["--num-decode", str(num_decode), "--kv-transport", transport(), *STACK_FLAGS]
    argv += ["--port", str(port), "--grpc-port", str(grpc_port), "--state-file", str(state)]
    proc = Proc([*argv, *extra], log_dir / "serve.log", env=env)
    deadline = time.monotonic() + 240
    while not state.exists():
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"pdserve serve did not come up:\n{proc.log()}")
        time.sleep(0.25)
    nodes = {n["name"]: n for n in json.loads(state.read_text())}
    return Stack(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", model, nodes)


@contextmanager
def running_stack(model: str, log_dir: Path, *args, **kwargs) -> Iterator[Stack]:
    """start_stack, then stop it on the way out; serve must exit cleanly (code 0)."""
    stack = start_stack(model, log_dir, *args, **kwargs)
    try:
        yield stack
    finally:
        code = stack.proc.stop(timeout_s=40)
        assert code == 0, f"pdserve serve exited with {code}:\n{stack.proc.log()}"
