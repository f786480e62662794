"""The KV transfer wire format: exact round trips, and every defect named."""

from __future__ import annotations

import struct

import pytest

from pdserve.kvtransfer.wire import (
    HEADER_PREFIX_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    WIRE_VERSION,
    KVLayoutMismatch,
    LayoutSignature,
    TransferHeader,
    WireFormatError,
    header_size,
)

SMALL_F32 = LayoutSignature("small", "float32", 8, 4, 64, 16)
TRACE = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "congo=t61rcWkgMzE",
}


def header(**changes) -> TransferHeader:
    fields = dict(
        transfer_id="req-é-7",
        layout=SMALL_F32,
        first_block=3,
        num_blocks=4,
        payload_bytes=4 * SMALL_F32.block_bytes,
        trace_context=TRACE,
    )
    fields.update(changes)
    return TransferHeader(**fields)


def test_block_bytes_of_the_small_model():
    # 8 layers * (K, V) * 4 kv heads * 16 slots * 64 dims
    assert SMALL_F32.block_bytes == 262144
    assert SMALL_F32.itemsize == 4
    bf16 = LayoutSignature("small", "bfloat16", 8, 4, 64, 16)
    assert (bf16.itemsize, bf16.block_bytes) == (2, 131072)


def test_round_trip_keeps_every_field():
    one_block = SMALL_F32.block_bytes
    untraced = header(trace_context={}, first_block=0, num_blocks=1, payload_bytes=one_block)
    for original in (header(), untraced):
        encoded = original.encode()
        assert encoded[:4] == MAGIC
        assert header_size(encoded[:HEADER_PREFIX_BYTES]) == len(encoded)
        assert TransferHeader.decode(encoded) == original
        assert TransferHeader.decode(memoryview(bytearray(encoded))) == original


def test_bad_magic_and_version_are_named():
    encoded = bytearray(header().encode())
    bad_magic = b"XXXX" + encoded[4:]
    with pytest.raises(WireFormatError, match="bad magic"):
        TransferHeader.decode(bad_magic)
    bad_version = encoded[:4] + struct.pack("!H", WIRE_VERSION + 1) + encoded[6:]
    with pytest.raises(WireFormatError, match=f"wire version {WIRE_VERSION + 1}"):
        TransferHeader.decode(bad_version)


def test_every_truncation_and_trailing_bytes_are_rejected():
    encoded = header().encode()
    for cut in range(len(encoded)):
        with pytest.raises(WireFormatError):
            TransferHeader.decode(encoded[:cut])
    with pytest.raises(WireFormatError, match="claims"):
        TransferHeader.decode(encoded + b"\0")


def test_a_body_that_lies_about_its_strings_is_rejected():
    encoded = bytearray(header(trace_context={}).encode())
    # the transfer id's length field says 0xFFFF bytes follow
    encoded[HEADER_PREFIX_BYTES : HEADER_PREFIX_BYTES + 2] = b"\xff\xff"
    with pytest.raises(WireFormatError, match="malformed"):
        TransferHeader.decode(encoded)


def test_payload_size_must_match_the_blocks():
    with pytest.raises(ValueError, match="payload_bytes=10 but 4 blocks of 262144 bytes"):
        header(payload_bytes=10)
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        header(num_blocks=0, payload_bytes=0)
    # a peer that encodes a wrong size is caught on decode
    encoded = bytearray(header(trace_context={}).encode())
    size_at = len(encoded) - 2 - 8  # payload_bytes u64 sits before the u16 trace count
    encoded[size_at : size_at + 8] = struct.pack("!Q", 12345)
    with pytest.raises(WireFormatError, match="payload_bytes=12345"):
        TransferHeader.decode(encoded)


def test_oversized_header_cannot_be_encoded_or_announced():
    with pytest.raises(WireFormatError, match="exceeds"):
        header(trace_context={"tracestate": "x" * MAX_HEADER_BYTES}).encode()
    prefix = struct.pack("!4sHI", MAGIC, WIRE_VERSION, MAX_HEADER_BYTES)
    with pytest.raises(WireFormatError, match="exceeds"):
        header_size(prefix)


def test_layout_check_names_every_differing_field_with_both_values():
    SMALL_F32.check(LayoutSignature("small", "float32", 8, 4, 64, 16))  # equal: no error
    other = LayoutSignature("bench", "bfloat16", 8, 4, 64, 32)
    with pytest.raises(KVLayoutMismatch) as info:
        SMALL_F32.check(other)
    message = str(info.value)
    for expected in (
        "model: 'small' != 'bench'",
        "dtype: 'float32' != 'bfloat16'",
        "block_size: 16 != 32",
    ):
        assert expected in message
    assert "num_layers" not in message and "head_dim" not in message
    assert isinstance(info.value, ValueError)


def test_a_lora_adapter_is_part_of_the_layout_a_transfer_carries():
    sql = SMALL_F32.with_adapter("sql")
    assert SMALL_F32.with_adapter(None) == SMALL_F32 == SMALL_F32.with_adapter("")
    sql.check(SMALL_F32.with_adapter("sql"))
    for other in (SMALL_F32, SMALL_F32.with_adapter("poem")):  # base KV, another adapter's
        with pytest.raises(KVLayoutMismatch, match="sql"):
            sql.check(other)
    decoded = TransferHeader.decode(header(layout=sql, payload_bytes=4 * sql.block_bytes).encode())
    assert decoded.layout == sql


def test_layout_rejects_unknown_dtype_and_empty_dims():
    with pytest.raises(ValueError, match="dtype"):
        LayoutSignature("m", "float16", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        LayoutSignature("m", "float32", 1, 1, 0, 1)
