"""CUDA graphs of the decode step (vLLM's and nano-vllm's): on small models a decode step is
hundreds of short kernels and their launches, not the GPU, set its time. At start-up the
target's forward is captured once per batch size of a ladder (1, 2, 4, 8, 16, 24, ...) over
static input buffers; a decode-only step copies its inputs into the buffers of the next size
up and replays that graph. Padding rows decode token 0 at position 0 with a context of one
key and write their K/V into the null block's slot 0, which no request reads.

Only the layers run in the graph; the logits and the sampler run after it, eagerly, on the
rows that are real. On a CPU there is nothing to capture: `capture()` runs each size once
(the same buffers and padding, eagerly), so the buffer handling is tested where no GPU is.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.outputs import ScheduledChunk
from pdserve.engine.utils import cdiv

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256
"""The largest batch captured (vLLM's default ladder ends at 512; 256 keeps start-up short)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to max_num_seqs (and
    MAX_CAPTURE_SIZE), the last one covering max_num_seqs itself."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return sizes + [limit]


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""The model forward the graphs capture: (input_ids, positions, meta) -> hidden [T, H]."""


class DecodeGraphs:
    """The captured decode forwards of one model and their static inputs."""

    def __init__(
        self,
        forward: Forward,
        meta_for: Callable[..., AttentionMetadata],
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        """forward: the model's layers; meta_for(slot_mapping, block_tables, seq_lens): the
        AttentionMetadata of a decode-only batch over those static tensors."""
        self.forward = forward
        self.meta_for = meta_for
        self.device = device
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = cdiv(max_model_len, block_size)
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for size in reversed(self.sizes):
            self._run(size)  # warm-up: Triton compiles, allocator settles, outside the graph
            if not cuda:
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._run(size)
            self._graphs[size] = graph
        if cuda:
            torch.cuda.synchronize(self.device)
        logger.info(
            "decode %s for batch sizes %s in %.1fs",
            "CUDA graphs captured" if cuda else "static buffers ready (CPU: run eagerly)",
            self.sizes,
            time.perf_counter() - start,
        )

    def _run(self, size: int) -> torch.Tensor:
        meta = self.meta_for(
            self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size]
        )
        return self.forward(self.input_ids[:size], self.positions[:size], meta)

    def accepts(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step is a decode-only batch the graphs cover."""
        return 0 < len(chunks) <= self.max_batch and all(len(c.token_ids) == 1 for c in chunks)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Hidden states [len(chunks), hidden] of a decode-only batch, in chunk order. The
        tensor is the graph's output buffer: read it before the next run."""
        n = len(chunks)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.block_size
        ids = torch.zeros(size, dtype=torch.long)
        positions = torch.zeros(size, dtype=torch.long)
        slots = torch.zeros(size, dtype=torch.long)  # padding rows: the null block's slot 0
        lens = torch.ones(size, dtype=torch.long)
        tables = torch.zeros(size, self.max_blocks, dtype=torch.long)
        for i, c in enumerate(chunks):
            p = c.start_pos
            ids[i], positions[i], lens[i] = c.token_ids[0], p, p + 1
            slots[i] = c.block_ids[p // bs] * bs + p % bs
            used = c.block_ids[: cdiv(p + 1, bs)]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        for static, host in (
            (self.input_ids, ids),
            (self.positions, positions),
            (self.slot_mapping, slots),
            (self.seq_lens, lens),
            (self.block_tables, tables),
        ):
            static[:size].copy_(host, non_blocking=True)
        graph = self._graphs.get(size)
        if graph is None:  # CPU: the same buffers, eagerly
            return self._run(size)[:n]
        graph.replay()
        return self._outputs[size][:n]
