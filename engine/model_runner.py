"""SchedulerOutput -> flattened batch tensors -> one forward -> logits -> sampled tokens.

The model runner owns the KV cache tensors and knows nothing of request policy: it computes the
chunks it is given and samples where a chunk asks for it, with each request's SampleRow.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine.attention import AttentionMetadata, PrefillSeq, use_cpu_decode_kernel
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import ModelArch
from engine.sampler import Sampler, SampleRow, SamplingMetadata
from engine.scheduler import SampledTokens, ScheduledChunk, SchedulerOutput
from kernels.cpu import cpu_ops


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem


def zeroed_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS zeroes on first touch (calloc -> mmap), so a multi-GiB
    KV cache costs nothing at start-up. Zeros matter: padding slots must never hold NaN (a
    masked NaN still poisons softmax(QK) @ V)."""
    numel = int(np.prod(shape))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(numel * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class ModelRunner:
    """Runs the model over a paged KV cache of num_blocks blocks."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        arch: ModelArch,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        use_cpu_kernels: bool = True,
    ) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        # [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim] (engine/attention.py)
        self.kv_cache = zeroed_lazily(
            (arch.num_layers, *model.kv_cache_shape(num_blocks, block_size)), dtype
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.sampler = Sampler()
        ops = cpu_ops() if use_cpu_kernels else None
        use_cpu_decode_kernel(ops.paged_decode_attention if ops is not None else None)
        self.forward_time_s = 0.0
        """Time spent in the model forward (transformer layers), summed over steps."""

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, rows: dict[str, SampleRow]
    ) -> dict[str, SampledTokens]:
        """Compute every chunk; sample one token for each chunk that reaches its end."""
        chunks = sorted(output.chunks, key=lambda c: len(c.token_ids) > 1)  # decodes first
        input_ids, positions, meta = self._prepare_inputs(chunks)
        start = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self.forward_time_s += time.perf_counter() - start
        sample_chunks = [c for c in chunks if c.samples]
        if not sample_chunks:
            return {}
        last_index = torch.tensor(self._last_token_indices(chunks), dtype=torch.long)
        logits = self.model.compute_logits(hidden[last_index])
        sample_rows = [rows[c.request_id] for c in sample_chunks]
        sampled = self.sampler(logits, SamplingMetadata.build(sample_rows, logits.shape[-1]))
        return {
            c.request_id: SampledTokens([tok], [lp] if lp is not None else None)
            for c, tok, lp in zip(sample_chunks, sampled.token_ids, sampled.logprobs, strict=True)
        }

    def _last_token_indices(self, chunks: list[ScheduledChunk]) -> list[int]:
        indices, offset = [], 0
        for chunk in chunks:
            offset += len(chunk.token_ids)
            if chunk.samples:
                indices.append(offset - 1)
        return indices

    def _prepare_inputs(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        nd = len(decodes)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for c in decodes:
            p = c.start_pos
            ids.append(c.token_ids[0])
            pos.append(p)
            slots.append(c.block_ids[p // bs] * bs + p % bs)
        prefills = []
        prefill_slots = []
        offset = nd
        for c in chunks[nd:]:
            n = len(c.token_ids)
            table = torch.tensor(c.block_ids, dtype=torch.long)
            p = torch.arange(c.start_pos, c.start_pos + n)
            prefill_slots.append(table[p // bs] * bs + p % bs)
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + n))
            context_len = c.start_pos + n
            prefills.append(PrefillSeq(offset, n, context_len, table[: -(-context_len // bs)]))
            offset += n
        slot_mapping = torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots])
        block_tables, seq_lens, mask = self._decode_tables(decodes)
        meta = AttentionMetadata(slot_mapping, nd, block_tables, seq_lens, mask, prefills, bs)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta

    def _decode_tables(
        self, decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not decodes:
            empty = torch.zeros(0, 1, dtype=torch.long)
            return empty, torch.zeros(0, dtype=torch.long), None
        bs = self.block_size
        seq_lens = [c.start_pos + 1 for c in decodes]
        max_blocks = -(-max(seq_lens) // bs)
        table = [c.block_ids[:max_blocks] + [0] * (max_blocks - len(c.block_ids)) for c in decodes]
        block_tables = torch.tensor(table, dtype=torch.long)
        lens = torch.tensor(seq_lens, dtype=torch.long)
        mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
        return block_tables, lens, mask[:, None, None, :]
