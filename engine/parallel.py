"""Tensor parallelism over torch.distributed: gloo on CPU (NCCL is the GPU issue's), one
process per rank, Megatron-style sharding of the Llama family.

Rank 0 is the engine's own process: it schedules, samples and owns the requests; ranks
1..N-1 are worker processes it spawns. Every rank holds its share of each decoder layer:

- q/k/v and gate/up are column-parallel: a rank computes its heads (num_heads / N query
  heads, num_kv_heads / N key/value heads, or one replicated key/value head when there are
  fewer than N) and its slice of the MLP width;
- o_proj and down_proj are row-parallel: a rank multiplies its slice of their input, and an
  all-reduce sums the partial outputs (their bias is added once, by rank 0);
- each rank's paged KV cache holds its own heads (same blocks, same block tables);
- the embedding, norms and lm_head are replicated (only rank 0 computes logits).

For each forward rank 0 broadcasts the flattened batch (token ids, positions, attention
metadata) and every rank runs the same layers in lockstep; the all-reduces are the only other
communication. Sampling never leaves rank 0. What differs from vLLM here: the embedding and
lm_head are replicated, not vocab-parallel (simpler, and on CPU the lm_head is one GEMM).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pdserve.engine.models.llama import CausalLM
    from pdserve.engine.models.loader import ModelArch

logger = logging.getLogger(__name__)

_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a rank waits for the others in one collective before giving up (a dead peer)."""

_COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW_PARALLEL = {"o_proj", "down_proj"}
_SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def _check_supported(arch: ModelArch, what: str) -> None:
    if arch.architecture not in _SUPPORTED:
        raise ValueError(f"{what} supports {sorted(_SUPPORTED)}, not {arch.architecture}")


def check_tensor_parallel(arch: ModelArch, tp_size: int) -> None:
    """ValueError unless arch can be split over tp_size ranks."""
    if tp_size == 1:
        return
    _check_supported(arch, "tensor parallelism")
    if arch.num_heads % tp_size:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the {arch.num_heads} attention heads"
        )
    kv = arch.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} and the {kv} key/value heads: one must divide "
            "the other"
        )
    if arch.intermediate_size % tp_size:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the MLP width "
            f"{arch.intermediate_size}"
        )


def check_pipeline_parallel(arch: ModelArch, pp_size: int) -> None:
    """ValueError unless arch's layers can be split into pp_size stages."""
    if pp_size == 1:
        return
    _check_supported(arch, "pipeline parallelism")
    if pp_size > arch.num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {pp_size} exceeds the model's {arch.num_layers} layers"
        )


def stage_layers(num_layers: int, rank: int, pp_size: int) -> range:
    """The layers stage rank runs: consecutive, the first stages one more when uneven."""
    base, extra = divmod(num_layers, pp_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def stage_arch(arch: ModelArch, rank: int, pp_size: int) -> ModelArch:
    return replace(arch, num_layers=len(stage_layers(arch.num_layers, rank, pp_size)))


def stage_weight_name(name: str, layers: range) -> str | None:
    """The name of checkpoint tensor name in a stage that runs layers (renumbered from 0),
    or None if it belongs to another stage. Embedding, norm and lm_head: every stage."""
    prefix = "model.layers."
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    i = int(index)
    return f"{prefix}{i - layers.start}.{rest}" if i in layers else None


class PipelineStage:
    """One stage's place in the pipeline: stage 0 (the engine's process) embeds, runs its
    layers and hands the residual stream on; each next stage takes it, runs its layers and
    hands it on; the last hands it back to stage 0, which applies the final norm and samples.
    One forward at a time (no micro-batches): on these CPUs it is for correctness."""

    def __init__(self, rank: int, pp_size: int) -> None:
        self.rank = rank
        self.pp_size = pp_size

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def receive(
        self, rows: int, hidden: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = torch.empty(rows, hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype)
        dist.recv(x, src=self.rank - 1)
        dist.recv(residual, src=self.rank - 1)
        return x, residual

    def pass_on(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: the last stage's output; other stages: (x, residual), already sent on."""
        after = (self.rank + 1) % self.pp_size
        dist.send(x.contiguous(), dst=after)
        dist.send(residual.contiguous(), dst=after)
        if not self.is_first:
            return x, residual
        last = self.pp_size - 1
        out_x, out_residual = torch.empty_like(x), torch.empty_like(residual)
        dist.recv(out_x, src=last)
        dist.recv(out_residual, src=last)
        return out_x, out_residual


def local_arch(arch: ModelArch, tp_size: int) -> ModelArch:
    """The shape one rank's layers have."""
    return replace(
        arch,
        num_heads=arch.num_heads // tp_size,
        num_kv_heads=max(arch.num_kv_heads // tp_size, 1),
        intermediate_size=arch.intermediate_size // tp_size,
    )


def shard(
    name: str, tensor: torch.Tensor, arch: ModelArch, rank: int, tp_size: int
) -> torch.Tensor:
    """Rank's part of the checkpoint tensor name (arch: the whole model's)."""
    if tp_size == 1:
        return tensor
    module, _, leaf = name.rpartition(".")
    proj = module.rpartition(".")[2]
    hd = arch.head_dim
    if proj == "q_proj":
        rows = arch.num_heads // tp_size * hd
        return tensor.narrow(0, rank * rows, rows)
    if proj in ("k_proj", "v_proj"):
        kv = arch.num_kv_heads
        if kv >= tp_size:
            rows = kv // tp_size * hd
            return tensor.narrow(0, rank * rows, rows)
        return tensor.narrow(0, rank * kv // tp_size * hd, hd)  # one head, shared by ranks
    if proj in ("gate_proj", "up_proj"):
        rows = arch.intermediate_size // tp_size
        return tensor.narrow(0, rank * rows, rows)
    if proj in _ROW_PARALLEL:
        if leaf == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        cols = tensor.shape[1] // tp_size
        return tensor.narrow(1, rank * cols, cols)
    return tensor  # embedding, norms, lm_head: replicated


def attach_all_reduce(model: CausalLM, group: Any = None) -> None:
    """Make every row-parallel projection sum its output over the ranks."""
    from pdserve.engine.models.llama import Linear

    def all_reduce(y: torch.Tensor) -> None:
        dist.all_reduce(y, group=group)

    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rpartition(".")[2] in _ROW_PARALLEL:
            module.reduce = all_reduce


class TensorParallelGroup:
    """Rank 0's side: spawns the workers, joins the process group, and broadcasts each
    forward's inputs."""

    def __init__(
        self,
        tp_size: int,
        model_dir: str,
        dtype: str,
        max_model_len: int | None,
        num_threads: int,
        pp_size: int = 1,
    ) -> None:
        if dist.is_initialized():
            raise ValueError("one parallel engine per process (torch.distributed is in use)")
        if tp_size > 1 and pp_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported yet")
        self.tp_size = tp_size
        self.pp_size = pp_size
        world = tp_size * pp_size
        port = _free_port()
        context = multiprocessing.get_context("spawn")
        self.workers = [
            context.Process(
                target=_worker_main,
                args=(rank, tp_size, port, model_dir, dtype, max_model_len, num_threads, pp_size),
                daemon=True,
                name=f"pdserve-rank{rank}",
            )
            for rank in range(1, world)
        ]
        for worker in self.workers:
            worker.start()
        _join_group(port, 0, world)
        self._closed = False
        atexit.register(self.close)

    def start_workers(self, num_blocks: int, block_size: int) -> None:
        """Tell the workers the KV cache to allocate (known once rank 0 has sized it)."""
        dist.broadcast_object_list([(num_blocks, block_size)], src=0)

    def before_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> None:
        """Every worker runs this forward too (its layers' all-reduces meet rank 0's)."""
        dist.broadcast_object_list([(input_ids, positions, meta)], src=0)

    def heads_of(self, rank: int, num_kv_heads: int) -> list[int]:
        """The key/value heads rank holds (shard())."""
        return _heads_of(rank, self.tp_size, num_kv_heads)

    def gather_heads(
        self, local: torch.Tensor, block_ids: list[int], num_kv_heads: int
    ) -> torch.Tensor:
        """Every rank's heads of the blocks ([layers, n, 2, heads, bs, dim]), rank 0's local
        part given: the whole blocks, each head once."""
        dist.broadcast_object_list([("gather", block_ids)], src=0)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.gather(local, gather_list=parts, dst=0)
        whole = torch.empty(
            (local.shape[0], local.shape[1], 2, num_kv_heads, *local.shape[4:]), dtype=local.dtype
        )
        for rank, part in enumerate(parts):
            whole[:, :, :, self.heads_of(rank, num_kv_heads)] = part
        return whole

    def scatter_heads(
        self, whole: torch.Tensor, block_ids: list[int], num_kv_heads: int
    ) -> torch.Tensor:
        """Send each worker its heads of whole blocks to write; rank 0's part returned."""
        dist.broadcast_object_list([("scatter", block_ids, whole)], src=0)
        return whole[:, :, :, self.heads_of(0, num_kv_heads)]

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            dist.broadcast_object_list([None], src=0)
        except RuntimeError:
            pass  # a worker is gone already
        for worker in self.workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
        dist.destroy_process_group()


def _heads_of(rank: int, tp_size: int, num_kv_heads: int) -> list[int]:
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_kv_heads // tp_size]


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(port: int, rank: int, world: int) -> None:
    """Join the ranks' gloo group: the rendezvous at 127.0.0.1:port and gloo's own pair sockets
    on the loopback interface (every rank is a process of this host; unset, gloo binds the
    address the host name resolves to, which may face the network)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=_TIMEOUT,
    )  # fmt: skip


def _worker_main(
    rank: int,
    tp_size: int,
    port: int,
    model_dir: str,
    dtype: str,
    max_model_len: int | None,
    num_threads: int,
    pp_size: int = 1,
) -> None:
    """A worker rank: load its shard (or stage), allocate its KV cache, run every forward rank
    0 broadcasts until it broadcasts None."""
    from pdserve.engine.model_runner import zeroed_lazily
    from pdserve.engine.models.loader import load_model
    from pdserve.kernels.cpu import cpu_ops

    torch.set_num_threads(num_threads)
    _join_group(port, rank, tp_size * pp_size)
    if pp_size > 1:
        model, arch = load_model(model_dir, dtype, max_model_len, pp_rank=rank, pp_size=pp_size)
    else:
        model, arch = load_model(model_dir, dtype, max_model_len, tp_rank=rank, tp_size=tp_size)
    full_kv_heads = arch.num_kv_heads
    model.use_cpu_fused_ops(cpu_ops())  # attention: each forward's metadata names its backend
    sizes: list[Any] = [None]
    dist.broadcast_object_list(sizes, src=0)
    num_blocks, block_size = sizes[0]
    kv_cache = zeroed_lazily((model.arch.num_layers, *model.kv_cache_shape(num_blocks, block_size)),
                             model.dtype)  # fmt: skip
    kv_caches = list(kv_cache.unbind(0))
    heads = _heads_of(rank, tp_size, full_kv_heads)
    while True:
        item: list[Any] = [None]
        dist.broadcast_object_list(item, src=0)
        message = item[0]
        if message is None:
            break
        if message[0] == "gather":  # the KV of blocks leaving for a decode node
            index = torch.tensor(message[1], dtype=torch.long)
            dist.gather(kv_cache.index_select(1, index), dst=0)
        elif message[0] == "scatter":  # the KV of blocks arriving from a prefill node
            index = torch.tensor(message[1], dtype=torch.long)
            kv_cache.index_copy_(1, index, message[2][:, :, :, heads])
        else:
            input_ids, positions, meta = message
            with torch.inference_mode():
                model(input_ids, positions, kv_caches, meta)
    dist.destroy_process_group()
