"""The committed gRPC stubs must be exactly what the pinned grpcio-tools generates."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto" / "pdserve" / "v1"


def test_committed_stubs_match_the_protos(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in PROTO_DIR.glob("*.proto"))
    assert protos, "no .proto files found"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto")]
    cmd += [f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    subprocess.run(cmd + protos, check=True, cwd=ROOT)
    generated = sorted((tmp_path / "pdserve" / "v1").iterdir())
    assert len(generated) == 3 * len(protos)
    for fresh in generated:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed: run scripts/gen_proto.sh"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed} is stale: run scripts/gen_proto.sh"
        )


def test_stubs_import_as_pdserve_v1():
    from pdserve.v1 import common_pb2, gateway_pb2_grpc, node_pb2, node_pb2_grpc

    assert node_pb2.DecodeRequest(sampling_params=common_pb2.SamplingParams(max_tokens=3))
    assert hasattr(node_pb2_grpc, "DecodeNodeServicer")
    assert hasattr(node_pb2_grpc, "PrefillNodeStub")
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
