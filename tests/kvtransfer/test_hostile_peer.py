"""An unauthenticated peer against the KV receivers (UCX and TCP), in a separate process whose
resident memory is read from /proc: every message claiming a large payload for a transfer it
holds no token of is refused before any buffer is taken, and the receiver keeps working."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pdserve.kvtransfer.transport import KVTransferError, available_transports, make_sender
from pdserve.kvtransfer.wire import LayoutSignature, TransferHeader

pytestmark = pytest.mark.timeout(180)

LAYOUT = LayoutSignature("m", "float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
CLAIM_BLOCKS = (512 << 20) // LAYOUT.block_bytes  # 512 MiB claimed per message

RECEIVER = textwrap.dedent(
    """
    import asyncio, sys
    from pdserve.kvtransfer.transport import make_receiver
    from pdserve.kvtransfer.wire import LayoutSignature

    def rss_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

    async def main():
        kind = sys.argv[1]
        receiver = make_receiver(kind, "127.0.0.1", 0)
        await receiver.start()
        layout = LayoutSignature("m", "float32", 2, 2, 16, 16)
        got = []
        token = receiver.expect("good", layout, 2, lambda h, p: got.append(bytes(p)))
        warm = receiver.expect("warm", layout, 2, lambda h, p: got.append(bytes(p)))
        print(receiver.address, token, warm, flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if line.strip() == "stats":
                print(rss_kib(), receiver.expected.refused, len(got), flush=True)
            else:
                break
        await receiver.close()

    asyncio.run(main())
    """
)


def bogus_header(transfer_id: str, token: str) -> bytes:
    header = TransferHeader(
        transfer_id, LAYOUT, 0, CLAIM_BLOCKS, CLAIM_BLOCKS * LAYOUT.block_bytes, token=token
    )
    return header.encode()


async def claim_tcp(address: str, encoded: bytes) -> bytes:
    """Send a header (and a little of the claimed payload); what the receiver answers."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(encoded + b"\0" * 65536)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def claim_ucx(address: str, encoded: bytes, payload: np.ndarray | None) -> None:
    """Send a header claiming 512 MiB on a fresh endpoint, then offer the payload (if given)
    on the tag a receiver would read it from."""
    from pdserve.kvtransfer.ucx import _abort, _ucxx, payload_tag

    host, port = address.removeprefix("ucx://").rsplit(":", 1)
    endpoint = await _ucxx().create_endpoint(host, int(port))
    try:
        await endpoint.send(np.frombuffer(bytearray(encoded), dtype=np.uint8))
        if payload is not None:
            tag = payload_tag(TransferHeader.decode(encoded))
            try:
                await asyncio.wait_for(endpoint.send(payload, tag=tag), 5)
            except Exception:  # noqa: BLE001 - the receiver dropped us: what we want
                pass
        await asyncio.sleep(0.01)
    finally:
        _abort(endpoint)


@pytest.mark.parametrize("kind", available_transports())
def test_unauthenticated_claims_are_refused_without_allocating(kind):
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )
    try:
        address, token, warm_token = proc.stdout.readline().split()

        def stats() -> tuple[int, int, int]:
            proc.stdin.write("stats\n")
            proc.stdin.flush()
            rss, refused, delivered = map(int, proc.stdout.readline().split())
            return rss, refused, delivered

        blocks = np.arange(2 * LAYOUT.block_bytes, dtype=np.uint32).astype(np.uint8)
        baseline: list[int] = []

        async def send_good(transfer_id: str, transfer_token: str) -> None:
            sender = make_sender(kind)
            try:
                header = TransferHeader(
                    transfer_id, LAYOUT, 0, 2, blocks.nbytes, token=transfer_token
                )
                await sender.send(address, header, blocks, timeout_s=30)
            finally:
                await sender.close()

        async def attack() -> None:
            # one good transfer first, so the transport's own pools and buffers exist before
            # the baseline is read (under load they can be tens of MiB)
            await send_good("warm", warm_token)
            baseline.append(stats()[0])
            claims = [bogus_header(f"forged-{i}", "0" * 32) for i in range(95)]
            claims += [bogus_header("good", "f" * 32) for _ in range(5)]  # right id, no token
            # three of the UCX claims offer the whole 512 MiB (a receiver that took a buffer
            # for them would hold it, resident, once received)
            payload = None
            if kind == "ucx":
                payload = np.ones(CLAIM_BLOCKS * LAYOUT.block_bytes, dtype=np.uint8)
            for i, encoded in enumerate(claims):
                if kind == "tcp":
                    assert await claim_tcp(address, encoded) == b""  # closed, never acked
                else:
                    await claim_ucx(address, encoded, payload if i % 40 == 0 else None)
            # the receiver still serves the one peer that holds the token
            await send_good("good", token)
            if kind == "ucx":
                from pdserve.kvtransfer.ucx import shutdown_ucx

                shutdown_ucx()

        start = time.monotonic()
        asyncio.run(attack())
        deadline = time.monotonic() + 30
        while (current := stats())[1] < 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        rss_after, refused, delivered = current
        assert refused == 100, f"{refused} of 100 bogus claims refused"
        assert delivered == 2
        # one accepted claim would hold 512 MiB; 64 MiB is allowance for allocator noise
        assert rss_after - baseline[0] < 64 * 1024, (baseline, rss_after)
        assert time.monotonic() - start < 120
    finally:
        if proc.poll() is None:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_forged_token_send_raises_for_a_real_sender():
    """The sender side of a refusal: a clear KVTransferError, not a hang."""

    async def main() -> None:
        from pdserve.kvtransfer.transport import make_receiver

        receiver, sender = make_receiver("tcp"), make_sender("tcp")
        await receiver.start()
        try:
            receiver.expect("t", LAYOUT, 1, lambda h, p: None)
            header = TransferHeader("t", LAYOUT, 0, 1, LAYOUT.block_bytes, token="x")
            with pytest.raises(KVTransferError):
                await sender.send(receiver.address, header, bytes(LAYOUT.block_bytes), 5)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())
