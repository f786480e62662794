"""The KV push connector: which blocks are sent when, and that they land intact."""

from __future__ import annotations

import asyncio

import torch

from pdserve.engine.outputs import ScheduledChunk, SchedulerOutput
from pdserve.kvtransfer.connector import KVPushConnector, PushTarget, gather_blocks, scatter_blocks
from pdserve.kvtransfer.inproc import InprocReceiver, InprocSender
from pdserve.kvtransfer.wire import LayoutSignature

BS = 4
LAYOUT = LayoutSignature("m", "float32", num_layers=2, num_kv_heads=2, head_dim=3, block_size=BS)


def cache(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, 2, 2, BS, 3, generator=g)


def chunk(rid: str, start: int, n: int, block_ids: list[int]) -> SchedulerOutput:
    c = ScheduledChunk(rid, list(range(n)), start, block_ids, 0, samples=False)
    return SchedulerOutput([c], n)


def test_gather_then_scatter_moves_blocks_between_different_physical_ids():
    src, dst = cache(8, 0), torch.zeros(2, 8, 2, 2, BS, 3)
    payload = gather_blocks(src, [5, 2])
    assert payload.nbytes == 2 * LAYOUT.block_bytes
    scatter_blocks(dst, [1, 7], payload)
    assert torch.equal(dst[:, 1], src[:, 5]) and torch.equal(dst[:, 7], src[:, 2])
    assert dst[:, [0, 2, 3, 4, 5, 6]].abs().sum() == 0


def test_blocks_are_pushed_as_they_become_final_and_land_intact():
    async def main():
        src, dst = cache(10, 1), torch.zeros(2, 10, 2, 2, BS, 3)
        receiver, sender = InprocReceiver(), InprocSender()
        await receiver.start()
        loop = asyncio.get_running_loop()
        connector = KVPushConnector("m", sender, loop)
        connector.register_kv_cache(src, BS)  # as the engine's constructor does
        assert connector.layout == LAYOUT
        prefill_blocks = [3, 8, 6, 1]  # the prefill node's physical blocks for a 14-token prompt
        decode_blocks = [9, 2, 5, 4]  # the decode node's, skipping the first (cached there)
        arrived = []

        def on_blocks(header, payload):
            arrived.append((header.first_block, header.num_blocks))
            start = 1 + header.first_block
            scatter_blocks(dst, decode_blocks[start : start + header.num_blocks], payload)

        token = receiver.expect("t1", LAYOUT, 3, on_blocks)
        target = PushTarget(receiver.address, "t1", skip_blocks=1, token=token)
        connector.register("r", target, 14)
        # step 1 computes tokens [0, 6): block 0 is final but skipped, nothing to send yet
        await asyncio.to_thread(connector.after_execute, chunk("r", 0, 6, prefill_blocks))
        # step 2 computes [6, 10): block 1 (tokens 4..7) is final; block 2 not yet
        await asyncio.to_thread(connector.after_execute, chunk("r", 6, 4, prefill_blocks))
        # step 3 computes [10, 14): the prompt is done, blocks 2 and 3 (partial) are final
        await asyncio.to_thread(connector.after_execute, chunk("r", 10, 4, prefill_blocks))
        stats = await connector.sent("r", timeout_s=5)
        got = await receiver.wait("t1", timeout_s=5)
        assert arrived == [(0, 1), (1, 2)]
        assert stats.bytes == got.bytes == 3 * LAYOUT.block_bytes and stats.num_messages == 2
        for p, d in zip(prefill_blocks[1:], decode_blocks[1:], strict=True):
            assert torch.equal(dst[:, d], src[:, p])
        assert dst[:, decode_blocks[0]].abs().sum() == 0
        connector.unregister("r")
        await receiver.close()
        await sender.close()

    asyncio.run(main())
