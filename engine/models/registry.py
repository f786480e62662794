"""HF ``architectures[0]`` -> our model class."""

from __future__ import annotations

from pdserve.engine.models.gemma3 import Gemma3ForCausalLM
from pdserve.engine.models.llama import CausalLM, LlamaForCausalLM

# The Llama family is one class, its members differing only in config.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class implementing architecture; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
