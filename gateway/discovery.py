"""NodeDiscovery: which node addresses the gateway routes to, from its --decode-nodes and
--prefill-nodes entries.

An entry is either an address (an IP literal and a port: "10.0.0.7:50061", "[fd00::7]:50061"),
taken as it is, or a DNS name and a port ("decode:50061", "dns:///pdserve-decode.ns.svc:50061"),
resolved every refresh_s seconds to all its A records (AAAA when it has none): one node per
address. This is how the gateway follows a docker-compose service scaled with --scale, or a
Kubernetes headless Service whose ready pods come and go. What changes is handed to
NodeRegistry.update_nodes: an address that appears becomes a node (routed to once a load poll
finds it healthy); one that disappears gets no new requests, and its open streams finish.

A name that does not exist (NXDOMAIN: a service scaled to zero, a headless Service with no
ready pod) means no nodes; any other resolution failure (timeout, DNS server unreachable)
keeps the addresses last resolved. With refresh_s == 0 nothing is resolved here: every entry
is a static address that gRPC resolves itself (one channel per entry).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.gateway.registry import NodeRegistry, Role

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
"""gRPC's name syntax for a DNS name (the default authority only)."""
RESOLVE_TIMEOUT_S = 5.0
"""Deadline of one name's resolution; a slower answer counts as a failure (addresses kept)."""
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""(host, port) -> the IP addresses the name has now; raises socket.gaierror (EAI_NONAME for a
name that does not exist) or OSError when it cannot tell."""


async def resolve_ips(host: str, port: int) -> list[str]:
    """The default Resolver: getaddrinfo in the loop's executor; the IPv4 addresses, or the
    IPv6 ones when there are none (so "localhost" is one node, not two)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    by_family: dict[int, set[str]] = {socket.AF_INET: set(), socket.AF_INET6: set()}
    for family, _, _, _, sockaddr in infos:
        if family in by_family:
            by_family[family].add(str(sockaddr[0]))
    return sorted(by_family[socket.AF_INET] or by_family[socket.AF_INET6])


@dataclass(frozen=True)
class NodeEntry:
    """One --decode-nodes/--prefill-nodes entry, parsed."""

    host: str
    """An IP literal (without brackets) or a DNS name."""
    port: int
    is_name: bool
    """True for a DNS name (to resolve), False for an IP literal (an address as it is)."""

    @classmethod
    def parse(cls, entry: str) -> NodeEntry:
        """ "host:port", "[v6]:port" or "dns:///host:port"; ValueError otherwise."""
        text = entry.removeprefix(DNS_SCHEME)
        if "://" in text or text.startswith("dns:"):
            raise ValueError(f"node address {entry!r}: only the dns:/// scheme is understood")
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"node address {entry!r} is not host:port")
        host = host.removeprefix("[").removesuffix("]")
        is_name = not _is_ip(host)
        if is_name and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"node address {entry!r} is not host:port")
        return cls(host, int(port), is_name)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def format_address(ip: str, port: int) -> str:
    """ip:port as gRPC wants it ("[fd00::7]:50061" for IPv6)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class NodeDiscovery:
    """Keeps a NodeRegistry's decode and prefill nodes equal to what the entries name (see the
    module docstring). start() resolves once and updates the registry before returning, then
    refreshes every refresh_s in a background task until close()."""

    def __init__(
        self,
        decode_entries: Sequence[str],
        prefill_entries: Sequence[str],
        refresh_s: float,
        resolver: Resolver = resolve_ips,
    ) -> None:
        self._entries: dict[Role, list[str]] = {
            "decode": list(decode_entries),
            "prefill": list(prefill_entries),
        }
        self._refresh_s = refresh_s
        self._resolver = resolver
        self._last: dict[str, list[str]] = {}
        """Per name entry, the addresses of its last successful resolution."""
        self._task: asyncio.Task[None] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether some entry is a name that is re-resolved."""
        return self._refresh_s > 0 and any(
            NodeEntry.parse(e).is_name for entries in self._entries.values() for e in entries
        )

    async def start(self, registry: NodeRegistry) -> None:
        await self.refresh(registry)
        if self.dynamic:
            self._task = asyncio.create_task(self._refresh_forever(registry), name="dns-refresh")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def refresh(self, registry: NodeRegistry) -> None:
        """Resolve every entry now and hand the addresses to the registry."""
        for role, entries in self._entries.items():
            await registry.update_nodes(role, await self.addresses(entries))

    async def addresses(self, entries: Sequence[str]) -> list[str]:
        """The node addresses entries stand for now, in entry order, without duplicates."""
        if self._refresh_s <= 0:
            return list(dict.fromkeys(entries))
        resolved = await asyncio.gather(*(self._addresses_of(entry) for entry in entries))
        return list(dict.fromkeys(a for addresses in resolved for a in addresses))

    async def _addresses_of(self, entry: str) -> list[str]:
        parsed = NodeEntry.parse(entry)
        if not parsed.is_name:
            return [format_address(parsed.host, parsed.port)]
        try:
            ips = await asyncio.wait_for(
                self._resolver(parsed.host, parsed.port), RESOLVE_TIMEOUT_S
            )
        except socket.gaierror as exc:
            if exc.errno not in _NO_SUCH_NAME:
                return self._keep_last(entry, exc)
            ips = []
        except (OSError, TimeoutError) as exc:
            return self._keep_last(entry, exc)
        addresses = sorted(format_address(ip, parsed.port) for ip in ips)
        if addresses != self._last.get(entry):
            logger.info("%s resolves to %s", entry, ", ".join(addresses) or "nothing")
        self._last[entry] = addresses
        return addresses

    def _keep_last(self, entry: str, exc: BaseException) -> list[str]:
        last = self._last.get(entry, [])
        logger.warning("cannot resolve %s (%r); keeping %s", entry, exc, last or "no nodes")
        return last

    async def _refresh_forever(self, registry: NodeRegistry) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh(registry)
            except Exception:  # a bug here must not stop discovery for good
                logger.exception("node discovery failed")
