"""Prefill and decode nodes as real processes on 127.0.0.1, driven through the generated gRPC
stubs (no gateway): remote prefill over each KV transport equals the offline engine."""

from __future__ import annotations

import random

import grpc
import pytest

from pdserve.common.protocol import sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.kvtransfer.transport import available_transports
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.integration.procs import Proc, free_port, wait_grpc_serving

BLOCK = 16
NODE_FLAGS = ["--block-size", str(BLOCK), "--num-blocks", "256", "--dtype", "float32"]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module", params=[t for t in ("tcp", "ucx") if t in available_transports()])
def nodes(request, tiny_llama, tmp_path_factory):
    """One prefill node and one decode node using the given KV transport."""
    transport = request.param
    logs = tmp_path_factory.mktemp(f"nodes_{transport}")
    procs = []
    try:
        addresses = {}
        for role in ("prefill", "decode"):
            port = free_port()
            argv = [role, "--model", tiny_llama, *NODE_FLAGS, "--port", str(port)]
            argv += ["--kv-transport", transport, "--num-threads", "1"]
            if role == "decode":
                argv += ["--remote-prefill-min-tokens", "8"]
            proc = Proc(argv, logs / f"{role}.log")
            procs.append(proc)
            addresses[role] = f"127.0.0.1:{port}"
        for proc, address in zip(procs, addresses.values(), strict=True):
            wait_grpc_serving(address, proc)
        yield transport, addresses, procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", block_size=BLOCK, num_blocks=256)


def generate(address, request_id, prompt, params, candidates=()):
    with grpc.insecure_channel(address) as channel:
        stub = node_pb2_grpc.DecodeNodeStub(channel)
        request = node_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(params),
            prefill_candidates=list(candidates),
        )
        chunks = list(stub.Generate(request, timeout=TIMEOUT_S))
    return chunks


def load(address):
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.DecodeNodeStub(channel).GetLoad(node_pb2.GetLoadRequest(), timeout=5.0)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(9, 120))] for _ in range(n)]


def test_remote_prefill_equals_offline_and_moves_exactly_the_prompt_kv(nodes, offline):
    transport, addr, _ = nodes
    cases = prompts(6, seed=1)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, logprobs=2),
    ]
    layout_load = load(addr["decode"])
    assert layout_load.kv_address.startswith(f"{transport}://")
    for i, prompt in enumerate(cases):
        p = params[i % 2]
        want = offline.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        chunks = generate(addr["decode"], f"{transport}-r{i}", prompt, p, [addr["prefill"]])
        got = [t for c in chunks for t in c.token_ids]
        assert got == want.token_ids, f"prompt {i}"
        first = chunks[0]
        assert first.prefilled_by == f"remote:{addr['prefill']}"
        assert first.num_prompt_tokens == len(prompt)
        # fp32 tiny llama: 4 layers x K,V x 2 kv heads x 16 slots x 64 dims x 4 bytes per block
        block_bytes = 4 * 2 * 2 * BLOCK * 64 * 4
        assert first.kv_transfer_bytes == -(-len(prompt) // BLOCK) * block_bytes
        assert chunks[-1].finish_reason != 0
        if p.logprobs is not None:
            lps = [lp for c in chunks for lp in c.logprobs]
            assert [lp.token_id for lp in lps] == got
            for lp, ref in zip(lps, want.logprobs, strict=True):
                assert lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
    assert load(addr["decode"]).num_free_blocks == layout_load.num_total_blocks


def test_short_prompts_prefill_locally(nodes, offline):
    _, addr, _ = nodes
    prompt = [5, 6, 7, 8]  # 4 uncached tokens < --remote-prefill-min-tokens 8
    p = SamplingParams(max_tokens=5, temperature=0.0)
    chunks = generate(addr["decode"], "short", prompt, p, [addr["prefill"]])
    assert chunks[0].prefilled_by == "local" and chunks[0].kv_transfer_bytes == 0
    want = offline.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for c in chunks for t in c.token_ids] == want


def test_dead_prefill_candidate_falls_back(nodes, offline):
    _, addr, _ = nodes
    prompt = prompts(1, seed=5)[0]
    p = SamplingParams(max_tokens=6, temperature=0.0)
    dead = f"127.0.0.1:{free_port()}"
    chunks = generate(addr["decode"], "fallback", prompt, p, [dead, addr["prefill"]])
    assert chunks[0].prefilled_by == f"remote:{addr['prefill']}"
    want = offline.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for c in chunks for t in c.token_ids] == want
    chunks = generate(addr["decode"], "all-dead", prompt, p, [dead])
    assert chunks[0].prefilled_by == "local"
    assert [t for c in chunks for t in c.token_ids] == want


def test_cancel_mid_stream_frees_every_block(nodes):
    _, addr, _ = nodes
    total = load(addr["decode"]).num_total_blocks
    with grpc.insecure_channel(addr["decode"]) as channel:
        stub = node_pb2_grpc.DecodeNodeStub(channel)
        request = node_pb2.DecodeRequest(
            request_id="cancel-me",
            prompt_token_ids=prompts(1, seed=9)[0],
            sampling_params=sampling_params_to_proto(
                SamplingParams(max_tokens=200, ignore_eos=True)
            ),
            prefill_candidates=[addr["prefill"]],
        )
        call = stub.Generate(request, timeout=TIMEOUT_S)
        next(call)
        call.cancel()
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and load(addr["decode"]).num_free_blocks != total:
        time.sleep(0.05)
    assert load(addr["decode"]).num_free_blocks == total
    assert load(addr["decode"]).num_running == 0


def test_bad_request_is_invalid_argument_and_node_keeps_serving(nodes, offline):
    _, addr, _ = nodes
    with pytest.raises(grpc.RpcError) as err:
        generate(addr["decode"], "bad", [10**7], SamplingParams(max_tokens=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(addr["decode"], "bad2", [1, 2], SamplingParams(max_tokens=10**6))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    p = SamplingParams(max_tokens=4, temperature=0.0)
    chunks = generate(addr["decode"], "good-after-bad", [3, 4, 5], p)
    want = offline.generate([[3, 4, 5]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for c in chunks for t in c.token_ids] == want


def test_sigterm_drains_then_aborts_and_exits_cleanly(tiny_llama, tmp_path):
    import signal
    import threading
    import time

    port = free_port()
    argv = ["decode", "--model", tiny_llama, *NODE_FLAGS, "--port", str(port)]
    proc = Proc([*argv, "--kv-transport", "tcp", "--drain-timeout-s", "1"], tmp_path / "d.log")
    try:
        address = f"127.0.0.1:{port}"
        wait_grpc_serving(address, proc)
        p = SamplingParams(max_tokens=1900, ignore_eos=True)
        chunks: list = []
        errors: list = []

        def consume():
            try:
                chunks.extend(generate(address, "long", [1, 2, 3], p))
            except grpc.RpcError as e:
                errors.append(e)

        consumer = threading.Thread(target=consume)
        consumer.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and load(address).num_running == 0:
            time.sleep(0.05)
        proc.process.send_signal(signal.SIGTERM)
        consumer.join(30)
        assert not consumer.is_alive(), "the stream did not end after SIGTERM"
        assert not errors, errors
        assert chunks[-1].finish_reason == 3  # FINISH_REASON_ABORT after the 1 s drain
        assert proc.process.wait(30) == 0
        assert "decode node stopped" in proc.log()
    finally:
        proc.stop()


def test_blocks_the_decode_node_has_cached_are_not_transferred(nodes, offline):
    _, addr, _ = nodes
    rng = random.Random(77)
    shared = [rng.randrange(3, 2000) for _ in range(3 * BLOCK)]
    first = shared + [rng.randrange(3, 2000) for _ in range(20)]
    second = shared + [rng.randrange(3, 2000) for _ in range(40)]
    p = SamplingParams(max_tokens=4, temperature=0.0)
    block_bytes = 4 * 2 * 2 * BLOCK * 64 * 4
    chunks = generate(addr["decode"], "warm-shared", first, p, [addr["prefill"]])
    assert chunks[0].kv_transfer_bytes == -(-len(first) // BLOCK) * block_bytes
    chunks = generate(addr["decode"], "reuse-shared", second, p, [addr["prefill"]])
    # the 3 shared blocks are in the decode node's own prefix cache: only the rest crosses
    assert chunks[0].prefilled_by == f"remote:{addr['prefill']}"
    assert chunks[0].kv_transfer_bytes == (-(-len(second) // BLOCK) - 3) * block_bytes
    assert chunks[0].num_cached_tokens >= 3 * BLOCK
    want = offline.generate([second], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for c in chunks for t in c.token_ids] == want


def test_layout_mismatch_is_refused_and_preemption_recomputes_locally(
    tiny_llama, tmp_path, offline
):
    """A prefill node with another block size is refused and the next candidate delivers; a
    decode node short of blocks preempts remote-prefilled requests and resumes them by local
    recompute; the output stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    bad_port, good_port, decode_port = free_port(), free_port(), free_port()
    common = ["--model", tiny_llama, "--dtype", "float32", "--kv-transport", "tcp"]
    procs = [
        Proc(["prefill", *common, "--block-size", "32", "--num-blocks", "64",
              "--port", str(bad_port)], tmp_path / "bad.log"),
        Proc(["prefill", *common, "--block-size", str(BLOCK), "--num-blocks", "64",
              "--port", str(good_port)], tmp_path / "good.log"),
        Proc(["decode", *common, "--block-size", str(BLOCK), "--num-blocks", "24",
              "--remote-prefill-min-tokens", "8", "--port", str(decode_port)],
             tmp_path / "decode.log"),
    ]  # fmt: skip
    try:
        bad, good, d_addr = (f"127.0.0.1:{p}" for p in (bad_port, good_port, decode_port))
        for proc, address in zip(procs, (bad, good, d_addr), strict=True):
            wait_grpc_serving(address, proc)
        work = [w[:60] for w in prompts(8, seed=31)]
        p = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(generate, d_addr, f"pre-{i}", w, p, [bad, good])
                for i, w in enumerate(work)
            ]
            served = [f.result(timeout=TIMEOUT_S) for f in futures]
        for w, chunks in zip(work, served, strict=True):
            assert chunks[0].prefilled_by == f"remote:{good}"
            want = offline.generate([w], p, use_tqdm=False)[0].outputs[0].token_ids
            assert [t for c in chunks for t in c.token_ids] == want
        log = procs[2].log()
        assert "FAILED_PRECONDITION" in log and "block_size" in log, log
        final = load(d_addr)
        assert final.num_preemptions > 0  # 23 blocks cannot hold 8 x 120 tokens at once
        assert final.num_free_blocks == final.num_total_blocks
    finally:
        for proc in procs:
            proc.stop()


class _StalledPrefillNode(node_pb2_grpc.PrefillNodeServicer):
    """Holds every Prefill call until released, then fails it: a prefill tier with a queue."""

    def __init__(self) -> None:
        import threading

        self.called = threading.Event()
        self.release = threading.Event()

    def Prefill(self, request, context):
        self.called.set()
        self.release.wait(TIMEOUT_S)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released by the test")


def test_queue_aware_decode_node_prefills_locally_while_the_remote_backlog_is_longer(
    tiny_llama, tmp_path, offline
):
    """--max-remote-prefill-queue-tokens: while one prompt waits on a (held) prefill node, the
    next prefills locally in --max-num-batched-tokens chunks and finishes first; the held one
    falls back to local prefill once its call fails. Both equal the offline engine's output."""
    import threading
    from concurrent import futures

    stalled = _StalledPrefillNode()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    node_pb2_grpc.add_PrefillNodeServicer_to_server(stalled, server)
    held_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    port = free_port()
    argv = ["decode", "--model", tiny_llama, *NODE_FLAGS, "--port", str(port)]
    argv += ["--kv-transport", "tcp", "--num-threads", "1", "--remote-prefill-min-tokens", "8"]
    argv += ["--max-remote-prefill-queue-tokens", "1", "--max-num-batched-tokens", "32"]
    proc = Proc(argv, tmp_path / "decode.log")
    try:
        address = f"127.0.0.1:{port}"
        wait_grpc_serving(address, proc)
        first, second = (w[:100] for w in prompts(2, seed=41))
        first += [7] * (100 - len(first))  # the held prompt is the longer queue
        p = SamplingParams(max_tokens=8, temperature=0.0)
        held: dict = {}
        waiter = threading.Thread(
            target=lambda: held.update(chunks=generate(address, "held", first, p, [held_address]))
        )
        waiter.start()
        assert stalled.called.wait(TIMEOUT_S), "the first prompt never reached the prefill node"
        chunks = generate(address, "queued", second, p, [held_address])
        assert waiter.is_alive()  # the held prompt is still waiting for its prefill node
        assert chunks[0].prefilled_by == "local" and chunks[0].kv_transfer_bytes == 0
        want = offline.generate([second], p, use_tqdm=False)[0].outputs[0].token_ids
        assert [t for c in chunks for t in c.token_ids] == want
        stalled.release.set()
        waiter.join(TIMEOUT_S)
        assert held["chunks"][0].prefilled_by == "local"  # fell back after the failed call
        want = offline.generate([first], p, use_tqdm=False)[0].outputs[0].token_ids
        assert [t for c in held["chunks"] for t in c.token_ids] == want
        final = load(address)
        assert final.num_free_blocks == final.num_total_blocks
    finally:
        stalled.release.set()
        proc.stop()
        server.stop(grace=None)


def test_prefill_node_refuses_hostile_kv_targets_and_keeps_serving(nodes, offline):
    """A Prefill call straight to the prefill node: a KV target on a host other than the
    caller's is PERMISSION_DENIED (the node never connects out to it), impossible block ranges
    and oversized transfer ids are INVALID_ARGUMENT; a 20 KB client request id still gets a
    remote prefill through the decode node, and the output stays exact."""
    transport, addresses, _ = nodes
    prompt = prompts(1, seed=41)[0][:40]
    bad_targets = {
        grpc.StatusCode.PERMISSION_DENIED: [
            node_pb2.KVTarget(address=f"{transport}://10.255.255.1:9", transfer_id="x")
        ],
        grpc.StatusCode.INVALID_ARGUMENT: [
            node_pb2.KVTarget(address=f"{transport}://127.0.0.1:9", transfer_id="x",
                              skip_blocks=skip)
            for skip in (-5, 2**31 - 1, 3)  # 40 tokens = 3 blocks: 3 skips them all
        ] + [
            node_pb2.KVTarget(address=f"{transport}://127.0.0.1:9", transfer_id="x" * 20000),
            node_pb2.KVTarget(address="nonsense", transfer_id="x"),
        ],
    }  # fmt: skip
    with grpc.insecure_channel(addresses["prefill"]) as channel:
        stub = node_pb2_grpc.PrefillNodeStub(channel)
        for code, targets in bad_targets.items():
            for target in targets:
                request = node_pb2.PrefillRequest(
                    request_id="hostile", prompt_token_ids=prompt, kv_target=target
                )
                with pytest.raises(grpc.RpcError) as info:
                    stub.Prefill(request, timeout=10)
                assert info.value.code() == code, (target, info.value.details())
        garbage = channel.unary_unary("/pdserve.v1.PrefillNode/Prefill")
        with pytest.raises(grpc.RpcError) as info:
            garbage(b"\xff\xff\xff\xff not a message", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    long_id = "r" * 20000
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    chunks = generate(addresses["decode"], long_id, prompt, p, [addresses["prefill"]])
    assert chunks[0].prefilled_by == f"remote:{addresses['prefill']}"
    want = offline.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for c in chunks for t in c.token_ids] == want
