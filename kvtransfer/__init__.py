"""KV-cache block transfer from prefill nodes (senders) to decode nodes (receivers).

wire.py holds the versioned message format, transport.py the KVReceiver / KVSender
interfaces and their factories; ucx.py, tcp.py and inproc.py implement them.
"""

from pdserve.kvtransfer.transport import (
    KVReceiver,
    KVSender,
    KVTransferError,
    OnBlocks,
    TransferStats,
    available_transports,
    make_receiver,
    make_sender,
)
from pdserve.kvtransfer.wire import (
    WIRE_VERSION,
    KVLayoutMismatch,
    LayoutSignature,
    TransferHeader,
    WireFormatError,
)

__all__ = [
    "WIRE_VERSION",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "LayoutSignature",
    "OnBlocks",
    "TransferHeader",
    "TransferStats",
    "WireFormatError",
    "available_transports",
    "make_receiver",
    "make_sender",
]
