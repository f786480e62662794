"""SchedulerOutput -> flattened batch tensors -> one forward -> logits -> sampled tokens.

PagedModel is a model over its own paged KV cache: one flattened forward over a list of chunks,
logits at the positions they ask for (the target and a speculative draft model each own one).
The ModelRunner is the target's: it knows nothing of request policy, computes the chunks it is
given and samples where a chunk asks for it, with each request's SampleRow, or verifies the
chunk's speculative tokens with the rejection sampler.
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pdserve.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSeq,
    attention_backend,
)
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.host_memory import HUGE_PAGE, zeroed_lazily
from pdserve.engine.lora.manager import LoRAManager
from pdserve.engine.models.llama import SMALL_ROWS_MAX, CausalLM
from pdserve.engine.models.loader import ModelArch
from pdserve.engine.outputs import SampledTokens, ScheduledChunk, SchedulerOutput
from pdserve.engine.parallel import TensorParallelGroup
from pdserve.engine.request import TokenLogprobs
from pdserve.engine.sampler import (
    Sampler,
    SampleRow,
    SamplingMetadata,
    token_logprobs,
)
from pdserve.engine.spec_decode.rejection_sampler import DraftsToVerify, RejectionSampler
from pdserve.engine.utils import cdiv
from pdserve.kernels.cpu import cpu_ops, threads_hot


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem


_PREFAULT_WAIT_S = 0.5
"""How long one wait for a free core lasts before the prefault checks its cache still lives."""
_PREFAULT_NEAR_FREE_S = 0.002
"""How long a core must stay free before the prefault faults a chunk the block pool will hand
out soon (within _PREFAULT_AHEAD_CHUNKS of its high-water mark): steps would fault it anyway."""
_PREFAULT_FAR_FREE_S = 0.02
"""The same for the rest of the cache: the machine must be idle, not between two steps (gated
at 2 ms, a 1 + 1 `pdserve serve` stack kept faulting its 2 x 4 GiB during issue 17's served
workload and measured 122-129 output tok/s against ~150-160)."""
_PREFAULT_AHEAD_CHUNKS = 4
_PREFAULT_RUN_CHUNKS = 8
"""Once a core has stayed free for _PREFAULT_FAR_FREE_S (the machine idle), the next chunks up
to this many in all wait only _PREFAULT_NEAR_FREE_S, as long as each call returns within
_PREFAULT_RUN_CALL_S (the core still free): with a 20 ms wait before every 2 MiB an idle node
took ~48 s to fault its 4 GiB in (2070 waits; AMD Zen 5, SmolLM2); a node that computes again
meets at most the run's remaining chunks at the short wait."""
_PREFAULT_RUN_CALL_S = 0.01

_PREFAULT_RESERVE = 1 << 30
"""Memory the prefault leaves free (MemAvailable, or the cgroup limit's headroom)."""

logger = logging.getLogger(__name__)


def memory_headroom() -> int:
    """Bytes this process may still take: MemAvailable, or less where its cgroup's memory
    limit (v2 memory.max, v1 memory.limit_in_bytes) is nearer."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    headroom = int(fields["MemAvailable"].split()[0]) * 1024
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (int((folder / name).read_text()) for name in files)
        except (OSError, ValueError):  # not mounted here, or "max": no limit
            continue
        headroom = min(headroom, limit - usage)
    return headroom


_prefault_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@functools.cache
def _stop_prefaults_at_exit(ops: ModuleType) -> None:
    """At interpreter exit, end the prefault threads still waiting for a free core (a daemon
    thread inside a native call when the interpreter ends is unwound through its C++ frames,
    which aborts the process)."""

    def stop() -> None:
        ops.populate_cancel()
        for thread in list(_prefault_threads):
            thread.join(timeout=5.0)

    atexit.register(stop)


def next_prefault_run(run_left: int, far: bool, near: bool, took_s: float) -> int:
    """Chunks that may still take the short wait after one that was faulted in: a far wait
    (the core free _PREFAULT_FAR_FREE_S) starts a run of _PREFAULT_RUN_CHUNKS - 1; a short
    wait of the run uses one, and ends the run where its call took longer than
    _PREFAULT_RUN_CALL_S (the core was not free at once); near chunks leave it as it is."""
    if far:
        return _PREFAULT_RUN_CHUNKS - 1
    if near:
        return run_left
    return run_left - 1 if took_s <= _PREFAULT_RUN_CALL_S and run_left > 0 else 0


def prefault_in_background(
    cache: torch.Tensor, high_water: Callable[[], int] | None = None
) -> threading.Thread | None:
    """Fault in the pages of a lazily mapped cache [num_layers, num_blocks, ...] from a daemon
    thread on spare CPU time, lowest block ids first in every layer (the order the block pool
    hands never-used blocks out). A first touch of never-used memory costs a page fault, and in
    a VM a host fault too (4 GiB touched for the first time here: 6.5 s; the same pages again:
    0.25 s); without this, the steps that first store K/V into a block pay it (a 4096-token
    prompt through `pdserve serve` on 2 cores: 7.2 s TTFT instead of 4.9).
    Each 2 MiB of a layer waits for a core with nothing else to run (the kernels'
    populate_when_idle, pdserve_kernels/cpu/host_memory.cpp: for 2 ms where the block pool's
    high_water() is near, else for 20 ms, or 2 ms for the next chunks of a run after such a
    wait, next_prefault_run; without high_water, 2 ms), then is faulted in by
    madvise(MADV_POPULATE_WRITE), which maps pages without changing what they hold, so blocks
    in use meanwhile are safe, at this thread's normal priority: madvise holds the process's
    mmap lock, and the idle-priority thread this used to be, preempted inside it while another
    node computed on every core, stalled this process's every mmap for seconds (a decode node
    then missed the gateway's health polls, and long prompts failed). The thread holds only a
    weak reference and stops once the cache is freed (or the kernel lacks the advice, or the
    CPU kernels are not built), and before it would leave less than 1 GiB of memory free
    (memory_headroom): the pages it does not fault in are faulted by their first K/V store, as
    without it. Returns the thread, or None where it cannot run (not Linux)."""
    if not sys.platform.startswith("linux") or cache.dim() < 2:
        return None
    if cache.numel() * cache.element_size() < HUGE_PAGE:
        return None  # zeroed_lazily wrote it already
    ref = weakref.ref(cache)
    base = cache.data_ptr()
    item = cache.element_size()
    layer_bytes, block_bytes = cache.stride(0) * item, cache.stride(1) * item
    num_layers, num_blocks = cache.shape[0], cache.shape[1]
    chunk = max(1, HUGE_PAGE // block_bytes)  # blocks per call: >= 2 MiB of each layer
    page = mmap.PAGESIZE

    run_left = 0  # chunks that may still take the short wait after an idle window

    def populate(ops: Any, lo: int, hi: int, start: int) -> bool:
        """Fault [lo, hi) (of blocks from start) in once a core is free; False to stop (freed
        cache, or an error)."""
        nonlocal run_left
        while True:
            near = high_water is None or start <= high_water() + _PREFAULT_AHEAD_CHUNKS * chunk
            far = not near and run_left == 0
            free_s = _PREFAULT_FAR_FREE_S if far else _PREFAULT_NEAR_FREE_S
            t0 = time.perf_counter()
            err = ops.populate_when_idle(lo, hi - lo, _PREFAULT_WAIT_S, free_s)
            took = time.perf_counter() - t0
            if err != errno.EAGAIN:
                break
            run_left = 0  # no free core within the wait: the machine is busy
            if ref() is None:
                return False
        if err != 0:
            logger.debug("KV cache prefault stopped: %s", os.strerror(err))
            return False
        run_left = next_prefault_run(run_left, far, near, took)
        return True

    def run() -> None:
        ops = cpu_ops()
        if ops is None:
            logger.debug("KV cache prefault off: no CPU kernels")
            return
        _stop_prefaults_at_exit(ops)
        t0 = time.perf_counter()
        for start in range(0, num_blocks, chunk):
            if ref() is None:
                return
            stop = min(start + chunk, num_blocks)
            try:
                headroom = memory_headroom()
            except (OSError, KeyError, ValueError) as exc:  # no /proc/meminfo as expected
                logger.debug("KV cache prefault stopped: %s", exc)
                return
            if headroom - (stop - start) * block_bytes * num_layers < _PREFAULT_RESERVE:
                logger.info(
                    "KV cache prefault stopped at block %d of %d: %.2f GiB of memory left",
                    start, num_blocks, headroom / 2**30,
                )  # fmt: skip
                return
            for layer in range(num_layers):
                lo = base + layer * layer_bytes + start * block_bytes
                hi = base + layer * layer_bytes + stop * block_bytes
                if not populate(ops, lo - lo % page, hi, start):
                    return
        logger.info(
            "KV cache pages faulted in: %.2f GiB in %.1f s (on spare CPU time)",
            num_layers * layer_bytes / 2**30,
            time.perf_counter() - t0,
        )

    thread = threading.Thread(target=run, name="kv-prefault", daemon=True)
    _prefault_threads.add(thread)
    thread.start()
    return thread


PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions whose logits are computed at once for prompt logprobs (bounds the memory
of a long prompt's [positions, vocab] logits)."""


@dataclass(frozen=True)
class PromptLogprobsTask:
    """Prompt logprobs wanted from one chunk: the logits at chunk.token_ids[first:first + len(
    targets)] score the prompt tokens that follow those positions (targets)."""

    first: int
    targets: list[int]
    num_top: int
    """Top logprobs per position (SamplingParams.prompt_logprobs)."""


@dataclass
class RunnerOutput:
    """What one execute() produced, per request id."""

    sampled: dict[str, SampledTokens]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """For each PromptLogprobsTask, the logprobs of its targets, in order."""


def num_logit_positions(chunk: ScheduledChunk) -> int:
    """Trailing positions of a chunk whose logits are needed: the last known token's (to
    sample) plus one per speculative token (to verify it); none for a chunk that does not
    reach the end of its known tokens."""
    return 1 + chunk.num_spec_tokens if chunk.samples else 0


class PagedModel:
    """A model over its own paged KV cache of num_blocks blocks: one flattened forward per
    call over a list of chunks, returning logits at the positions they ask for. The target's
    ModelRunner and a speculative draft model each own one."""

    def __init__(
        self,
        model: CausalLM,
        arch: ModelArch,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend | None = None,
        fused_ops: ModuleType | None = None,
        device: torch.device | None = None,
    ) -> None:
        """dtype: the KV cache's (the model's, or float8_e4m3fn); fused_ops: the compiled CPU
        layers the model runs on (cpu_ops()), None: torch's; device: where the model's
        parameters are (the cache goes there too; default: the CPU)."""
        self.model = model
        model.use_cpu_fused_ops(fused_ops)
        self.fused_ops = fused_ops
        self._pool_ops = (
            fused_ops if fused_ops is not None and fused_ops.kernel_pool_enabled() else None
        )
        """fused_ops where the kernels' own pool runs (asked once, not a pybind call per
        forward), else None."""
        self._pool_takes_all = self._pool_ops is not None and model.products_on_kernel()
        """Whether every product of every forward runs on the kernels (and so on their pool):
        where the pool runs, small_rows_take_all gives them every weight they have a layout
        for."""
        self.device = device or torch.device("cpu")
        self.attention = attention or attention_backend("auto", self.device.type)
        """How this model's layers attend (engine/attention.py), chosen once here."""
        self.arch = arch
        self.block_size = block_size
        # [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim] (engine/attention.py)
        shape = (model.arch.num_layers, *model.kv_cache_shape(num_blocks, block_size))
        if self.device.type == "cpu":
            self.kv_cache = zeroed_lazily(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.forward_time_s = 0.0
        """Time spent in the model forward (transformer layers), summed over steps."""
        self.lora: LoRAManager | None = None
        """The target's LoRA adapters (engine/lora/), when enabled: each forward tells it
        which adapter each token uses."""
        self.tp: TensorParallelGroup | None = None
        """Tensor parallelism (engine/parallel.py): each forward's inputs go to the other
        ranks first, which run it in lockstep."""
        self.graphs: DecodeGraphs | None = None
        """Decode-only steps replay these (engine/cuda_graphs.py), once captured."""

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward for a ladder of batch sizes up to max_num_seqs (CUDA
        graphs; on a CPU the same static buffers, run eagerly)."""
        graphs = DecodeGraphs(
            self._run_model,
            self._decode_meta,
            self.device,
            max_num_seqs,
            max_model_len,
            self.block_size,
        )
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def _decode_meta(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttentionMetadata:
        """A decode-only batch's metadata over (static) tensors on the device."""
        width = block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=seq_lens.device)
        mask = (positions.unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
        return AttentionMetadata(
            slot_mapping,
            len(slot_mapping),
            block_tables,
            seq_lens,
            mask,
            [],
            self.block_size,
            self.attention,
        )

    @torch.inference_mode()
    def compute_logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Compute every chunk (writing its K/V into this cache) in one forward; returns the
        float32 logits [sum of num_logit_positions, vocab] of each chunk's trailing
        num_logit_positions(chunk) positions, in chunk order then position order."""
        hidden, ends = self._forward(chunks)
        return self._logits_at(hidden, chunks, ends)

    def _hot_ops(self, chunks: Sequence[ScheduledChunk]) -> ModuleType | None:
        """threads_hot's argument for a forward over chunks: the pool's ops where every product
        runs on the kernels, else None (the pool's workers then sleep between loops). Where
        oneDNN takes the products of more than SMALL_ROWS_MAX rows (a weight without the
        kernel's layout), those run on torch's OpenMP threads, and a pool worker spinning
        beside them keeps one off its core: on an AMD Zen 4, issue 17's served bf16 workload
        ran its prefill steps so slowly that the pool cost 25% overall while oneDNN took every
        prefill product (engine loop alone, OMP_WAIT_POLICY=PASSIVE: 120-123 output tok/s with
        a hot pool in every step vs 141-159 without the pool; 173 now that the kernel takes
        them, small_rows_take_all)."""
        if self._pool_ops is None or self._pool_takes_all:
            return self._pool_ops
        rows = sum(len(chunk.token_ids) for chunk in chunks)
        return self._pool_ops if rows <= SMALL_ROWS_MAX else None

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """One forward over every chunk: the final hidden states [tokens, hidden] and, per
        chunk in chunk order, the row just past its last token."""
        with threads_hot(self._hot_ops(chunks)):
            return self._forward_hot(chunks)

    def _forward_hot(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)
        batch = [chunks[i] for i in order]  # decodes first (engine/attention.py)
        if self.graphs is not None and self.lora is None and self.graphs.accepts(batch):
            start = time.perf_counter()
            hidden = self.graphs.run(batch)
        else:
            input_ids, positions, meta = self._prepare_inputs(batch)
            self._set_lora(batch)
            start = time.perf_counter()
            hidden = self._run_model(input_ids, positions, meta)
        self.forward_time_s += time.perf_counter() - start
        ends = [0] * len(chunks)
        offset = 0
        for i in order:
            offset += len(chunks[i].token_ids)
            ends[i] = offset
        return hidden, ends

    def _logits_at(
        self, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk], ends: list[int]
    ) -> torch.Tensor:
        index = [
            p
            for chunk, end in zip(chunks, ends, strict=True)
            for p in range(end - num_logit_positions(chunk), end)
        ]
        if not index:
            return hidden.new_zeros((0, self.arch.vocab_size), dtype=torch.float32)
        if len(index) == hidden.shape[0] and index == list(range(len(index))):
            # every row in order (decode steps): no gather copy
            return self.model.compute_logits(hidden)
        rows = torch.tensor(index, dtype=torch.long).to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def hidden_states(self, chunks: Sequence[ScheduledChunk]) -> list[torch.Tensor]:
        """The final hidden states [len(chunk.token_ids), hidden] of each chunk (prefills
        from position 0, writing their K/V into blocks the caller owns), in chunk order."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) > 1)
        batch = [chunks[i] for i in order]
        input_ids, positions, meta = self._prepare_inputs(batch)
        self._set_lora(batch)
        start = time.perf_counter()
        with threads_hot(self._hot_ops(chunks)):
            hidden = self._run_model(input_ids, positions, meta)
        self.forward_time_s += time.perf_counter() - start
        out: list[torch.Tensor] = [hidden] * len(chunks)
        offset = 0
        for i in order:  # decodes (1-token prompts) first, as _prepare_inputs lays them out
            n = len(chunks[i].token_ids)
            out[i] = hidden[offset : offset + n]
            offset += n
        return out

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.tp is not None:
            self.tp.before_forward(input_ids, positions, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _set_lora(self, batch: Sequence[ScheduledChunk]) -> None:
        if self.lora is not None:
            self.lora.set_batch([(c.lora_name, len(c.token_ids)) for c in batch])

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
            prefills.append(PrefillSeq(offset, n, context_len, table[: cdiv(context_len, bs)]))
            offset += n
        slot_mapping = torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots])
        block_tables, seq_lens, mask = self._decode_tables(decodes)
        input_ids, positions = (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(pos, dtype=torch.long),
        )
        if self.device.type != "cpu":
            input_ids, positions, slot_mapping, block_tables, seq_lens = (
                _to_device(t, self.device)
                for t in (input_ids, positions, slot_mapping, block_tables, seq_lens)
            )
            mask = None if mask is None else _to_device(mask, self.device)
            for seq in prefills:
                seq.block_table = _to_device(seq.block_table, self.device)
        meta = AttentionMetadata(
            slot_mapping, nd, block_tables, seq_lens, mask, prefills, bs, self.attention
        )
        return input_ids, positions, meta

    def _decode_tables(
        self, decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not decodes:
            empty = torch.zeros(0, 1, dtype=torch.long)
            return empty, torch.zeros(0, dtype=torch.long), None
        bs = self.block_size
        seq_lens = [c.start_pos + 1 for c in decodes]
        max_blocks = cdiv(max(seq_lens), bs)
        table = [c.block_ids[:max_blocks] + [0] * (max_blocks - len(c.block_ids)) for c in decodes]
        block_tables = torch.tensor(table, dtype=torch.long)
        lens = torch.tensor(seq_lens, dtype=torch.long)
        mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
        return block_tables, lens, mask[:, None, None, :]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step input (a few KiB) copied to the device. From pageable memory the driver stages
    the copy itself; pinning each small tensor would cost more than it saves."""
    return t.to(device, non_blocking=True)


class ModelRunner(PagedModel):
    """The target model: computes a step's chunks in one forward, samples a token for every
    chunk that reaches its end and verifies the speculative tokens chunks carry."""

    def __init__(
        self,
        model: CausalLM,
        arch: ModelArch,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        use_cpu_kernels: bool = True,
        lora: LoRAManager | None = None,
        attention: AttentionBackend | None = None,
        device: torch.device | None = None,
    ) -> None:
        """dtype: the KV cache's; use_cpu_kernels: the compiled CPU layers and sampling kernels
        (on a CPU device)."""
        on_cpu = device is None or device.type == "cpu"
        ops = cpu_ops() if use_cpu_kernels and on_cpu else None
        super().__init__(model, arch, dtype, num_blocks, block_size, attention, ops, device)
        self.lora = lora
        self.sampling_ops = ops
        """The compiled CPU kernels sampling uses (SamplingMetadata.cpu_ops), None: torch's."""
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(ops)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        rows: Mapping[str, SampleRow],
        draft_probs: Mapping[str, torch.Tensor] | None = None,
        prompt_logprobs: Mapping[str, PromptLogprobsTask] | None = None,
    ) -> RunnerOutput:
        """Compute every chunk; for each chunk that reaches its end, sample one token with
        rows[request_id] or, when it carries speculative tokens, verify them and return the
        accepted ones plus a correction or bonus token. draft_probs[request_id] ([k, V]) is the
        distribution its proposed tokens were drawn from; absent means one-hot (n-gram).
        prompt_logprobs[request_id]: the prompt logprobs to score from that request's chunk."""
        with threads_hot(self._hot_ops(output.chunks)):
            return self._execute(output, rows, draft_probs, prompt_logprobs)

    def _execute(
        self,
        output: SchedulerOutput,
        rows: Mapping[str, SampleRow],
        draft_probs: Mapping[str, torch.Tensor] | None,
        prompt_logprobs: Mapping[str, PromptLogprobsTask] | None,
    ) -> RunnerOutput:
        hidden, ends = self._forward(output.chunks)
        logits = self._logits_at(hidden, output.chunks, ends)
        plain: list[tuple[ScheduledChunk, int]] = []
        spec: list[tuple[ScheduledChunk, int]] = []
        offset = 0
        for chunk in output.chunks:
            if chunk.samples:
                (spec if chunk.num_spec_tokens else plain).append((chunk, offset))
            offset += num_logit_positions(chunk)
        sampled = self._sample(logits, plain, rows) if plain else {}
        if spec:
            sampled.update(self._verify(logits, spec, rows, draft_probs or {}))
        result = RunnerOutput(sampled)
        for chunk, end in zip(output.chunks, ends, strict=True):
            task = (prompt_logprobs or {}).get(chunk.request_id)
            if task is not None:
                first_row = end - len(chunk.token_ids) + task.first
                result.prompt_logprobs[chunk.request_id] = self._prompt_logprobs(
                    hidden, first_row, task
                )
        return result

    def _prompt_logprobs(
        self, hidden: torch.Tensor, first_row: int, task: PromptLogprobsTask
    ) -> list[TokenLogprobs]:
        """Logprobs (of the raw logits, as the sampled tokens') of task.targets, scored at
        hidden rows first_row.., PROMPT_LOGPROBS_ROWS positions at a time."""
        out: list[TokenLogprobs] = []
        for start in range(0, len(task.targets), PROMPT_LOGPROBS_ROWS):
            targets = task.targets[start : start + PROMPT_LOGPROBS_ROWS]
            rows = hidden[first_row + start : first_row + start + len(targets)]
            raw = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            tokens = torch.tensor(targets, dtype=torch.long).to(raw.device)
            out += token_logprobs(raw, tokens, [task.num_top] * len(targets))
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        chunks: list[tuple[ScheduledChunk, int]],
        rows: Mapping[str, SampleRow],
    ) -> dict[str, SampledTokens]:
        offsets = [offset for _, offset in chunks]
        # every row in order (decode steps): no gather copy
        if len(offsets) != logits.shape[0] or offsets != list(range(len(offsets))):
            logits = logits[torch.tensor(offsets, dtype=torch.long).to(logits.device)]
        sample_rows = [rows[c.request_id] for c, _ in chunks]
        meta = SamplingMetadata.build(
            sample_rows, logits.shape[-1], logits.device, self.sampling_ops
        )
        out = self.sampler(logits, meta)
        return {
            c.request_id: SampledTokens([tok], [lp] if lp is not None else None)
            for (c, _), tok, lp in zip(chunks, out.token_ids, out.logprobs, strict=True)
        }

    def _verify(
        self,
        logits: torch.Tensor,
        chunks: list[tuple[ScheduledChunk, int]],
        rows: Mapping[str, SampleRow],
        draft_probs: Mapping[str, torch.Tensor],
    ) -> dict[str, SampledTokens]:
        index: list[int] = []
        items: list[DraftsToVerify] = []
        for chunk, offset in chunks:
            k = chunk.num_spec_tokens  # the scheduler may have verified fewer than proposed
            index.extend(range(offset, offset + k + 1))
            probs = draft_probs.get(chunk.request_id)
            items.append(
                DraftsToVerify(
                    rows[chunk.request_id],
                    chunk.token_ids[-k:],
                    None if probs is None else probs[:k].cpu(),
                )
            )
        # Verification runs on the host (one copy of the verified rows' logits per step).
        verified = logits[torch.tensor(index, dtype=torch.long).to(logits.device)].cpu()
        results = self.rejection_sampler(verified, items)
        return {c.request_id: r for (c, _), r in zip(chunks, results, strict=True)}
