"""Inter-token latency as the decode tier delivers it, without the gateway or an HTTP client.

Sends the serve_disagg workload (Poisson arrivals of 384-640-token random prompts, 64 greedy
output tokens) straight to a running decode node's gRPC Generate, with the prefill node as the
candidate, and prints ITL and TTFT percentiles. Compare with `pdserve bench serve` through the
gateway to see how much of the tail the gateway path adds.

    .venv/bin/pdserve serve --model models/small --num-prefill 1 --num-decode 1 --num-threads 1 \\
        --pin-cpus --state-file /tmp/state.json &
    .venv/bin/python benchmarks/decode_tier_itl.py --state-file /tmp/state.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import grpc

from pdserve.common.protocol import sampling_params_to_proto
from pdserve.engine.request import SamplingParams
from pdserve.v1 import node_pb2, node_pb2_grpc


async def one(stub, rid: str, prompt: list[int], prefill: str, gaps: list, ttfts: list) -> None:
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    request = node_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sampling_params_to_proto(params),
        prefill_candidates=[prefill],
    )
    start, last = time.perf_counter(), None
    async for _ in stub.Generate(request, timeout=300):
        now = time.perf_counter()
        (ttfts if last is None else gaps).append(now - (start if last is None else last))
        last = now


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(args: argparse.Namespace) -> None:
    state = json.loads(open(args.state_file).read())
    decode = next(n["address"] for n in state if n["name"].startswith("decode"))
    prefill = next(n["address"] for n in state if n["name"].startswith("prefill"))
    rng = random.Random(args.seed)
    gaps: list[float] = []
    ttfts: list[float] = []
    async with grpc.aio.insecure_channel(decode) as channel:
        stub = node_pb2_grpc.DecodeNodeStub(channel)
        tasks = []
        for i in range(args.num_prompts):
            prompt = [rng.randrange(3, 8000) for _ in range(rng.randrange(384, 640))]
            tasks.append(asyncio.create_task(one(stub, f"itl-{i}", prompt, prefill, gaps, ttfts)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    sys.stdout.write(
        f"decode tier: ITL p50 {percentile_ms(gaps, 0.5):.1f} / p99 "
        f"{percentile_ms(gaps, 0.99):.1f} ms; TTFT p50 {percentile_ms(ttfts, 0.5):.0f} / p99 "
        f"{percentile_ms(ttfts, 0.99):.0f} ms\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--state-file", required=True, help="`pdserve serve --state-file` output")
    p.add_argument("--num-prompts", type=int, default=40, help="requests to send")
    p.add_argument("--request-rate", type=float, default=1.0, help="Poisson rate (req/s)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    asyncio.run(run(p.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
