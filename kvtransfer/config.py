"""The one configuration dataclass of the hand-off library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferConfig:
    # A hand-off not complete within this many seconds fails alone and both sides free.
    # Receiver: counted from expect() (the reservation), so it must cover the prefill too.
    # Sender: counted from begin().
    timeout_s: float = 60.0
    # Bound on pairing two endpoints (rendezvous plus layout handshake).
    connect_timeout_s: float = 60.0
    # Send layer i as soon as it is computed (overlaps the prefill of later layers),
    # instead of one message after the last layer.
    pipeline_layers: bool = True
    # Prefill worker: begin the hand-off of a prompt prefilled in several chunks after its
    # first chunk, sending each chunk's finished KV rows while later chunks compute, instead
    # of all of it after the last chunk.
    stream_prefill: bool = True
    # Gloo only: the address this process is reachable at from its peers.
    advertise_host: str = "127.0.0.1"
    # How often the deadline watcher looks for expired hand-offs.
    watchdog_interval_s: float = 0.01

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not 0 < self.watchdog_interval_s <= 1.0:
            raise ValueError(f"watchdog_interval_s must be in (0, 1], got {self.watchdog_interval_s}")
        if not self.advertise_host:
            raise ValueError("advertise_host must be a non-empty host name or address")
