"""Small explicit messages: what the caller passes in, what it gets back, what goes on the wire."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HandoffTarget:
    """Where one request's state goes: told to the sender by the caller before the prefill.

    The decode side reserved dst_block_ids (at least one per prompt block; only the first
    ceil(prompt tokens / block_size) are written) and dst_slot (None for a cache without
    recurrent layers) before the prefill started; the sender writes only there.
    """

    request_id: str
    receiver: str  # the receiver endpoint's name, as given to connect()
    dst_block_ids: tuple[int, ...]
    dst_slot: int | None
    # How many shards arrive, one per rank of a tensor-parallel pair of equal size, each over
    # its own channel (engine.tp.rank_handoffs); 1: one un-sharded copy.
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if len(self.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes: {self.request_id[:40]}...")
        object.__setattr__(self, "dst_block_ids", tuple(int(b) for b in self.dst_block_ids))

    def digest(self) -> int:
        """Checksum of the destination rows, so a receiver can refuse a sender aiming elsewhere."""
        data = struct.pack(f"<q{len(self.dst_block_ids)}q", -1 if self.dst_slot is None else self.dst_slot, *self.dst_block_ids)
        return zlib.crc32(data)


@dataclass(frozen=True)
class HandoffResult:
    """The outcome of one hand-off on one side. ok=False always carries an error naming the request."""

    request_id: str
    ok: bool
    side: str  # "sender" or "receiver"
    first_token: int | None = None
    num_tokens: int = 0
    error: str | None = None
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class GlooOffer:
    receiver: str
    host: str
    port: int
    prefix: str


@dataclass(frozen=True)
class NcclOffer:
    receiver: str
    unique_id: bytes = field(repr=False)
    device_uuid: str = ""  # the receiver's GPU: a sender on the same one is refused (NCCL would be)
    host: str = ""  # the receiver's store, where the pair's doorbell rings (kvtransfer.doorbell)
    port: int = 0
    prefix: str = ""


@dataclass(frozen=True)
class ShmOffer:
    receiver: str
    socket_name: str
    token: str


# ---- fixed-size wire records of the stream transports (Gloo, NCCL) ----

MAX_REQUEST_ID_BYTES = 400
HEADER_BYTES = 512
TRAILER_BYTES = 16
_MAGIC = 0x4B565846  # "KVXF"
_HEADER = struct.Struct("<IHHqqqqqIH")
_PIPELINED, _PART = 1, 2
_TRAILER = struct.Struct("<IIq")
STATUS_OK = 0
STATUS_ABORTED = 1


@dataclass(frozen=True)
class WireHeader:
    """Announces one part of a hand-off. A part carries the block rows [first_row, end_row) of
    every block tensor; the last part (final) also carries the slot rows and the trailer. A
    hand-off begun after its prefill is one final part with first_row 0; one begun while the
    prompt still prefills sends parts as chunks finish their rows, in order on the pair, so
    other requests' parts may come between them."""

    request_id: str
    num_tokens: int
    num_rows: int  # block rows on the wire (kvtransfer/grid.py): the blocks, when both sides' sizes agree
    dst_slot: int | None
    dst_digest: int
    pipelined: bool  # a final part whose rows go one message per layer
    first_row: int = 0
    end_row: int | None = None  # None: num_rows
    final: bool = True

    def __post_init__(self) -> None:
        if self.end_row is None:
            object.__setattr__(self, "end_row", self.num_rows)
        if not 0 <= self.first_row <= self.end_row <= self.num_rows:
            raise ValueError(f"part rows [{self.first_row}, {self.end_row}) outside the hand-off's {self.num_rows} rows")

    def encode(self) -> torch.Tensor:
        rid = self.request_id.encode()
        flags = (_PIPELINED if self.pipelined else 0) | (0 if self.final else _PART)
        head = _HEADER.pack(_MAGIC, 1, flags, self.num_tokens, self.num_rows,
                            -1 if self.dst_slot is None else self.dst_slot, self.first_row, self.end_row,
                            self.dst_digest, len(rid))
        buf = bytearray(HEADER_BYTES)
        buf[: len(head) + len(rid)] = head + rid
        return torch.frombuffer(buf, dtype=torch.uint8).clone()

    @classmethod
    def decode(cls, data: torch.Tensor) -> WireHeader:
        raw = bytes(data.cpu().numpy())
        magic, _version, flags, num_tokens, num_rows, slot, first_row, end_row, digest, rid_len = _HEADER.unpack_from(raw)
        if magic != _MAGIC:
            raise ValueError(f"bad hand-off header magic {magic:#x}: the stream is out of sync")
        rid = raw[_HEADER.size : _HEADER.size + rid_len].decode()
        return cls(rid, num_tokens, num_rows, None if slot < 0 else slot, digest, bool(flags & _PIPELINED),
                   first_row, end_row, not flags & _PART)


def encode_trailer(status: int, first_token: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(_TRAILER.pack(_MAGIC, status, first_token)), dtype=torch.uint8).clone()


def decode_trailer(data: torch.Tensor) -> tuple[int, int]:
    magic, status, first_token = _TRAILER.unpack(bytes(data.cpu().numpy()))
    if magic != _MAGIC:
        raise ValueError(f"bad hand-off trailer magic {magic:#x}: the stream is out of sync")
    return status, first_token
