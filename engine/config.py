"""Frozen, validated configuration, one dataclass per concern.

Values discovered at run time (number of KV blocks, eos id, vocabulary size) are passed to
constructors, never written back into a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how."""

    model: str
    """Path of a Hugging Face-format model directory."""
    dtype: str = "auto"
    """Weights and KV dtype: "float32", "bfloat16" or "auto" (the checkpoint's, float16 -> bfloat16)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    seed: int = 0
    """Seed for requests that do not bring one of their own."""

    def __post_init__(self) -> None:
        if self.dtype not in (*SUPPORTED_DTYPES, "auto"):
            raise ValueError(
                f"dtype must be one of {SUPPORTED_DTYPES} or 'auto', got {self.dtype!r} "
                "(float16 is not supported on CPU: it is ~1000x slower than bfloat16)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized and shared."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Number of KV blocks (block 0 is the reserved null block); overrides kv_cache_memory."""
    kv_cache_memory: float = 4.0
    """KV cache size in GiB when num_blocks is not given (the CPU analogue of vLLM's
    --gpu-memory-utilization)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose chained hash matches an earlier request's."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (one is the null block), got {self.num_blocks}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of the unified token-budget scheduler."""

    max_num_seqs: int = 128
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes + speculative tokens)."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Admission and preemption order: arrival, or (priority, arrival) with lower = sooner."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget over several steps."""
    remote_prefill_min_tokens: int = 1
    """Decode role: requests offered a remote prefill take it only when at least this many
    prompt tokens are not in the local prefix cache; shorter ones prefill locally."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.remote_prefill_min_tokens < 1:
            raise ValueError(
                f"remote_prefill_min_tokens must be >= 1, got {self.remote_prefill_min_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config)."""

    method: Literal["ngram", "draft_model"] = "ngram"
    """Proposer: prompt lookup over the request's own tokens, or a smaller draft model."""
    num_speculative_tokens: int = 3
    """Tokens proposed per step for each request."""
    prompt_lookup_min: int = 1
    """Shortest n-gram to match (ngram)."""
    prompt_lookup_max: int = 4
    """Longest n-gram to match (ngram)."""
    model: str | None = None
    """Draft model directory (draft_model)."""

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft 'model' directory")
