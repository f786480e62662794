"""Reading the stack's Prometheus expositions in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import Stack


def metrics_addresses(stack: Stack) -> dict[str, str]:
    """name ("gateway", "prefill-0", "decode-0") -> host:port of its /metrics."""
    return {name: node["metrics_address"] for name, node in stack.nodes.items()}


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


class Samples:
    """One exposition's samples, looked up by name and a subset of labels."""

    def __init__(self, text: str) -> None:
        self.samples = [
            sample for family in text_string_to_metric_families(text) for sample in family.samples
        ]

    def value(self, sample_name: str, **labels: str) -> float:
        """The sum of the samples named sample_name whose labels include labels (0 if none)."""
        return sum(
            s.value
            for s in self.samples
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def has(self, sample_name: str) -> bool:
        return any(s.name == sample_name for s in self.samples)
