"""pdserve as users install it: a real wheel (not the editable install the suite runs from),
installed into a fresh virtual environment, then `pdserve serve` started from another directory
answers a completion, with the compiled CPU kernels (not the silent torch fallback): the wheel's
kernel sources must hash to the checkout's build key, whose build it then loads.

The fresh venv gets pdserve only from the wheel; its dependencies come from this venv's
site-packages through a plain path entry (a .pth line naming the directory: the editable
install's own .pth hook in there is not run, so nothing of the checkout can leak in)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from pdserve.kernels.cpu import build_key, built_folder
from tests.integration.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE_DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the working tree's files (setuptools builds in the source tree)."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.check_output(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT
    )
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(out), str(source)], check=True, timeout=300)
    (built,) = out.glob("pdserve-*.whl")
    return built


def test_the_wheel_holds_every_package_stub_and_kernel_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"pdserve", next(t for t in tops if t.endswith(".dist-info"))}
    for needed in (
        "pdserve/cli.py",
        "pdserve/v1/node_pb2.py",
        "pdserve/v1/node_pb2_grpc.py",
        "pdserve/engine/llm_engine.py",
        "pdserve/common/node.py",
        "pdserve/kernels/cpu/paged_attention.cpp",
        "pdserve/kernels/cpu/vec.h",
        "pdserve/gateway/static/dashboard.html",
    ):
        assert needed in names, needed


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "pdserve_test_deps.pth").write_text("\n".join(deps) + "\n")
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(cmd, check=True, timeout=300)
    return venv


def test_the_installed_wheel_imports_from_its_own_files(fresh_venv: Path, tmp_path: Path) -> None:
    code = (
        "import json, pdserve, pdserve.v1.node_pb2 as pb, pdserve.engine.scheduler as s;"
        "from pdserve import LLM, SamplingParams;"
        "print(json.dumps([pdserve.__file__, pb.__file__, s.__file__, LLM.__module__]))"
    )
    out = subprocess.check_output([fresh_venv / "bin/python", "-c", code], cwd=tmp_path, text=True)
    files = json.loads(out)
    assert all(str(fresh_venv) in f for f in files[:3]), files  # not the checkout's
    assert files[3] == "pdserve.engine.llm"


def test_pdserve_serve_from_the_wheel_answers_with_the_compiled_kernels(
    fresh_venv: Path, tiny_llama: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PDSERVE_KERNEL_BUILD_DIR": str(tmp_path / "kernels"),  # the wheel's own build dir
    }
    env.pop("PYTHONPATH", None)
    python = fresh_venv / "bin/python"
    # The build key hashes the kernel sources, the flags, torch, Python and the compiler: equal
    # keys mean the wheel ships the checkout's kernels byte for byte, so the checkout's build
    # (scripts/setup.sh made it) is the wheel's too and is copied rather than compiled again (~2
    # minutes on 2 cores). Where the checkout has no build yet, the wheel compiles its own.
    code = "import json; from pdserve.kernels.cpu import build_key; print(json.dumps(build_key()))"
    out = subprocess.check_output([python, "-c", code], env=env, cwd=tmp_path, text=True)
    assert tuple(json.loads(out)) == build_key()
    if (built := built_folder()) is not None:
        shutil.copytree(built, tmp_path / "kernels" / os.path.basename(built))
    check = "from pdserve.kernels.cpu import cpu_ops; assert cpu_ops() is not None"
    subprocess.run([python, "-c", check], check=True, env=env, cwd=tmp_path, timeout=600)
    port = free_port()
    state = tmp_path / "state.json"
    argv = [str(fresh_venv / "bin/pdserve"), "serve", "--model", tiny_llama, "--port", str(port)]
    argv += ["--grpc-port", "0", "--num-threads", "1", "--num-blocks", "128"]
    argv += ["--kv-transport", "tcp", "--state-file", str(state)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + SERVE_DEADLINE_S
        while not state.exists():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.25)
        body = {"model": tiny_llama, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["usage"]["completion_tokens"] == 5
        assert reply["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    logs = log_path.read_text()
    assert "kernels unavailable" not in logs, logs
