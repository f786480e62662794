"""`pdserve serve` start-up: a child dying before the stack is up (a port taken between pick and
bind) starts the whole stack again on fresh ports; readiness waits for every node."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import serve
from pdserve.engine.models import gguf as gguf_source


def _args(**overrides) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model", "unused", "--startup-timeout-s", "5"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _child(name: str, code: int | None) -> serve.Child:
    """A real process: already exited with `code`, or sleeping until stopped (code None)."""
    script = "import time; time.sleep(60)" if code is None else f"raise SystemExit({code})"
    process = subprocess.Popen([sys.executable, "-c", script])
    if code is not None:
        process.wait(10)
    return serve.Child(name, process, "127.0.0.1:9", "")


def test_a_startup_death_restarts_the_stack(monkeypatch):
    started: list[list[serve.Child]] = []

    def start_stack(args, turns_lock=None):
        # first attempt: a node dies at once; second attempt: everything stays up
        code = 1 if not started else None
        children = [_child("prefill-0", code), _child("gateway", None)]
        started.append(children)
        return children

    def wait_healthy(url, children, timeout_s, tls=None):
        dead = [c.name for c in children if c.process.poll() is not None]
        if dead:
            raise serve.StartupDeath(f"{dead} exited during startup")
        raise KeyboardInterrupt  # "up": leave run() through its cleanup

    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)  # keep pytest's handlers
    monkeypatch.setattr(serve, "_prepare_model", lambda model, tokenizer: None)
    monkeypatch.setattr(serve, "start_stack", start_stack)
    monkeypatch.setattr(serve, "wait_healthy", wait_healthy)
    with pytest.raises(KeyboardInterrupt):
        serve.run(_args())
    assert len(started) == 2, "started again after the death"
    for children in started:  # every process of both attempts stopped
        assert all(c.process.poll() is not None for c in children)


def test_gives_up_after_the_last_attempt(monkeypatch):
    started = []

    def start_stack(args, turns_lock=None):
        started.append([_child("decode-0", 1)])
        return started[-1]

    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    monkeypatch.setattr(serve, "_prepare_model", lambda model, tokenizer: None)
    monkeypatch.setattr(serve, "start_stack", start_stack)
    with pytest.raises(serve.StartupDeath, match="decode-0 exited during startup"):
        serve.run(_args())
    assert len(started) == serve._START_ATTEMPTS


def _serve(model: str, cwd: Path) -> subprocess.CompletedProcess:
    """`pdserve serve --model model` on free loopback ports, to its exit (bounded)."""
    argv = ["serve", "--model", model, "--port", str(serve.free_port())]
    argv += ["--grpc-port", str(serve.free_port()), "--startup-timeout-s", "60"]
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip


def test_a_bad_model_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """A missing path, a directory without config.json, a converted GGUF without a tokenizer,
    a file that is no GGUF and a GGUF cut short: exit 2, one ERROR line naming the file and the
    reason, no child process started, no traceback."""
    import gguf
    import numpy as np

    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(2000)])
    writer.add_tensor("token_embd.weight", np.zeros((64, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:4000])  # inside the token list
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 50)
    (tmp_path / "empty").mkdir()
    untokenized = tmp_path / "untokenized"  # as converted from a GGUF without tokenizer metadata
    untokenized.mkdir()
    (untokenized / "config.json").write_text("{}")
    (untokenized / gguf_source.SOURCE_FILE).write_text(
        json.dumps({"gguf": str(tmp_path / "m.gguf"), "tokenizer": False})
    )
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "empty"): "no config.json",
        str(untokenized): "m.gguf: the GGUF file has no tokenizer metadata; pass --tokenizer",
        str(junk): "not a readable GGUF file",
        str(cut): "not a readable GGUF file",
    }
    for model, reason in cases.items():
        result = _serve(model, tmp_path)
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and reason in errors[0], result.stderr
        assert model in errors[0] or model == str(untokenized), result.stderr
        assert "Traceback" not in result.stderr and "starting" not in result.stderr


def test_a_child_that_refuses_its_model_is_not_started_again(
    tiny_llama: str, tmp_path: Path
) -> None:
    """A model the supervisor cannot judge (here: no tokenizer.json) is refused by the children
    with exit 2: serve stops at once with exit 2 instead of retrying on fresh ports."""
    import shutil

    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama, model)
    (model / "tokenizer.json").unlink()
    result = _serve(str(model), tmp_path)
    assert result.returncode == 2, result.stderr
    assert "refused to start" in result.stderr
    assert result.stderr.count("starting gateway") == 1, result.stderr
    assert "no tokenizer.json" in result.stderr and "Traceback" not in result.stderr


def test_not_ready_while_a_node_is_not_serving():
    # a live process whose address serves nothing: never ready, times out
    child = _child("prefill-0", None)
    try:
        with pytest.raises(TimeoutError):
            serve.wait_healthy("http://127.0.0.1:9/health", [child], timeout_s=1.0)
    finally:
        child.process.kill()
        child.process.wait(10)


def test_children_sleep_while_idle_unless_told_otherwise(monkeypatch) -> None:
    """serve's processes share cores: their OpenMP threads must not spin while idle
    (benchmarks/omp_wait_policy.py: spinning made a 1+1 stack 1.8x slower here)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("PDSERVE_KERNEL_POOL", raising=False)
    assert serve.child_env(False)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert serve.child_env(False)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_kernel_pool_only_where_the_nodes_threads_fit_the_cores(monkeypatch) -> None:
    """A node's kernel workers spin inside its steps (pdserve_kernels/cpu/thread_pool.h) only
    where no other node computes on its cores (benchmarks/kernel_pool_ab.py: 1.03-1.16x aggregated,
    0.74x with 1 + 1 nodes on 2 cores); the caller's own choice stands."""
    monkeypatch.delenv("PDSERVE_KERNEL_POOL", raising=False)
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: {0, 1})

    def fits(prefill: int, decode: int, threads: int | None) -> bool:
        ns = argparse.Namespace(num_prefill=prefill, num_decode=decode, num_threads=threads)
        return serve.threads_fit_cores(ns)

    assert fits(0, 1, None) and fits(0, 1, 2) and fits(1, 1, 1)
    assert not fits(1, 1, None) and not fits(1, 1, 2) and not fits(0, 1, 3) and not fits(2, 2, 1)
    assert serve.child_env(True)["PDSERVE_KERNEL_POOL"] == "1"
    assert serve.child_env(False)["PDSERVE_KERNEL_POOL"] == "0"
    monkeypatch.setenv("PDSERVE_KERNEL_POOL", "0")
    assert serve.child_env(True)["PDSERVE_KERNEL_POOL"] == "0"
