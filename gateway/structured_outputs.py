"""A request's structured-output parameters -> one StructuredOutputSpec on the wire.

Accepted spellings, as vLLM's server takes them: OpenAI's response_format (json_object,
json_schema), vLLM's structured_outputs {json, regex, choice, grammar, json_object} and its
older guided_json / guided_regex / guided_choice / guided_grammar. At most one constraint per
request. The spec is checked here (xgrammar parses it, no tokenizer needed), so a malformed
schema, an unsupported schema feature or a bad regex is a 400 naming it before any node sees
the request; nodes compile it against their vocabulary off the engine thread.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pdserve.common.protocol import structured_output_from_proto, structured_output_to_proto
from pdserve.engine.structured_output import StructuredOutputKind, StructuredOutputSpec, check_spec
from pdserve.gateway.errors import ApiError
from pdserve.v1 import common_pb2

_STRUCTURED_OUTPUTS_KEYS = {
    "json": StructuredOutputKind.JSON,
    "regex": StructuredOutputKind.REGEX,
    "choice": StructuredOutputKind.CHOICE,
    "grammar": StructuredOutputKind.GRAMMAR,
}
_GUIDED = {f"guided_{key}": kind for key, kind in _STRUCTURED_OUTPUTS_KEYS.items()}
_BACKENDS = (None, "auto", "xgrammar")


def _spec(kind: StructuredOutputKind, value: Any, param: str) -> StructuredOutputSpec:
    """value as the request gave it (a schema object or text, a list of choices, a string)."""
    if kind is StructuredOutputKind.JSON:
        if isinstance(value, str):
            text = value
        elif isinstance(value, dict | bool):
            text = json.dumps(value)
        else:
            raise ApiError.bad_request(f"{param} must be a JSON schema (object or text)", param)
    elif kind is StructuredOutputKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError.bad_request(f"{param} must be a non-empty list of strings", param)
        return StructuredOutputSpec.choice(value)
    elif isinstance(value, str) and value:
        text = value
    else:
        raise ApiError.bad_request(f"{param} must be a non-empty string", param)
    return StructuredOutputSpec(kind, text)


def _from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputSpec | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(StructuredOutputKind.JSON_OBJECT)
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ApiError.bad_request(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        return _spec(StructuredOutputKind.JSON, schema, "response_format")
    raise ApiError.bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema are)",
        "response_format",
    )


def _from_structured_outputs(value: Any) -> list[tuple[str, StructuredOutputSpec]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise ApiError.bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - {*_STRUCTURED_OUTPUTS_KEYS, "json_object"})
    set_keys = {k: v for k, v in value.items() if v is not None and v is not False}
    if unknown:
        raise ApiError.bad_request(
            f"structured_outputs {unknown} are not supported "
            f"(json, regex, choice, grammar, json_object are)",
            "structured_outputs",
        )
    found = []
    for key, item in set_keys.items():
        param = f"structured_outputs.{key}"
        if key == "json_object":
            found.append((param, StructuredOutputSpec(StructuredOutputKind.JSON_OBJECT)))
        else:
            found.append((param, _spec(_STRUCTURED_OUTPUTS_KEYS[key], item, param)))
    return found


def structured_output_of(body: Any) -> StructuredOutputSpec | None:
    """The one constraint a (chat or completions) request sets, checked; None when none is.
    A 400 when several are set or the one set is invalid."""
    backend = getattr(body, "guided_decoding_backend", None)
    if backend not in _BACKENDS:
        raise ApiError.bad_request(
            f"guided_decoding_backend {backend!r} is not available (xgrammar is)",
            "guided_decoding_backend",
        )
    found = _from_structured_outputs(getattr(body, "structured_outputs", None))
    for name, kind in _GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _spec(kind, value, name)))
    response_format = _from_response_format(getattr(body, "response_format", None))
    if response_format is not None:
        found.append(("response_format", response_format))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise ApiError.bad_request(
            f"only one structured output constraint may be set, got {names}", names[1]
        )
    if not found:
        return None
    param, spec = found[0]
    check(spec, param)
    return spec


def check(spec: StructuredOutputSpec, param: str) -> None:
    """A 400 naming param and the problem when the spec cannot be compiled."""
    error = _check_cached(spec)
    if error is not None:
        raise ApiError.bad_request(f"{param}: {error}", param)


@functools.lru_cache(maxsize=256)
def _check_cached(spec: StructuredOutputSpec) -> str | None:
    try:
        check_spec(spec)
    except ValueError as exc:
        return str(exc)
    return None


def add_structured_output(params: common_pb2.SamplingParams, spec: StructuredOutputSpec) -> None:
    params.structured_output.CopyFrom(structured_output_to_proto(spec))


def check_wire_structured_output(params: common_pb2.SamplingParams) -> None:
    """A gRPC front request's structured_output: a 400 when its kind is unknown or it does
    not compile."""
    if not params.HasField("structured_output"):
        return
    try:
        spec = structured_output_from_proto(params.structured_output)
    except ValueError as exc:
        raise ApiError.bad_request(str(exc), "structured_output") from exc
    check(spec, "structured_output")
