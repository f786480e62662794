"""LLMEngine: the engine. It accepts requests at any time and steps the scheduler and the model
runner; its facade (requests, step(), kv_cache, load()) is all that code outside engine/ uses.

One step: schedule() -> model_runner.execute() -> update_from_output() -> StepOutput. The
offline LLM calls step() in its own loop; a node's EngineLoop (engine_loop.py) calls it from
the engine thread it owns. With speculative decoding, drafts are proposed before schedule() and
folded back after the update (engine/spec_decode/speculator.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.attention import (
    AttentionBackend,
    CpuAttention,
    TorchAttention,
    attention_backend,
)
from pdserve.engine.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.engine.device import kv_cache_torch_dtype, resolve_device
from pdserve.engine.gpu_memory import dummy_step, gpu_num_blocks
from pdserve.engine.kv_block_io import KVBlockIO
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.lora.manager import LoRAManager
from pdserve.engine.lora.request import LoRARequest
from pdserve.engine.model_runner import (
    ModelRunner,
    PromptLogprobsTask,
    kv_block_bytes,
    prefault_in_background,
)
from pdserve.engine.models import gguf
from pdserve.engine.models.llama import CausalLM
from pdserve.engine.models.loader import ModelArch, load_model, parse_model_arch
from pdserve.engine.outputs import (
    EngineLoad,
    RequestUpdate,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
    StepOutput,
)
from pdserve.engine.parallel import (
    TensorParallelGroup,
    check_pipeline_parallel,
    check_tensor_parallel,
)
from pdserve.engine.platform import tune_allocator
from pdserve.engine.pooling import POOLING_TYPES, pool
from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.sampler import SampleRow
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.engine.spec_decode.speculator import Speculator, build_proposer
from pdserve.engine.structured_output import GrammarCompiler
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.utils import cdiv

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class EngineStats:
    """Counters and gauges for metrics and benchmarks."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    execute_time_s: float = 0.0
    """Model runner time: input preparation, forward, logits and sampling."""
    step_time_s: float = 0.0


class EngineKVConnector(Protocol):
    """The engine's side of a KV connector that pushes KV out (the prefill role;
    kvtransfer/connector.py implements it). The engine calls it on its own thread. The scheduler
    itself does no I/O. (The decode role needs no connector: its remote prefills come out of
    step() in StepOutput, and received blocks are written on the engine thread.)"""

    def register_kv_cache(self, kv_cache: KVBlockIO, block_size: int) -> None:
        """Called once by the engine's constructor with the KV cache it allocated (as whole
        blocks: under tensor parallelism their heads are on several ranks)."""

    def after_execute(self, output: SchedulerOutput) -> None:
        """The step's KV is written; snapshot and push the blocks that became final. Runs
        before update_from_output(), so finished requests still hold blocks."""


class LLMEngine:
    """Owns the tokenizer, scheduler (with its KV cache manager), model runner and, when
    speculative_config is given, the speculator (proposer, policy, spec_stats)."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        kv_connector: EngineKVConnector | None = None,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
        parallel_config: ParallelConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        sched = self.scheduler_config
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            # vLLM refuses this; here it works, but a step cannot advance every running request
            logger.warning(
                "max_num_batched_tokens %d < max_num_seqs %d: with more requests running than "
                "that, a step leaves the last of them without a token",
                sched.max_num_batched_tokens, sched.max_num_seqs,
            )  # fmt: skip
        start = time.monotonic()
        tune_allocator()
        self.parallel_config = parallel_config or ParallelConfig()
        tp_size = self.parallel_config.tensor_parallel_size
        pp_size = self.parallel_config.pipeline_parallel_size
        self.tp: TensorParallelGroup | None = None
        """Tensor or pipeline parallelism's workers and process group (None in one process)."""
        if tp_size > 1 or pp_size > 1:
            if lora_config is not None:
                raise ValueError("LoRA with tensor or pipeline parallelism is not supported yet")
            if pp_size > 1 and kv_connector is not None:
                raise ValueError("pipeline parallelism is offline-only yet")
            whole = parse_model_arch(gguf.model_dir(model_config.model))
            check_tensor_parallel(whole, tp_size)
            check_pipeline_parallel(whole, pp_size)
            self.tp = TensorParallelGroup(
                tp_size,
                model_config.model,
                model_config.dtype,
                model_config.max_model_len,
                torch.get_num_threads(),
                pp_size,
            )
        self.device = self._device(tp_size, pp_size, lora_config)
        model, arch = load_model(
            model_config.model, model_config.dtype, model_config.max_model_len, 0, tp_size, 0,
            pp_size, self.device,
        )  # fmt: skip
        self.arch: ModelArch = arch
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_cache_torch_dtype(self.cache_config.kv_cache_dtype, self.dtype)
        """The KV cache's dtype (the model's, or float8 with kv_cache_dtype fp8)."""
        if self.kv_dtype != self.dtype and self.tp is not None:
            raise ValueError(
                "a float8 KV cache with tensor or pipeline parallelism is not supported yet"
            )
        attention = self._attention_backend()
        self.tokenizer = Tokenizer.from_pretrained(model_config.tokenizer or model_config.model)
        self.max_model_len = self._max_model_len(arch)
        self.num_blocks = self._num_blocks(arch, model, attention)
        tokenizer_eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = arch.eos_token_ids or (
            (tokenizer_eos,) if tokenizer_eos is not None else ()
        )
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size = arch.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        """Structured-output grammars, compiled and cached; thread-safe, so a node compiles a
        request's grammar on a worker thread before add_request (which then finds it cached)."""
        kv = KVCacheManager(
            self.num_blocks, self.cache_config.block_size, self.cache_config.enable_prefix_caching
        )
        self.lora = LoRAManager(model, lora_config) if lora_config is not None else None
        """The LoRA adapters (None unless lora_config)."""
        self.scheduler = Scheduler(
            self.scheduler_config,
            kv,
            self.max_model_len,
            max_loras=lora_config.max_loras if lora_config is not None else None,
        )
        self.runner = ModelRunner(
            model,
            arch,
            self.kv_dtype,
            self.num_blocks,
            self.cache_config.block_size,
            lora=self.lora,
            attention=attention,
            device=self.device,
        )
        self._prefault = None
        if (
            self.device.type == "cpu"
            and self.cache_config.kv_cache_prefault
            and os.environ.get("PDSERVE_KV_CACHE_PREFAULT", "1") != "0"
        ):
            pool = kv.pool
            self._prefault = prefault_in_background(
                self.runner.kv_cache, high_water=lambda: pool.high_water
            )
        if self.device.type == "cuda" and not model_config.enforce_eager:
            self._capture_decode_graphs()
        if self.tp is not None:
            self.tp.start_workers(
                self.num_blocks, self.cache_config.block_size, self._prefault is not None
            )
            self.runner.tp = self.tp
        self._kv_blocks = KVBlockIO(self.runner.kv_cache, self.tp, arch.num_kv_heads)
        self.stats = EngineStats()
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_cache(self._kv_blocks, self.cache_config.block_size)
        self._owner_thread: int | None = None
        self.speculator = self._speculator(speculative_config)
        self._seed_rng = random.Random(model_config.seed)
        logger.info(
            "engine ready in %.1fs: %s (%s, %s on %s, KV %s), %d KV blocks of %d tokens, "
            "max_model_len %d",
            time.monotonic() - start,
            model_config.model,
            arch.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks,
            self.cache_config.block_size,
            self.max_model_len,
        )

    def _max_model_len(self, arch: ModelArch) -> int:
        limit = arch.max_position_embeddings
        asked = self.model_config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(
                f"max_model_len {asked} exceeds the model's max_position_embeddings {limit}"
            )
        return asked or limit

    def _device(self, tp_size: int, pp_size: int, lora_config: LoRAConfig | None) -> torch.device:
        device = resolve_device(self.model_config.device)
        if device.type == "cuda":
            if tp_size > 1 or pp_size > 1:
                raise ValueError("tensor or pipeline parallelism on CUDA is not supported yet")
            if lora_config is not None:
                raise ValueError("LoRA on CUDA is not supported yet")
            torch.cuda.set_device(device)  # Triton launches on the current device
        return device

    def _attention_backend(self) -> AttentionBackend:
        """The model config's backend for this device; a float8 KV cache needs one that reads
        it (auto takes torch's on a CPU)."""
        name = self.model_config.attention_backend
        if name == "cpu" and self.device.type != "cpu":
            raise ValueError(f"the cpu attention backend cannot run on {self.device}")
        backend = attention_backend(name, self.device.type)
        if self.kv_dtype != self.dtype and isinstance(backend, CpuAttention):
            if name == "cpu":
                raise ValueError(
                    "the cpu attention kernels do not read a float8 KV cache: use "
                    "attention_backend torch (or triton), or kv_cache_dtype auto"
                )
            backend = TorchAttention()
        return backend

    def _num_blocks(self, arch: ModelArch, model: CausalLM, attention: AttentionBackend) -> int:
        cfg = self.cache_config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = kv_block_bytes(arch, cfg.block_size, self.kv_dtype)
        needed_one = cdiv(self.max_model_len, cfg.block_size) + 1
        if self.device.type == "cuda":
            num_blocks = cfg.num_gpu_blocks_override or self._profiled_num_blocks(
                arch, model, attention, per_block
            )
            what = f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves room for"
        else:
            num_blocks = int(cfg.kv_cache_memory * GiB) // per_block
            what = f"kv_cache_memory {cfg.kv_cache_memory} GiB holds"
        if num_blocks < needed_one:
            raise ValueError(
                f"{what} {num_blocks} blocks, fewer than the {needed_one} one max_model_len "
                "request needs"
            )
        return num_blocks

    def _profiled_num_blocks(
        self, arch: ModelArch, model: CausalLM, attention: AttentionBackend, per_block: int
    ) -> int:
        sched, bs = self.scheduler_config, self.cache_config.block_size
        step = dummy_step(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len, bs)
        return gpu_num_blocks(
            model, arch, self.kv_dtype, bs, per_block, self.cache_config.gpu_memory_utilization,
            step, attention, self.device,
        )  # fmt: skip

    def _capture_decode_graphs(self) -> None:
        """CUDA graphs for decode steps; a capture that fails leaves the engine eager (logged:
        the step is the same, only slower)."""
        try:
            self.runner.capture_decode_graphs(
                self.scheduler_config.max_num_seqs, self.max_model_len
            )
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            self.runner.graphs = None

    def _speculator(self, config: SpeculativeConfig | None) -> Speculator | None:
        if config is None:
            return None
        proposer = build_proposer(
            config,
            self.model_config.dtype,
            self.vocab_size,
            self.max_model_len,
            self.num_blocks,
            self.cache_config.block_size,
            self.device,
        )
        logger.info("speculative decoding: %s", config)
        return Speculator(config, proposer, self.max_model_len)

    # -- the facade: what code outside engine/ may use besides requests and steps -----------------

    def claim_thread(self) -> None:
        """From now on only the calling thread may change the engine (EngineLoop's thread calls
        this first): the methods that change engine state raise RuntimeError on any other."""
        self._owner_thread = threading.get_ident()

    def _check_thread(self) -> None:
        owner = self._owner_thread
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError(
                f"the engine belongs to thread {owner}; called from {threading.get_ident()} "
                "(go through EngineLoop.call/submit)"
            )

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV cache, [layers, blocks, 2, kv_heads, block_size, head_dim]. Writing
        into it (received KV blocks) is a change of engine state: owner thread only."""
        self._check_thread()
        return self.runner.kv_cache

    @property
    def kv_blocks(self) -> KVBlockIO:
        """The KV cache as whole blocks with every head (what KV transfers carry), under any
        tensor parallelism. Gathering or scattering blocks is engine work: owner thread only."""
        self._check_thread()
        return self._kv_blocks

    def load(self) -> EngineLoad:
        """The engine's load, from any thread."""
        scheduler, kv, stats = self.scheduler, self.scheduler.kv, self.stats
        return EngineLoad(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_awaiting_kv=scheduler.num_awaiting_kv,
            remote_prefill_backlog=scheduler.remote_prefill_backlog,
            local_prefill_backlog=scheduler.local_prefill_backlog,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=self.num_blocks - 1,  # block 0 is the null block
            kv_cache_usage=kv.usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also at exit); idempotent."""
        if self.tp is not None:
            self.tp.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache); False, changing
        nothing, while any request holds blocks."""
        return self.kv.pool.reset_prefix_cache()

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding counters (None without speculative_config)."""
        return self.speculator.stats if self.speculator is not None else None

    # -- requests --------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        outside = [t for t in params.token_ids_used() if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"token id {outside[0]} in logit_bias, allowed_token_ids or bad words is "
                f"outside the vocabulary [0, {self.vocab_size})"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len {self.max_model_len}"
            )
        blocks_needed = cdiv(total, self.cache_config.block_size)
        if blocks_needed > self.num_blocks - 1:
            raise ValueError(
                f"request needs {blocks_needed} KV blocks, the cache has {self.num_blocks - 1}"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        seed: int | None = None,
        wants_remote_prefill: bool = False,
        prefill_only: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError (queueing nothing) if it is bad.
        seed overrides the effective sampling seed (a prefill node uses the decode node's, so
        the first token is the one a local prefill would sample); prefill_only ends the request
        after its first token (the prefill role)."""
        self._check_thread()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(token_ids, params)
        if seed is None:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(
                    f"request names LoRA adapter {lora_request.lora_name!r}, but LoRA is not "
                    "enabled (--enable-lora)"
                )
            self.lora.add(lora_request)  # ValueError if the adapter is bad
        spec = params.structured_output
        grammar = self.grammars.matcher(spec) if spec is not None else None  # ValueError if bad
        if grammar is not None and params.structured_output_resume:
            resumed = params.structured_output_resume
            if resumed > len(token_ids):
                raise ValueError(
                    f"structured_output_resume={resumed} exceeds the prompt's {len(token_ids)} tokens"
                )
            for position, token in enumerate(token_ids[-resumed:]):
                if not grammar.accept(token):
                    raise ValueError(
                        f"generated token {token} (resumed position {position}) does not match "
                        "the structured output's grammar"
                    )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            seed=seed,
            # prompt logprobs score every prompt position, so the prompt is computed here
            wants_remote_prefill=wants_remote_prefill and params.prompt_logprobs is None,
            prefill_only=prefill_only,
            grammar=grammar,
            lora_request=lora_request,
        )
        self.scheduler.add_request(request)
        return request

    def embed(
        self, prompts: Sequence[Sequence[int]], pooling: str = "last", normalize: bool = True
    ) -> list[list[float]]:
        """One pooled embedding per prompt (engine/pooling.py), computed between steps in
        forwards of at most max_num_batched_tokens tokens (or one prompt), over KV blocks taken
        from the free pool and given back at once: nothing is cached, no running request is
        disturbed. Raises ValueError for a bad prompt or pooling, before computing anything."""
        self._check_thread()
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES}, got {pooling!r}")
        if not prompts:
            raise ValueError("no input to embed")
        bs = self.cache_config.block_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"input {i} is empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"input {i}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            if len(prompt) > self.max_model_len:
                raise ValueError(
                    f"input {i} has {len(prompt)} tokens, more than max_model_len "
                    f"{self.max_model_len}"
                )
        pool_ = self.scheduler.kv.pool
        budget = self.scheduler_config.max_num_batched_tokens
        out: list[list[float]] = []
        group: list[Sequence[int]] = []
        for prompt in [*prompts, None]:
            blocks = sum(cdiv(len(p), bs) for p in group)
            if prompt is not None and group:
                tokens = sum(len(p) for p in group) + len(prompt)
                fits = tokens <= budget and blocks + cdiv(len(prompt), bs) <= pool_.num_free_blocks
                if fits:
                    group.append(prompt)
                    continue
            if group:
                if blocks > pool_.num_free_blocks:
                    raise ValueError(
                        f"embedding needs {blocks} free KV blocks, {pool_.num_free_blocks} are free"
                    )
                taken = [pool_.get_new_blocks(cdiv(len(p), bs)) for p in group]
                try:
                    chunks = [
                        ScheduledChunk(f"embed-{j}", list(p), 0, [b.block_id for b in t], 0, False)
                        for j, (p, t) in enumerate(zip(group, taken, strict=True))
                    ]
                    hidden = self.runner.hidden_states(chunks)
                finally:
                    for t in taken:
                        pool_.free_blocks(reversed(t))
                out += [pool(h, pooling, normalize).tolist() for h in hidden]
            group = [prompt] if prompt is not None else []
        return out

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        self.scheduler.abort_request(request_id)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        self._check_thread()
        self.scheduler.finish_requests([request_id], status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether step() could compute anything now (requests awaiting remote KV cannot)."""
        return self.scheduler.has_work()

    def finish_remote_prefill(
        self, request_id: str, first_token: SampledTokens, num_cached_tokens: int
    ) -> RequestUpdate | None:
        """A prefill node filled the request's blocks and sampled its first token."""
        self._check_thread()
        update = self.scheduler.finish_remote_prefill(request_id, first_token, num_cached_tokens)
        if update is not None:
            self.stats.num_generation_tokens += len(update.new_token_ids)
        return update

    def fail_remote_prefill(self, request_id: str) -> None:
        """No prefill node delivered: the request prefills locally."""
        self._check_thread()
        self.scheduler.fail_remote_prefill(request_id)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one scheduler step: the requests that got new tokens, and (decode role) the
        requests whose reserved blocks prefill nodes are to fill."""
        self._check_thread()
        start = time.perf_counter()
        start_s = time.monotonic()
        spec = self.speculator
        if spec is not None:
            spec.propose(self.scheduler.running)
        output = self.scheduler.schedule()
        if spec is not None:
            spec.after_schedule(output)
        self._date_first_scheduling(output, start_s)
        if output.is_empty:
            if spec is not None:
                spec.after_step(output, {}, [])
            return StepOutput([], output.remote_prefills)
        requests = self.scheduler.requests
        rows = {
            c.request_id: self._sample_row(requests[c.request_id])
            for c in output.chunks
            if c.samples
        }
        # prompt tokens computed this step (recomputation after preemption included)
        self.stats.num_prompt_tokens += sum(
            max(
                min(c.start_pos + len(c.token_ids), requests[c.request_id].num_prompt_tokens)
                - c.start_pos,
                0,
            )
            for c in output.chunks
        )
        execute_start = time.perf_counter()
        draft_probs = spec.draft_probs if spec is not None else None
        result = self.runner.execute(output, rows, draft_probs, self._prompt_logprobs_tasks(output))
        sampled = result.sampled
        for request_id, entries in result.prompt_logprobs.items():
            scored = requests[request_id].prompt_logprobs
            assert scored is not None
            scored.extend(entries)
        execute_s = time.perf_counter() - execute_start
        self.stats.execute_time_s += execute_s
        if self.kv_connector is not None:
            self.kv_connector.after_execute(output)
        updates = self.scheduler.update_from_output(output, sampled)
        if spec is not None:
            spec.after_step(output, sampled, updates, execute_s)
        self.stats.num_steps += 1
        self.stats.num_generation_tokens += sum(len(u.new_token_ids) for u in updates)
        self.stats.step_time_s += time.perf_counter() - start
        return StepOutput(updates, output.remote_prefills)

    def _prompt_logprobs_tasks(self, output: SchedulerOutput) -> dict[str, PromptLogprobsTask]:
        """The prompt positions of this step whose next prompt token is still to be scored
        (the logits at position p score prompt token p + 1; a recomputation after preemption
        scores nothing twice)."""
        tasks = {}
        requests = self.scheduler.requests
        for chunk in output.chunks:
            request = requests[chunk.request_id]
            scored = request.prompt_logprobs
            if scored is None:
                continue
            first = max(chunk.start_pos, len(scored) - 1)
            end = min(chunk.start_pos + len(chunk.token_ids), request.num_prompt_tokens - 1)
            if first < end:
                tasks[chunk.request_id] = PromptLogprobsTask(
                    first - chunk.start_pos,
                    request.prompt_token_ids[first + 1 : end + 1],
                    request.sampling_params.prompt_logprobs or 0,
                )
        return tasks

    def _date_first_scheduling(self, output: SchedulerOutput, start_s: float) -> None:
        """Stamp requests scheduled for the first time with the step's start."""
        requests = self.scheduler.requests
        for scheduled in (output.chunks, output.remote_prefills):
            for item in scheduled:
                request = requests[item.request_id]
                if request.scheduled_s is None:
                    request.scheduled_s = start_s

    def _sample_row(self, request: Request) -> SampleRow:
        return SampleRow(
            params=request.sampling_params,
            seed=request.seed,
            position=request.num_tokens,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            grammar=request.grammar,
        )
