"""GatewayContext: what both front ends (REST and gRPC) share, and the checks they share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.admission import Admission
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import ApiError
from pdserve.gateway.generation import GenerationPipeline, GenerationRequest
from pdserve.gateway.logprobs import TokenTexts
from pdserve.gateway.lora import LoRARegistry
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import NodeRegistry
from pdserve.v1 import common_pb2


@dataclass
class GatewayContext:
    """The gateway's parts, built once by main."""

    config: GatewayConfig
    tokenizer: Tokenizer
    registry: NodeRegistry
    generator: GenerationPipeline
    admission: Admission
    token_texts: TokenTexts
    metrics: GatewayMetrics
    loras: LoRARegistry = field(init=False)
    """The LoRA adapters clients may name (--lora-modules, then runtime loads)."""

    def __post_init__(self) -> None:
        self.loras = LoRARegistry(self.config.lora_modules, self.model_names)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def max_model_len(self) -> int | None:
        """--max-model-len, else the smallest the decode nodes report (None: none has yet)."""
        return self.config.max_model_len or self.registry.max_model_len()

    def is_ready(self) -> bool:
        """What /health and the gRPC health service report."""
        return self.registry.is_ready() and not self.admission.draining

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id clients may name: --served-model-name's, the first one first."""
        return (self.config.served_model_name, *self.config.served_model_aliases)

    def check_model(self, model: str) -> common_pb2.LoRAAdapter | None:
        """404 unless model is the base model's id or an adapter's; the adapter, if one."""
        if model in self.model_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise ApiError.model_not_found(model)
        return lora

    def check_decode_available(self) -> int:
        """Fail fast (503) when no decode node accepts work; else the max_model_len."""
        max_model_len = self.max_model_len()
        if not any(n.accepting for n in self.registry.decode_nodes) or max_model_len is None:
            raise ApiError.unavailable("no healthy decode node is available")
        return max_model_len

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: common_pb2.SamplingParams,
        n: int,
        cache_salt: str = "",
        priority: int = 0,
        batch: tuple[list[int], ...] = (),
        lora: common_pb2.LoRAAdapter | None = None,
    ) -> GenerationRequest:
        """batch: every prompt of a batched completions request (prompt_token_ids first)."""
        return GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            deadline=time.monotonic() + self.config.request_timeout_s,
            n=n,
            cache_salt=cache_salt,
            priority=priority,
            batch=batch,
            lora=lora,
        )
