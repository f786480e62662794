"""Session-wide fixtures: tiny models built once per test session (pdserve make-model)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from pdserve.make_model import make_model

# Engines made by tests (and the servers they start) leave their KV caches mapped lazily: the
# background prefault would commit each default 4 GiB cache, and a test process holds several.
os.environ.setdefault("PDSERVE_KV_CACHE_PREFAULT", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """Factory: arch ("llama", "qwen2", "qwen3", "mistral") -> directory of its tiny model,
    written on first use (seed 0) and shared by the whole session."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny_{arch}")
            make_model(arch, "tiny", str(out), seed=0)
            built[arch] = str(out)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("mistral")
