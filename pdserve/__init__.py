"""pdserve: LLM serving with disaggregated prefill and decode tiers.

Every module of the project imports under this one namespace (pdserve.engine, pdserve.gateway,
...; pyproject.toml maps the layout's folders into it). The offline API, as vLLM's:

    from pdserve import LLM, SamplingParams
"""

from pdserve.engine.request import RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):  # LLM imports torch: keep `import pdserve` light
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
