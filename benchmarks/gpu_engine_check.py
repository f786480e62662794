"""The engine on a GPU, end to end (issue 20): one section per run, results as JSON.

    python benchmarks/gpu_engine_check.py SECTION --out FILE.json [--device cuda] [--smoke]
    python benchmarks/gpu_engine_check.py summary DIR      # the table of every DIR/*.json

scripts/gpu_check.sh runs each section in its own process under its own timeout. Sections:

  vs-hf       greedy float32 token ids equal to transformers' on the same device, for the
              llama, qwen2, qwen3 and mistral shapes (tiny random models from make-model)
  kv-io       KVBlockIO on the device: staged gather in pieces, scatter, bf16 and float8 caches
              round-trip bit for bit; bytes/s of each direction
  throughput  offline batch (bf16, gpu-1b preset): output tokens/s; the decode step against the
              HBM roofline (weights + KV read per step / a large device copy's bytes/s) and the
              prefill against a large matmul's TFLOP/s
  graphs      decode tokens/s at batch 1 and 64 with CUDA graphs (default) and enforce_eager
  disagg      one prefill and one decode engine in this process, the KV pushed through the TCP
              transport on 127.0.0.1 by the real KVPushConnector: tokens equal the aggregated
              engine's; KV bytes/s device to device

`--device cpu --smoke` runs every section small on the CPU (tests/benchmarks/
test_gpu_engine_check_smoke.py), so this script cannot rot between GPU runs. A section's JSON
has "status": "ok", "mismatch" (ran, results differ), "failed" (raised: "error" holds the
traceback) or "running" (the process was killed, e.g. by the section's timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("gpu_engine_check")

SECTIONS = ("vs-hf", "kv-io", "throughput", "graphs", "disagg")
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the CPU smoke test's."""

    vs_hf_preset: str = "tiny"
    vs_hf_prompt_lens: tuple[int, ...] = (1, 7, 33, 100, 260)
    vs_hf_max_tokens: int = 32
    big_preset: str = "gpu-1b"
    """The model of throughput, graphs and disagg."""
    dtype: str = "bfloat16"
    num_requests: int = 128
    input_len: int = 128
    output_len: int = 128
    graph_batches: tuple[int, ...] = (1, 64)
    disagg_requests: int = 32
    disagg_input_len: int = 512
    disagg_output_len: int = 32
    kv_io_blocks: int = 2048
    """Blocks in the kv-io section's cache (gpu-1b's shape: 512 KiB each in bf16)."""
    copy_bytes: int = 1 << 30
    matmul_size: int = 8192


SMOKE = Plan(
    vs_hf_prompt_lens=(1, 20),
    vs_hf_max_tokens=6,
    big_preset="tiny",
    num_requests=4,
    input_len=16,
    output_len=8,
    graph_batches=(1, 2),
    disagg_requests=2,
    disagg_input_len=40,
    disagg_output_len=6,
    kv_io_blocks=16,
    copy_bytes=16 << 20,
    matmul_size=256,
)


@dataclass
class Context:
    """What every section gets."""

    device: torch.device
    plan: Plan
    models_dir: Path
    archs: tuple[str, ...]

    def engine_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """LLM/EngineArgs keywords on this device: device= is passed only off the CPU, so the
        CPU runs also work on an engine without the keyword."""
        if self.device.type != "cpu":
            kwargs["device"] = str(self.device)
        return kwargs

    def model(self, arch: str, preset: str) -> str:
        """A random model made by make-model (on this device), reused when already there."""
        from pdserve.make_model import make_model

        out = self.models_dir / f"{arch}-{preset}"
        if not (out / "model.safetensors").exists():
            started = time.perf_counter()
            make_model(arch, preset, str(out), seed=0, device=self.device)
            logger.info("made %s in %.1fs", out, time.perf_counter() - started)
        return str(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Let an engine's memory go before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


# -- vs-hf ---------------------------------------------------------------------------------------


def vs_hf(ctx: Context) -> dict[str, Any]:
    """Greedy float32 tokens of the engine and of transformers, both on ctx.device."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine import LLM, SamplingParams

    plan, rows = ctx.plan, []
    for arch in ctx.archs:
        model_dir = ctx.model(arch, plan.vs_hf_preset)
        hf = AutoModelForCausalLM.from_pretrained(model_dir).to(ctx.device).float().eval()
        vocab = hf.config.vocab_size
        rng = random.Random(7)
        prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in plan.vs_hf_prompt_lens]
        n = plan.vs_hf_max_tokens
        expected = []
        with torch.inference_mode():
            for ids in prompts:  # eos suppressed (min_new_tokens): every output has n tokens
                out = hf.generate(
                    torch.tensor([ids], device=ctx.device),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=ctx.device),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                )
                expected.append(out[0, len(ids) :].tolist())
        del hf
        free_memory(ctx.device)
        blocks = sum(-(-(len(p) + n) // BLOCK_SIZE) for p in prompts) + 8
        llm = LLM(
            model_dir,
            **ctx.engine_kwargs(dtype="float32", num_blocks=blocks, max_num_seqs=8),
        )
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        free_memory(ctx.device)
        diverged = [_first_diff(g, e) for g, e in zip(got, expected, strict=True)]
        rows.append(
            {
                "arch": arch,
                "prompts": len(prompts),
                "equal": sum(d is None for d in diverged),
                "first_divergence": [d for d in diverged if d is not None][:1] or None,
            }
        )
    equal = all(r["equal"] == r["prompts"] for r in rows)
    # "highest" (no TF32) unless something in this process lowered it: both sides share it
    precision = torch.get_float32_matmul_precision()
    return {"status": "ok" if equal else "mismatch", "rows": rows, "fp32_matmul": precision}


def _first_diff(got: list[int], expected: list[int]) -> int | None:
    for i, (g, e) in enumerate(zip(got, expected, strict=False)):
        if g != e:
            return i
    return None if len(got) == len(expected) else min(len(got), len(expected))


# -- kv-io ---------------------------------------------------------------------------------------


def kv_io(ctx: Context) -> dict[str, Any]:
    """KVBlockIO on the device (staged; on a CPU forced): round trips and bytes/s."""
    from pdserve.engine.kv_block_io import KVBlockIO
    from pdserve.make_model import PRESET_SIZES

    p = PRESET_SIZES[ctx.plan.big_preset]
    head_dim = p.hidden_size // p.num_heads
    shape = (p.num_layers, ctx.plan.kv_io_blocks, 2, p.num_kv_heads, BLOCK_SIZE, head_dim)
    rows, equal = [], True
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = torch.randn(shape, device=ctx.device).to(dtype)
        dst = torch.zeros(shape, device=ctx.device).to(dtype)
        src_io, dst_io = KVBlockIO(src, staged=True), KVBlockIO(dst, staged=True)
        n = ctx.plan.kv_io_blocks // 2
        ids = random.Random(1).sample(range(1, ctx.plan.kv_io_blocks), n)
        targets = random.Random(2).sample(range(1, ctx.plan.kv_io_blocks), n)
        for _ in range(2):  # the first round pins the staging buffers
            sync(ctx.device)
            started = time.perf_counter()
            pieces = src_io.gather_pieces(ids)
            for piece in pieces:
                piece.done.synchronize()
            gather_s = time.perf_counter() - started
            payloads = [(piece, dst_io.stage(piece.payload)) for piece in pieces]
            sync(ctx.device)
            started = time.perf_counter()
            for piece, staged in payloads:
                dst_io.scatter(targets[piece.first : piece.first + piece.num_blocks], staged)
            sync(ctx.device)
            scatter_s = time.perf_counter() - started
            for piece in pieces:
                piece.release()
        same = torch.equal(
            dst[:, targets].view(torch.uint8).cpu(), src[:, ids].view(torch.uint8).cpu()
        )
        equal &= same
        num_bytes = n * src_io.block_bytes
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "blocks": n,
                "pieces": len(pieces),
                "bytes": num_bytes,
                "gather_gb_s": num_bytes / gather_s / 1e9,
                "scatter_gb_s": num_bytes / scatter_s / 1e9,
                "equal": same,
            }
        )
        del src, dst, src_io, dst_io, pieces, payloads
        free_memory(ctx.device)
    return {"status": "ok" if equal else "mismatch", "rows": rows}


# -- throughput ----------------------------------------------------------------------------------


@dataclass
class BatchRun:
    """One batch of requests through engine.step(), timed step by step."""

    tokens: dict[str, list[int]]
    total_s: float
    prefill_s: float
    """From the first step until every request has its first token."""
    decode_steps_s: list[float] = field(default_factory=list)
    """Each later step that started with every request running."""

    @property
    def decode_step_s(self) -> float:
        steps = sorted(self.decode_steps_s)
        return steps[len(steps) // 2] if steps else float("nan")


def run_batch(engine: Any, prompts: list[list[int]], max_tokens: int) -> BatchRun:
    """Greedy, every request exactly max_tokens; the engine's own step loop."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{uuid.uuid4().hex[:8]}-{i}"
        engine.add_request(rid, prompt, params)
        tokens[rid] = []
    started = time.perf_counter()
    prefill_s, decode_steps, finished = None, [], 0
    while engine.has_unfinished_requests():
        step_started = time.perf_counter()
        full_batch = prefill_s is not None and finished == 0
        output = engine.step()
        if full_batch:
            decode_steps.append(time.perf_counter() - step_started)
        for update in output.updates:
            tokens[update.request_id] += update.new_token_ids
            finished += update.finished
        if prefill_s is None and all(tokens.values()):
            prefill_s = time.perf_counter() - started
    total_s = time.perf_counter() - started
    return BatchRun(tokens, total_s, prefill_s or total_s, decode_steps)


def copy_bandwidth(ctx: Context) -> float:
    """Bytes/s of a large device-to-device copy (read + write): the memory roofline."""
    src = torch.empty(ctx.plan.copy_bytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(ctx.device)
    rounds, started = 10, time.perf_counter()
    for _ in range(rounds):
        dst.copy_(src)
    sync(ctx.device)
    return 2 * ctx.plan.copy_bytes * rounds / (time.perf_counter() - started)


def matmul_flops(ctx: Context, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in dtype: the compute roofline."""
    n = ctx.plan.matmul_size
    a = torch.randn(n, n, device=ctx.device).to(dtype)
    b = torch.randn(n, n, device=ctx.device).to(dtype)
    torch.matmul(a, b)
    sync(ctx.device)
    rounds, started = 10, time.perf_counter()
    for _ in range(rounds):
        torch.matmul(a, b)
    sync(ctx.device)
    return 2 * n**3 * rounds / (time.perf_counter() - started)


def big_engine_args(ctx: Context, num_seqs: int, max_len: int, **kwargs: Any) -> Any:
    """EngineArgs of the big preset, its KV sized to num_seqs requests of max_len tokens, a step
    budget that prefills them all in one step."""
    from pdserve.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=ctx.model("llama", ctx.plan.big_preset),
        **ctx.engine_kwargs(
            dtype=ctx.plan.dtype,
            num_blocks=num_seqs * -(-max_len // BLOCK_SIZE) + 8,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(num_seqs * max_len, 2048),
            max_model_len=max_len,
            **kwargs,
        ),
    )


def big_engine(
    ctx: Context, num_seqs: int, max_len: int, kv_connector: Any = None, **kwargs: Any
) -> Any:
    """The big preset's LLMEngine (with kv_connector: as a prefill node builds it)."""
    from pdserve.engine.llm_engine import LLMEngine

    configs = big_engine_args(ctx, num_seqs, max_len, **kwargs).to_configs()
    return LLMEngine(
        configs.model_config,
        configs.cache_config,
        configs.scheduler_config,
        kv_connector=kv_connector,
    )


def throughput(ctx: Context) -> dict[str, Any]:
    from pdserve.make_model import param_count

    plan = ctx.plan
    engine = big_engine(ctx, plan.num_requests, plan.input_len + plan.output_len)
    vocab = engine.vocab_size
    run_batch(engine, random_prompts(2, plan.input_len, vocab, 0), 4)  # warm-up
    run = run_batch(engine, random_prompts(plan.num_requests, plan.input_len, vocab, 1),
                    plan.output_len)  # fmt: skip
    arch = engine.runner.kv_cache.shape
    kv_token_bytes = arch[0] * 2 * arch[3] * arch[5] * engine.runner.kv_cache.element_size()
    del engine
    free_memory(ctx.device)
    params = param_count("llama", plan.big_preset)
    weight_bytes = params * torch.finfo(getattr(torch, plan.dtype)).bits // 8
    # the median decode step's context: prompt + about half the outputs
    context = plan.input_len + plan.output_len // 2
    step_bytes = weight_bytes + plan.num_requests * context * kv_token_bytes
    bandwidth = copy_bandwidth(ctx)
    peak_flops = matmul_flops(ctx, getattr(torch, plan.dtype))
    prefill_flops = 2 * params * plan.num_requests * plan.input_len
    output_tokens = plan.num_requests * plan.output_len
    return {
        "status": "ok",
        "requests": plan.num_requests,
        "input_len": plan.input_len,
        "output_len": plan.output_len,
        "dtype": plan.dtype,
        "output_tokens_per_s": output_tokens / run.total_s,
        "total_tokens_per_s": (output_tokens + plan.num_requests * plan.input_len) / run.total_s,
        "total_s": run.total_s,
        "prefill_s": run.prefill_s,
        "prefill_tflops": prefill_flops / run.prefill_s / 1e12,
        "matmul_tflops": peak_flops / 1e12,
        "prefill_vs_matmul": prefill_flops / run.prefill_s / peak_flops,
        "decode_step_ms": run.decode_step_s * 1e3,
        "decode_step_bytes": step_bytes,
        "copy_gb_s": bandwidth / 1e9,
        "decode_roofline_ms": step_bytes / bandwidth * 1e3,
        "decode_vs_roofline": step_bytes / bandwidth / run.decode_step_s,
    }


# -- graphs --------------------------------------------------------------------------------------


def graphs(ctx: Context) -> dict[str, Any]:
    """Decode tokens/s with CUDA graphs (the default) and with enforce_eager, per batch."""
    plan, rows = ctx.plan, []
    max_batch = max(plan.graph_batches)
    for eager in (False, True):
        extra = _eager(ctx) if eager else {}
        engine = big_engine(ctx, max_batch, plan.input_len + plan.output_len, **extra)
        run_batch(engine, random_prompts(2, plan.input_len, engine.vocab_size, 0), 4)
        for batch in plan.graph_batches:
            prompts = random_prompts(batch, plan.input_len, engine.vocab_size, batch)
            run = run_batch(engine, prompts, plan.output_len)
            rows.append(
                {
                    "batch": batch,
                    "cuda_graphs": not eager,
                    "decode_step_ms": run.decode_step_s * 1e3,
                    "decode_tokens_per_s": batch / run.decode_step_s,
                }
            )
        del engine
        free_memory(ctx.device)
    rate = {(r["batch"], r["cuda_graphs"]): r["decode_tokens_per_s"] for r in rows}
    ratios = {str(b): rate[b, True] / rate[b, False] for b in plan.graph_batches}
    return {"status": "ok", "rows": rows, "graphs_vs_eager": ratios}


def _eager(ctx: Context) -> dict[str, Any]:
    """enforce_eager=True, passed (like device=) only off the CPU, where it has no effect."""
    return {"enforce_eager": True} if ctx.device.type != "cpu" else {}


# -- disagg --------------------------------------------------------------------------------------


class LoopThread:
    """An asyncio event loop on its own thread: the node's loop (transports, sends)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Arrivals:
    """Received messages waiting for the decode engine's thread (here: the main thread)."""

    staged: list[tuple[list[int], Any]] = field(default_factory=list)
    first_s: float | None = None
    last_s: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, target: list[int], staged: Any) -> None:
        with self.lock:
            self.staged.append((target, staged))
            self.last_s = time.perf_counter()
            self.first_s = self.first_s or self.last_s

    def receiver_of(self, kv_blocks: Any, block_ids: list[int], skip: int) -> Callable:
        """A transfer's on_blocks: wire block j is the request's block skip + j (as in
        decode_node/prefill_client.py); staged out of the transport's buffer on the loop."""

        def on_blocks(header: Any, payload: Any) -> None:
            start = skip + header.first_block
            self.note(block_ids[start : start + header.num_blocks], kv_blocks.stage(payload))

        return on_blocks

    def take(self) -> list[tuple[list[int], Any]]:
        with self.lock:
            taken, self.staged = self.staged, []
        return taken


def disagg(ctx: Context) -> dict[str, Any]:
    """Aggregated tokens, then the same requests prefilled by one engine and decoded by another
    (both on ctx.device), the KV pushed over TCP on 127.0.0.1."""
    plan = ctx.plan
    max_len = plan.disagg_input_len + plan.disagg_output_len
    n = plan.disagg_requests
    aggregated = big_engine(ctx, n, max_len)
    prompts = random_prompts(n, plan.disagg_input_len, aggregated.vocab_size, 3)
    expected = list(run_batch(aggregated, prompts, plan.disagg_output_len).tokens.values())
    del aggregated
    free_memory(ctx.device)
    loop = LoopThread()
    try:
        got, stats = _disaggregated(ctx, loop, prompts, max_len)
    finally:
        loop.close()
    equal = sum(g == e for g, e in zip(got, expected, strict=True))
    return {"status": "ok" if equal == n else "mismatch", "requests": n, "equal": equal, **stats}


def _disaggregated(
    ctx: Context, loop: LoopThread, prompts: list[list[int]], max_len: int
) -> tuple[list[list[int]], dict[str, Any]]:
    from pdserve.engine import SamplingParams
    from pdserve.engine.outputs import SampledTokens
    from pdserve.engine.utils import cdiv
    from pdserve.kvtransfer.connector import KVPushConnector, PushTarget, kv_layout
    from pdserve.kvtransfer.transport import make_receiver, make_sender

    plan, n = ctx.plan, len(prompts)
    sender, receiver = make_sender("tcp"), make_receiver("tcp", "127.0.0.1")
    loop.run(receiver.start())
    connector = KVPushConnector("m", sender, loop.loop)
    # prefill steps never replay CUDA graphs: capturing them would only cost start-up time
    prefill = big_engine(ctx, n, max_len, kv_connector=connector, **_eager(ctx))
    decode = big_engine(ctx, n, max_len)
    kv_blocks = decode.kv_blocks
    layout = kv_layout("m", kv_blocks, BLOCK_SIZE)
    connector.layout.check(layout)  # as the prefill node checks the decode node's target
    params = SamplingParams(temperature=0.0, max_tokens=plan.disagg_output_len, ignore_eos=True)
    ids = [f"r{i}" for i in range(n)]
    for rid, prompt in zip(ids, prompts, strict=True):
        decode.add_request(rid, prompt, params, wants_remote_prefill=True)
    arrivals, transfers = Arrivals(), {}
    reserved = []
    for _ in range(100):  # every request is admitted with its blocks reserved (max_num_seqs=n)
        reserved += decode.step().remote_prefills
        if len(reserved) == n:
            break
    started = time.perf_counter()
    for rp in reserved:
        prompt = prompts[ids.index(rp.request_id)]
        skip = rp.num_local_cached_tokens // BLOCK_SIZE
        transfer_id = uuid.uuid4().hex
        on_blocks = arrivals.receiver_of(kv_blocks, rp.block_ids, skip)
        num_blocks = cdiv(len(prompt), BLOCK_SIZE) - skip
        token = loop.call(partial(receiver.expect, transfer_id, layout, num_blocks, on_blocks))
        target = PushTarget(receiver.address, transfer_id, skip, token=token)
        connector.register(rp.request_id, target, len(prompt))
        prefill.add_request(rp.request_id, prompt, params, prefill_only=True)
        transfers[rp.request_id] = transfer_id
    first: dict[str, list[int]] = {}
    while len(first) < n:
        for update in prefill.step().updates:
            first[update.request_id] = update.new_token_ids
    prefill_done = time.perf_counter()
    kv_bytes = 0
    for rid, transfer_id in transfers.items():
        loop.run(connector.sent(rid, timeout_s=60))
        kv_bytes += loop.run(receiver.wait(transfer_id, timeout_s=60)).bytes
        connector.unregister(rid)
    received = time.perf_counter()
    for target_blocks, staged in arrivals.take():
        kv_blocks.scatter(target_blocks, staged)
    sync(ctx.device)
    scattered = time.perf_counter()
    for rid in ids:
        decode.finish_remote_prefill(rid, SampledTokens(first[rid]), 0)
    tokens = {rid: list(first[rid]) for rid in ids}
    while decode.has_unfinished_requests():
        for update in decode.step().updates:
            tokens[update.request_id] += update.new_token_ids
    loop.run(receiver.close())
    loop.run(sender.close())
    del prefill, decode
    free_memory(ctx.device)
    window = (arrivals.last_s or received) - (arrivals.first_s or started)
    stats = {
        "kv_bytes": kv_bytes,
        "prefill_s": prefill_done - started,
        "receive_window_s": window,
        "kv_receive_gb_s": kv_bytes / max(window, 1e-9) / 1e9,
        "scatter_s": scattered - received,
        "device_to_device_gb_s": kv_bytes / (scattered - (arrivals.first_s or started)) / 1e9,
        "exposed_transfer_s": scattered - prefill_done,
    }
    return [tokens[rid] for rid in ids], stats


# -- driver --------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "vs-hf": vs_hf,
    "kv-io": kv_io,
    "throughput": throughput,
    "graphs": graphs,
    "disagg": disagg,
}


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    if device.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return env


def run_section(name: str, ctx: Context, out: Path) -> dict[str, Any]:
    """Run one section; its JSON is written before (as "running") and after."""
    result: dict[str, Any] = {"section": name, "status": "running", **environment(ctx.device)}
    out.write_text(json.dumps(result, indent=2))
    started = time.perf_counter()
    try:
        result |= RUNNERS[name](ctx)
    except Exception:  # noqa: BLE001 - recorded; the next section still runs
        result |= {"status": "failed", "error": traceback.format_exc()}
        logger.exception("section %s failed", name)
    result["seconds"] = time.perf_counter() - started
    result["plan"] = asdict(ctx.plan)
    out.write_text(json.dumps(result, indent=2, default=str))
    return result


def summary(results_dir: Path) -> str:
    """A markdown table: one line per section file, its headline numbers."""
    lines = ["| section | status | seconds | headline |", "|---|---|---|---|"]
    for path in sorted(results_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            lines.append(f"| {path.stem} | unreadable | | {e} |")
            continue
        seconds = result.get("seconds")
        lines.append(
            f"| {result.get('section', path.stem)} | {_status(result)} | "
            f"{'' if seconds is None else f'{seconds:.0f}'} | {_headline(result)} |"
        )
    return "\n".join(lines)


def _status(result: dict[str, Any]) -> str:
    if "sections" in result:  # benchmarks/gpu_kernels.py's file
        failed = [k for k, v in result["sections"].items() if v.get("status") != "ok"]
        return f"failed: {', '.join(failed)}" if failed else "ok"
    status = result.get("status", "?")
    return "killed (timeout?)" if status == "running" else status


def _headline(result: dict[str, Any]) -> str:
    section = result.get("section")
    if "sections" in result:
        rows = result["sections"].get("correctness", {}).get("rows", [])
        return f"kernels: {sum(r.get('ok', False) for r in rows)}/{len(rows)} correctness cases"
    if result.get("status") == "failed":
        return (result.get("error") or "").strip().splitlines()[-1][:120]
    if section == "vs-hf":
        return ", ".join(f"{r['arch']} {r['equal']}/{r['prompts']}" for r in result.get("rows", []))
    if section == "kv-io":
        return ", ".join(
            f"{r['dtype']} gather {r['gather_gb_s']:.1f} / scatter {r['scatter_gb_s']:.1f} GB/s"
            f"{'' if r['equal'] else ' DIFFERS'}"
            for r in result.get("rows", [])
        )
    if section == "throughput" and "output_tokens_per_s" in result:
        return (
            f"{result['output_tokens_per_s']:.0f} out tok/s; decode step "
            f"{result['decode_step_ms']:.2f} ms = {result['decode_vs_roofline']:.0%} of HBM "
            f"roofline; prefill {result['prefill_tflops']:.0f} TFLOP/s = "
            f"{result['prefill_vs_matmul']:.0%} of matmul"
        )
    if section == "graphs" and "graphs_vs_eager" in result:
        return ", ".join(f"batch {b}: {r:.2f}x" for b, r in result["graphs_vs_eager"].items())
    if section == "disagg" and "equal" in result:
        return (
            f"{result['equal']}/{result['requests']} equal; KV {result['kv_bytes'] / 2**20:.1f} "
            f"MiB at {result['device_to_device_gb_s']:.2f} GB/s device to device"
        )
    return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("section", choices=(*SECTIONS, "summary"))
    p.add_argument("results_dir", nargs="?", help="summary: the directory of section JSONs")
    p.add_argument("--out", help="the section's JSON file")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU smoke test)")
    p.add_argument("--models-dir", help="where make-model writes (default: next to --out)")
    p.add_argument("--archs", default=",".join(ARCHS), help="vs-hf's architectures")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.section == "summary" and not args.results_dir:
        p.error("summary needs the results directory")
    if args.section != "summary" and not args.out:
        p.error("a section needs --out")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if args.section == "summary":
        print(summary(Path(args.results_dir)))
        return 0
    out = Path(args.out)
    ctx = Context(
        device=torch.device(args.device),
        plan=SMOKE if args.smoke else Plan(),
        models_dir=Path(args.models_dir) if args.models_dir else out.parent / "models",
        archs=tuple(args.archs.split(",")),
    )
    result = run_section(args.section, ctx, out)
    print(summary_line(result))
    return 0 if result["status"] == "ok" else 1


def summary_line(result: dict[str, Any]) -> str:
    return f"{result['section']}: {result['status']} {_headline(result)}"


if __name__ == "__main__":
    sys.exit(main())
