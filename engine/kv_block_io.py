"""The paged KV cache as KV transfers carry it (KVBlockIO): whole blocks with every head, as
wire payload bytes, gathered out of and scattered into the engine's cache wherever it lives
(the CPU, a CUDA device through pinned staging buffers, the ranks of a tensor-parallel group)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from pdserve.engine.parallel import TensorParallelGroup


STAGING_PIECE_BYTES = 8 << 20
"""A staged gather copies at most this many bytes per piece (whole blocks, at least one), so
sending piece i overlaps the device-to-host copy of piece i + 1. Each piece is one message."""
MAX_FREE_STAGING_BYTES = 1 << 30
"""Free staging buffers kept for reuse beyond this many bytes are dropped (freed)."""


class _CopyDone:
    """The event of a copy that already ran (no device: staging in ordinary memory)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _CopyDone()


class _StagingPool:
    """Host buffers a staged KVBlockIO copies through, pinned when the cache is on a CUDA device
    (pinning costs far more than a copy, so buffers are reused). Any thread (one lock).

    Invariant: a free buffer carries the event of the last copy that used it, and take() only
    hands out a buffer whose copy is complete, so host code may write into what it gets. Lent
    buffers are not tracked: one never given back (its send cancelled before it started) is
    simply freed."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._lock = threading.Lock()
        self.num_allocated = 0
        """Buffers made so far (a test's view of the reuse)."""

    def take(self, num_bytes: int, min_bytes: int = 0) -> torch.Tensor:
        """A uint8 buffer of exactly num_bytes (a view of one of at least min_bytes)."""
        with self._lock:
            for i, (buffer, done) in enumerate(self._free):
                if buffer.numel() >= num_bytes and done.query():
                    del self._free[i]
                    return buffer[:num_bytes]
            self.num_allocated += 1
        size = max(num_bytes, min_bytes)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)[:num_bytes]

    def give_back(self, buffer: torch.Tensor, done: Any) -> None:
        """Return a buffer taken from take(); done: the event of the last copy using it."""
        whole = buffer._base if buffer._base is not None else buffer
        with self._lock:
            free_bytes = sum(b.numel() for b, _ in self._free)
            if free_bytes + whole.numel() <= MAX_FREE_STAGING_BYTES:
                self._free.append((whole, done))


@dataclass
class KVPiece:
    """Blocks [first, first + num_blocks) of a gather's block ids, as wire payload bytes in a
    staging buffer. The bytes are valid once ready() (the copy into it finished); release()
    once they have been sent hands the buffer back for reuse."""

    first: int
    num_blocks: int
    payload: np.ndarray
    """uint8, [layers, num_blocks, 2, kv_heads, block_size, head_dim] bytes."""
    done: Any = _DONE
    """The event of the copy filling payload."""
    pool: _StagingPool | None = None
    buffer: torch.Tensor | None = None

    async def ready(self) -> None:
        """Wait (without blocking the event loop) until the payload's copy finished."""
        if not self.done.query():
            await asyncio.to_thread(self.done.synchronize)

    def release(self) -> None:
        """Give the staging buffer back (idempotent); the payload must no longer be read."""
        if self.pool is not None and self.buffer is not None:
            self.pool.give_back(self.buffer, self.done)
        self.pool = self.buffer = None


@dataclass
class StagedPayload:
    """Received wire payload bytes copied out of a transport's buffer (into pinned memory for a
    CUDA cache), waiting to be scattered. Made by KVBlockIO.stage()."""

    data: torch.Tensor
    """uint8, the payload's bytes."""
    pooled: bool


class KVBlockIO:
    """The paged KV cache as the wire carries it: whole blocks with every key/value head, read
    (gather) and written (scatter) as bytes of [layers, n, 2, heads, block_size, head_dim],
    whatever the tensor parallelism (the heads of other ranks travel through the group).
    Engine thread only, between steps (the collectives keep pace with the forwards), except
    stage(), which any thread may call.

    A cache on a device is *staged*: gathers copy blocks into reused pinned host buffers with
    asynchronous copies on a side stream, in pieces of at most piece_bytes that can be sent as
    soon as each is copied; scatters copy a staged payload to the device and write it there.
    The side stream starts after the work queued on the engine's stream so far (the forward
    that wrote the blocks) and the engine's stream waits for its copies before anything later
    (a forward that reuses a freed block, or reads an arrived one): correct whatever stream the
    engine computes on, never blocking the engine thread. `staged=True` on a CPU cache runs the
    same code through ordinary memory (tests)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        tp: TensorParallelGroup | None = None,
        num_kv_heads: int = 0,
        *,
        staged: bool | None = None,
        piece_bytes: int = STAGING_PIECE_BYTES,
    ) -> None:
        self.kv_cache = kv_cache
        self.tp = tp
        self.num_layers, _, _, local_heads, self.block_size, self.head_dim = kv_cache.shape
        self.num_kv_heads = num_kv_heads if tp is not None else local_heads
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device
        self.staged = kv_cache.device.type != "cpu" if staged is None else staged
        if self.staged and tp is not None:
            raise ValueError("tensor-parallel KV caches live on the CPU: not staged")
        elements = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        self.block_bytes = elements * kv_cache.element_size()
        """Bytes of one whole block on the wire (every layer, key and value, head)."""
        self.piece_blocks = max(1, piece_bytes // self.block_bytes)
        """Blocks per piece of a staged gather."""
        # Copies move bytes: uint8 views work for every dtype (CPU has no float8 index_copy_).
        self._bytes = kv_cache.view(torch.uint8)
        on_cuda = kv_cache.device.type == "cuda"
        self._pool = _StagingPool(pin=on_cuda)
        self._pin = on_cuda
        self._stream = torch.cuda.Stream(kv_cache.device) if on_cuda else None

    @property
    def device_kind(self) -> str:
        """Where the cache lives: "cpu" or "cuda" (LayoutSignature.device)."""
        return self.device.type

    def gather(self, block_ids: list[int]) -> np.ndarray:
        """The blocks' wire payload bytes (waits for a staged copy; gather_pieces does not)."""
        if not self.staged:
            index = torch.tensor(block_ids, dtype=torch.long)
            blocks = self.kv_cache.index_select(1, index)
            if self.tp is not None:
                blocks = self.tp.gather_heads(blocks, block_ids, self.num_kv_heads)
            return blocks.contiguous().view(torch.uint8).numpy().reshape(-1)
        if not block_ids:
            return np.empty(0, dtype=np.uint8)
        piece = self._stage_out(0, block_ids)  # one piece: layers are the payload's outer dim
        piece.done.synchronize()
        out = piece.payload.copy()
        piece.release()
        return out

    def gather_pieces(self, block_ids: list[int]) -> list[KVPiece]:
        """The blocks' wire payload in pieces of consecutive block ids, each one message (its
        own [layers, piece's blocks, ...] bytes). Staged: the copies are queued, not finished
        (await KVPiece.ready()); else one piece, ready."""
        if not self.staged:
            return [KVPiece(0, len(block_ids), self.gather(block_ids))] if block_ids else []
        step = self.piece_blocks
        return [self._stage_out(i, block_ids[i : i + step]) for i in range(0, len(block_ids), step)]

    def _stage_out(self, first: int, block_ids: list[int]) -> KVPiece:
        num_bytes = len(block_ids) * self.block_bytes
        buffer = self._pool.take(num_bytes, min_bytes=self.piece_blocks * self.block_bytes)

        def copy() -> None:
            blocks = self._bytes.index_select(1, self._device_index(block_ids))
            buffer.copy_(blocks.view(-1), non_blocking=True)

        done = self._copy(copy)
        return KVPiece(first, len(block_ids), buffer.numpy(), done, self._pool, buffer)

    def stage(self, payload: np.ndarray) -> StagedPayload:
        """Copy received payload bytes out of a transport's buffer, ready for scatter(): into a
        staging buffer if staged, else a plain copy. Any thread."""
        if not self.staged:
            return StagedPayload(torch.from_numpy(payload.copy()), pooled=False)
        buffer = self._pool.take(payload.nbytes)
        buffer.numpy()[:] = payload
        return StagedPayload(buffer, pooled=True)

    def scatter(self, block_ids: list[int], payload: np.ndarray | StagedPayload) -> None:
        """Write wire payload bytes into the given blocks (a staged one's copy is queued)."""
        shape = (self.num_layers, len(block_ids), 2, self.num_kv_heads, self.block_size,
                 self.head_dim)  # fmt: skip
        if self.tp is not None:
            data = payload.data if isinstance(payload, StagedPayload) else payload
            blocks = torch.as_tensor(data).view(self.dtype).view(shape)
            blocks = self.tp.scatter_heads(blocks, block_ids, self.num_kv_heads)
            self.kv_cache.index_copy_(1, torch.tensor(block_ids, dtype=torch.long), blocks)
            return
        staged = payload if isinstance(payload, StagedPayload) else self.stage(payload)
        byte_shape = (*shape[:-1], self._bytes.shape[-1])

        def copy() -> None:
            blocks = staged.data.to(self.device, non_blocking=True).view(byte_shape)
            self._bytes.index_copy_(1, self._device_index(block_ids), blocks)

        done = self._copy(copy)
        if staged.pooled:
            self._pool.give_back(staged.data, done)

    def _device_index(self, block_ids: list[int]) -> torch.Tensor:
        """block_ids on the cache's device, copied without waiting (from pinned memory)."""
        index = torch.tensor(block_ids, dtype=torch.long, pin_memory=self._pin)
        return index.to(self.device, non_blocking=True)

    def _copy(self, copy: Callable[[], None]) -> Any:
        """Run copy() on the side stream after the engine stream's queued work, and make the
        engine stream wait for it; returns the copy's event (_DONE without a device). What
        copy() allocates on the device belongs to the side stream, so the caching allocator
        does not hand it to the engine stream while the copy may still use it."""
        if self._stream is None:
            copy()
            return _DONE
        engine_stream = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(engine_stream)
        with torch.cuda.stream(self._stream):
            copy()
        done = torch.cuda.Event()
        done.record(self._stream)
        engine_stream.wait_event(done)
        return done
