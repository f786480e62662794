"""The offline API, named like vLLM's: LLM(model=...).generate(prompts, SamplingParams)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from tqdm import tqdm

from pdserve.engine.arg_utils import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput
from pdserve.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from pdserve.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """An engine for offline batch generation.

    >>> llm = LLM(model="models/demo")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text

    Keyword arguments are EngineArgs' fields (vLLM's names: dtype, block_size, max_num_seqs,
    scheduling_policy, ...), with its defaults. speculative_config (a dict with vLLM's keys, or
    a SpeculativeConfig) turns on speculative decoding, e.g. {"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "draft_model", "model":
    "models/tiny", "num_speculative_tokens": 3}.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        """kwargs: EngineArgs' fields (TypeError names unknown ones); ValueError names a bad
        value."""
        unknown = sorted(set(kwargs) - {f.name for f in fields(EngineArgs)})
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; see EngineArgs")
        configs = EngineArgs(model=model, **kwargs).to_configs()
        self.engine = LLMEngine(
            configs.model_config,
            configs.cache_config,
            configs.scheduler_config,
            speculative_config=configs.speculative_config,
            lora_config=configs.lora_config,
            parallel_config=configs.parallel_config,
        )
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """The LLM of parsed flags (EngineArgs.from_cli_args)."""
        return cls(**{f.name: getattr(engine_args, f.name) for f in fields(engine_args)})

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, e.g. between benchmark runs of the same prompts;
        False (nothing changed) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in input order.
        lora_request: one adapter for every prompt, or one (or None) per prompt, as vLLM's.
        Every request is validated before any is queued (ValueError names the problem)."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        token_lists = [self._tokenize(p) for p in prompt_list]
        for tokens, params in zip(token_lists, params_list, strict=True):
            self.engine.validate(tokens, params)
        groups = []
        for i, (tokens, params) in enumerate(zip(token_lists, params_list, strict=True)):
            prio = priority[i] if priority is not None else 0
            groups.append(self._add(tokens, params, prio, loras[i]))
        self._run(sum((g for g in groups), []), use_tqdm)
        return [
            self._output(prompt, group) for prompt, group in zip(prompt_list, groups, strict=True)
        ]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings or token-id lists): the final hidden states
        pooled ("last", "mean" or "cls") and, by default, L2-normalized (engine/pooling.py)."""
        token_lists = [self._tokenize(p) for p in self._as_prompt_list(prompts)]
        vectors = self.engine.embed(token_lists, pooling, normalize)
        return [
            EmbeddingRequestOutput(tokens, EmbeddingOutput(vector))
            for tokens, vector in zip(token_lists, vectors, strict=True)
        ]

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # one token-id prompt
        return prompts

    @staticmethod
    def _as_params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _add(
        self,
        tokens: list[int],
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> list[_OfflineRequest]:
        """Queue params.n child requests (seeded ones get seed, seed + 1, ...)."""
        tracked = []
        for index in range(params.n):
            child = (
                params
                if params.n == 1
                else replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            )
            request_id = str(next(self._ids))
            request = self.engine.add_request(
                request_id, tokens, child, priority=priority, lora_request=lora_request
            )
            tracked.append(_OfflineRequest(request, index, self._detokenizer(request)))
        return tracked

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.engine.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=request.sampling_params.skip_special_tokens,
        )

    def _run(self, tracked: list[_OfflineRequest], use_tqdm: bool) -> None:
        by_id = {t.request.request_id: t for t in tracked}
        pending = set(by_id)
        bar = tqdm(total=len(tracked), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for update in self.engine.step().updates:
                    item = by_id.get(update.request_id)
                    if item is None:
                        continue
                    if item.feed(update.new_token_ids) and not update.finished:
                        self.engine.finish_request(
                            update.request_id, RequestStatus.FINISHED_STOPPED
                        )
                    if item.request.finished and update.request_id in pending:
                        item.close()
                        pending.discard(update.request_id)
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and pending:
                    raise RuntimeError(f"requests {sorted(pending)} were lost by the engine")
        finally:
            bar.close()
            for request_id in pending:
                self.engine.abort_request(request_id)

    def _output(self, prompt: Prompt, group: list[_OfflineRequest]) -> RequestOutput:
        first = group[0].request
        return RequestOutput(
            request_id=first.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[t.completion() for t in group],
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs,
            lora_request=first.lora_request,
        )


class _OfflineRequest:
    """A request with its incremental detokenizer and stop-string state."""

    def __init__(self, request: Request, index: int, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.index = index
        self.detok = detok
        self.text = ""
        self.stop_reason: int | str | None = None

    def feed(self, new_token_ids: list[int]) -> bool:
        """Append new text; returns True when a stop string matched (text cut before it)."""
        if self.stop_reason is not None:
            return False
        self.text += self.detok.add(new_token_ids)
        for stop in self.request.sampling_params.stop:
            cut = self.text.find(stop)
            if cut != -1:
                self.text = self.text[:cut]
                self.stop_reason = stop
                return True
        return False

    def close(self) -> None:
        """The request ended: flush text held back for an incomplete character."""
        if self.stop_reason is None:
            self.text += self.detok.finish()

    def completion(self) -> CompletionOutput:
        request = self.request
        params = request.sampling_params
        reason = self.stop_reason
        last = request.output_token_ids[-1] if request.output_token_ids else None
        if reason is None and last is not None and last in params.stop_token_ids:
            reason = last
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(request.output_token_ids),
            finish_reason="stop" if self.stop_reason else request.status.finish_reason,
            logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            stop_reason=reason,
        )
