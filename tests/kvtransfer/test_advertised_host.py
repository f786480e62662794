"""A KV receiver told a wildcard host binds every interface and gives senders this machine's
own address (what a decode node in a container or a pod runs with: --kv-host 0.0.0.0)."""

from __future__ import annotations

import asyncio
import socket

from pdserve.kvtransfer.transport import advertised_host, make_receiver, split_address


def test_a_host_is_advertised_as_given_and_a_wildcard_as_this_machine() -> None:
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    own = socket.gethostbyname(socket.gethostname())
    assert advertised_host("0.0.0.0") == own == advertised_host("")


def test_a_tcp_receiver_on_the_wildcard_advertises_and_accepts_on_the_own_address() -> None:
    async def scenario() -> None:
        receiver = make_receiver("tcp", host="0.0.0.0", port=0)
        await receiver.start()
        try:
            host, port = split_address(receiver.address, "tcp")
            assert host == socket.gethostbyname(socket.gethostname())
            for address in (host, "127.0.0.1"):  # bound on every interface
                _, writer = await asyncio.open_connection(address, port)
                writer.close()
                await writer.wait_closed()
        finally:
            await receiver.close()

    asyncio.run(scenario())
