"""TLS between the tiers (mutual) and on the gateway's public ports.

Internal gRPC (gateway -> nodes, decode -> prefill) is mutual TLS when a role is given
--tls-cert, --tls-key and --tls-ca: servers require a client certificate signed by the CA,
clients verify the server's certificate against the same CA. Every role of one deployment
holds a certificate from one internal CA (deploy/certs/make-dev-certs.sh makes a set for the
dev stack). Hostname checks: a client checks the server's certificate names the host it dialled
(an IP SAN for 127.0.0.1, a DNS SAN for a service name), or, with --tls-server-name, that name
for every node (where node addresses are pod IPs that no certificate can list in advance).

The KV transports carry no TLS of their own: every KV message is authenticated by its
transfer's token (kvtransfer/receiver.py), which travels only inside the Prefill call, so
under mutual TLS no party without a certificate ever learns one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, kw_only=True)
class InternalTLSConfig:
    """The mutual-TLS settings every role shares (fields of NodeConfig and GatewayConfig)."""

    tls_cert: str | None = None
    """PEM certificate this process presents to the other tiers (server and client side);
    with --tls-key and --tls-ca, internal gRPC is mutual TLS. None: $PDSERVE_TLS_CERT, else
    plaintext (likewise $PDSERVE_TLS_KEY, _CA, _SERVER_NAME for the three below)."""
    tls_key: str | None = None
    """PEM private key of --tls-cert."""
    tls_ca: str | None = None
    """PEM CA certificate that signed every role's certificate; peers must present one."""
    tls_server_name: str | None = None
    """Name every internal server's certificate must carry (e.g. pdserve.internal, where node
    addresses are pod IPs); None: the host dialled."""

    def tls_files(self) -> TLSFiles | None:
        """The files read (ValueError naming what is missing or unreadable), or None. A flag
        left unset falls back to its environment variable (PDSERVE_TLS_CERT, PDSERVE_TLS_KEY,
        PDSERVE_TLS_CA, PDSERVE_TLS_SERVER_NAME): how a compose file or pod spec turns mutual
        TLS on for every role without restating their commands."""
        return TLSFiles.load(
            self.tls_cert or os.environ.get("PDSERVE_TLS_CERT"),
            self.tls_key or os.environ.get("PDSERVE_TLS_KEY"),
            self.tls_ca or os.environ.get("PDSERVE_TLS_CA"),
            self.tls_server_name or os.environ.get("PDSERVE_TLS_SERVER_NAME"),
        )


@dataclass(frozen=True)
class TLSFiles:
    """A role's certificate, its key and the CA that signs every role's certificate (PEM)."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str | None = None
    """The name every server certificate must carry; None: the host dialled."""

    @classmethod
    def load(
        cls,
        cert: str | None,
        key: str | None,
        ca: str | None,
        server_name: str | None = None,
    ) -> TLSFiles | None:
        """The three files read, or None when none is given; ValueError when only some are
        given or one cannot be read."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            if server_name:
                raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise ValueError(f"mutual TLS needs {', '.join(missing)} too")
        data = {}
        for flag, path in given.items():
            try:
                data[flag] = Path(path).read_bytes()  # type: ignore[arg-type]
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror}") from None
        return cls(data["--tls-cert"], data["--tls-key"], data["--tls-ca"], server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Requires and verifies a client certificate."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def aio_channel(
    address: str, tls: TLSFiles | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.aio.Channel:
    """A channel to an internal server: mutual TLS when tls is given, plaintext otherwise."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def sync_channel(address: str, tls: TLSFiles | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), tls.channel_options())


def add_port(server: grpc.aio.Server, address: str, tls: TLSFiles | None) -> int:
    """Listen on address (mutual TLS when tls is given); the bound port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
