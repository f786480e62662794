"""deploy/k8s: the cpu and gpu overlays render (kubectl kustomize), every object validates
strictly against the Kubernetes 1.30 schemas (and the newest kubernetes-validate knows), the
ServiceMonitor (a CRD) has the Operator's shape, the manifests hang together (probes on the
ports the commands open, services on the right pods, grace periods above the drains, HPAs on
metrics the adapter serves), and the cpu overlay's pods, run as local processes with their
exact args (tests/deploy/described.py), answer a chat request, pass their probes, and expose
every series the autoscaling rules read."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from openai import OpenAI

from pdserve.cli import build_parser
from tests.deploy.described import (
    DEPLOY,
    LocalStack,
    Loopback,
    expand_k8s_vars,
    healthcheck_module,
    image_entrypoint,
    local_stack,
    metric_names,
    wait_until,
)

K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu")
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
ROLES = ("gateway", "prefill", "decode")
IMAGE_USER = 10001
"""USER of deploy/docker/Dockerfile.*."""

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


@functools.cache
def render(directory: str) -> tuple[dict, ...]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def by_kind(objects: tuple[dict, ...], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def main_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def service_backends(objects: tuple[dict, ...]) -> dict[str, tuple[str, dict[int, int]]]:
    """Service name -> (the Deployment its selector picks, service port -> container port)."""
    deployments = by_kind(objects, "Deployment")
    backends = {}
    for name, service in by_kind(objects, "Service").items():
        (target,) = [
            d
            for d in deployments
            if selects(
                service["spec"]["selector"],
                deployments[d]["spec"]["template"]["metadata"]["labels"],
            )
        ]
        ports = {
            p["name"]: p["containerPort"] for p in main_container(deployments[target])["ports"]
        }
        port_map = {}
        for port in service["spec"]["ports"]:
            target_port = port["targetPort"]
            port_map[port["port"]] = (
                ports[target_port] if isinstance(target_port, str) else target_port
            )
        backends[name] = (target, port_map)
    return backends


def container_env(container: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it (downward API: this pod on loopback)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        field = var["valueFrom"]["fieldRef"]["fieldPath"]
        env[var["name"]] = {"status.podIP": "127.0.0.1", "metadata.name": pod_name}[field]
    return env


def pod_argv(container: dict, entrypoint: list[str], env: dict[str, str]) -> list[str]:
    """The pdserve arguments a container runs (the image's ENTRYPOINT, unless overridden)."""
    command = container.get("command", entrypoint)
    assert command == ["pdserve"], command
    return [expand_k8s_vars(arg, env) for arg in container["args"]]


def adapter_config() -> dict:
    (config_map,) = render("prometheus-adapter")
    return yaml.safe_load(config_map["data"]["config.yaml"])


def series_in(query: str) -> set[str]:
    """The pdserve series a PromQL query or series selector names."""
    names = set()
    for alternatives in re.findall(r'__name__=~"pdserve:\(([^)]*)\)"', query):
        names |= {f"pdserve:{a}" for a in alternatives.split("|")}
    query = re.sub(r'__name__=~"[^"]*"', "", query)
    return names | set(re.findall(r"pdserve:[A-Za-z_:]+[A-Za-z_]", query))


def adapter_metrics() -> dict[str, tuple[str, set[str]]]:
    """Metric name in the custom/external metrics API -> (API, the series it comes from)."""
    config = adapter_config()
    metrics = {}
    for api, rules in (("pods", config["rules"]), ("external", config["externalRules"])):
        for rule in rules:
            pattern, replacement = (
                rule["name"]["matches"],
                rule["name"]["as"].replace("${1}", r"\1"),
            )
            sources = series_in(rule["seriesQuery"]) | series_in(rule["metricsQuery"])
            for series in series_in(rule["seriesQuery"]):
                assert re.search(pattern, series), (pattern, series)
                metrics[re.sub(pattern, replacement, series)] = (api, sources)
    return metrics


@needs_kubectl
@pytest.mark.parametrize("directory", [f"overlays/{o}" for o in OVERLAYS] + ["prometheus-adapter"])
def test_renders_and_validates_strictly(directory: str) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue  # not in the core schemas: test_service_monitor checks its shape
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                what = f"{obj['kind']}/{obj['metadata']['name']} ({version})"
                raise AssertionError(f"{what}: {exc}") from exc


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor(overlay: str) -> None:
    """monitoring.coreos.com/v1 ServiceMonitor: selects the pdserve Services, and each endpoint
    names a port that some of them have."""
    objects = render(f"overlays/{overlay}")
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    services = [
        s
        for s in by_kind(objects, "Service").values()
        if selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert {s["metadata"]["name"] for s in services} == {f"pdserve-{r}" for r in ROLES}
    named_ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings"}
        assert endpoint["port"] in named_ports and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_images_probes_and_drains(overlay: str) -> None:
    objects = render(f"overlays/{overlay}")
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {f"pdserve-{r}" for r in ROLES}
    tag = {"cpu": "cpu", "gpu": "cuda"}[overlay]
    for role in ROLES:
        pod = deployments[f"pdserve-{role}"]["spec"]["template"]["spec"]
        container = main_container(deployments[f"pdserve-{role}"])
        argv = container["args"]
        assert argv[0] == role
        # one image for every role, tagged (never latest), run as the image's non-root user
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"] == f"pdserve:{tag}"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"])
            assert set(c["resources"]["requests"]) <= set(c["resources"]["limits"])
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == IMAGE_USER
        # draining finishes before the kill
        assert pod["terminationGracePeriodSeconds"] > float(flag(argv, "--drain-timeout-s")) + 5
        # probes on what the command opens
        port = int(flag(argv, "--port"))
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        if role == "gateway":
            named = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert {named[p["httpGet"]["port"]] for p in probes} == {port}
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        else:
            assert [p["grpc"]["port"] for p in probes] == [port] * 3
        # the model comes from the initContainer, into the volume the node reads
        (init,) = pod["initContainers"]
        model = build_parser().parse_args(init["args"])
        assert model.command == "make-model" and flag(argv, "--model") == model.out
        if overlay == "gpu" and role != "gateway":
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_finds_the_pools_and_prefill_finds_decode(overlay: str) -> None:
    objects = render(f"overlays/{overlay}")
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    backends = service_backends(objects)
    gateway = main_container(deployments["pdserve-gateway"])["args"]
    for role in ("decode", "prefill"):
        # a headless Service over the pool, at the port the pods' gRPC server opens
        host, port = flag(gateway, f"--{role}-nodes").split(":")
        assert services[host]["spec"]["clusterIP"] == "None"
        target, port_map = backends[host]
        assert target == f"pdserve-{role}"
        node_args = main_container(deployments[target])["args"]
        assert port_map[int(port)] == int(flag(node_args, "--port"))
    decode = main_container(deployments["pdserve-decode"])
    assert flag(decode["args"], "--kv-host") == "$(POD_IP)"
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in decode["env"]
    transport = {"cpu": "tcp", "gpu": "ucx"}[overlay]
    for role in ("prefill", "decode"):
        env = container_env(main_container(deployments[f"pdserve-{role}"]), role)
        assert env["PDSERVE_KV_TRANSPORT"] == transport


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_autoscalers(overlay: str) -> None:
    objects = render(f"overlays/{overlay}")
    deployments = by_kind(objects, "Deployment")
    pdbs = by_kind(objects, "PodDisruptionBudget")
    for role in ROLES:
        labels = deployments[f"pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert selects(pdbs[f"pdserve-{role}"]["spec"]["selector"]["matchLabels"], labels)
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    served = adapter_metrics()
    names = {}
    for role in ("prefill", "decode"):
        spec = hpas[f"pdserve-{role}"]["spec"]
        assert spec["scaleTargetRef"]["name"] == f"pdserve-{role}"
        names[role] = set()
        for metric in spec["metrics"]:
            api = metric["type"].lower()
            name = metric[api]["metric"]["name"]
            assert served[name][0] == api, f"{role} HPA: the adapter serves no {api} {name}"
            names[role].add(name)
    assert names == {
        "prefill": {"pdserve_num_requests_waiting", "pdserve_time_to_first_token_seconds_p90"},
        "decode": {"pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"},
    }


def _probe_ok(probe: dict, workload: str, container: dict, loopback: Loopback, hc) -> bool:
    if "grpc" in probe:
        return hc.probe_grpc(f"127.0.0.1:{loopback.port(workload, probe['grpc']['port'])}")
    get = probe["httpGet"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    port = named.get(get["port"], get["port"])
    return hc.probe_http(f"http://127.0.0.1:{loopback.port(workload, port)}{get['path']}")


def _start_pods(objects: tuple[dict, ...], loopback: Loopback, stack: LocalStack) -> dict:
    """One process per Deployment, as its main container would run; returns the containers."""
    entrypoint = image_entrypoint(DEPLOY / "docker/Dockerfile.cpu")
    containers = {}
    for name, deployment in by_kind(objects, "Deployment").items():
        container = main_container(deployment)
        env = {k: loopback.value(name, v) for k, v in container_env(container, name).items()}
        argv = loopback.args(name, pod_argv(container, entrypoint, env))
        loopback.assert_mapped(argv)
        (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
        init_argv = pod_argv(init, entrypoint, container_env(init, name))
        assert build_parser().parse_args(init_argv).out in loopback.model_paths
        stack.start(name, argv, env)
        containers[name] = container
    return containers


def _scrape_service_monitor(objects: tuple[dict, ...], loopback: Loopback) -> set[str]:
    """The series names every target of the ServiceMonitor exposes."""
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    scraped: set[str] = set()
    for endpoint in monitor["spec"]["endpoints"]:
        for name, service in by_kind(objects, "Service").items():
            for port_spec in service["spec"]["ports"]:
                if port_spec["name"] == endpoint["port"]:
                    port = loopback.service_port(name, port_spec["port"])
                    url = f"http://127.0.0.1:{port}{endpoint['path']}"
                    with urllib.request.urlopen(url) as response:
                        scraped |= metric_names(response.read().decode())
    return scraped


@needs_kubectl
def test_the_cpu_overlay_answers(tiny_llama: str, tmp_path: Path) -> None:
    objects = render("overlays/cpu")
    loopback = Loopback(service_backends(objects), tiny_llama)
    hc = healthcheck_module()
    with local_stack(tmp_path) as stack:
        containers = _start_pods(objects, loopback, stack)
        procs = list(stack.procs.values())
        for name, container in containers.items():
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container[kind]
                wait_until(
                    lambda p=probe, n=name, c=container: _probe_ok(p, n, c, loopback, hc),
                    procs,
                    120,
                    f"{name} {kind}",
                )
        gateway = containers["pdserve-gateway"]["args"]
        port = loopback.service_port("pdserve-gateway", 8000)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=flag(gateway, "--served-model-name"),
            messages=[{"role": "user", "content": "Say something about the sea. " * 8}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        # The ServiceMonitor's targets answer, with every series the autoscaling rules read.
        scraped = _scrape_service_monitor(objects, loopback)
        for metric, (_, sources) in adapter_metrics().items():
            assert sources <= scraped, f"{metric} reads {sources - scraped}, which nobody exposes"
        codes = stack.stop()
    assert codes == {name: 0 for name in containers}, stack.logs()


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_only_the_tiers_that_talk(overlay: str) -> None:
    """Every port of every pdserve pod is covered by a policy, and each internal port admits
    exactly the component that calls it (and node metrics only Prometheus)."""
    objects = render(f"overlays/{overlay}")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    admitted: set[tuple[str, str, int]] = set()
    for policy in policies:
        target = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            sources = [
                peer["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                or peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                for peer in rule.get("from", [])
            ] or ["anyone"]
            for source in sources:
                for port in rule["ports"]:
                    admitted.add((source, target, port["port"]))
    assert admitted == {
        ("anyone", "gateway", 8000),
        ("anyone", "gateway", 50051),
        ("gateway", "decode", 50061),
        ("prefill", "decode", 50062),
        ("decode", "prefill", 50071),
        ("prometheus", "decode", 9400),
        ("prometheus", "prefill", 9400),
    }
    # and those are the pods' ports
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        component = obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for container in obj["spec"]["template"]["spec"]["containers"]:
            for port in container.get("ports", []):
                assert any(a[1:] == (component, port["containerPort"]) for a in admitted), (
                    component,
                    port,
                )
