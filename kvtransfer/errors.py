"""Exceptions of the hand-off library. Every per-request failure names its request id."""


class TransferError(RuntimeError):
    """Base class: something went wrong moving state between two workers."""


class LayoutMismatchError(TransferError):
    """The two sides' caches differ (layer kinds, dtypes, per-token shapes; block sizes may differ)."""


class HandoffTimeoutError(TransferError):
    """A hand-off did not complete within its timeout; it fails alone."""


class HandoffAbortedError(TransferError):
    """A hand-off was aborted by the caller or refused by the peer."""


class ChannelClosedError(TransferError):
    """The channel to a peer broke or was closed; hand-offs on it fail."""


class WireError(TransferError):
    """The byte mover (Gloo, NCCL, socket) reported an error."""


class WireTimeoutError(WireError):
    """A send or receive did not finish in time; the wire is no longer usable."""
