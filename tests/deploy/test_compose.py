"""deploy/docker-compose.yml (+ the GPU override): docker-compose accepts them, they describe a
scalable, ordered stack, and the stack they describe, run as local processes with their exact
commands (tests/deploy/described.py), answers a chat request with the prompt prefilled remotely,
is scraped where the Prometheus config says, and sends its traces where OTEL_* says."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from pdserve.cli import build_parser
from tests.deploy.described import (
    DEPLOY,
    LocalStack,
    Loopback,
    image_entrypoint,
    local_command,
    local_stack,
    run_check,
    wait_until,
)
from tests.observability.otlp_receiver import OtlpReceiver

COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
LONG_PROMPT = " ".join(["Tell me a long story about the sea, the ships and the sailors."] * 6)


def load(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def pdserve_services(compose: dict) -> dict[str, dict]:
    """The services that run the pdserve image."""
    return {
        name: s
        for name, s in compose["services"].items()
        if s.get("build", {}).get("dockerfile", "").startswith("deploy/docker/Dockerfile")
    }


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def compose_config(*files: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_IMAGE"}
    cmd = ["docker-compose", *(a for f in files for a in ("-f", str(f))), "config"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_files() -> None:
    base = yaml.safe_load(compose_config(COMPOSE))
    assert {"model", "prefill", "decode", "gateway", "prometheus", "grafana"} <= set(
        base["services"]
    )
    assert {"otel-collector", "jaeger"} <= set(base["services"])
    gpu = yaml.safe_load(compose_config(COMPOSE, COMPOSE_GPU))
    for name in ("model", "gateway", "prefill", "decode"):
        service = gpu["services"][name]
        assert service["image"] == "pdserve:cuda"
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    for name in ("prefill", "decode"):
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # The override changes images and devices only: the commands stay the base's.
    for name in ("prefill", "decode", "gateway"):
        assert gpu["services"][name]["command"] == base["services"][name]["command"]


def test_the_stack_is_ordered_scalable_and_drains() -> None:
    compose = load()
    services = compose["services"]
    pdserve = pdserve_services(compose)
    assert set(pdserve) == {"model", "prefill", "decode", "gateway"}
    job = services["model"]
    assert job["command"][0] == "make-model" and job["healthcheck"] == {"disable": True}
    for name in ("prefill", "decode"):
        s = services[name]
        # --scale: no fixed container name, no host port
        assert "container_name" not in s and "ports" not in s
        assert s["depends_on"]["model"] == {"condition": "service_completed_successfully"}
    for name in ("prefill", "decode"):
        assert services["gateway"]["depends_on"][name] == {"condition": "service_healthy"}
    assert services["grafana"]["depends_on"]["prometheus"] == {"condition": "service_healthy"}
    for name in ("prefill", "decode", "gateway"):
        s = services[name]
        assert s["healthcheck"]["test"][:3] == [
            "CMD",
            "python",
            "/opt/pdserve/deploy/docker/healthcheck.py",
        ]
        drain_s = float(flag(s["command"], "--drain-timeout-s"))
        assert float(s["stop_grace_period"].removesuffix("s")) > drain_s
        assert "entrypoint" not in s  # the image's: pdserve
    gateway = services["gateway"]["command"]
    assert (
        flag(gateway, "--decode-nodes") == f"decode:{flag(services['decode']['command'], '--port')}"
    )
    assert (
        flag(gateway, "--prefill-nodes")
        == f"prefill:{flag(services['prefill']['command'], '--port')}"
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_compose_scrape_config() -> None:
    config = DEPLOY / "prometheus/prometheus.compose.yml"
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mounted_configs_exist() -> None:
    for name, service in load()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts a missing {source}"
    grafana = DEPLOY / "grafana/provisioning"
    assert (grafana / "datasources/pdserve.yml").exists()
    assert (grafana / "dashboards/pdserve.yml").exists()


def _node_series_value(exposition: str, metric: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(metric + "{") or line.startswith(metric + " ")
    ]
    return sum(values)


def _start_in_order(services: dict, runners: list[str], loopback: Loopback, stack: LocalStack):
    """Start the runners as depends_on orders them, each waited for by its own healthcheck
    (the job and the non-pdserve services count as done: the test plays them)."""
    healthy: set[str] = set()
    while len(healthy) < len(runners):
        startable = [
            name
            for name in runners
            if name not in healthy
            and all(d in healthy or d not in runners for d in services[name].get("depends_on", {}))
        ]
        assert startable, f"depends_on cycle among {set(runners) - healthy}"
        for name in startable:
            argv = loopback.args(name, services[name]["command"])
            loopback.assert_mapped(argv)
            env = {k: loopback.value(name, v) for k, v in services[name]["environment"].items()}
            stack.start(name, argv, env)
        for name in startable:
            check = local_command(name, services[name]["healthcheck"]["test"][1:], loopback)
            wait_until(lambda c=check: run_check(c), list(stack.procs.values()), 120, name)
            healthy.add(name)


def _scrape_prometheus_targets(loopback: Loopback) -> dict[str, str]:
    """Every target of prometheus.compose.yml: service name -> its /metrics."""
    expositions = {}
    prometheus = yaml.safe_load((DEPLOY / "prometheus/prometheus.compose.yml").read_text())
    for job in prometheus["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                port = loopback.service_port(name, sd["port"])
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
                    expositions[name] = response.read().decode()
    return expositions


def test_the_described_stack_answers(tiny_llama: str, tmp_path: Path) -> None:
    services = load()["services"]
    assert image_entrypoint(DEPLOY / "docker/Dockerfile.cpu") == ["pdserve"]
    loopback = Loopback({name: (name, {}) for name in services}, tiny_llama)
    receiver = OtlpReceiver().start()
    try:
        collector_port = int(receiver.endpoint.rsplit(":", 1)[1])
        loopback.reserve("otel-collector", 4317, collector_port)  # the collector, played here
        # The model job: its flags parse, and it writes where the others read (checked below).
        job = build_parser().parse_args(services["model"]["command"])
        runners = [name for name in pdserve_services(load()) if name != "model"]
        with local_stack(tmp_path) as stack:
            _start_in_order(services, runners, loopback, stack)
            assert loopback.model_paths == {job.out}
            gateway = services["gateway"]["command"]
            base_url = f"http://127.0.0.1:{loopback.port('gateway', int(flag(gateway, '--port')))}"
            client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(
                model=flag(gateway, "--served-model-name"),
                messages=[{"role": "user", "content": LONG_PROMPT}],
                max_tokens=8,
                temperature=0,
            )
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage is not None and reply.usage.completion_tokens >= 1
            expositions = _scrape_prometheus_targets(loopback)
            assert set(expositions) == {"gateway", "prefill", "decode"}
            # The prompt was prefilled by the prefill node, its KV pushed to the decode node at the
            # address it advertised (--kv-host 0.0.0.0): KV over tcp, as the command says.
            assert _node_series_value(expositions["prefill"], "pdserve:prompt_tokens_total") > 0
            assert _node_series_value(expositions["decode"], "pdserve:kv_transfer_bytes_total") > 0
            codes = stack.stop()
        assert codes == {name: 0 for name in runners}, stack.logs()
        # Traces went where OTEL_EXPORTER_OTLP_ENDPOINT says (flushed on the way out).
        traced = {s.service_name for s in receiver.spans}
        assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= traced
    finally:
        receiver.stop()


def test_stop_grace_periods_parse() -> None:
    """docker-compose durations as written here: plain seconds."""
    for service in load()["services"].values():
        if "stop_grace_period" in service:
            assert re.fullmatch(r"\d+s", service["stop_grace_period"])


COMPOSE_TLS = DEPLOY / "docker-compose.tls.yml"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_nodes_are_unreachable_from_outside_and_the_tls_overlay_is_complete() -> None:
    """Nodes sit only on the internal network (no published port); with the TLS overlay every
    pdserve role has a certificate the one-off job writes, the same CA and server name, and
    waits for the job; the gateway's health check and Prometheus speak https."""
    base = yaml.safe_load(compose_config(COMPOSE))
    assert base["networks"]["internal"]["internal"] is True
    for name in ("prefill", "decode", "model"):
        assert set(base["services"][name]["networks"]) == {"internal"}
        assert not base["services"][name].get("ports")
    published = {name for name, s in base["services"].items() if s.get("ports")}
    assert published == {"gateway", "prometheus", "grafana", "jaeger"}
    for name in published:
        assert set(base["services"][name]["networks"]) == {"internal", "edge"}
    tls = yaml.safe_load(compose_config(COMPOSE, COMPOSE_TLS))
    job = " ".join(tls["services"]["certs"]["command"])
    assert "make-dev-certs.sh /certs" in job
    for role in ("prefill", "decode", "gateway"):
        service = tls["services"][role]
        env = service["environment"]
        assert env["PDSERVE_TLS_CERT"] == f"/certs/{role}.pem"
        assert env["PDSERVE_TLS_KEY"] == f"/certs/{role}.key"
        assert env["PDSERVE_TLS_CA"] == "/certs/ca.pem"
        assert env["PDSERVE_TLS_SERVER_NAME"] == "pdserve.internal"
        assert "certs:/certs:ro" in service["volumes"]
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert service["command"] == base["services"][role]["command"]  # commands unchanged
    assert tls["services"]["gateway"]["healthcheck"]["test"][-1].startswith("https://")
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.compose.tls.yml").read_text())
    assert scrape["scrape_configs"][0]["scheme"] == "https"
