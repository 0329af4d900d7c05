"""kvtransfer: hand a prefilled request's state (attention KV blocks, whatever recurrent state
its layers declare, first token) from a prefill worker to a decode worker. See docs/kvtransfer.md."""

from kvtransfer import nccl
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    ChannelClosedError,
    HandoffAbortedError,
    HandoffTimeoutError,
    LayoutMismatchError,
    TransferError,
    WireError,
    WireTimeoutError,
)
from kvtransfer.layout import BLOCK, SLOT, CacheEntry, CacheLayout, CacheTensors, TensorSpec
from kvtransfer.messages import GlooOffer, HandoffResult, HandoffTarget, NcclOffer, ShmOffer
from kvtransfer.receiver import HandoffReceiver
from kvtransfer.sender import HandoffSender, OutgoingHandoff
from kvtransfer.transport import (TRANSPORTS, Transport, check_transport, choose_transport, default_cpu_transport,
                                  make_transport)

__all__ = [
    "BLOCK", "SLOT", "CacheEntry", "CacheLayout", "CacheTensors", "TensorSpec",
    "TransferConfig", "HandoffTarget", "HandoffResult", "GlooOffer", "NcclOffer", "ShmOffer",
    "HandoffSender", "HandoffReceiver", "OutgoingHandoff",
    "TRANSPORTS", "Transport", "make_transport", "default_cpu_transport", "check_transport", "choose_transport", "nccl",
    "TransferError", "LayoutMismatchError", "HandoffTimeoutError", "HandoffAbortedError",
    "ChannelClosedError", "WireError", "WireTimeoutError",
]
