"""HF ``architectures[0]`` -> our model class."""

from __future__ import annotations

from pdserve.engine.models.llama import LlamaForCausalLM

# Every supported architecture is a Llama-family config of the one class.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing architecture; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
