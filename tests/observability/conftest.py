"""One traced `pdserve serve` stack (gateway + 1 prefill + 1 decode, node metrics on) shared by
the observability tests, exporting its spans to an OTLP receiver run by the tests."""

from __future__ import annotations

import pytest

from tests.integration.stack import start_stack
from tests.observability.otlp_receiver import OtlpReceiver

BSP_SCHEDULE_DELAY_MS = 200
"""Batch span processor delay: spans reach the receiver within a fraction of a second."""


@pytest.fixture(scope="package")
def otlp():
    receiver = OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="package")
def stack(tiny_llama, tmp_path_factory, otlp):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": str(BSP_SCHEDULE_DELAY_MS),
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    # Prompts under 64 uncached tokens stay on the decode node: the tests' short chat prompts
    # (~15 tokens with the template) are prefilled locally, their long ones remotely.
    extra = ["--remote-prefill-min-tokens", "64"]
    s = start_stack(tiny_llama, tmp_path_factory.mktemp("observed"), 1, 1, extra, env)
    try:
        yield s
    finally:
        code = s.proc.stop(timeout_s=40)
        assert code == 0, f"pdserve serve exited with {code}:\n{s.proc.log()}"
