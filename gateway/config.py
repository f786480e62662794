"""GatewayConfig: everything the gateway process is told at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from pdserve.common.tls import InternalTLSConfig
from pdserve.gateway.discovery import NodeEntry


def parse_address_list(value: str) -> tuple[str, ...]:
    """Split "host:port,host:port" into addresses; blanks are dropped."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class GatewayConfig(InternalTLSConfig):
    """The gateway's settings (flags of `pdserve gateway`)."""

    model: str
    """Model (HF directory or GGUF file) the tokenizer and chat template are read from."""
    served_model_name: str
    """Model id clients must name (default: --model as given)."""
    decode_nodes: tuple[str, ...]
    served_model_aliases: tuple[str, ...] = ()
    """More model ids clients may name (vLLM's --served-model-name NAME NAME...)."""
    """Decode node entries: host:port, a DNS name standing for every address it resolves to
    (also written dns:///name:port); at least one."""
    prefill_nodes: tuple[str, ...] = ()
    """Prefill node entries, as decode_nodes; may be empty (decode nodes prefill locally)."""
    tokenizer: str | None = None
    """Tokenizer directory (or GGUF file) to use instead of the model's."""
    chat_template: str | None = None
    """A Jinja chat template file, or the template itself, to use instead of the model's."""
    host: str = "127.0.0.1"
    """Interface the REST and gRPC servers listen on."""
    port: int = 8000
    """REST port (0 picks a free one)."""
    grpc_port: int | None = 50051
    """Public gRPC port; None disables the gRPC front."""
    max_model_len: int | None = None
    """Longest prompt + generation accepted; None: the smallest the decode nodes report."""
    max_num_requests: int = 1024
    """Requests in flight at once; more are refused with 429 + Retry-After."""
    request_timeout_s: float = 600.0
    """Deadline of one request, from arrival to its last token."""
    poll_interval_s: float = 0.5
    """How often every node's load is polled."""
    poll_timeout_s: float = 1.0
    """Deadline of one load poll; a node that misses it is unhealthy."""
    dns_refresh_s: float = 2.0
    """How often node entries that are DNS names are resolved again (0: never resolved here,
    each entry is one node that gRPC resolves itself)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish before the servers stop."""
    keep_alive_timeout_s: float = 30.0
    """How long an idle HTTP/1.1 connection stays open for the client's next request. Longer
    than the idle expiry of common client pools (httpx, which the openai client uses: 5 s), so
    the client, not the server, closes an idle connection: when the server closes one just as
    the client reuses it, the request dies with a connection reset (uvicorn's default is 5 s).
    """
    log_level: str = "INFO"
    """Logging level name."""
    ssl_keyfile: str | None = None
    """PEM key of --ssl-certfile: the public REST and gRPC ports then speak TLS (None:
    $PDSERVE_SSL_KEYFILE, else plaintext)."""
    ssl_certfile: str | None = None
    """PEM certificate (chain) the public REST and gRPC ports present (None:
    $PDSERVE_SSL_CERTFILE)."""
    header_timeout_s: float = 10.0
    """How long a client may take to send a request's headers (from connecting, or from the
    first byte of a request on a kept-alive connection) and then its body; slower connections
    are closed."""
    max_connections: int = 4096
    """Open REST connections at most; more are answered 503 at once."""
    max_request_body_bytes: int = 4 << 20
    """Largest REST request body (and public gRPC message) accepted; larger is 413 /
    RESOURCE_EXHAUSTED before anything is parsed."""
    allowed_origins: tuple[str, ...] = ()
    """CORS: origins browsers may call the REST API from ("*" for any); empty: no CORS
    headers (browsers on other origins are refused)."""
    allow_credentials: bool = False
    """CORS: let browsers send credentials (cookies, Authorization) cross-origin."""
    root_path: str = ""
    """The path prefix a reverse proxy serves the gateway under (ASGI root_path)."""
    enable_log_requests: bool = False
    """Log every request (id, prompt as token ids, sampling parameters) at INFO, as vLLM's
    --enable-log-requests; off by default (prompts may be private)."""
    max_log_len: int | None = None
    """With --enable-log-requests: log at most this many prompt token ids (None: all)."""
    pooling: Literal["last", "mean", "cls"] = "last"
    """How /v1/embeddings pools a prompt's final hidden states: the last token's (decoder
    models), the mean over tokens, or the first token's."""
    stall_timeout_s: float = 5.0
    """A stream whose decode node stops producing tokens moves to another decode node with
    its tokens so far after this long without one (or 20 of its recent inter-token gaps, if
    longer); at once (1 s) when the node's load polls fail."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters clients may name as models: (name, PEFT directory) pairs (vLLM's
    --lora-modules name=path ...); the nodes need --enable-lora."""
    allow_runtime_lora_updating: bool = False
    """Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING); behind --api-key when one is set."""
    tool_call_parser: str | None = None
    """How tool_choice "auto" finds tool calls in the output: hermes (<tool_call> JSON) or
    llama3_json (vLLM's names; needs --enable-auto-tool-choice)."""
    enable_auto_tool_choice: bool = False
    """Accept tool_choice "auto" (the default when tools are given), parsed with
    --tool-call-parser."""
    api_key: str | None = None
    """Clients must send `Authorization: Bearer <key>` on every REST route but /health,
    /metrics, /version and the dashboard page (also read from PDSERVE_API_KEY or
    VLLM_API_KEY). Internal node addresses are shown only with it, when it is set."""

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not self.decode_nodes:
            raise ValueError("at least one decode node is needed (--decode-nodes)")
        for address in self.decode_nodes + self.prefill_nodes:
            NodeEntry.parse(address)  # raises ValueError
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grpc_port is not None and not 0 <= self.grpc_port < 65536:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {self.max_num_requests}")
        for name in ("request_timeout_s", "poll_interval_s", "poll_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dns_refresh_s < 0:
            raise ValueError(f"dns_refresh_s must be >= 0, got {self.dns_refresh_s}")
        if self.keep_alive_timeout_s <= 0:
            raise ValueError(f"keep_alive_timeout_s must be > 0, got {self.keep_alive_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"unknown log level {self.log_level!r}")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise ValueError(
                f"tool_call_parser must be hermes or llama3_json, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tls_files()  # all three internal TLS files or none, readable
