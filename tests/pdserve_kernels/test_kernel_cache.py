"""The CPU kernels' build cache: one folder per build key, found without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.kernels import cpu


@pytest.fixture(autouse=True)
def _fresh_identity():
    cpu._compiler_identity.cache_clear()
    yield
    cpu._compiler_identity.cache_clear()


def test_key_changes_with_march_sources_and_compiler(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CPU_MARCH", "native")
    native = cpu.build_key()
    monkeypatch.setenv("PDSERVE_CPU_MARCH", "x86-64-v3")
    v3 = cpu.build_key()
    assert native[0] != v3[0] and native[1] == v3[1]
    edited = tmp_path / "sampling_ops.cpp"
    edited.write_text(Path(cpu._SOURCES[-1]).read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu, "_SOURCES", [*cpu._SOURCES[:-1], str(edited)])
    assert cpu.build_key()[0] != v3[0]
    fake = tmp_path / "fakecxx"
    fake.write_text("#!/bin/sh\necho 'fake c++ 1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    cpu._compiler_identity.cache_clear()
    assert cpu.build_key()[1] not in (None, v3[1])
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    cpu._compiler_identity.cache_clear()
    assert cpu.build_key()[1] is None


def test_lookup_takes_finished_builds_only(tmp_path: Path) -> None:
    key = ("0123456789abcdef", "aaaaaaaaaaaa")
    half = tmp_path / ".build-0123456789abcdef-x1y2"  # a build in progress (not renamed yet)
    half.mkdir()
    (half / f"{cpu._NAME}.so").write_bytes(b"")
    assert cpu._built_module(str(tmp_path), key) is None
    other = tmp_path / "0123456789abcdef-bbbbbbbbbbbb"  # the same sources by another compiler
    other.mkdir()
    (other / f"{cpu._NAME}.so").write_bytes(b"")
    assert cpu._built_module(str(tmp_path), key) is None  # this machine's compiler differs
    assert cpu._built_module(str(tmp_path), (key[0], None)) == str(other / f"{cpu._NAME}.so")
    assert cpu._built_module(str(tmp_path), ("fedcba9876543210", None)) is None


def test_a_built_key_loads_without_a_compiler_in_seconds(tmp_path: Path) -> None:
    """What a node start does once setup has built the kernels: no compiler on PATH (as in a
    runtime image), nothing written, the module imported from the cache."""
    assert cpu.cpu_ops() is not None, "the CPU kernels must build on this machine"
    root = Path(cpu._cache_root())
    before = sorted(os.listdir(root))
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "PATH": str(tmp_path)}
    code = (
        "import time; t = time.monotonic(); from pdserve.kernels.cpu import cpu_ops;"
        "m = cpu_ops(); assert m is not None and hasattr(m, 'store_kv');"
        "print(m.__file__); print(time.monotonic() - t)"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    path, seconds = done.stdout.split()
    assert Path(path).parent.parent == root
    assert float(seconds) < 10 and time.monotonic() - start < 60
    assert sorted(os.listdir(root)) == before
    assert shutil.which("c++", path=str(tmp_path)) is None
