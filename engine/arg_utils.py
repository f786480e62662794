"""EngineArgs: every engine setting in one place, as flags and as LLM(...) keyword arguments
(vLLM's `EngineArgs`). Defaults and help come from the config dataclasses' own field defaults
and attribute docstrings (engine/config.py), so neither is written twice; the same helpers turn
any frozen config (a node's, the gateway's) into flags.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import textwrap
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin, get_type_hints

from pdserve.engine.config import (
    KV_CACHE_DTYPES,
    SUPPORTED_DTYPES,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup


# -- dataclass fields as flags ---------------------------------------------------------------------


@functools.cache
def _own_field_docs(cls: type) -> Mapping[str, str]:
    """The attribute docstrings written in cls's own body (the string after each field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return types.MappingProxyType(docs)


def config_field_docs(cls: type) -> dict[str, str]:
    """{field: its attribute docstring, whitespace collapsed} of a dataclass, its dataclass bases'
    included (a subclass's docstring for a field wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _flag_kwargs(hint: Any) -> dict[str, Any]:
    """argparse's type/choices/action for a field's type hint (Optional[X] as X)."""
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = (a for a in get_args(hint) if a is not types.NoneType)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return {"type": type(choices[0]), "choices": choices}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"no flag type for {hint!r}; pass type= explicitly")


def add_flag(
    parser: ArgumentContainer, name: str, hint: Any, default: Any, help: str, **kwargs: Any
) -> None:
    """The flag --name-with-dashes of one field: type, choices or --no- form from its type hint
    (unless kwargs give them), required when default is MISSING."""
    if "type" not in kwargs and "action" not in kwargs:
        kwargs = _flag_kwargs(hint) | kwargs
    if default is MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    parser.add_argument(flag_name(name), help=help.replace("%", "%%"), **kwargs)


def add_config_flags(
    parser: ArgumentContainer,
    cls: type,
    names: Iterable[str] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of the dataclass cls (or of the fields named), with the field's
    default and its attribute docstring as help (unless helps gives another)."""
    hints = get_type_hints(cls)
    docs = config_field_docs(cls) | dict(helps or {})
    wanted = set(names) if names is not None else None
    for f in fields(cls):
        if wanted is None or f.name in wanted:
            add_flag(parser, f.name, hints[f.name], f.default, docs[f.name])


def config_from_namespace(cls: type, args: argparse.Namespace) -> Any:
    """cls built from the parsed flags named like its fields (absent ones keep defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def flag_argv(name: str, value: Any) -> list[str]:
    """The argv that sets field `name` to value through its flag (as add_flag defines it)."""
    if isinstance(value, bool):
        return [flag_name(name) if value else "--no-" + flag_name(name)[2:]]
    return [f"{flag_name(name)}={value}"]  # "=": a value may start with "-"


def config_argv(config: Any, names: Iterable[str] | None = None) -> list[str]:
    """The flags that rebuild a dataclass instance: those of its fields that differ from their
    defaults (of the fields named, when names is given)."""
    wanted = set(names) if names is not None else None
    argv = []
    for f in fields(config):
        value = getattr(config, f.name)
        if (wanted is None or f.name in wanted) and value != f.default:
            argv += flag_argv(f.name, value)
    return argv


# -- EngineArgs ------------------------------------------------------------------------------------


class EngineConfigs(NamedTuple):
    """What an LLMEngine is built from (named like its parameters)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None
    lora_config: LoRAConfig | None
    """None unless enable_lora."""
    parallel_config: ParallelConfig


_CONFIG_FIELD = {"scheduling_policy": "policy"}
"""EngineArgs fields named unlike their config field (vLLM's flag name)."""

DECODE_ONLY = frozenset(
    {"remote_prefill_min_tokens", "max_remote_prefill_queue_tokens", "speculative_config"}
)
"""Engine settings that are flags of the decode role only (`pdserve decode`, `pdserve serve`)."""

DECODE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({"remote_prefill_min_tokens": 32})
"""The decode role's defaults where they differ from the engine's (its flags' defaults, the one
place they are written): a decode node prefills prompts with fewer than 32 uncached tokens
itself; SchedulerConfig's 1 (the engine's, which offline never prefills remotely) would send
every prompt that can go remote."""


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting: the flags of `pdserve generate`, `prefill`, `decode` and `serve`
    (add_cli_args / from_cli_args / to_argv) and LLM(...)'s keyword arguments. Defaults and help
    are the config dataclasses'; to_configs() builds (and so validates) them."""

    model: str
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    seed: int = ModelConfig.seed
    attention_backend: str = ModelConfig.attention_backend
    device: str = ModelConfig.device
    enforce_eager: bool = ModelConfig.enforce_eager
    block_size: int = CacheConfig.block_size
    num_blocks: int | None = CacheConfig.num_blocks
    kv_cache_memory: float = CacheConfig.kv_cache_memory
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    kv_cache_prefault: bool = CacheConfig.kv_cache_prefault
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    scheduling_policy: str = SchedulerConfig.policy
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    max_prefill_tokens_while_decoding: int | None = (
        SchedulerConfig.max_prefill_tokens_while_decoding
    )
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    enable_lora: bool = LoRAConfig.enable_lora
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras
    remote_prefill_min_tokens: int = SchedulerConfig.remote_prefill_min_tokens
    max_remote_prefill_queue_tokens: int = SchedulerConfig.max_remote_prefill_queue_tokens
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None
    """Speculative decoding, like vLLM's speculative_config: a SpeculativeConfig or a dict of its
    keys (on the command line, a JSON object), e.g. {"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "draft_model", "model":
    "DRAFT_DIR", "num_speculative_tokens": 3}; None: off."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, decode: bool = False) -> None:
        """Add the engine flags, vLLM's names; decode: also the decode role's (DECODE_ONLY),
        with its defaults (DECODE_DEFAULTS)."""
        group = parser.add_argument_group("engine")
        defaults = _defaults(decode)
        for f in fields(cls):
            if f.name in defaults:
                hint, doc = _source(f.name)
                add_flag(group, f.name, hint, defaults[f.name], doc, **_FLAG_KWARGS.get(f.name, {}))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """From flags parsed by a parser add_cli_args built (absent decode flags: defaults)."""
        return config_from_namespace(cls, args)

    def to_argv(self, decode: bool = False) -> list[str]:
        """The flags that rebuild these args in a parser add_cli_args(decode) built: --model and
        every setting that differs from that parser's default."""
        defaults = _defaults(decode)
        argv = flag_argv("model", self.model)
        for name, default in defaults.items():
            value = getattr(self, name)
            if value == default or name == "model":
                continue
            if value is None:
                raise ValueError(f"{name}=None has no flag (its flag's default is {default!r})")
            if name == "speculative_config":
                value = _speculative_json(value)
            argv += flag_argv(name, value)
        return argv

    def to_configs(self) -> EngineConfigs:
        """The engine's configs; ValueError names a bad setting."""
        speculative = self.speculative_config
        return EngineConfigs(
            ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
                attention_backend=self.attention_backend,
                device=self.device,
                enforce_eager=self.enforce_eager,
            ),
            CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_dtype=self.kv_cache_dtype,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_prefault=self.kv_cache_prefault,
            ),
            SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,  # type: ignore[arg-type]  # validated there
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                remote_prefill_min_tokens=self.remote_prefill_min_tokens,
                max_remote_prefill_queue_tokens=self.max_remote_prefill_queue_tokens,
            ),
            SpeculativeConfig.from_dict(speculative)
            if isinstance(speculative, Mapping)
            else speculative,
            LoRAConfig(
                enable_lora=self.enable_lora,
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras,
            )
            if self.enable_lora
            else None,
            ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
            ),
        )


def _source(name: str) -> tuple[Any, str]:
    """(type hint, help) of an EngineArgs field: those of the config field it sets."""
    config_name = _CONFIG_FIELD.get(name, name)
    for config in (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig):
        if config_name in config.__dataclass_fields__:
            return get_type_hints(config)[config_name], config_field_docs(config)[config_name]
    doc = config_field_docs(EngineArgs)[name]
    if name == "speculative_config":
        doc += f" Keys: {', '.join(f.name for f in fields(SpeculativeConfig))}."
    return get_type_hints(EngineArgs)[name], doc


def _defaults(decode: bool) -> dict[str, Any]:
    """{field: its flag's default} of the flags add_cli_args(decode) adds."""
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    if not decode:
        return {name: value for name, value in defaults.items() if name not in DECODE_ONLY}
    return defaults | dict(DECODE_DEFAULTS)


def _speculative_config_flag(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as exc:  # argparse shows this message (a ValueError's would be lost)
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _speculative_json(value: SpeculativeConfig | Mapping[str, Any]) -> str:
    if isinstance(value, SpeculativeConfig):
        value = {
            f.name: getattr(value, f.name)
            for f in fields(value)
            if f.name == "method" or getattr(value, f.name) != f.default
        }
    return json.dumps(dict(value))


_FLAG_KWARGS: dict[str, dict[str, Any]] = {
    "dtype": {"choices": ("auto", *SUPPORTED_DTYPES)},
    "attention_backend": {"choices": ("auto", "torch", "cpu", "triton")},
    "kv_cache_dtype": {"choices": KV_CACHE_DTYPES},
    "speculative_config": {"type": _speculative_config_flag, "metavar": "JSON"},
}
"""argparse settings a field's type hint does not give."""
