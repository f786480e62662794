"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens.

The draft owns its own paged KV cache (its own KVCacheManager without prefix caching, its own
PagedModel), so it never touches the target's blocks. Per request it tracks how many of the
request's tokens it has computed. A proposal first catches up, in one flattened forward for
every request (the whole prompt the first time: on a decode node that is how the draft gets
its prompt KV, since only the target's KV comes over the wire), then runs k - 1 more batched
single-token forwards. Each draft is sampled with the request's own SamplingParams from the
draft's processed distribution q (greedy rows: its argmax) and q is kept for the rejection
sampler. After verification the draft's counter rolls back to the accepted prefix: its KV
past that is garbage and gets overwritten.

Invariant: between steps (after rollback), num_computed[r] <= num_tokens of r, and the draft's
KV for positions [0, num_computed[r]) is that of the request's tokens. A proposal recomputes at
least the request's last token (its logits are needed, and logits are not kept).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.model_runner import PagedModel
from pdserve.engine.models.loader import load_model, parse_model_arch
from pdserve.engine.outputs import ScheduledChunk
from pdserve.engine.request import Request
from pdserve.engine.sampler import (
    DRAFT_STREAM,
    SampleRow,
    SamplingMetadata,
    argmax_rows,
    compute_probs,
    random_sample,
)
from pdserve.engine.spec_decode.proposer import Proposal
from pdserve.kernels.cpu import cpu_ops

logger = logging.getLogger(__name__)


@dataclass
class _Drafting:
    """One request's proposal in progress."""

    request: Request
    k: int
    block_ids: list[int]
    num_tokens: int
    """The request's num_tokens: drafts go to positions num_tokens, num_tokens + 1, ..."""
    tokens: list[int]
    probs: list[Tensor]


class DraftModelProposer:
    """Proposes with a draft model over its own paged KV cache of num_blocks blocks."""

    def __init__(
        self,
        model_dir: str,
        dtype: str,
        vocab_size: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        device: torch.device | None = None,
    ) -> None:
        device = device or torch.device("cpu")
        arch = parse_model_arch(model_dir)  # checked before loading any weight
        if arch.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {model_dir!r} has vocab_size {arch.vocab_size}, the target "
                f"{vocab_size}: a draft must share the target's vocabulary"
            )
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(
                f"draft model {model_dir!r} supports {arch.max_position_embeddings} positions, "
                f"fewer than max_model_len {max_model_len}"
            )
        model, arch = load_model(model_dir, dtype, max_model_len, device=device)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        dtype = next(model.parameters()).dtype
        ops = cpu_ops() if device.type == "cpu" else None
        self.model = PagedModel(
            model, arch, dtype, num_blocks, block_size, fused_ops=ops, device=device
        )
        self.num_computed: dict[str, int] = {}
        """Request id -> leading tokens of the request whose KV this draft holds."""

    @torch.inference_mode()
    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, Proposal]:
        drafting = [d for d in (self._start(r, k) for r, k in requests) if d is not None]
        if not drafting:
            return {}
        # Forward 0: catch up (last token at least) and draft position num_tokens.
        self._draft_next(drafting, [self._catch_up_chunk(d) for d in drafting])
        for i in range(1, max(d.k for d in drafting)):
            active = [d for d in drafting if d.k > i]
            self._draft_next(active, [self._next_chunk(d) for d in active])
        for d in drafting:
            self.num_computed[d.request.request_id] = d.num_tokens + d.k - 1
        return {d.request.request_id: Proposal(d.tokens, torch.stack(d.probs)) for d in drafting}

    def rollback(self, request_id: str, num_tokens: int) -> None:
        if request_id not in self.num_computed:
            return
        kept = min(self.num_computed[request_id], num_tokens)
        self.num_computed[request_id] = kept
        self.kv.trim(request_id, kept)

    def free(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)
        self.kv.free_request_id(request_id)

    def _start(self, request: Request, k: int) -> _Drafting | None:
        """Reserve slots for positions [0, num_tokens + k - 1) (the last draft is proposed,
        not computed); None, proposing nothing, when the draft's cache is full."""
        request_id, num_tokens = request.request_id, request.num_tokens
        if not self.kv.allocate_positions(request_id, num_tokens + k - 1):
            logger.debug("draft KV cache full: no proposal for %s", request_id)
            return None
        block_ids = self.kv.get_block_ids(request_id)
        return _Drafting(request, k, block_ids, num_tokens, [], [])

    def _catch_up_chunk(self, d: _Drafting) -> ScheduledChunk:
        request_id = d.request.request_id
        start = min(self.num_computed.get(request_id, 0), d.num_tokens - 1)
        tokens = d.request.token_slice(start, d.num_tokens)
        return ScheduledChunk(request_id, tokens, start, d.block_ids, 0, True)

    @staticmethod
    def _next_chunk(d: _Drafting) -> ScheduledChunk:
        """The latest draft, to compute at its position (num_tokens + drafts so far - 1)."""
        position = d.num_tokens + len(d.tokens) - 1
        return ScheduledChunk(d.request.request_id, [d.tokens[-1]], position, d.block_ids, 0, True)

    def _draft_next(self, drafting: list[_Drafting], chunks: list[ScheduledChunk]) -> None:
        """One forward; each request samples its next draft from the draft's q."""
        logits = self.model.compute_logits(chunks)
        rows = [self._row(d) for d in drafting]
        meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
        probs = compute_probs(logits, meta)
        tokens = argmax_rows(probs)  # greedy rows are one-hot
        if not meta.all_greedy:
            random = random_sample(
                probs[meta.random_rows], meta.seeds, meta.positions, DRAFT_STREAM
            )
            tokens[meta.random_rows] = random
        for d, token, q in zip(drafting, tokens.tolist(), probs, strict=True):
            d.tokens.append(token)
            d.probs.append(q)

    @staticmethod
    def _row(d: _Drafting) -> SampleRow:
        """The request's row for its next draft, as the target will see it when verifying."""
        request = d.request
        return SampleRow(
            params=request.sampling_params,
            seed=request.seed,
            position=d.num_tokens + len(d.tokens),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=[*request.output_token_ids, *d.tokens],
            eos_token_ids=request.eos_token_ids,
        )
