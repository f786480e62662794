"""vLLM's routes beside OpenAI's: POST /tokenize and /detokenize (the prompt and messages forms,
with vLLM's request and response fields) and GET /version."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field, field_validator, model_validator

from pdserve.gateway.context import GatewayContext
from pdserve.gateway.openai_api import (
    RESERVED_TEMPLATE_KWARGS,
    ChatMessage,
    TokenId,
    TopLevelRequest,
)
from pdserve.gateway.prompts import check_token_ids, render_chat


class TokenizeCompletionRequest(TopLevelRequest):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(TopLevelRequest):
    """POST /tokenize with chat messages (rendered through the chat template)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    chat_template: Any = None

    @field_validator("tools", "chat_template", mode="before")
    @classmethod
    def _reject(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server yet")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or {}))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash}")
        return kwargs

    @model_validator(mode="after")
    def _check_continue(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    """vLLM's: the ids, how many, the context limit, and (asked for) each token's string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(TopLevelRequest):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class VllmRoutes:
    """Handlers of vLLM's extra routes over one GatewayContext."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            self.ctx.check_model(model)

    async def tokenize(
        self, body: TokenizeChatRequest | TokenizeCompletionRequest
    ) -> TokenizeResponse:
        self._check_model(body.model)
        tokenizer = self.ctx.tokenizer
        if isinstance(body, TokenizeChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = render_chat(
                tokenizer,
                messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.continue_final_message,
            )
        else:
            text = body.prompt
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        token_strs = None
        if body.return_token_strs:
            token_strs = [tokenizer.backend.id_to_token(t) or "" for t in ids]
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.ctx.max_model_len() or 0,
            tokens=ids,
            token_strs=token_strs,
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        tokenizer = self.ctx.tokenizer
        ids = check_token_ids(body.tokens, tokenizer.vocab_size, "tokens") if body.tokens else []
        return DetokenizeResponse(prompt=tokenizer.decode(ids))

    async def version(self) -> VersionResponse:
        return VersionResponse(version=_VERSION)


def add_vllm_routes(app: FastAPI, ctx: GatewayContext) -> None:
    """Register /tokenize, /detokenize and /version on the REST app."""
    routes = VllmRoutes(ctx)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])


try:
    _VERSION = importlib.metadata.version("pdserve")
    """The installed distribution's version (the app package pdserve/ sits above the gateway
    in the import layers, so it is not imported for it)."""
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    _VERSION = "0+unknown"
