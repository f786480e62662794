"""KV transfer from a cache on a device: KVBlockIO's staged gather (pieces through reused host
buffers) and scatter, the float8 cache, and the device kind in the layout.

On this CPU machine the staged code runs with `staged=True` through ordinary memory; the
tests marked `cuda` run the same checks on a CUDA cache where there is one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pdserve.engine.kv_block_io import KVBlockIO
from pdserve.engine.outputs import ScheduledChunk, SchedulerOutput
from pdserve.kvtransfer.connector import KVPushConnector, PushTarget, kv_layout
from pdserve.kvtransfer.inproc import InprocReceiver, InprocSender
from pdserve.kvtransfer.transport import KVReceiver, KVSender, make_receiver, make_sender
from pdserve.kvtransfer.wire import (
    KVLayoutMismatch,
    LayoutSignature,
    TransferHeader,
    WireFormatError,
)

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]  # fmt: skip


def cache(num_blocks: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(LAYERS, num_blocks, 2, HEADS, BS, DIM, generator=g)
    return values.to(dtype).to(device)


def as_bytes(blocks: torch.Tensor) -> torch.Tensor:
    """Compare float8 (no equality op on CPU) and NaN-free floats alike, bit for bit."""
    return blocks.cpu().contiguous().view(torch.uint8)


def staged_io(kv_cache: torch.Tensor, piece_blocks: int = 1 << 20) -> KVBlockIO:
    one_block = LAYERS * 2 * HEADS * BS * DIM * kv_cache.element_size()
    return KVBlockIO(kv_cache, staged=True, piece_bytes=piece_blocks * one_block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_staged_gather_then_scatter_moves_blocks_bit_for_bit(dtype, device):
    src, dst = cache(9, dtype, 0, device), torch.zeros(LAYERS, 9, 2, HEADS, BS, DIM).to(dtype)
    dst = dst.to(device)
    src_io, dst_io = staged_io(src, piece_blocks=2), staged_io(dst)
    assert src_io.staged and src_io.block_bytes == LAYERS * 2 * HEADS * BS * DIM * src.itemsize
    payload = src_io.gather([5, 2, 7])
    # the same wire bytes as the unstaged path's
    assert np.array_equal(payload, KVBlockIO(src.cpu(), staged=False).gather([5, 2, 7]))
    dst_io.scatter([1, 8, 3], payload)
    for d, s in ((1, 5), (8, 2), (3, 7)):
        assert torch.equal(as_bytes(dst[:, d]), as_bytes(src[:, s]))
    untouched = [0, 2, 4, 5, 6, 7]
    assert as_bytes(dst[:, untouched]).sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unstaged_float8_and_bf16_round_trip_too(dtype):
    src, dst = cache(4, dtype, 1), torch.zeros(LAYERS, 4, 2, HEADS, BS, DIM).to(dtype)
    io = KVBlockIO(dst)
    assert not io.staged
    io.scatter([0, 3], KVBlockIO(src).gather([3, 1]))
    assert torch.equal(as_bytes(dst[:, 0]), as_bytes(src[:, 3]))
    assert torch.equal(as_bytes(dst[:, 3]), as_bytes(src[:, 1]))


@pytest.mark.parametrize(
    ("num_blocks", "piece_blocks", "expected"),
    [
        (5, 2, [(0, 2), (2, 2), (4, 1)]),  # a short last piece
        (4, 2, [(0, 2), (2, 2)]),  # pieces end exactly at the end
        (3, 3, [(0, 3)]),  # one piece, exactly full
        (1, 4, [(0, 1)]),  # one block, a piece with room to spare
        (3, 0, [(0, 1), (1, 1), (2, 1)]),  # a block larger than piece_bytes: one per piece
        (0, 2, []),
    ],
)
def test_pieces_cover_the_blocks_in_order_at_every_boundary(num_blocks, piece_blocks, expected):
    src = cache(8, torch.float32, 2)
    io = staged_io(src, piece_blocks)
    block_ids = [7, 1, 4, 0, 6][:num_blocks]
    pieces = io.gather_pieces(block_ids)
    assert [(p.first, p.num_blocks) for p in pieces] == expected
    for p in pieces:  # each its own message: [layers, its blocks, ...]
        expected_bytes = KVBlockIO(src).gather(block_ids[p.first : p.first + p.num_blocks])
        assert np.array_equal(p.payload, expected_bytes)


def test_piece_bytes_between_whole_blocks_rounds_down():
    src = cache(8, torch.bfloat16, 3)
    one_block = LAYERS * 2 * HEADS * BS * DIM * 2
    io = KVBlockIO(src, staged=True, piece_bytes=2 * one_block + one_block // 2)
    assert io.piece_blocks == 2
    assert [p.num_blocks for p in io.gather_pieces([0, 1, 2, 3, 4])] == [2, 2, 1]


def test_staging_buffers_are_reused_once_released():
    src = cache(8, torch.float32, 4)
    io = staged_io(src, piece_blocks=2)
    pieces = io.gather_pieces([0, 1, 2, 3])  # two buffers lent at once
    assert io._pool.num_allocated == 2
    for piece in pieces:
        piece.release()
        piece.release()  # idempotent
    again = io.gather_pieces([4, 5, 6])  # a full piece and a short one: the same two buffers
    assert io._pool.num_allocated == 2
    assert np.array_equal(again[0].payload, KVBlockIO(src).gather([4, 5]))
    assert np.array_equal(again[1].payload, KVBlockIO(src).gather([6]))
    io.stage(again[0].payload)  # both lent: received bytes need a third buffer
    assert io._pool.num_allocated == 3
    for piece in again:
        piece.release()
    io.stage(again[0].payload)  # a free one now
    assert io._pool.num_allocated == 3


def test_stage_copies_the_transports_buffer():
    src, dst = cache(3, torch.float32, 5), torch.zeros(LAYERS, 3, 2, HEADS, BS, DIM)
    for io in (staged_io(dst), KVBlockIO(dst)):
        received = KVBlockIO(src).gather([2])
        staged = io.stage(received)
        received[:] = 0  # the transport reuses its buffer after on_blocks returns
        io.scatter([0], staged)
        assert torch.equal(dst[:, 0], src[:, 2])


# -- the layout's device kind and the float8 dtype ---------------------------------------------


def test_layout_names_the_device_kind_and_float8_is_one_byte():
    layout = kv_layout("m", cache(2, torch.float8_e4m3fn, 6), BS)
    assert (layout.dtype, layout.device, layout.itemsize) == ("float8_e4m3fn", "cpu", 1)
    assert layout.block_bytes == LAYERS * 2 * HEADS * BS * DIM
    gpu = LayoutSignature("m", "float8_e4m3fn", LAYERS, HEADS, DIM, BS, device="cuda")
    with pytest.raises(KVLayoutMismatch, match="device: 'cpu' != 'cuda'"):
        layout.check(gpu)
    with pytest.raises(ValueError, match="device must be one of"):
        LayoutSignature("m", "float32", 1, 1, 1, 1, device="mps")


def test_the_device_kind_travels_in_the_header():
    gpu = LayoutSignature("m", "bfloat16", LAYERS, HEADS, DIM, BS, device="cuda")
    header = TransferHeader("t", gpu, 0, 2, 2 * gpu.block_bytes, token="x")
    assert TransferHeader.decode(header.encode()).layout.device == "cuda"
    encoded = header.encode().replace(b"\x00\x04cuda", b"\x00\x04tpu0")
    with pytest.raises(WireFormatError, match="device must be one of"):
        TransferHeader.decode(encoded)


def test_a_receiver_refuses_kv_of_the_other_device_kind():
    async def main():
        receiver, sender = InprocReceiver(), InprocSender()
        await receiver.start()
        cpu = LayoutSignature("m", "float32", LAYERS, HEADS, DIM, BS)
        gpu = LayoutSignature("m", "float32", LAYERS, HEADS, DIM, BS, device="cuda")
        landed = []
        token = receiver.expect("t", cpu, 1, lambda header, payload: landed.append(header))
        header = TransferHeader("t", gpu, 0, 1, gpu.block_bytes, token=token)
        await sender.send(receiver.address, header, np.zeros(gpu.block_bytes, np.uint8))
        with pytest.raises(KVLayoutMismatch, match="device"):
            await receiver.wait("t", timeout_s=5)
        assert landed == []
        await receiver.close()

    asyncio.run(main())


# -- the connector sends a staged cache piece by piece -----------------------------------------


def chunk(rid: str, start: int, n: int, block_ids: list[int]) -> SchedulerOutput:
    c = ScheduledChunk(rid, list(range(n)), start, block_ids, 0, samples=False)
    return SchedulerOutput([c], n)


async def push_prompt(
    receiver: KVReceiver, sender: KVSender, src_io: KVBlockIO, dst_io: KVBlockIO
) -> list[tuple[int, int]]:
    """A 22-token prompt (6 blocks, the first cached on the decode side) pushed in two steps;
    returns the (first_block, num_blocks) of every message that arrived."""
    connector = KVPushConnector("m", sender, asyncio.get_running_loop())
    connector.register_kv_cache(src_io, BS)
    prefill_blocks, decode_blocks = [3, 8, 6, 1, 0, 9], [9, 2, 5, 4, 7, 1]
    arrived = []

    def on_blocks(header, payload):
        arrived.append((header.first_block, header.num_blocks))
        start = 1 + header.first_block
        dst_io.scatter(decode_blocks[start : start + header.num_blocks], dst_io.stage(payload))

    token = receiver.expect("t1", connector.layout, 5, on_blocks)
    connector.register("r", PushTarget(receiver.address, "t1", skip_blocks=1, token=token), 22)
    await asyncio.to_thread(connector.after_execute, chunk("r", 0, 13, prefill_blocks))
    await asyncio.to_thread(connector.after_execute, chunk("r", 13, 9, prefill_blocks))
    stats = await connector.sent("r", timeout_s=10)
    got = await receiver.wait("t1", timeout_s=10)
    assert stats.bytes == got.bytes == 5 * src_io.block_bytes
    assert stats.num_messages == got.num_messages == len(arrived)
    for p, d in zip(prefill_blocks[1:], decode_blocks[1:], strict=True):
        assert torch.equal(as_bytes(dst_io.kv_cache[:, d]), as_bytes(src_io.kv_cache[:, p]))
    assert as_bytes(dst_io.kv_cache[:, decode_blocks[0]]).sum() == 0
    connector.unregister("r")
    return sorted(arrived)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_connector_sends_each_piece_as_a_message_and_blocks_land_intact(dtype):
    async def main():
        receiver, sender = InprocReceiver(), InprocSender()
        await receiver.start()
        src, dst = cache(10, dtype, 7), torch.zeros(LAYERS, 10, 2, HEADS, BS, DIM).to(dtype)
        src_io = staged_io(src, piece_blocks=2)
        # step 1 makes blocks 1..2 final (one piece), step 2 blocks 3..5 (two pieces)
        assert await push_prompt(receiver, sender, src_io, staged_io(dst)) == [
            (0, 2),
            (2, 2),
            (4, 1),
        ]
        assert src_io._pool.num_allocated <= 3  # buffers came back between the two steps
        await receiver.close()
        await sender.close()

    asyncio.run(main())


def test_staged_pieces_cross_the_tcp_transport():
    async def main():
        receiver, sender = make_receiver("tcp"), make_sender("tcp")
        await receiver.start()
        src = cache(10, torch.bfloat16, 8)
        dst = torch.zeros(LAYERS, 10, 2, HEADS, BS, DIM, dtype=torch.bfloat16)
        arrived = await push_prompt(receiver, sender, staged_io(src, 1), staged_io(dst))
        assert arrived == [(i, 1) for i in range(5)]
        await receiver.close()
        await sender.close()

    asyncio.run(main())
