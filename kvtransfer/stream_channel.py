"""Hand-offs over a point-to-point message wire: the protocol shared by Gloo and NCCL.

Per request, in order on the pair: a fixed header (request id, token and block counts,
checksum of the destination rows) rung on the pair's doorbell (kvtransfer.doorbell: an idle
receiver never waits in a receive on the wire), then either one packed message per layer and
a fixed trailer (status, first token), when the prefill was still running as the hand-off
began and layers are pipelined, or else one message: all rows with the trailer at its end.
Every message is a wait on each side, and under a busy engine thread each wait may cost a GIL
hand-off. The sender packs its rows into a reused buffer; the receiver lands each segment in
its own reused buffer and scatters it into the reserved rows only while the reservation is
live. So a late or aborted stream can only ever write the channel's buffer, never a freed
block, and the stream stays in step: a request the receiver no longer wants is drained.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from kvtransfer.errors import ChannelClosedError
from kvtransfer.grid import Grid
from kvtransfer.layout import CacheLayout
from kvtransfer.messages import STATUS_ABORTED, STATUS_OK, TRAILER_BYTES, WireHeader, decode_trailer, encode_trailer
from kvtransfer.rows import byte_rows, copy_rows, packed, packed_rows, plan_packing, request_maps
from kvtransfer.sender import ALL_LAYERS

log = logging.getLogger(__name__)
PROTOCOL_VERSION = 2
# The caller posts a hand-off itself only up to this size: Gloo writes a message whose receive
# is already posted inside send(), which the caller's engine step pays. Bigger hand-offs are
# about bandwidth, not latency: the channel thread posts them.
INLINE_MAX_BYTES = 8 << 20


class Pending(Protocol):
    def wait(self, timeout_s: float | None) -> None:
        """Block until done; raises WireTimeoutError (wire unusable afterwards) or WireError."""


class Wire(Protocol):
    """Ordered messages between exactly two processes; the n-th recv matches the peer's n-th send."""

    device: torch.device

    def announce(self, header: torch.Tensor) -> None: ...  # sender: this request follows (host header)
    def await_announcement(self) -> torch.Tensor | None: ...  # receiver: the next header; None once closed
    def send(self, tensors: list[torch.Tensor]) -> Pending: ...
    def recv(self, tensors: list[torch.Tensor]) -> Pending: ...
    def exchange(self, outgoing: list[torch.Tensor], incoming: list[torch.Tensor]) -> Pending: ...
    def on_stream(self) -> AbstractContextManager: ...  # where packing/scattering is enqueued
    def wait_event(self, event) -> None: ...  # transfer work after this waits for a compute-stream event
    def fence(self) -> None: ...  # returns once all work enqueued on the transfer stream has run
    def abort(self) -> None: ...  # unblocks every pending wait with an error; the wire is dead


def handshake(wire: Wire, layout: CacheLayout, me: str, peer: str, role: str, timeout_s: float) -> Grid:
    """Swap layouts with the peer; both sides raise the same LayoutMismatchError on a mismatch.
    Returns the rows block tensors move in between the two block sizes."""
    mine = json.dumps({"version": PROTOCOL_VERSION, "name": me, "role": role, "layout": layout.to_dict()}).encode()
    size_out = torch.tensor([len(mine)], dtype=torch.int64, device=wire.device)
    size_in = torch.zeros(1, dtype=torch.int64, device=wire.device)
    wire.exchange([size_out], [size_in]).wait(timeout_s)
    data_out = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(wire.device)
    data_in = torch.empty(int(size_in.item()), dtype=torch.uint8, device=wire.device)
    wire.exchange([data_out], [data_in]).wait(timeout_s)
    theirs = json.loads(bytes(data_in.cpu().numpy()))
    if theirs["version"] != PROTOCOL_VERSION:
        raise RuntimeError(f"{peer} speaks hand-off protocol {theirs['version']}, {me} speaks {PROTOCOL_VERSION}")
    peer_layout = CacheLayout.from_dict(theirs["layout"])
    layout.check_compatible(peer_layout, f"{role} {me}", f"{theirs['role']} {peer}")
    return Grid.between(layout, peer_layout)


class _Buffer:
    """One packed hand-off buffer per channel, grown on demand and reused (no per-request allocation)."""

    def __init__(self, device: torch.device):
        self.device, self.tensor = device, torch.empty(0, dtype=torch.uint8, device=device)

    def at_least(self, nbytes: int) -> torch.Tensor:
        if self.tensor.numel() < nbytes:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.tensor


class _Posted:
    """A job the caller's thread posted itself; the channel thread only waits for it."""

    def __init__(self, job):
        self.job, self.started, self.pending, self.ok, self.error = job, False, [], False, None


class StreamSenderChannel:
    """One thread per channel posts queued jobs and waits for every job's messages in order. A
    finished prefill's small job on an idle channel is posted by the caller itself (header,
    packing, the send), as the shm sender copies inline: under a busy engine thread, waking the
    channel thread costs a wait for the GIL, more than the posting itself (docs/kvtransfer.md)."""

    def __init__(self, sender, peer: str, wire: Wire, grid: Grid):
        self.sender, self.peer, self.wire, self.grid = sender, peer, wire, grid
        self._wire_layout = grid.wire_layout(sender.layout)
        self._src_rows = grid.split_all({name: byte_rows(t) for name, t in sender.cache.tensors.items()}, sender.layout)
        self._buffer = _Buffer(wire.device)  # one job's at a time: a job is posted only once the one before is done
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._active = 0  # jobs submitted and not yet done with the wire
        self._posting_inline = False
        self._held_back: list = []  # jobs submitted while the caller posts: queued after its job
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-send-{sender.name}-{peer}", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        with self._lock:
            inline = (self._active == 0 and job.ready_layer == ALL_LAYERS and not self._closing
                      and self.sender.layout.handoff_bytes(job.num_tokens) <= INLINE_MAX_BYTES)
            self._active += 1
            if inline:
                self._posting_inline = True
            elif self._posting_inline:
                self._held_back.append(job)
            else:
                self._queue.put(job)
        if not inline:
            return
        item = _Posted(job)  # queued once posted: waking the channel thread earlier would cost the caller the GIL
        try:
            item.started = self.sender._start(job, self)
            if item.started:
                item.pending, item.ok = self._post(job)
        except Exception as error:  # the channel thread fails the wire with it
            item.error = error
        with self._lock:
            closed = self._closing  # the channel thread may be gone: nobody else would report the job
            for queued in [] if closed else [item, *self._held_back]:
                self._queue.put(queued)
            self._held_back, self._posting_inline = [], False
        if closed and item.started:
            self.wire.fence()
            self.sender._finalize(job, ok=False, why=f"channel to {self.peer} closed")

    def close(self) -> None:
        with self._lock:  # after this no caller queues a job it posted (submit reports it itself)
            self._closing = True
            self._queue.put(None)
        self.wire.abort()
        self.sender._abort_jobs_of(self, ChannelClosedError(f"channel to {self.peer} closed by sender {self.sender.name}"))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, _Posted):
                    if item.error is not None:
                        raise item.error
                    if item.started:
                        self._complete(item.job, item.pending, item.ok)
                elif self.sender._start(item, self):
                    self._complete(item, *self._post(item))
                with self._lock:
                    self._active -= 1
        except Exception as error:  # the wire is broken: fail everything queued on it
            if not self._closing:
                log.warning("kvtransfer: channel %s -> %s broke: %s", self.sender.name, self.peer, error)
            self.wire.abort()
            self.sender._channel_broken(self, self.peer, error)

    def _post(self, job) -> tuple[list, bool]:
        """Announce the job and post its messages; returns (what to wait for, whether it went out whole)."""
        # A job whose prefill already finished goes as one message: fewer waits on both sides,
        # each of which may cost a GIL hand-off under a busy engine thread.
        pipelined = self.sender.config.pipeline_layers and job.ready_layer != ALL_LAYERS
        rows = self.grid.wire_rows(self.sender.layout, job.num_tokens)
        plan = plan_packing(self._wire_layout, rows, pipelined)
        buffer = self._buffer.at_least(plan.total_bytes + TRAILER_BYTES)
        target = job.target
        header = WireHeader(job.request_id, job.num_tokens, rows, target.dst_slot, target.digest(), pipelined)
        self.wire.announce(header.encode())  # the doorbell: the receiver posts its receives once it reads this
        pending = []
        src_rows = self.grid.my_rows(job.src_block_ids, job.num_tokens)  # none without blocks: no ids to split
        maps = request_maps(self.sender.layout, src_rows, job.src_slot, packed(rows), 0 if job.src_slot is not None else None)
        ok = True
        for segment in plan.segments:
            if ok:
                ok, ready_event = self.sender._wait_ready(job, segment.layers[-1])
            if ok:  # else the segment goes out as filler, keeping the stream in step
                with self.wire.on_stream():
                    if ready_event is not None:
                        self.wire.wait_event(ready_event)
                    for entry in segment.entries:
                        copy_rows(self._src_rows[entry.spec.name], packed_rows(buffer, entry), maps[entry.spec.role])
            if pipelined:
                pending.append(self.wire.send([buffer[segment.offset : segment.offset + segment.nbytes]]))
        if ok:
            ok, _ = self.sender._wait_ready(job, ALL_LAYERS)
        trailer = encode_trailer(STATUS_OK if ok else STATUS_ABORTED, job.first_token if ok else -1).to(self.wire.device)
        if pipelined:
            pending.append(self.wire.send([trailer]))
        else:
            with self.wire.on_stream():
                buffer[plan.total_bytes : plan.total_bytes + TRAILER_BYTES].copy_(trailer)
            pending.append(self.wire.send([buffer[: plan.total_bytes + TRAILER_BYTES]]))
        return pending, ok

    def _complete(self, job, pending: list, ok: bool) -> None:
        if not ok:
            self.wire.fence()  # no packing of source rows is still queued
            self.sender._finalize(job, ok=False)
        for p in pending:
            p.wait(max(job.deadline - time.monotonic(), 1.0))
        if ok:
            self.sender._finalize(job, ok=True)


class StreamReceiverChannel:
    def __init__(self, receiver, peer: str, wire: Wire, grid: Grid):
        self.receiver, self.peer, self.wire, self.grid = receiver, peer, wire, grid
        self._wire_layout = grid.wire_layout(receiver.layout)
        self._dst_rows = grid.split_all({name: byte_rows(t) for name, t in receiver.cache.tensors.items()}, receiver.layout)
        self._buffer = _Buffer(wire.device)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-recv-{receiver.name}-{peer}", daemon=True)
        self._thread.start()

    def release(self, incoming) -> bool:
        """Called once incoming is no longer live: after this no scatter of it runs."""
        with incoming.write_lock:
            self.wire.fence()
        return True

    def close(self) -> None:
        self._closing = True
        self.wire.abort()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        error: Exception = ChannelClosedError(f"sender {self.peer} closed the channel")
        try:
            while (header := self.wire.await_announcement()) is not None:
                self._receive(WireHeader.decode(header))
        except Exception as exc:
            error = exc
        if not self._closing:
            log.info("kvtransfer: channel %s <- %s ended: %s", self.receiver.name, self.peer, error)
        self.wire.abort()
        self.receiver._channel_broken(self, self.peer, error)

    def _receive(self, header: WireHeader) -> None:
        incoming, why = self.receiver._claim(
            header.request_id, header.num_tokens, header.num_rows, header.dst_digest, header.dst_slot, self
        )
        if incoming is None:
            log.warning("kvtransfer: draining hand-off: %s", why)
        plan = plan_packing(self._wire_layout, header.num_rows, header.pipelined)
        buffer = self._buffer.at_least(plan.total_bytes + TRAILER_BYTES)
        if header.pipelined:
            segments = [(s, self.wire.recv([buffer[s.offset : s.offset + s.nbytes]])) for s in plan.segments]
            trailer = torch.empty(TRAILER_BYTES, dtype=torch.uint8, device=self.wire.device)
            trailer_pending = self.wire.recv([trailer])
        else:  # one message, trailer last: waited for once, with the segment
            whole = self.wire.recv([buffer[: plan.total_bytes + TRAILER_BYTES]])
            segments, trailer_pending = [(s, whole) for s in plan.segments], None
            trailer = buffer[plan.total_bytes : plan.total_bytes + TRAILER_BYTES]
        stall_limit = self.receiver.config.timeout_s  # a sender silent this long mid-request is gone
        waited_for_compute = False
        maps = None
        if incoming is not None:
            slot = incoming.target.dst_slot
            dst_rows = self.grid.my_rows(incoming.dst_block_ids, header.num_tokens)
            maps = request_maps(self.receiver.layout, packed(header.num_rows), 0 if slot is not None else None, dst_rows, slot)
        for segment, pending in segments:
            pending.wait(stall_limit)
            if incoming is None:
                continue
            with incoming.write_lock:
                if not incoming.live:
                    continue
                with self.wire.on_stream():
                    if not waited_for_compute and incoming.compute_ready is not None:
                        self.wire.wait_event(incoming.compute_ready)  # previous owner of the rows is done
                    waited_for_compute = True
                    for entry in segment.entries:
                        copy_rows(packed_rows(buffer, entry), self._dst_rows[entry.spec.name], maps[entry.spec.role])
        if trailer_pending is not None:
            trailer_pending.wait(stall_limit)
        status, first_token = decode_trailer(trailer)
        if incoming is not None:
            self.wire.fence()  # every scatter has run before DONE is reported
            self.receiver._landed(incoming, status == STATUS_OK, first_token, "the sender aborted the hand-off")


def join_as_receiver(receiver, peer: str, make_wire) -> None:
    """Receiver side of pairing over a stream wire: build it, check layouts, install the
    channel; any failure is reported for `peer` and leaves no half-open wire behind."""
    wire = None
    try:
        wire = make_wire()
        grid = handshake(wire, receiver.layout, receiver.name, peer, "receiver", receiver.config.connect_timeout_s)
    except Exception as error:
        if wire is not None:
            wire.abort()
        receiver._channel_failed_to_open(peer, error)
        return
    receiver._install_channel(peer, StreamReceiverChannel(receiver, peer, wire, grid))


def join_as_sender(sender, peer: str, wire) -> StreamSenderChannel:
    """Sender side of pairing over a stream wire: check layouts, then the channel; a refused
    handshake aborts the wire and raises (connect() reports it to its caller)."""
    try:
        grid = handshake(wire, sender.layout, sender.name, peer, "sender", sender.config.connect_timeout_s)
    except Exception:
        wire.abort()
        raise
    return StreamSenderChannel(sender, peer, wire, grid)
