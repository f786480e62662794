"""Conversions between the engine's types and the pdserve.v1 protobuf messages."""

from __future__ import annotations

import dataclasses

from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.request import RequestStatus, SamplingParams, TokenLogprobs
from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputSpec
from pdserve.kvtransfer.wire import LayoutSignature
from pdserve.v1 import common_pb2, node_pb2

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
}

_KINDS = {
    StructuredOutputKind.JSON: common_pb2.STRUCTURED_OUTPUT_KIND_JSON,
    StructuredOutputKind.JSON_OBJECT: common_pb2.STRUCTURED_OUTPUT_KIND_JSON_OBJECT,
    StructuredOutputKind.REGEX: common_pb2.STRUCTURED_OUTPUT_KIND_REGEX,
    StructuredOutputKind.CHOICE: common_pb2.STRUCTURED_OUTPUT_KIND_CHOICE,
    StructuredOutputKind.GRAMMAR: common_pb2.STRUCTURED_OUTPUT_KIND_GRAMMAR,
}
_KINDS_FROM_PROTO = {v: k for k, v in _KINDS.items()}

_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "logprobs",
    "skip_special_tokens",
    "prompt_logprobs",
)


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; raises ValueError when invalid."""
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    return SamplingParams(
        **kwargs,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=tuple(msg.allowed_token_ids) or None,
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in msg.bad_words),
        structured_output=structured_output_from_proto(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
        structured_output_resume=msg.structured_output.num_generated_in_prompt,
    )


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    """ValueError for an unset or unknown kind."""
    kind = _KINDS_FROM_PROTO.get(msg.kind)
    if kind is None:
        raise ValueError(f"structured_output.kind {msg.kind} is not a known kind")
    return StructuredOutputSpec(kind, msg.value)


def structured_output_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=_KINDS[spec.kind], value=spec.text)


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        logit_bias=params.logit_bias or {},
        allowed_token_ids=list(params.allowed_token_ids or ()),
        bad_words=[
            common_pb2.TokenSequence(token_ids=list(word)) for word in params.bad_words_token_ids
        ],
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
        msg.structured_output.num_generated_in_prompt = params.structured_output_resume
    return msg


def logprob_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()]
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=top)


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    top = {t.token_id: t.logprob for t in msg.top}
    return TokenLogprobs(token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank, top=top)


def finish_reason_to_proto(status: RequestStatus) -> int:
    return _FINISH_REASONS.get(status, common_pb2.FINISH_REASON_UNSPECIFIED)


def layout_to_proto(layout: LayoutSignature) -> node_pb2.KVLayout:
    return node_pb2.KVLayout(**dataclasses.asdict(layout))


def layout_from_proto(msg: node_pb2.KVLayout) -> LayoutSignature:
    """The proto's fields are named like LayoutSignature's (a test keeps them so)."""
    return LayoutSignature(
        **{f.name: getattr(msg, f.name) for f in dataclasses.fields(LayoutSignature)}
    )


def lora_from_proto(msg: common_pb2.LoRAAdapter) -> LoRARequest:
    """ValueError for an empty name or path or an id <= 0."""
    return LoRARequest(msg.name, msg.id, msg.path)


def lora_to_proto(lora: LoRARequest) -> common_pb2.LoRAAdapter:
    return common_pb2.LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id, path=lora.lora_path)
