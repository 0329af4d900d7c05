"""Hand-offs over a point-to-point message wire: the protocol shared by Gloo and NCCL.

Per request, in order on the pair: a fixed header (request id, token and block counts,
checksum of the destination rows) rung on the pair's doorbell (kvtransfer.doorbell: an idle
receiver never waits in a receive on the wire), then either one packed message per layer and
a fixed trailer (status, first token), when the prefill was still running as the hand-off
began and layers are pipelined, or else one message: all rows with the trailer at its end.
A hand-off streamed while its prompt prefills in chunks goes as parts, each announced by its
own header: block rows [first, end) as chunks finish them, then a final part with the rest,
the slot rows and the trailer. Parts of other requests may come between, so a short prompt's
hand-off never waits for a long prompt's prefill.
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
from kvtransfer.layout import BLOCK, CacheLayout
from kvtransfer.messages import STATUS_ABORTED, STATUS_OK, TRAILER_BYTES, WireHeader, decode_trailer, encode_trailer
from kvtransfer.rows import RowMap, byte_rows, copy_rows, packed, packed_rows, plan_packing, request_maps
from kvtransfer.sender import ALL_LAYERS, ON_WIRE, QUEUED

log = logging.getLogger(__name__)
PROTOCOL_VERSION = 3
# The caller posts a hand-off itself only up to this size: Gloo writes a message whose receive
# is already posted inside send(), which the caller's engine step pays. Bigger hand-offs are
# about bandwidth, not latency: the channel thread posts them.
INLINE_MAX_BYTES = 8 << 20
# A part costs an announcement and a message wait on each side: rows a chunk finished wait to
# go with the next chunk's until they are at least this big (the final part takes any rest).
MIN_PART_BYTES = 256 << 10


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


class _Part:
    """A streaming hand-off's next piece for the channel thread: block rows [first, end) its
    finished chunks wrote (event: the CUDA event of that mark), or its final part (end None),
    which carries every row not posted before it."""

    def __init__(self, job, first: int, end: int | None, event=None):
        self.job, self.first, self.end, self.event = job, first, end, event


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
        row_bytes = sum(spec.row_bytes for spec in self._wire_layout.specs if spec.role == BLOCK)
        self._min_part_rows = max(1, MIN_PART_BYTES // row_bytes) if row_bytes else 0
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._active = 0  # jobs submitted and not yet done with the wire
        self._posting_inline = False
        self._held_back: list = []  # jobs submitted while the caller posts: queued after its job
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-send-{sender.name}-{peer}", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        if job.streaming:
            job.rows_queued, job.rows_posted, job.final_queued, job.parts_sent = 0, 0, False, 0
            self.progress(job)  # rows computed before it began (a cached prefix, earlier chunks)
            return
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

    def progress(self, job) -> None:
        """A streaming job moved on: queue the block rows its chunks finished (once there are
        enough for a part), or its final part once it is finished or failing."""
        if not job.streaming:
            return  # its one post waits for the layers itself (_post)
        with self._lock:
            if job.final_queued or self._closing:
                return
            if job.first_token is not None or job.state not in (QUEUED, ON_WIRE):
                part, job.final_queued = _Part(job, job.rows_queued, None), True
            else:
                ready = min(job.ready_tokens // self.grid.row_tokens, self.grid.wire_rows(self.sender.layout, job.num_tokens))
                if not self._min_part_rows or ready - job.rows_queued < self._min_part_rows:
                    return
                part, job.rows_queued = _Part(job, job.rows_queued, ready, job.tokens_event), ready
            self._active += 1
            if self._posting_inline:
                self._held_back.append(part)
            else:
                self._queue.put(part)

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
                elif isinstance(item, _Part):
                    self._post_part(item)
                elif self.sender._start(item, self):
                    self._complete(item, *self._post(item))
                with self._lock:
                    self._active -= 1
        except Exception as error:  # the wire is broken: fail everything queued on it
            if not self._closing:
                log.warning("kvtransfer: channel %s -> %s broke: %s", self.sender.name, self.peer, error)
            self.wire.abort()
            self.sender._channel_broken(self, self.peer, error)

    def _post_part(self, part: _Part) -> None:
        """Post one part of a streaming job and wait for it (the buffer is reused by the next)."""
        job = part.job
        if job.parts_sent == 0 and not self.sender._start(job, self):
            return  # failed before its first part: reported already, and the receiver saw nothing
        if part.end is None:
            job.parts_sent += 1
            self._complete(job, *self._post(job, job.rows_posted))
            return
        if job.state != ON_WIRE:
            return  # failing: its final part, queued by the failure, tells the receiver
        rows, count = self.grid.wire_rows(self.sender.layout, job.num_tokens), part.end - part.first
        target = job.target
        header = WireHeader(job.request_id, job.num_tokens, rows, target.dst_slot, target.digest(), False,
                            part.first, part.end, final=False)
        self.wire.announce(header.encode())
        plan = plan_packing(self._wire_layout, count, False, with_slots=False)
        buffer = self._buffer.at_least(plan.total_bytes)
        row_map = RowMap(self.grid.my_rows(job.src_block_ids, job.num_tokens)[part.first : part.end], packed(count))
        with self.wire.on_stream():
            if part.event is not None:
                self.wire.wait_event(part.event)
            for segment in plan.segments:
                for entry in segment.entries:
                    copy_rows(self._src_rows[entry.spec.name], packed_rows(buffer, entry), row_map)
        job.parts_sent, job.rows_posted = job.parts_sent + 1, part.end
        self.wire.send([buffer[: plan.total_bytes]]).wait(max(job.deadline - time.monotonic(), 1.0))

    def _post(self, job, first_row: int = 0) -> tuple[list, bool]:
        """Announce the job's final part (for a job not streamed: all of it) and post its
        messages; returns (what to wait for, whether it went out whole)."""
        # A job whose prefill already finished goes as one message: fewer waits on both sides,
        # each of which may cost a GIL hand-off under a busy engine thread.
        pipelined = self.sender.config.pipeline_layers and job.ready_layer != ALL_LAYERS and not job.streaming
        rows = self.grid.wire_rows(self.sender.layout, job.num_tokens)
        count = rows - first_row
        plan = plan_packing(self._wire_layout, count, pipelined)
        buffer = self._buffer.at_least(plan.total_bytes + TRAILER_BYTES)
        target = job.target
        header = WireHeader(job.request_id, job.num_tokens, rows, target.dst_slot, target.digest(), pipelined, first_row)
        self.wire.announce(header.encode())  # the doorbell: the receiver posts its receives once it reads this
        pending = []
        src_rows = self.grid.my_rows(job.src_block_ids, job.num_tokens)[first_row:]  # none without blocks
        maps = request_maps(self.sender.layout, src_rows, job.src_slot, packed(count), 0 if job.src_slot is not None else None)
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
        if header.first_row == 0:
            incoming, why = self.receiver._claim(
                header.request_id, header.num_tokens, header.num_rows, header.dst_digest, header.dst_slot, self
            )
        else:  # a later part of a streamed hand-off
            incoming, why = self.receiver._continue(header.request_id, header.first_row, self)
        if incoming is None:
            log.warning("kvtransfer: draining hand-off: %s", why)
        count = header.end_row - header.first_row
        plan = plan_packing(self._wire_layout, count, header.pipelined, with_slots=header.final)
        buffer = self._buffer.at_least(plan.total_bytes + TRAILER_BYTES)
        if not header.final:  # block rows only, in one message; no trailer
            whole = self.wire.recv([buffer[: plan.total_bytes]])
            segments, trailer_pending, trailer = [(s, whole) for s in plan.segments], None, None
        elif header.pipelined:
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
            dst_rows = self.grid.my_rows(incoming.dst_block_ids, header.num_tokens)[header.first_row : header.end_row]
            maps = (request_maps(self.receiver.layout, packed(count), 0 if slot is not None else None, dst_rows, slot)
                    if header.final else {BLOCK: RowMap(packed(count), dst_rows)})
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
        if not header.final:
            if incoming is not None:
                incoming.rows_landed = header.end_row
            return
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
