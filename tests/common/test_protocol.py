"""Engine/wire conversions of common/protocol.py that have no other test of their own."""

from __future__ import annotations

import dataclasses

from pdserve.common.protocol import layout_from_proto, layout_to_proto
from pdserve.kvtransfer.wire import LayoutSignature
from pdserve.v1 import node_pb2


def test_kv_layout_round_trips_and_names_every_field():
    layout = LayoutSignature(
        "m", "bfloat16", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16
    )
    msg = layout_to_proto(layout)
    assert (msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size) == (30, 3, 64, 16)
    assert layout_from_proto(msg) == layout
    proto_fields = {f.name for f in node_pb2.KVLayout.DESCRIPTOR.fields}
    assert proto_fields == {f.name for f in dataclasses.fields(LayoutSignature)}
