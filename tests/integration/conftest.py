"""Stacks shared by several integration modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.models.test_gguf import smollm2_gguf
from tests.integration.stack import SMOLLM2_NAMES, Stack, running_stack


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`pdserve serve` (1 prefill + 1 decode node, STACK_FLAGS) on the real SmolLM2-135M-Instruct
    GGUF, served under SMOLLM2_NAMES: one stack for the modules that only send it requests
    (test_real_model, test_serve_structured, test_vllm_request_shapes; each started its own,
    ~14 s a time), none of which counts on a counter starting at zero."""
    extra = ["--served-model-name", *SMOLLM2_NAMES]
    log_dir = tmp_path_factory.mktemp("smollm2")
    with running_stack(str(smollm2_gguf()), log_dir, 1, 1, extra=extra) as stack:
        yield stack
