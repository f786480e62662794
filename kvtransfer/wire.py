"""Versioned wire format of one KV transfer message: a header, then a raw payload.

A *transfer* is one request's KV push from a prefill node to a decode node. It travels as
one or more *messages*; each message is an encoded TransferHeader followed by its payload.

Header encoding (all integers big-endian):

    prefix  magic b"PDKV" | version u16 | body_bytes u32           (HEADER_PREFIX_BYTES)
    body    transfer_id str | token str | model str | dtype str | device str
            | num_layers u32 | num_kv_heads u32 | head_dim u32 | block_size u32
            | first_block u32 | num_blocks u32 | payload_bytes u64
            | trace_context: count u16, then count x (key str, value str)

where str is a u16 byte length followed by UTF-8. token is the transfer's secret, issued by
the receiver (receiver.py): it authenticates the message before its payload is read. The prefix alone tells a reader how many
bytes the whole header takes (header_size()), so a stream reader can frame it.

Payload: the raw bytes of a C-contiguous tensor shaped
``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]`` in ``layout.dtype``
(dim 2: 0 = keys, 1 = values). It holds the request's blocks with indices
``[first_block, first_block + num_blocks)`` - indices into the request's block list, not
physical block ids: each side maps them to its own physical blocks. Hence
``payload_bytes == num_blocks * layout.block_bytes`` always (checked on construction).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields, replace

WIRE_VERSION = 3
"""2: the token after the transfer id. 3: the device kind after the dtype."""
MAGIC = b"PDKV"
MAX_HEADER_BYTES = 16 * 1024
"""Receivers reject longer headers (the trace context is the only part that can grow)."""

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
"""KV dtypes by torch's name; a float8 payload is the cache's raw float8 bytes (scales 1.0)."""
DEVICE_KINDS = ("cpu", "cuda")
"""Where a cache lives. The bytes of a block are the same on both, but a CPU tier and a GPU
tier never exchange KV: their engines differ in kernels and numerics, so the KV is not the
KV the other side would have computed."""
LORA_SEPARATOR = "+lora:"
"""Between the model id and a LoRA adapter's name in a layout's model (with_adapter)."""

_PREFIX = struct.Struct("!4sHI")
HEADER_PREFIX_BYTES = _PREFIX.size
_U16 = struct.Struct("!H")
_SHAPE = struct.Struct("!IIII")  # num_layers, num_kv_heads, head_dim, block_size
_RANGE = struct.Struct("!IIQ")  # first_block, num_blocks, payload_bytes


class WireFormatError(ValueError):
    """Bytes that are not a valid header of this wire version (bad magic, version, length)."""


class KVLayoutMismatch(ValueError):
    """The two sides of a transfer disagree on the KV layout; the data would be garbage."""


@dataclass(frozen=True)
class LayoutSignature:
    """What both sides must agree on for the bytes of a block to mean the same thing."""

    model: str
    """Model id (name or path) the KV was computed with."""
    dtype: str
    """KV dtype: a key of DTYPE_ITEMSIZE ("float32", "bfloat16", "float8_e4m3fn")."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    """Token slots per block."""
    device: str = "cpu"
    """Device kind the KV cache lives on: "cpu" or "cuda" (DEVICE_KINDS)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"device must be one of {DEVICE_KINDS}, got {self.device!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of dtype."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        elems = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        return elems * self.itemsize

    def with_adapter(self, lora_name: str | None) -> LayoutSignature:
        """The layout of KV computed under a LoRA adapter: the adapter's name joins the model
        id, so KV computed without it (or under another) is refused like any mismatch."""
        if not lora_name:
            return self
        return replace(self, model=f"{self.model}{LORA_SEPARATOR}{lora_name}")

    def check(self, other: LayoutSignature) -> None:
        """Raise KVLayoutMismatch naming every field where other differs from self."""
        diffs = [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise KVLayoutMismatch("KV layout mismatch (expected != got): " + "; ".join(diffs))


@dataclass(frozen=True)
class TransferHeader:
    """Describes one message of a transfer: which blocks its payload holds, in what layout."""

    transfer_id: str
    layout: LayoutSignature
    first_block: int
    """Index of the payload's first block in the request's block list."""
    num_blocks: int
    payload_bytes: int
    """Always num_blocks * layout.block_bytes."""
    trace_context: dict[str, str] = field(default_factory=dict)
    """W3C trace context ("traceparent", "tracestate"); may be empty."""
    token: str = ""
    """The transfer's token, as the receiver's expect() issued it."""

    def __post_init__(self) -> None:
        if self.first_block < 0 or self.num_blocks < 1:
            raise ValueError(
                f"need first_block >= 0 and num_blocks >= 1, "
                f"got first_block={self.first_block} num_blocks={self.num_blocks}"
            )
        expected = self.num_blocks * self.layout.block_bytes
        if self.payload_bytes != expected:
            raise ValueError(
                f"payload_bytes={self.payload_bytes} but {self.num_blocks} blocks of "
                f"{self.layout.block_bytes} bytes take {expected}"
            )

    def encode(self) -> bytes:
        """The header's wire bytes (prefix + body); raises WireFormatError if too long."""
        parts = [_pack_str(self.transfer_id), _pack_str(self.token), _pack_str(self.layout.model)]
        parts += [_pack_str(self.layout.dtype), _pack_str(self.layout.device)]
        lay = self.layout
        parts.append(_SHAPE.pack(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size))
        parts.append(_RANGE.pack(self.first_block, self.num_blocks, self.payload_bytes))
        parts.append(_U16.pack(len(self.trace_context)))
        for key, value in self.trace_context.items():
            parts += [_pack_str(key), _pack_str(value)]
        body = b"".join(parts)
        if HEADER_PREFIX_BYTES + len(body) > MAX_HEADER_BYTES:
            raise WireFormatError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
        return _PREFIX.pack(MAGIC, WIRE_VERSION, len(body)) + body

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> TransferHeader:
        """Parse exactly one encoded header; raises WireFormatError on any defect."""
        size = header_size(data)
        if len(data) != size:
            raise WireFormatError(f"header claims {size} bytes, got {len(data)}")
        reader = _Reader(memoryview(data)[HEADER_PREFIX_BYTES:])
        try:
            return reader.header()
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise WireFormatError(f"malformed header: {e}") from e


def header_size(prefix: bytes | bytearray | memoryview) -> int:
    """Total header bytes announced by its first HEADER_PREFIX_BYTES bytes (validated)."""
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise WireFormatError(f"truncated header prefix: {len(prefix)} bytes")
    magic, version, body_bytes = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireFormatError(f"wire version {version}, this side speaks {WIRE_VERSION}")
    if HEADER_PREFIX_BYTES + body_bytes > MAX_HEADER_BYTES:
        raise WireFormatError(f"header of {body_bytes} bytes exceeds {MAX_HEADER_BYTES}")
    return HEADER_PREFIX_BYTES + body_bytes


def _pack_str(text: str) -> bytes:
    raw = text.encode()
    return _U16.pack(len(raw)) + raw


class _Reader:
    """Cursor over a header body; struct.error signals truncation."""

    def __init__(self, body: memoryview) -> None:
        self.body = body
        self.pos = 0

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        values = fmt.unpack_from(self.body, self.pos)
        self.pos += fmt.size
        return values

    def text(self) -> str:
        (length,) = self.unpack(_U16)
        if self.pos + length > len(self.body):
            raise struct.error(f"string of {length} bytes runs past the end")
        text = bytes(self.body[self.pos : self.pos + length]).decode()
        self.pos += length
        return text

    def header(self) -> TransferHeader:
        transfer_id, token, model = self.text(), self.text(), self.text()
        dtype, device = self.text(), self.text()
        num_layers, num_kv_heads, head_dim, block_size = self.unpack(_SHAPE)
        first_block, num_blocks, payload_bytes = self.unpack(_RANGE)
        (num_items,) = self.unpack(_U16)
        trace_context = {self.text(): self.text() for _ in range(num_items)}
        if self.pos != len(self.body):
            raise struct.error(f"{len(self.body) - self.pos} trailing bytes")
        layout = LayoutSignature(
            model, dtype, num_layers, num_kv_heads, head_dim, block_size, device
        )
        return TransferHeader(
            transfer_id, layout, first_block, num_blocks, payload_bytes, trace_context, token
        )
