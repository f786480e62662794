"""EngineArgs: one source for every engine flag, its default and its help (the configs'), the
flags that rebuild it (to_argv), and its validation through the configs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import pytest

from pdserve.engine import LLM
from pdserve.engine.arg_utils import (
    DECODE_DEFAULTS,
    EngineArgs,
    add_config_flags,
    config_field_docs,
)
from pdserve.engine.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

ENGINE_FLAGS = [
    "--model",
    "--tokenizer",
    "--dtype",
    "--max-model-len",
    "--seed",
    "--attention-backend",
    "--device",
    "--enforce-eager",
    "--no-enforce-eager",
    "--block-size",
    "--num-blocks",
    "--kv-cache-memory",
    "--gpu-memory-utilization",
    "--num-gpu-blocks-override",
    "--kv-cache-dtype",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--kv-cache-prefault",  # ours
    "--no-kv-cache-prefault",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--scheduling-policy",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--max-prefill-tokens-while-decoding",  # ours
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--enable-lora",
    "--no-enable-lora",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
]
DECODE_FLAGS = [
    "--remote-prefill-min-tokens",
    "--max-remote-prefill-queue-tokens",
    "--speculative-config",
]


def parser(decode: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, decode=decode)
    return p


def flags(p: argparse.ArgumentParser) -> list[str]:
    return [s for a in p._actions for s in a.option_strings if s not in ("-h", "--help")]


def helps(p: argparse.ArgumentParser) -> dict[str, str | None]:
    return {a.dest: a.help for a in p._actions}


def test_the_flags_keep_vllms_names() -> None:
    assert flags(parser()) == ENGINE_FLAGS
    assert flags(parser(decode=True)) == ENGINE_FLAGS + DECODE_FLAGS


def test_every_default_is_the_configs() -> None:
    args = EngineArgs(model="m")
    configs = args.to_configs()
    assert configs == (
        ModelConfig(model="m"),
        CacheConfig(),
        SchedulerConfig(),
        None,
        None,
        ParallelConfig(),
    )
    assert (args.dtype, args.max_model_len, args.seed) == ("auto", None, 0)
    assert (args.block_size, args.num_blocks, args.kv_cache_memory) == (16, None, 4.0)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (128, 2048)
    assert (args.scheduling_policy, args.enable_chunked_prefill) == ("fcfs", True)
    assert (args.remote_prefill_min_tokens, args.max_remote_prefill_queue_tokens) == (1, 0)


def test_flag_defaults_are_the_configs_and_the_decode_roles() -> None:
    assert EngineArgs.from_cli_args(parser().parse_args(["--model", "m"])) == EngineArgs("m")
    decode = EngineArgs.from_cli_args(parser(decode=True).parse_args(["--model", "m"]))
    assert DECODE_DEFAULTS == {"remote_prefill_min_tokens": 32}
    assert decode == EngineArgs("m", remote_prefill_min_tokens=32)


def test_help_is_the_config_fields_docstring() -> None:
    by_dest = helps(parser(decode=True))
    assert by_dest["block_size"] == "Tokens per KV block."
    assert by_dest["block_size"] == config_field_docs(CacheConfig)["block_size"]
    assert by_dest["scheduling_policy"] == config_field_docs(SchedulerConfig)["policy"]
    assert by_dest["dtype"] == config_field_docs(ModelConfig)["dtype"]
    # a docstring over several lines, whitespace collapsed
    assert by_dest["kv_cache_memory"] == (
        "CPU: KV cache size in GiB when num_blocks is not given (the CPU analogue of "
        "gpu_memory_utilization)."
    )
    for dest in ("remote_prefill_min_tokens", "max_remote_prefill_queue_tokens"):
        assert by_dest[dest] == config_field_docs(SchedulerConfig)[dest]
    assert by_dest["speculative_config"].startswith("Speculative decoding, like vLLM's")
    assert by_dest["speculative_config"].endswith(
        "Keys: method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
        "draft_num_blocks, max_batch_for_speculation, min_expected_accepted, backoff_steps, "
        "acceptance_ema_alpha."
    )


def test_field_docs_of_a_subclass_include_its_bases_and_percent_signs_survive_help() -> None:
    @dataclass(frozen=True)
    class Base:
        rate: float = 0.5
        """Share of requests, in %."""
        name: str = "a"
        """Base's name."""

    @dataclass(frozen=True)
    class Child(Base):
        name: str = "b"
        """Child's name."""
        count: int = 3

    assert config_field_docs(Child) == {"rate": "Share of requests, in %.", "name": "Child's name."}
    p = argparse.ArgumentParser()
    add_config_flags(p, Child, ["rate", "name"])
    assert "Share of requests, in %." in p.format_help()
    assert p.parse_args([]) == argparse.Namespace(rate=0.5, name="b")


def test_to_argv_writes_only_what_differs_from_the_parsers_defaults() -> None:
    args = EngineArgs("m", block_size=32, enable_prefix_caching=False, seed=-1)
    assert args.to_argv() == [
        "--model=m",
        "--seed=-1",
        "--block-size=32",
        "--no-enable-prefix-caching",
    ]
    # decode-only settings are not flags of the other roles
    assert EngineArgs("m", remote_prefill_min_tokens=8).to_argv() == ["--model=m"]
    # 1 is the engine's default but not the decode flag's (32): it must be written
    assert EngineArgs("m", remote_prefill_min_tokens=1).to_argv(decode=True) == [
        "--model=m",
        "--remote-prefill-min-tokens=1",
    ]
    assert EngineArgs("m", remote_prefill_min_tokens=32).to_argv(decode=True) == ["--model=m"]
    spec = EngineArgs("m", speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    assert spec.to_argv(decode=True)[-1] == (
        '--speculative-config={"method": "ngram", "num_speculative_tokens": 2}'
    )


NON_DEFAULT = EngineArgs(
    model="-model dir",
    dtype="bfloat16",
    max_model_len=256,
    seed=-3,
    block_size=32,
    num_blocks=40,
    kv_cache_memory=0.5,
    enable_prefix_caching=False,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    scheduling_policy="priority",
    enable_chunked_prefill=False,
    remote_prefill_min_tokens=1,
    max_remote_prefill_queue_tokens=100,
    speculative_config=SpeculativeConfig(
        method="draft_model", model="draft", num_speculative_tokens=2, min_expected_accepted=0.25
    ),
)


def test_from_cli_args_of_to_argv_round_trips() -> None:
    decode = parser(decode=True).parse_args(NON_DEFAULT.to_argv(decode=True))
    assert EngineArgs.from_cli_args(decode) == NON_DEFAULT
    # the other roles: every setting but the decode role's
    other = EngineArgs.from_cli_args(parser().parse_args(NON_DEFAULT.to_argv()))
    assert other == replace(NON_DEFAULT, max_remote_prefill_queue_tokens=0, speculative_config=None)
    # a dict round-trips to the SpeculativeConfig it stands for
    as_dict = EngineArgs("m", speculative_config={"num_speculative_tokens": 5})
    parsed = parser(decode=True).parse_args(as_dict.to_argv(decode=True))
    assert EngineArgs.from_cli_args(parsed).speculative_config == SpeculativeConfig(
        num_speculative_tokens=5
    )


def test_a_setting_without_a_flag_value_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size=None has no flag"):
        EngineArgs("m", block_size=None).to_argv()  # type: ignore[arg-type]


def test_llm_rejects_an_unknown_keyword() -> None:
    # raised before any model is read: the directory need not exist
    with pytest.raises(TypeError, match=r"unknown engine arguments \['policy', 'tp'\]"):
        LLM(model="no/such/dir", policy="priority", tp=2)


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"dtype": "float16"}, "dtype must be one of"),
        ({"max_model_len": 0}, "max_model_len must be >= 1"),
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"num_blocks": 1}, "num_blocks must be >= 2"),
        ({"kv_cache_memory": 0.0}, "kv_cache_memory must be > 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"scheduling_policy": "lifo"}, "policy must be 'fcfs' or 'priority'"),
        ({"remote_prefill_min_tokens": 0}, "remote_prefill_min_tokens must be >= 1"),
        ({"max_remote_prefill_queue_tokens": -1}, "max_remote_prefill_queue_tokens must be >= 0"),
        ({"speculative_config": {"k": 3}}, r"unknown speculative_config keys \['k'\]"),
        ({"speculative_config": {"num_speculative_tokens": 0}}, "num_speculative_tokens"),
    ],
)
def test_to_configs_validates(setting: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs("m", **setting).to_configs()


def test_a_bad_speculative_config_flag_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parser(decode=True).parse_args(["--model", "m", "--speculative-config", '{"k": 3}'])
    assert "argument --speculative-config: unknown speculative_config keys ['k']" in (
        capsys.readouterr().err
    )
