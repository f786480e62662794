"""The stacks deploy/ describes, run as local processes on 127.0.0.1, without a container runtime.

A compose service or a Kubernetes Deployment becomes one `pdserve ...` process running exactly
what its container would: the image's ENTRYPOINT plus the command (compose) or args (Kubernetes,
with $(VAR) expanded as the kubelet does), its environment and its ports, except that

- service names become `localhost` (so the gateway's DNS discovery still resolves them) and
  bind addresses 127.0.0.1;
- every (workload, container port) gets a free local port, used wherever that port is meant:
  the workload's own flags, other workloads' host:port references, healthchecks and probes;
- the model directory becomes the tiny test model;
- the image's source tree (/opt/pdserve) is this checkout, its python this one.

Everything else is passed as written, so a typo in a flag, a port, a service name or a
healthcheck fails the tests that use this.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from tests.integration.procs import Proc, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE_SOURCE = "/opt/pdserve"
"""Where the images keep the source tree (WORKDIR of their build stage)."""
PORT_FLAGS = {"--port", "--grpc-port", "--metrics-port", "--kv-port"}
HOST_FLAGS = {"--host", "--metrics-host", "--kv-host"}
_SELF_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0"}
_ADDRESS = re.compile(r"(?P<lead>^|//|dns:///|,)(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")
_K8S_VAR = re.compile(r"\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def image_entrypoint(dockerfile: Path) -> list[str]:
    """The final stage's ENTRYPOINT (exec form) of a Dockerfile."""
    lines = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    assert lines, f"{dockerfile} has no ENTRYPOINT"
    return json.loads(lines[-1].removeprefix("ENTRYPOINT").strip())


def healthcheck_module() -> ModuleType:
    """deploy/docker/healthcheck.py, the images' probe, imported from the checkout."""
    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "docker/healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expand_k8s_vars(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command and args: defined variables are replaced,
    undefined ones left as written, $$ is a literal $."""

    def one(match: re.Match[str]) -> str:
        name = match.group("name")
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _K8S_VAR.sub(one, text)


@dataclass
class Loopback:
    """The container network mapped onto 127.0.0.1 (see the module docstring)."""

    services: dict[str, tuple[str, dict[int, int]]]
    """Service name -> (the workload behind it, service port -> container port)."""
    model_dir: str
    model_paths: set[str] = field(default_factory=set)
    """The model directories the workloads name (all mapped to model_dir)."""
    _ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def reserve(self, workload: str, container_port: int, local_port: int) -> None:
        """A port already open locally (a test double of a non-pdserve service)."""
        self._ports[(workload, container_port)] = local_port

    def port(self, workload: str, container_port: int) -> int:
        key = (workload, container_port)
        if key not in self._ports:
            self._ports[key] = free_port()
        return self._ports[key]

    def service_port(self, service: str, port: int) -> int:
        """The local port behind a service's port."""
        workload, port_map = self.services[service]
        return self.port(workload, port_map.get(port, port))

    def value(self, workload: str, text: str) -> str:
        """text with every host:port in it mapped: a service's to localhost:<its local port>,
        the workload's own (127.0.0.1, localhost, 0.0.0.0) to 127.0.0.1:<local port>."""

        def one(match: re.Match[str]) -> str:
            host, port = match.group("host"), int(match.group("port"))
            if host in self.services:
                return f"{match.group('lead')}localhost:{self.service_port(host, port)}"
            if host in _SELF_HOSTS:
                return f"{match.group('lead')}127.0.0.1:{self.port(workload, port)}"
            return match.group(0)

        return _ADDRESS.sub(one, text)

    def args(self, workload: str, argv: list[str]) -> list[str]:
        """A pdserve command line with its ports, hosts, addresses and model mapped."""
        out = []
        for i, arg in enumerate(argv):
            if arg.startswith("--") and "=" in arg:
                flag, value = arg.split("=", 1)
                out.append(f"{flag}={self._flag_value(workload, flag, value)}")
            else:
                out.append(self._flag_value(workload, argv[i - 1] if i else "", arg))
        return out

    def _flag_value(self, workload: str, flag: str, value: str) -> str:
        if flag in PORT_FLAGS:
            return str(self.port(workload, int(value))) if int(value) else value
        if flag in HOST_FLAGS:
            return "127.0.0.1"
        if flag == "--model":
            self.model_paths.add(value)
            return self.model_dir
        return self.value(workload, value)

    def assert_mapped(self, argv: list[str]) -> None:
        """Nothing of the container network is left in a mapped command line."""
        for arg in argv:
            assert "0.0.0.0" not in arg, arg
            for service in self.services:
                assert not re.search(rf"(^|[/,=]){re.escape(service)}:\d", arg), arg


def local_command(workload: str, argv: list[str], loopback: Loopback) -> list[str]:
    """A container's health command, run here: its python and source tree are the checkout's."""
    out = []
    for arg in argv:
        if arg == "python":
            out.append(sys.executable)
        elif arg.startswith(IMAGE_SOURCE + "/"):
            out.append(str(ROOT / arg.removeprefix(IMAGE_SOURCE + "/")))
        else:
            out.append(loopback.value(workload, arg))
    return out


def run_check(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wait_until(check: Callable[[], bool], procs: list[Proc], timeout_s: float, what: str) -> None:
    """Poll check until it holds; fail at once if one of procs exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if not proc.alive():
                raise AssertionError(
                    f"{proc.argv[0]} exited while waiting for {what}:\n{proc.log()}"
                )
        if check():
            return
        time.sleep(0.25)
    logs = "\n".join(f"--- {p.argv[0]}:\n{p.log()}" for p in procs)
    raise AssertionError(f"{what} not within {timeout_s} s\n{logs}")


class LocalStack:
    """The processes of one described stack; stop() ends them all (SIGTERM: they drain)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, Proc] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(argv, self.log_dir / f"{name}.log", env=env)
        self.procs[name] = proc
        return proc

    def stop(self) -> dict[str, int | None]:
        """Stop every process (the gateway first, as its clients would see); exit codes."""
        codes = {}
        for name in sorted(self.procs, key=lambda n: "gateway" not in n):
            codes[name] = self.procs[name].stop(timeout_s=40)
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- {name}:\n{proc.log()}" for name, proc in self.procs.items())


@contextlib.contextmanager
def local_stack(log_dir: Path) -> Iterator[LocalStack]:
    stack = LocalStack(log_dir)
    try:
        yield stack
    finally:
        stack.stop()


def metric_names(exposition: str) -> set[str]:
    """The series names of a Prometheus text exposition."""
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
