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

import atexit
import datetime
import logging
import multiprocessing
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING, Any

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

    def start_workers(self, num_blocks: int, block_size: int, prefault: bool = False) -> None:
        """Tell the workers the KV cache to allocate (known once rank 0 has sized it), and
        whether to fault its pages in on spare CPU time as rank 0 does (prefault_in_background)."""
        dist.broadcast_object_list([(num_blocks, block_size, prefault)], src=0)

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
    from pdserve.engine.host_memory import zeroed_lazily
    from pdserve.engine.model_runner import prefault_in_background
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
    num_blocks, block_size, prefault = sizes[0]
    kv_cache = zeroed_lazily((model.arch.num_layers, *model.kv_cache_shape(num_blocks, block_size)),
                             model.dtype)  # fmt: skip
    if prefault:
        prefault_in_background(kv_cache)
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
