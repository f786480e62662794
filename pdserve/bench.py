"""`pdserve bench serve`: an online load generator with `vllm bench serve` semantics.

    pdserve bench serve --base-url http://127.0.0.1:8000 --tokenizer models/tiny \\
        --random-input-len 256 --random-output-len 64 --num-prompts 64 --max-concurrency 16

The story of one run: build the prompts (seeded random token ids from the tokenizer's vocabulary,
special tokens excluded) → precompute the request payloads and arrival times (Poisson, or gamma
with --burstiness) → send one streaming request per prompt, each timed on the monotonic clock →
aggregate the per-request timings into vLLM's metrics (a pure function) → print the summary and
write the JSON result.

Timing follows vLLM's client: TTFT is the time to the first token chunk, ITL the gap between
consecutive token chunks, E2EL the time to the last token chunk, TPOT = (E2EL - TTFT) / (output
tokens - 1); the output token count comes from the final `usage` chunk (fallback: token chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

logger = logging.getLogger("pdserve.bench")

BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
MAX_ERRORS_LOGGED = 10


# -- datasets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptVocab:
    """What prompt building needs from a tokenizer."""

    allowed_ids: np.ndarray
    """Token ids that may be sampled: the vocabulary without special tokens."""
    decode: Callable[[list[int]], str]
    """Token ids -> text (used for chat prompts, which are sent as text)."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt's token ids and the number of tokens to generate."""

    prompt_ids: list[int]
    """Prompt token ids (sent as is to /v1/completions, decoded for chat)."""
    output_len: int
    """max_tokens of the request (exact with --ignore-eos)."""


def load_vocab(tokenizer_dir: str) -> PromptVocab:
    """The sampleable vocabulary of a local HF tokenizer (tokenizer.json, else transformers)."""
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer  # cheap: no transformers import for the common case

        tok = Tokenizer.from_file(path)
        special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        allowed = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
        return PromptVocab(allowed, lambda ids: tok.decode(ids, skip_special_tokens=True))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = set(hf.all_special_ids)
    allowed = np.array([i for i in range(len(hf)) if i not in special], dtype=np.int64)
    return PromptVocab(allowed, lambda ids: hf.decode(ids, skip_special_tokens=True))


def sample_lengths(
    rng: np.random.Generator, num: int, mean: int, range_ratio: float, minimum: int
) -> list[int]:
    """Lengths uniform over the integers of [floor(mean*(1-r)), ceil(mean*(1+r))], as vLLM."""
    low = max(math.floor(mean * (1 - range_ratio)), minimum)
    high = max(math.ceil(mean * (1 + range_ratio)), minimum)
    return rng.integers(low, high + 1, size=num).tolist()


def random_ids(rng: np.random.Generator, vocab: PromptVocab, num: int) -> list[int]:
    """`num` token ids drawn uniformly from the allowed vocabulary."""
    return vocab.allowed_ids[rng.integers(0, len(vocab.allowed_ids), size=num)].tolist()


def sample_random(
    vocab: PromptVocab,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `random` dataset: a shared random prefix + a random part of sampled length."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len + math.floor(input_len * (1 - range_ratio)) < 1:
        raise ValueError("prompts would be empty: raise --random-input-len or --random-prefix-len")
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio, minimum=0)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio, minimum=1)
    prefix = random_ids(rng, vocab, prefix_len)
    return [
        SampleRequest(prefix + random_ids(rng, vocab, n_in), n_out)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def sample_prefix_repetition(
    vocab: PromptVocab,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` random prefixes, each shared by an equal
    share of the prompts (request i uses prefix i % num_prefixes), a random suffix per prompt,
    shuffled. Unlike vLLM it always yields exactly `num_prompts` requests."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"need 1 <= num prefixes ({num_prefixes}) <= num prompts ({num_prompts})")
    if prefix_len + suffix_len < 1:
        raise ValueError("prompts would be empty: raise the prefix or suffix length")
    rng = np.random.default_rng(seed)
    prefixes = [random_ids(rng, vocab, prefix_len) for _ in range(num_prefixes)]
    requests = [
        SampleRequest(prefixes[i % num_prefixes] + random_ids(rng, vocab, suffix_len), output_len)
        for i in range(num_prompts)
    ]
    return [requests[i] for i in rng.permutation(num_prompts)]


def build_dataset(args: argparse.Namespace, vocab: PromptVocab) -> list[SampleRequest]:
    """The requests the flags ask for."""
    if args.dataset == "random":
        return sample_random(
            vocab,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    return sample_prefix_repetition(
        vocab,
        args.num_prompts,
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len,
        args.seed,
    )


# -- arrivals -------------------------------------------------------------------------------------


def arrival_offsets_s(
    num: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """When each request is sent, in seconds from the start. Gaps are gamma(shape=burstiness,
    mean=1/rate) (exponential, i.e. Poisson arrivals, at burstiness 1); as in vLLM they are then
    rescaled so that the last request is sent at exactly num / rate. rate inf = all at once."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate) or num == 0:
        return [0.0] * num
    if math.isinf(burstiness):
        gaps = np.full(num, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    offsets = np.cumsum(gaps)
    return (offsets * (num / request_rate) / offsets[-1]).tolist()


# -- one request ----------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What the client saw of one request; times are seconds on the monotonic clock."""

    prompt_len: int
    """Prompt tokens (the server's `usage.prompt_tokens` when it reports them)."""
    success: bool = False
    output_tokens: int | None = None
    """usage.completion_tokens of the final chunk; None if the server sent no usage."""
    num_token_chunks: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    """Request sent -> last token chunk received."""
    start_time_s: float = 0.0
    error: str = ""


def build_payload(
    backend: str,
    model: str,
    request: SampleRequest,
    vocab: PromptVocab,
    temperature: float,
    ignore_eos: bool,
) -> dict[str, Any]:
    """The streaming request body: token ids for completions, decoded text for chat."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai-chat":
        payload["messages"] = [{"role": "user", "content": vocab.decode(request.prompt_ids)}]
    else:
        payload["prompt"] = request.prompt_ids
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension field: output lengths become exact
    return payload


def is_token_chunk(event: dict[str, Any], chat: bool) -> bool:
    """Whether an SSE event carries generated tokens (usage-only events have no choices).

    Chat streams may open with a role-only delta and close with an empty delta that only holds
    finish_reason; neither carries a token. An empty completion text still counts (a token whose
    text is held back by the detokenizer), as in vLLM's client."""
    choices = event.get("choices")
    if not choices:
        return False
    if not chat:
        return True
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    return content is not None and not (delta.get("role") and content == "")


async def consume_stream(response: httpx.Response, chat: bool, result: RequestResult) -> None:
    """Time the token chunks of a 200 response into `result` (sets success at the end)."""
    last_s = result.start_time_s
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments, other SSE fields
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now_s = time.perf_counter()
        event = json.loads(data)
        if "error" in event:
            result.error = f"error event: {event['error']}"
            return
        if is_token_chunk(event, chat):
            if result.num_token_chunks == 0:
                result.ttft_s = now_s - result.start_time_s
            else:
                result.itl_s.append(now_s - last_s)
            last_s = now_s
            result.num_token_chunks += 1
        if usage := event.get("usage"):
            result.output_tokens = usage.get("completion_tokens")
            result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    if result.num_token_chunks == 0:
        result.error = "the stream ended without a token chunk"
        return
    result.latency_s = last_s - result.start_time_s
    result.success = True


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int, chat: bool
) -> RequestResult:
    """POST one streaming request and time it. Never raises: a failure is kept in `error`."""
    result = RequestResult(prompt_len=prompt_len, start_time_s=time.perf_counter())
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {body}"
            else:
                await consume_stream(response, chat, result)
    except Exception as exc:  # a transport or protocol failure fails this request, not the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# -- the run --------------------------------------------------------------------------------------


def make_client(max_concurrency: int) -> httpx.AsyncClient:
    """One pooled client, with a connection per concurrent request and a generous timeout."""
    limits = httpx.Limits(
        max_connections=max_concurrency, max_keepalive_connections=max_concurrency
    )
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0, connect=60.0))


async def wait_until_ready(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], chat: bool, timeout_s: float
) -> None:
    """Retry one request until it succeeds (vLLM's ready check); ValueError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await send_request(client, url, payload, 0, chat)
        if result.success:
            return
        if time.monotonic() >= deadline:
            raise ValueError(f"the endpoint is not ready after {timeout_s:.0f} s: {result.error}")
        await asyncio.sleep(1.0)


class LoopStalls:
    """How late the load generator's own event loop ran during the timed run.

    A task asks to wake every INTERVAL_S and records how much later it woke. A client that is
    not scheduled (a machine busy with the server) reads every stream late at once, and those
    waits land in its TTFT/ITL figures; this makes them visible next to the figures they
    inflate. (It found the 1-3 s run-queue waits of a load generator in another session than
    the server: see benchmarks/serve_vs_vllm.py start_vllm_server.)"""

    INTERVAL_S = 0.01
    WARN_MS = 50.0
    """A stall above this is logged as a warning with the results."""

    def __init__(self) -> None:
        self.late_s: list[float] = []

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        task = asyncio.ensure_future(self._watch())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        while True:
            start_s = time.perf_counter()
            await asyncio.sleep(self.INTERVAL_S)
            self.late_s.append(max(time.perf_counter() - start_s - self.INTERVAL_S, 0.0))

    def summary(self) -> dict[str, float]:
        """Result-file keys: the worst stall, the 99th percentile of all wake-ups' lateness,
        and the total of the stalls longer than WARN_MS."""
        late_ms = np.array(self.late_s or [0.0]) * 1000
        return {
            "client_stall_max_ms": float(late_ms.max()),
            "client_stall_p99_ms": float(np.percentile(late_ms, 99)),
            "client_stall_over_warn_s": float(late_ms[late_ms > self.WARN_MS].sum() / 1000),
        }


async def run_requests(
    client: httpx.AsyncClient,
    url: str,
    payloads: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int],
    offsets_s: Sequence[float],
    max_concurrency: int | None,
    chat: bool,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset, at most `max_concurrency` in flight at a time
    (a request that arrives while the limit is reached waits its turn, in arrival order).
    Returns the results in request order and the benchmark duration in seconds."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    pbar = tqdm(total=len(payloads), disable=not show_progress)
    start_s = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay_s = start_s + offsets_s[i] - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        async with limit:
            result = await send_request(client, url, payloads[i], prompt_lens[i], chat)
        pbar.update(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(len(payloads))))
    duration_s = time.perf_counter() - start_s
    pbar.close()
    return list(results), duration_s


# -- metrics --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricStats:
    """Summary of one latency metric, in milliseconds (all 0 when there are no samples)."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]
    """Percentile (e.g. 99.0) -> value, numpy's linear interpolation."""


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The aggregate numbers of a run, named as in vLLM's `BenchmarkMetrics`."""

    completed: int
    failed: int
    total_input: int
    """Prompt tokens of the successful requests."""
    total_output: int
    request_throughput: float
    """Successful requests per second."""
    request_goodput: float | None
    """Successful requests per second that met every SLO; None without SLOs."""
    output_throughput: float
    total_token_throughput: float
    output_lens: list[int]
    """Per request (0 for failed ones)."""
    stats: dict[str, MetricStats]
    """Metric name ("ttft", "tpot", "itl", "e2el") -> its summary."""


def metric_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """Mean/median/std/percentiles in ms of samples given in seconds."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return MetricStats(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
    return MetricStats(
        mean_ms=float(ms.mean()),
        median_ms=float(np.median(ms)),
        std_ms=float(ms.std()),
        percentiles_ms={p: float(np.percentile(ms, p)) for p in percentiles},
    )


def output_len_of(result: RequestResult) -> int:
    """Generated tokens: the server's usage count, else the number of token chunks."""
    return result.output_tokens if result.output_tokens else result.num_token_chunks


def tpot_s(result: RequestResult) -> float:
    """Time per output token after the first; 0 for single-token outputs (as vLLM's goodput)."""
    n = output_len_of(result)
    return (result.latency_s - result.ttft_s) / (n - 1) if n > 1 else 0.0


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request's TTFT/TPOT/E2EL are all within their SLOs."""
    values_s = {"ttft": result.ttft_s, "tpot": tpot_s(result), "e2el": result.latency_s}
    return all(values_s[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request results as vLLM's `calculate_metrics` does (pure).

    Only successful requests contribute; TPOT samples come from requests with more than one
    output token; ITL samples are pooled over all requests."""
    ok = [r for r in results if r.success]
    output_lens = [output_len_of(r) if r.success else 0 for r in results]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    goodput = None
    if goodput_slos_ms:
        goodput = sum(meets_slos(r, goodput_slos_ms) for r in ok) / duration_s
    samples = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [tpot_s(r) for r in ok if output_len_of(r) > 1],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.latency_s for r in ok],
    }
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        output_lens=output_lens,
        stats={name: metric_stats(v, percentiles) for name, v in samples.items()},
    )


# -- reporting ------------------------------------------------------------------------------------

METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def format_summary(
    m: BenchmarkMetrics, duration_s: float, args: argparse.Namespace, metrics: Sequence[str]
) -> str:
    """vLLM's "Serving Benchmark Result" table."""
    rows: list[str] = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(name: str, value: float | int) -> None:
        rows.append(
            f"{name:<40} {value:<10}" if isinstance(value, int) else f"{name:<40} {value:<10.2f}"
        )

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if not math.isinf(args.request_rate):
        row("Request rate configured (RPS):", float(args.request_rate))
    row("Benchmark duration (s):", duration_s)
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name in metrics:
        short, title = METRIC_TITLES[name]
        s = m.stats[name]
        rows.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", s.mean_ms)
        row(f"Median {short} (ms):", s.median_ms)
        for p, value in s.percentiles_ms.items():
            row(f"P{percentile_word(p)} {short} (ms):", value)
    rows.append("=" * 50)
    return "\n".join(rows) + "\n"


def build_result(
    m: BenchmarkMetrics,
    results: Sequence[RequestResult],
    duration_s: float,
    args: argparse.Namespace,
    metrics: Sequence[str],
) -> dict[str, Any]:
    """The --result-file JSON: vLLM's key names, per-request lists, and the args used."""
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": args.backend,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer,
        "num_prompts": len(results),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for name in metrics:
        s = m.stats[name]
        out[f"mean_{name}_ms"] = s.mean_ms
        out[f"median_{name}_ms"] = s.median_ms
        out[f"std_{name}_ms"] = s.std_ms
        for p, value in s.percentiles_ms.items():
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    out |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": m.output_lens,
        "ttfts": [r.ttft_s for r in results],
        "itls": [r.itl_s for r in results],
        "latencies": [r.latency_s for r in results],
        "start_times": [r.start_time_s for r in results],
        "errors": [r.error for r in results],
        "args": {k: v for k, v in vars(args).items() if k != "func" and _is_plain(v)},
    }
    return out


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def log_errors(results: Sequence[RequestResult]) -> None:
    """Log the first failures' errors (the rest are only in the result file)."""
    failed = [r.error for r in results if not r.success]
    for i, error in enumerate(failed[:MAX_ERRORS_LOGGED]):
        logger.warning("failed request %d/%d: %s", i + 1, len(failed), error)


# -- command line ---------------------------------------------------------------------------------


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC in {GOODPUT_METRICS}: {pair!r}"
            )
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput SLOs must be >= 0 ms: {pair!r}")
    return slos


def parse_metric_names(text: str) -> list[str]:
    """ "ttft,itl" -> ["ttft", "itl"], checked against the known metrics."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; known {PERCENTILE_METRICS}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """ "50,99" -> [50.0, 99.0], each in (0, 100]."""
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must lie in (0, 100]: {text!r}")
    return values


def resolve_model(base_url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, timeout=30.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot read the model id from {url} (pass --model): {exc}") from exc


def resolve_tokenizer(args: argparse.Namespace) -> str:
    """--tokenizer, else --model when it is a local directory."""
    if args.tokenizer:
        return args.tokenizer
    if os.path.isdir(args.model):
        return args.model
    raise ValueError(f"--model {args.model!r} is not a local directory: pass --tokenizer DIR")


async def benchmark(
    args: argparse.Namespace,
    requests: Sequence[SampleRequest],
    vocab: PromptVocab,
    stalls: LoopStalls,
) -> tuple[list[RequestResult], float]:
    """Ready check and warm-ups (untimed), then the timed run (watched by `stalls`)."""
    chat = args.backend == "openai-chat"
    url = args.base_url.rstrip("/") + args.endpoint
    payloads = [
        build_payload(args.backend, args.model, r, vocab, args.temperature, args.ignore_eos)
        for r in requests
    ]
    offsets_s = arrival_offsets_s(
        len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed)
    )
    concurrency = args.max_concurrency or len(requests)
    async with make_client(concurrency) as client:
        if args.ready_check_timeout_sec > 0:
            await wait_until_ready(client, url, payloads[0], chat, args.ready_check_timeout_sec)
        if args.num_warmups > 0:
            logger.info("warming up with %d requests", args.num_warmups)
            await run_requests(
                client, url, [payloads[0]] * args.num_warmups, [0] * args.num_warmups,
                [0.0] * args.num_warmups, args.max_concurrency, chat, show_progress=False,
            )  # fmt: skip
        logger.info(
            "sending %d requests to %s: rate %s req/s, burstiness %s, max concurrency %s",
            len(requests), url, args.request_rate, args.burstiness, args.max_concurrency,
        )  # fmt: skip
        async with stalls.watching():
            return await run_requests(
                client,
                url,
                payloads,
                [len(r.prompt_ids) for r in requests],
                offsets_s,
                args.max_concurrency,
                chat,
                show_progress=not args.disable_tqdm,
            )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run `pdserve bench serve`; 0 when at least one request succeeded."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    args.endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend]
    args.dataset = args.dataset.replace("_", "-")
    metric_names = parse_metric_names(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    slos_ms = parse_goodput(args.goodput)
    args.model = args.model or resolve_model(args.base_url)
    args.tokenizer = resolve_tokenizer(args)
    vocab = load_vocab(args.tokenizer)
    requests = build_dataset(args, vocab)
    # like vllm bench serve: no full collections walking the dataset while timing
    gc.collect()
    gc.freeze()
    stalls = LoopStalls()
    results, duration_s = asyncio.run(benchmark(args, requests, vocab, stalls))
    metrics = calculate_metrics(results, duration_s, percentiles, slos_ms)
    log_errors(results)
    stall = stalls.summary()
    if stall["client_stall_max_ms"] > LoopStalls.WARN_MS:
        logger.warning(
            "this client's event loop stood still for up to %.0f ms (%.1f s in stalls over %.0f"
            " ms): its latency figures include those waits (an overloaded machine, or the server"
            " in another login session: see benchmarks/README.md)",
            stall["client_stall_max_ms"], stall["client_stall_over_warn_s"], LoopStalls.WARN_MS,
        )  # fmt: skip
    sys.stdout.write(format_summary(metrics, duration_s, args, metric_names))
    if args.result_file:
        result = build_result(metrics, results, duration_s, args, metric_names) | stall
        with open(args.result_file, "w") as f:
            json.dump(result, f)
        logger.info("wrote %s", args.result_file)
    return 0 if metrics.completed else 1


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `bench serve`: vLLM's names and meanings."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--endpoint",
        default=None,
        help="API path; default /v1/completions (openai) or /v1/chat/completions (openai-chat)",
    )
    p.add_argument(
        "--backend",
        default="openai",
        choices=sorted(BACKEND_ENDPOINTS),
        help="openai: completions with token-id prompts; openai-chat: chat with decoded text",
    )
    p.add_argument(
        "--model", default=None, help="model name sent in requests; default: first of /v1/models"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local HF model/tokenizer directory whose vocabulary builds the prompts; "
        "default: --model when that is a directory",
    )
    p.add_argument(
        "--dataset",
        "--dataset-name",
        default="random",
        choices=["random", "prefix-repetition", "prefix_repetition"],
        help="random: random token ids of --random-* lengths; prefix-repetition: "
        "--prefix-repetition-num-prefixes shared prefixes + random suffixes",
    )
    p.add_argument("--num-prompts", type=int, default=1000, help="number of requests")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean requests/s of the arrival process; inf sends all requests at once",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more uniform",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (later arrivals wait); default: unlimited",
    )
    g = p.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="mean max_tokens")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="r in [0, 1): input/output lengths uniform in [len*(1-r), len*(1+r)]",
    )
    g.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one random prefix prepended to every prompt (not counted in "
        "--random-input-len)",
    )
    g = p.add_argument_group("prefix-repetition dataset")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix tokens")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="suffix tokens")
    g.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="distinct prefixes; each is shared by num-prompts / num-prefixes prompts",
    )
    g.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrival times")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs in ms (ttft, tpot, e2el), e.g. ttft:500 tpot:50: goodput counts the "
        "requests/s that meet all of them",
    )
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="comma-separated metrics to report (ttft, tpot, itl, e2el)",
    )
    p.add_argument(
        "--metric-percentiles",
        default="50,99",
        help="comma-separated percentiles reported for each metric, e.g. 25,50,75,99",
    )
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send vLLM's `ignore_eos: true` so every request generates exactly max_tokens",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy"
    )
    p.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="untimed requests (copies of the first prompt) sent before the run",
    )
    p.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="retry the first request until it succeeds, for up to this many seconds, before "
        "the run; 0 = no ready check",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--label", default=None, help="free-form name of this run, kept in the result")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the module docstring's layout and shows every meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help  # the help text says what "unset" means
        return super()._get_help_string(action)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` (with its `serve` sub-command) on the pdserve command line."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a running server", description="Benchmarks of a running server."
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    serve = bench_sub.add_parser(
        "serve",
        help="online serving load generator (vllm bench serve semantics)",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    add_serve_args(serve)
    serve.set_defaults(func=cmd_bench_serve)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pdserve.bench serve ...`: the same as `pdserve bench serve ...`."""
    from pdserve.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
