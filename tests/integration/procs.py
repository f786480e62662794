"""Start pdserve processes on 127.0.0.1 for integration tests, and always stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One `pdserve ...` process; its output goes to a log file shown when a test fails."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *argv],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # its own process group: stop() reaches its children too
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL after timeout_s; returns the exit code."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._ensure_group_gone()
        self._log.close()
        return self.process.returncode

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def _ensure_group_gone(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_grpc_serving(address: str, proc: Proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"process exited during startup:\n{proc.log()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout_s} s:\n{proc.log()}")
