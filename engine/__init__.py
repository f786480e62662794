"""The shared engine core: paged KV cache, unified scheduler, model runner, sampler."""

from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):  # LLM imports torch; keep `import engine.request` light
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
