"""Frozen, validated configuration, one dataclass per concern.

Values discovered at run time (number of KV blocks, eos id, vocabulary size) are passed to
constructors, never written back into a config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
"""Weight dtypes; float16 on CUDA only (on a CPU it is ~1000x slower than bfloat16)."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how."""

    model: str
    """A Hugging Face-format model directory, or a GGUF file (or a directory holding one)."""
    tokenizer: str | None = None
    """Tokenizer directory (or GGUF file) to use instead of the model's."""
    dtype: str = "auto"
    """Weights and KV dtype: "float32", "bfloat16", "float16" (CUDA only) or "auto" (the
    checkpoint's, float16 -> bfloat16)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    seed: int = 0
    """Seed for requests that do not bring one of their own."""
    attention_backend: str = "auto"
    """How layers attend over the paged KV cache: "cpu" (the compiled CPU kernels), "torch"
    (the pure-torch reference), "triton" (CUDA, or a CPU under TRITON_INTERPRET=1: slow, fp32,
    for tests) or "auto" (triton on CUDA; on a CPU the cpu kernels where they build, else torch)."""
    device: str = "auto"
    """Where weights, KV cache and sampling live: "cpu", "cuda", "cuda:N" or "auto" (the first
    CUDA GPU when torch sees one, else the CPU)."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly. By default decode-only steps replay CUDA graphs captured
    at start for batch sizes 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 256) (a batch runs
    padded to the next size). No effect on a CPU."""

    def __post_init__(self) -> None:
        if self.device != "auto" and not _is_device_name(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        cpu_dtypes = tuple(d for d in SUPPORTED_DTYPES if d != "float16")
        on_cpu = self.device == "cpu" or (self.device == "auto" and not _cuda_visible())
        if self.dtype not in (*(cpu_dtypes if on_cpu else SUPPORTED_DTYPES), "auto"):
            raise ValueError(
                f"dtype must be one of {cpu_dtypes if on_cpu else SUPPORTED_DTYPES} or 'auto', "
                f"got {self.dtype!r} (float16 runs on CUDA only: on a CPU it is ~1000x slower "
                "than bfloat16)"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, cpu or triton, got "
                f"{self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _is_device_name(name: str) -> bool:
    kind, _, index = name.partition(":")
    if kind == "cpu":
        return not index
    return kind == "cuda" and (not index or index.isdigit())


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized and shared."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Number of KV blocks (block 0 is the reserved null block); overrides kv_cache_memory."""
    kv_cache_memory: float = 4.0
    """CPU: KV cache size in GiB when num_blocks is not given (the CPU analogue of
    gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """CUDA: the fraction of the GPU's memory this engine may use; after the weights and the
    activations of a profiled max-size step, the rest of it becomes KV blocks (vLLM's flag)."""
    num_gpu_blocks_override: int | None = None
    """CUDA: this many KV blocks, skipping the memory profile (vLLM's flag; num_blocks does
    the same on any device)."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (float8 e4m3, one
    scale per tensor, 1.0 as vLLM's default without calibration: half the bytes of bfloat16;
    the torch and triton attention backends read it, the cpu kernels do not)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose chained hash matches an earlier request's."""
    kv_cache_prefault: bool = True
    """CPU: fault the KV cache's pages in from a background thread on spare CPU time (2 MiB
    at a time, each once a core has stayed free for 2 ms; its contents untouched), in the
    order blocks are handed out, so that no step waits on the first touch of never-used memory
    (the cache is mapped lazily for a fast start). The environment variable
    PDSERVE_KV_CACHE_PREFAULT=0 also turns it off."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (one is the null block), got {self.num_blocks}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                "num_gpu_blocks_override must be >= 2 (one is the null block), "
                f"got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )


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
    max_prefill_tokens_while_decoding: int | None = None
    """Most prompt tokens (chunks and admissions together) a step computes beside decodes;
    steps with no decode still take the whole budget (None: no cap; no cap either without
    chunked prefill, where a prompt must fit one step). A small cap spreads each
    prompt over the decode steps of the others: a decode step alone reads every weight for a
    few rows, and the prompt's chunk rides on that read (and the decodes wait less for it)."""
    remote_prefill_min_tokens: int = 1
    """Decode role: requests offered a remote prefill take it only when at least this many
    prompt tokens are not in the local prefix cache; shorter ones prefill locally."""
    max_remote_prefill_queue_tokens: int = 0
    """Decode role, queue-aware conditional disaggregation (0 = off, every long prompt goes
    remote). Once this node waits on prefill nodes for at least this many uncached prompt
    tokens, a new prompt prefills locally instead, as long as the local prefill backlog, it
    included, is no longer than the remote one: the prompt goes to whichever queue is shorter."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {cap}")
        if self.remote_prefill_min_tokens < 1:
            raise ValueError(
                f"remote_prefill_min_tokens must be >= 1, got {self.remote_prefill_min_tokens}"
            )
        if self.max_remote_prefill_queue_tokens < 0:
            raise ValueError(
                "max_remote_prefill_queue_tokens must be >= 0 (0 = off), "
                f"got {self.max_remote_prefill_queue_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (vLLM's flags; engine/parallel.py)."""

    tensor_parallel_size: int = 1
    """Ranks each layer is split over (torch.distributed, gloo on CPU): Megatron-style
    column/row-parallel projections, heads split, one process per rank."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split over, one process each (offline only yet, and not with
    tensor parallelism)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size > 1 together are not supported yet"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags): adapters applied per request on one base model."""

    enable_lora: bool = False
    """Accept requests that name a LoRA adapter (PEFT directories)."""
    max_loras: int = 1
    """Most distinct adapters in one step (each holds a slot of the stacked LoRA weights)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted (the slots' rank)."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in memory (least recently used dropped first); None: max_loras."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


_SPEC_INT_FIELDS = (
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "draft_num_blocks",
    "max_batch_for_speculation",
    "backoff_steps",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config), with the policy that turns it off
    where it does not pay (engine/spec_decode/policy.py)."""

    method: Literal["ngram", "draft_model"] = "ngram"
    """Proposer: prompt lookup over the request's own tokens, or a smaller draft model."""
    num_speculative_tokens: int = 3
    """Tokens proposed per step for each request (k)."""
    prompt_lookup_min: int = 1
    """Shortest n-gram to match (ngram)."""
    prompt_lookup_max: int = 4
    """Longest n-gram to match (ngram)."""
    model: str | None = None
    """Draft model directory (draft_model); its vocabulary must be the target's."""
    draft_num_blocks: int | None = None
    """KV blocks of the draft model's own cache; None takes the target's number of blocks."""
    max_batch_for_speculation: int = 4
    """No request speculates in a step with more running decode requests than this: the step
    turns compute-bound. Measured on the `small` model (float32, 256-token contexts, this
    2-core CPU, best of 12), a step with 1 + 3 tokens per request vs 1 token: 1.4-1.5x at
    batch 1, 0.6-1.1x at batch 2-4 (under 8 rows the plain step takes a slower GEMV path),
    2.1-2.5x at batch 8, 2.5-2.8x at batch 16: past 4, drafts must be accepted more than half
    the time just to break even."""
    min_expected_accepted: float = 0.5
    """The floor of the back-off rule: a request stops proposing while its acceptance-rate
    EMA x k is below this, or below what the engine's measured step cost says a draft token
    must return at this batch size, whichever is higher (engine/spec_decode/policy.py; the
    draft model's own forwards count in that cost). 0: no back-off at all."""
    backoff_steps: int = 16
    """Steps a request that fell below min_expected_accepted waits before probing again."""
    acceptance_ema_alpha: float = 0.3
    """Weight of the latest verification in a request's acceptance-rate EMA."""

    def __post_init__(self) -> None:
        self._validate_types()
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
        self._validate_policy()

    def _validate_types(self) -> None:
        for name in _SPEC_INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("min_expected_accepted", "acceptance_ema_alpha"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")

    def _validate_policy(self) -> None:
        if self.draft_num_blocks is not None and self.draft_num_blocks < 2:
            raise ValueError(f"draft_num_blocks must be >= 2, got {self.draft_num_blocks}")
        if self.max_batch_for_speculation < 0:
            raise ValueError(
                f"max_batch_for_speculation must be >= 0, got {self.max_batch_for_speculation}"
            )
        if self.min_expected_accepted < 0:
            raise ValueError(
                f"min_expected_accepted must be >= 0, got {self.min_expected_accepted}"
            )
        if self.backoff_steps < 0:
            raise ValueError(f"backoff_steps must be >= 0, got {self.backoff_steps}")
        if not 0 < self.acceptance_ema_alpha <= 1:
            raise ValueError(
                f"acceptance_ema_alpha must be in (0, 1], got {self.acceptance_ema_alpha}"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM-style keys; ValueError names unknown keys and bad values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From a JSON object (the --speculative-config flag), e.g.
        '{"method": "ngram", "num_speculative_tokens": 3}'. ValueError says what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON ({exc}): {text!r}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"speculative config must be a JSON object, got {text!r}")
        return cls.from_dict(values)
