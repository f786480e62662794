"""Container health probe of a pdserve process: exit 0 when it serves, 1 when it does not.

    python healthcheck.py grpc://127.0.0.1:50061     # grpc.health.v1 Check: SERVING?
    python healthcheck.py http://127.0.0.1:8000/health  # HTTP 200?
    python healthcheck.py                            # what the container's pdserve runs

Without a target it reads the command line of the container's pdserve process (PID 1, or the
first process running `pdserve`) and probes what that role serves: the gateway's /health (200
when every tier it routes to serves), a node's gRPC health service (NOT_SERVING while it
drains), `pdserve serve`'s gateway. Other commands (make-model, bench) have nothing to probe
and count as healthy. Standard library plus grpcio, which the image has anyway.

TLS: gRPC probes use mutual TLS when PDSERVE_TLS_CERT, _KEY and _CA are set (the container's
environment, which a health check inherits: docker-compose.tls.yml sets them); HTTP probes go
over https (certificate not verified: it is this container's own server) when
PDSERVE_SSL_CERTFILE is set or the command has --ssl-certfile.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

TIMEOUT_S = 3.0
_ROLE_PORTS = {"gateway": 8000, "serve": 8000, "prefill": 50071, "decode": 50061}
"""The roles' default ports (pdserve <role> --help), when the command line names none."""
_WILDCARDS = ("0.0.0.0", "::", "")


def flag(argv: Sequence[str], name: str) -> str | None:
    """The value of --name in argv ("--name v" or "--name=v"); None when absent."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def target_from_argv(argv: Sequence[str]) -> str | None:
    """The probe target of a pdserve command line (its arguments after the program), or None
    when the command serves nothing."""
    role = next((a for a in argv if not a.startswith("-") and a in _ROLE_PORTS), None)
    if role is None:
        return None
    host = flag(argv, "--host") or "127.0.0.1"
    host = "127.0.0.1" if host in _WILDCARDS else host
    port = flag(argv, "--port") or str(_ROLE_PORTS[role])
    if role in ("gateway", "serve"):
        tls = flag(argv, "--ssl-certfile") or os.environ.get("PDSERVE_SSL_CERTFILE")
        return f"{'https' if tls else 'http'}://{host}:{port}/health"
    return f"grpc://{host}:{port}"


def _pdserve_argv() -> list[str] | None:
    """The arguments of the container's pdserve process: PID 1 first, then any other."""
    pids = ["1"] + sorted((p for p in os.listdir("/proc") if p.isdigit() and p != "1"), key=int)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        for i, arg in enumerate(argv):
            if os.path.basename(arg) == "pdserve" or arg == "pdserve.cli":
                return argv[i + 1 :]
    return None


def probe_http(url: str) -> bool:
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def probe_grpc(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(grpc, address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _channel(grpc, address: str):  # noqa: ANN001, ANN202 - grpc is imported lazily
    paths = [os.environ.get(f"PDSERVE_TLS_{name}") for name in ("CERT", "KEY", "CA")]
    if not all(paths):
        return grpc.insecure_channel(address)
    cert, key, ca = (open(path, "rb").read() for path in paths)  # type: ignore[arg-type]
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    name = os.environ.get("PDSERVE_TLS_SERVER_NAME")
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(address, credentials, options)


def probe(target: str) -> bool:
    if target.startswith("grpc://"):
        return probe_grpc(target.removeprefix("grpc://"))
    if target.startswith(("http://", "https://")):
        return probe_http(target)
    raise ValueError(f"unknown probe target {target!r}: grpc://host:port or http://...")


def main(argv: Sequence[str]) -> int:
    if argv:
        target: str | None = argv[0]
    else:
        command = _pdserve_argv()
        if command is None:
            print("healthcheck: no pdserve process found", file=sys.stderr)
            return 1
        target = target_from_argv(command)
        if target is None:
            return 0
    healthy = probe(target)
    if not healthy:
        print(f"healthcheck: {target} is not serving", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
