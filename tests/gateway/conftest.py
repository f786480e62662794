"""Fixtures for the gateway tests: a background event loop, the tiny model's tokenizer, and a
cluster of fake nodes behind a gateway shared by a module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.gateway.harness import SCRIPT_TEXT, BackgroundLoop, Cluster, start_cluster


@pytest.fixture(scope="session")
def bg_loop() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def tokenizer(tiny_llama: str) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="session")
def script(tokenizer: Tokenizer) -> list[int]:
    """The fake decode nodes' token script (multi-byte characters split across tokens)."""
    return tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)


StartCluster = Callable[..., Cluster]


@pytest.fixture(scope="module")
def cluster(bg_loop: BackgroundLoop, tiny_llama: str, script: list[int]) -> Iterator[Cluster]:
    """Two fake decode nodes, one fake prefill node and a gateway, shared by a module; reset
    to its starting behaviour before each test that uses it."""
    started = start_cluster(bg_loop, tiny_llama, script)
    yield started
    started.stop()


@pytest.fixture
def gw(cluster: Cluster) -> Cluster:
    cluster.reset()
    return cluster


@pytest.fixture
def make_cluster(
    bg_loop: BackgroundLoop, tiny_llama: str, script: list[int]
) -> Iterator[StartCluster]:
    """Factory for a cluster with its own settings, stopped after the test."""
    started: list[Cluster] = []

    def make(**config: Any) -> Cluster:
        cluster = start_cluster(bg_loop, tiny_llama, script, **config)
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
