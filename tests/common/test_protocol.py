"""Engine/wire conversions of common/protocol.py that have no other test of their own."""

from __future__ import annotations

import dataclasses

from pdserve.common.protocol import (
    layout_from_proto,
    layout_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from pdserve.engine.request import SamplingParams
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


def test_sampling_params_round_trip_token_constraints():
    params = SamplingParams(
        temperature=0.5,
        logit_bias={7: -100.0, 3: 0.1},
        allowed_token_ids=(3, 7, 9),
        bad_words_token_ids=((1,), (4, 5, 6)),
    )
    msg = sampling_params_to_proto(params)
    assert dict(msg.logit_bias) == {7: -100.0, 3: 0.1}
    assert sampling_params_from_proto(msg) == params
    plain = sampling_params_from_proto(sampling_params_to_proto(SamplingParams()))
    assert plain.logit_bias is None and plain.allowed_token_ids is None
    assert plain.bad_words_token_ids == ()
