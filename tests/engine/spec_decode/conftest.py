"""Draft models for the speculative decoding tests, built once per session."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.make_model import make_model


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama unrelated to tiny_llama (another seed), with the same vocabulary."""
    out = tmp_path_factory.mktemp("tiny_llama_seed1")
    make_model("llama", "tiny", str(out), seed=1)
    return str(out)


def sharpened(src: str, dst: Path, factor: float) -> str:
    """A copy of src with lm_head scaled by factor: temperature-1 distributions ~1/factor as
    hot, so a distribution test sees a few likely tokens instead of a near-uniform vocab."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="session")
def sharp_models(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[float], str]:
    """Factory: factor -> tiny_llama with its lm_head scaled by factor (built once each)."""
    built: dict[float, str] = {}
    root = tmp_path_factory.mktemp("sharp")

    def get(factor: float) -> str:
        if factor not in built:
            built[factor] = sharpened(tiny_llama, root / f"x{factor:g}", factor)
        return built[factor]

    return get


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run these tests' tiny models on one thread: their matmuls are far too small for a
    second one to pay, and on a shared CPU an OpenMP team waiting for a busy core made them
    ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
