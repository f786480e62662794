"""The KV connector: the seam between the engine (scheduler + model runner) and a transport.

- `KVPushConnector` (prefill role) implements engine.llm_engine.EngineKVConnector: after each
  step, on the engine thread, it snapshots the blocks of a request that became final (full, or
  the prompt's last partial block once the prompt is done) and hands their sending to the node's
  event loop, so the transfer overlaps the rest of the prefill.
- The decode role needs no connector object: its remote prefills come out of LLMEngine.step()
  (StepOutput.remote_prefills) and decode_node/prefill_client.py has arriving blocks staged
  (KVBlockIO.stage) as they arrive and written (KVBlockIO.scatter) on the engine thread.

A KV cache on a GPU is sent from pinned host memory (KVBlockIO's staging): the engine thread
only queues the device-to-host copies, in pieces of at most STAGING_PIECE_BYTES, and each
piece's send waits for its own copy, so piece i is on the wire while piece i + 1 is copied.
Every transport sends from that host memory; UCX could send device memory directly where
UCX has CUDA transports, but the receiving side's buffers are host memory (the receiver
authenticates and sizes a message before taking one), so staging is kept for all of them.

A transfer carries the request's blocks [skip_blocks, ceil(prompt_len / block_size)) - those
the decode node does not have in its own prefix cache. Block indices on the wire count from
the start of that range (wire block j is the request's block skip_blocks + j, which holds
tokens [(skip_blocks + j) * block_size, ...)); each end maps them to its own physical blocks.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.kv_block_io import KVBlockIO, KVPiece
from pdserve.engine.outputs import SchedulerOutput
from pdserve.engine.utils import cdiv
from pdserve.kvtransfer.transport import KVSender, TransferStats
from pdserve.kvtransfer.wire import LayoutSignature, TransferHeader


def kv_layout(model: str, kv_cache: torch.Tensor | KVBlockIO, block_size: int) -> LayoutSignature:
    """The layout signature of an engine's KV (a tensor [layers, blocks, 2, kv_heads, bs, dim],
    or the engine's KVBlockIO: every head, however many ranks hold them)."""
    kv = kv_cache if isinstance(kv_cache, KVBlockIO) else KVBlockIO(kv_cache)
    assert kv.block_size == block_size
    return LayoutSignature(
        model=model,
        dtype=str(kv.dtype).removeprefix("torch."),
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        block_size=block_size,
        device=kv.device_kind,
    )


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> np.ndarray:
    """Copy blocks out of the cache as wire payload bytes ([layers, n, 2, kv_heads, bs, dim])."""
    index = torch.tensor(block_ids, dtype=torch.long)
    blocks = kv_cache.index_select(1, index)
    return blocks.view(torch.uint8).numpy().reshape(-1)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], payload: np.ndarray) -> None:
    """Write wire payload bytes into the given blocks of the cache."""
    num_layers, _, *block_shape = kv_cache.shape
    src = torch.from_numpy(payload).view(kv_cache.dtype)
    src = src.view(num_layers, len(block_ids), *block_shape)
    kv_cache.index_copy_(1, torch.tensor(block_ids, dtype=torch.long), src)


@dataclass(frozen=True)
class PushTarget:
    """Where one request's KV goes (from PrefillRequest.kv_target)."""

    address: str
    transfer_id: str
    skip_blocks: int
    trace_context: dict[str, str] = field(default_factory=dict)
    token: str = ""
    """The transfer's secret from the receiver (KVTarget.token), sent in every header."""
    lora_name: str = ""
    """The LoRA adapter the KV is computed under (its name goes into the header's layout)."""


@dataclass
class _Push:
    target: PushTarget
    num_prompt_tokens: int
    next_block: int
    sends: list[Future] = field(default_factory=list)
    bytes: int = 0
    started: float | None = None


class KVPushConnector:
    """Prefill role. Given to the engine's constructor, which registers its KV cache (and so
    fixes `layout`). register() a request before adding it to the engine, then await sent()
    after its first token: it resolves once every block has been delivered."""

    def __init__(self, model: str, sender: KVSender, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self.sender = sender
        self.loop = loop
        self.kv_cache: KVBlockIO | None = None
        self._layout: LayoutSignature | None = None
        self._pushes: dict[str, _Push] = {}  # guarded by the GIL: engine thread + event loop

    def register_kv_cache(self, kv_cache: torch.Tensor | KVBlockIO, block_size: int) -> None:
        self.kv_cache = kv_cache if isinstance(kv_cache, KVBlockIO) else KVBlockIO(kv_cache)
        self._layout = kv_layout(self.model, self.kv_cache, block_size)

    @property
    def layout(self) -> LayoutSignature:
        """The engine's KV layout, what every decode node's target must match."""
        if self._layout is None:
            raise RuntimeError("the connector was not given to an engine")
        return self._layout

    def register(self, request_id: str, target: PushTarget, num_prompt_tokens: int) -> None:
        self._pushes[request_id] = _Push(target, num_prompt_tokens, target.skip_blocks)

    def unregister(self, request_id: str) -> None:
        push = self._pushes.pop(request_id, None)
        for send in push.sends if push else ():
            send.cancel()

    async def sent(self, request_id: str, timeout_s: float) -> TransferStats:
        """Wait until all of the request's blocks are delivered; raises what a send raised."""
        push = self._pushes[request_id]
        expected = cdiv(push.num_prompt_tokens, self.layout.block_size)
        if push.next_block < expected:
            raise RuntimeError(f"{request_id}: blocks {push.next_block}..{expected} never sent")
        sends = [asyncio.wrap_future(f) for f in push.sends]
        await asyncio.wait_for(asyncio.gather(*sends), timeout_s)
        seconds = time.perf_counter() - push.started if push.started else 0.0
        return TransferStats(bytes=push.bytes, seconds=seconds, num_messages=len(push.sends))

    # -- engine thread ---------------------------------------------------------------------------

    def after_execute(self, output: SchedulerOutput) -> None:
        for chunk in output.chunks:
            push = self._pushes.get(chunk.request_id)
            if push is None:
                continue
            computed = chunk.start_pos + len(chunk.token_ids)
            if computed >= push.num_prompt_tokens:  # the partial last block is final too
                final = cdiv(push.num_prompt_tokens, self.layout.block_size)
            else:
                final = computed // self.layout.block_size
            if final > push.next_block:
                self._send(push, chunk.block_ids[push.next_block : final])
                push.next_block = final

    def _send(self, push: _Push, block_ids: list[int]) -> None:
        """Queue the copies of the request's blocks block_ids (its blocks from push.next_block
        on) and one send per piece; the sends run on the event loop."""
        assert self.kv_cache is not None  # registered by the engine's constructor
        push.started = push.started or time.perf_counter()
        for piece in self.kv_cache.gather_pieces(block_ids):
            header = TransferHeader(
                transfer_id=push.target.transfer_id,
                layout=self.layout.with_adapter(push.target.lora_name),
                first_block=push.next_block - push.target.skip_blocks + piece.first,
                num_blocks=piece.num_blocks,
                payload_bytes=piece.payload.nbytes,
                trace_context=push.target.trace_context,
                token=push.target.token,
            )
            push.bytes += piece.payload.nbytes
            coro = self._send_piece(push.target.address, header, piece)
            push.sends.append(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _send_piece(self, address: str, header: TransferHeader, piece: KVPiece) -> None:
        """On the event loop: send one piece once its copy is done, then free its buffer (also
        when cancelled mid-send; a send cancelled before it started leaves it to be freed)."""
        try:
            await piece.ready()
            await self.sender.send(address, header, piece.payload)
        finally:
            piece.release()
