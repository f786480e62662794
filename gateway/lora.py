"""LoRA adapters at the gateway, as vLLM's server offers them: `--lora-modules name=path`
(or vLLM's JSON form), each adapter a model id clients name (listed in /v1/models with the base
as its parent), carried to the nodes in DecodeRequest.lora; and, with
--allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), POST
/v1/load_lora_adapter and /v1/unload_lora_adapter. Unloading stops new requests for the adapter;
requests already running finish with it (the nodes keep it in memory until evicted).

The gateway checks that a directory looks like a PEFT LoRA adapter (adapter_config.json of
peft_type LORA); the nodes read the weights and check them against the base model, and a
request whose adapter a node cannot load fails with 400 naming why.
"""

from __future__ import annotations

import argparse
import json
import logging
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pdserve.gateway.errors import ApiError
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules value: name=path, or JSON {"name": ..., "path": ...} (vLLM's)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise argparse.ArgumentTypeError('expected {"name": ..., "path": ...}')
        return str(value["name"]), str(value["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def adapter_problem(path: str) -> str | None:
    """Why path is not a PEFT LoRA adapter directory (None: it looks like one)."""
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return f"{path} holds no adapter_config.json"
    try:
        peft_type = json.loads(config.read_text()).get("peft_type", "LORA")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        return f"{config} is not a readable JSON object: {e}"
    if peft_type != "LORA":
        return f"{config}: peft_type {peft_type!r} is not LORA"
    return None


class LoRARegistry:
    """The adapters clients may name, with vLLM's ids (1, 2, ... in the order added)."""

    def __init__(self, modules: tuple[tuple[str, str], ...], base_names: tuple[str, ...]) -> None:
        self._base_names = base_names
        self._adapters: dict[str, common_pb2.LoRAAdapter] = {}
        self._next_id = 1
        for name, path in modules:
            problem = adapter_problem(path)
            if problem is not None:
                raise ValueError(f"--lora-modules {name}: {problem}")
            self._add(name, path)

    def _add(self, name: str, path: str) -> None:
        if name in self._base_names or name in self._adapters:
            raise ValueError(f"LoRA adapter name {name!r} is already a model id")
        self._adapters[name] = common_pb2.LoRAAdapter(name=name, id=self._next_id, path=path)
        self._next_id += 1

    def get(self, model: str) -> common_pb2.LoRAAdapter | None:
        return self._adapters.get(model)

    @property
    def adapters(self) -> list[common_pb2.LoRAAdapter]:
        return list(self._adapters.values())

    def load(self, name: str, path: str) -> None:
        """vLLM's load_lora_adapter (ApiError 400 for a taken name or a bad directory)."""
        if name in self._adapters:
            raise ApiError.bad_request(f"The lora adapter '{name}' has already been loaded.")
        if name in self._base_names:
            raise ApiError.bad_request(f"'{name}' is the base model's id", "lora_name")
        problem = adapter_problem(path)
        if problem is not None:
            raise ApiError.bad_request(problem, "lora_path")
        self._add(name, path)
        logger.info("LoRA adapter %s registered (%s)", name, path)

    def unload(self, name: str) -> None:
        """vLLM's unload_lora_adapter (ApiError 404 for an unknown name)."""
        if self._adapters.pop(name, None) is None:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"The lora adapter '{name}' cannot be found.",
                "not_found_error",
                "lora_name",
            )
        logger.info("LoRA adapter %s unregistered", name)


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    """vLLM's runtime adapter routes (behind --api-key like every /v1 route)."""

    async def load(body: LoadLoRARequest) -> PlainTextResponse:
        registry.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(body: UnloadLoRARequest) -> PlainTextResponse:
        registry.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"])
