"""`pdserve serve` with mutual TLS between the tiers and TLS on the public ports, on 127.0.0.1:
requests through the official openai client (verifying the gateway's certificate) equal the
offline engine with remote prefill in use; a client without a certificate, or with one from
another CA, is refused by every internal gRPC port; plaintext is refused too."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from pdserve.common.protocol import sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.integration.stack import BLOCK, start_stack

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


def make_certs(out: Path) -> Path:
    subprocess.run(
        ["bash", str(ROOT / "deploy/certs/make-dev-certs.sh"), str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def stack(tiny_llama, certs, tmp_path_factory):
    tls = ["--tls-cert", str(certs / "decode.pem"), "--tls-key", str(certs / "decode.key")]
    tls += ["--tls-ca", str(certs / "ca.pem")]
    tls += [
        "--ssl-certfile",
        str(certs / "gateway.pem"),
        "--ssl-keyfile",
        str(certs / "gateway.key"),
    ]
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("serve_tls"), 1, 1, extra=tls)
    try:
        yield s
    finally:
        code = s.proc.stop(timeout_s=40)
        assert code == 0, f"pdserve serve exited with {code}:\n{s.proc.log()}"


def test_openai_client_over_tls_equals_offline_with_remote_prefill(stack, certs, tiny_llama):
    base = stack.base_url.replace("http://", "https://")
    http = httpx.Client(
        verify=ssl.create_default_context(cafile=certs / "ca.pem"), timeout=TIMEOUT_S
    )
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", http_client=http)
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(40)]  # long enough for remote prefill
    out = client.completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    offline = LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=128)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = offline.generate([prompt], p, use_tqdm=False)[0].outputs[0].text
    assert out.choices[0].text == want
    # decode -> prefill over mutual TLS, KV over the transport with its token: a Generate
    # straight to the decode node (as the gateway sends it) is prefilled remotely
    creds = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "gateway.key").read_bytes(),
        (certs / "gateway.pem").read_bytes(),
    )
    (prefill,) = stack.node_addresses("prefill")
    (decode,) = stack.node_addresses("decode")
    prompt = [(11 * i + 5) % 1000 + 3 for i in range(40)]  # not in the decode node's cache
    request = node_pb2.DecodeRequest(
        request_id="tls-direct",
        prompt_token_ids=prompt,
        sampling_params=sampling_params_to_proto(p),
        prefill_candidates=[prefill],
    )
    with grpc.secure_channel(decode, creds) as channel:
        chunks = list(node_pb2_grpc.DecodeNodeStub(channel).Generate(request, timeout=60))
    assert chunks[0].prefilled_by == f"remote:{prefill}"
    assert [t for c in chunks for t in c.token_ids] == list(
        offline.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    )
    with pytest.raises((httpx.RemoteProtocolError, httpx.ConnectError)):  # plaintext HTTP
        httpx.get(f"{stack.base_url}/health", timeout=5).raise_for_status()


def test_internal_ports_refuse_clients_without_a_certificate_of_the_ca(stack, tmp_path):
    other = make_certs(tmp_path / "other")  # a valid set from another CA
    ca = Path(stack.proc.argv[stack.proc.argv.index("--tls-ca") + 1]).read_bytes()
    no_cert = grpc.ssl_channel_credentials(ca)
    foreign = grpc.ssl_channel_credentials(
        ca, (other / "decode.key").read_bytes(), (other / "decode.pem").read_bytes()
    )
    for name, node in stack.nodes.items():
        if name == "gateway":
            continue
        channels = [
            grpc.insecure_channel(node["address"]),
            grpc.secure_channel(node["address"], no_cert),
            grpc.secure_channel(node["address"], foreign),
        ]
        for channel in channels:
            with channel:
                stub = node_pb2_grpc.DecodeNodeStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.GetLoad(node_pb2.GetLoadRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (name, info.value)


def test_the_container_health_check_speaks_tls(stack, certs, monkeypatch):
    """deploy/docker/healthcheck.py with the container's PDSERVE_TLS_* / PDSERVE_SSL_* (as
    docker-compose.tls.yml sets them): the nodes answer it over mutual TLS, the gateway over
    https; without the certificates the probe fails (never a false "healthy")."""
    from tests.deploy.described import healthcheck_module

    probe = healthcheck_module()
    nodes = [n["address"] for name, n in stack.nodes.items() if name != "gateway"]
    for address in nodes:
        assert not probe.probe(f"grpc://{address}")
    monkeypatch.setenv("PDSERVE_TLS_CERT", str(certs / "gateway.pem"))
    monkeypatch.setenv("PDSERVE_TLS_KEY", str(certs / "gateway.key"))
    monkeypatch.setenv("PDSERVE_TLS_CA", str(certs / "ca.pem"))
    monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", "pdserve.internal")
    for address in nodes:
        assert probe.probe(f"grpc://{address}"), address
    port = stack.base_url.rsplit(":", 1)[1]
    monkeypatch.setenv("PDSERVE_SSL_CERTFILE", str(certs / "gateway.pem"))
    target = probe.target_from_argv(["gateway", "--port", port])
    assert target == f"https://127.0.0.1:{port}/health" and probe.probe(target)
