"""pdserve: LLM serving with disaggregated prefill and decode tiers."""

__version__ = "0.1.0"
