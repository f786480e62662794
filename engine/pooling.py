"""Embeddings: the final hidden states of a prompt (after the model's last norm, as
transformers' `last_hidden_state`), pooled into one vector per prompt.

Pooling: "last" (the last token's state: decoder models, vLLM's default for them), "mean"
(the average over the prompt's tokens), "cls" (the first token's). normalize: divide by the L2
norm (OpenAI's embeddings are unit vectors). Computed in float32 whatever the engine dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

Pooling = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[str, ...] = get_args(Pooling)


def pool(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """[T, H] hidden states of one prompt -> [H] float32."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")
    states = hidden.float()
    if pooling == "last":
        vector = states[-1]
    elif pooling == "cls":
        vector = states[0]
    else:
        vector = states.mean(dim=0)
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's LLM.embed returns it (`out.outputs.embedding`)."""

    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
