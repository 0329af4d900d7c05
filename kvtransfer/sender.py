"""The prefill side: hand-offs queued per receiver, fed as the prefill computes.

A hand-off begun after its prompt's last layer ran goes whole (send()). One begun earlier is
fed as the prefill goes: layer by layer (layer_done, a GPU copy landing in host staging) or,
for a prompt prefilled in chunks, token by token (begin(..., computed_tokens=...) then
tokens_done after each chunk: the KV rows of finished tokens go while later chunks compute,
and what is left, the recurrent state with it, goes at finish()).

A hand-off moves QUEUED -> ON_WIRE -> DONE, or to FAILED. One that fails while ON_WIRE
goes through ABORTING until its channel stops reading the source rows; only then is the
failure reported, so the caller never frees blocks the transport still reads.
"""

from __future__ import annotations

import math
import time

from kvtransfer.endpoint import Endpoint, record_compute_event
from kvtransfer.errors import ChannelClosedError, HandoffAbortedError, HandoffTimeoutError, TransferError
from kvtransfer.messages import HandoffTarget

QUEUED, ON_WIRE, ABORTING, DONE, FAILED = "queued", "on_wire", "aborting", "done", "failed"
ALL_LAYERS = math.inf


class OutgoingHandoff:
    """Handle for one hand-off in flight; the prefill calls layer_done(i) per layer, then finish()."""

    def __init__(self, sender: HandoffSender, target: HandoffTarget, num_tokens: int, src_block_ids: list[int],
                 dst_block_ids: list[int], src_slot: int | None, timeout_s: float):
        self.sender = sender
        self.target = target
        self.num_tokens = num_tokens
        self.src_block_ids = list(src_block_ids)  # the prompt's blocks, in order (this side's block size)
        self.dst_block_ids = list(dst_block_ids)  # the receiver's blocks it fills (the receiver's block size)
        self.src_slot = src_slot
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.timeout_s = timeout_s
        self.state = QUEUED
        self.channel = None  # the channel that owns this hand-off
        self.ready_layer: float = -1  # every layer <= this one is computed
        self.ready_events: list = []  # (layer, CUDA event) in call order; empty on CPU
        # Streaming by tokens: KV rows of the first ready_tokens tokens are final in every
        # layer; tokens_event is the CUDA event of the latest such mark (None on CPU).
        self.streaming = False
        self.ready_tokens = 0
        self.tokens_event = None
        self.first_token: int | None = None
        self.error: TransferError | None = None

    @property
    def request_id(self) -> str:
        return self.target.request_id

    def layer_done(self, layer: int) -> None:
        """Layer `layer` (and every earlier one) is computed; its rows may be sent."""
        self.sender._mark_ready(self, layer, None)

    def tokens_done(self, num_tokens: int) -> None:
        """The prompt's first `num_tokens` tokens are computed in every layer (a chunk finished):
        their KV rows may be sent. Only for a hand-off begun with computed_tokens."""
        self.sender._mark_ready(self, -1, None, tokens=num_tokens)

    def finish(self, first_token: int) -> None:
        """The prompt is done and its first token sampled: send what is left and the token."""
        self.sender._mark_ready(self, ALL_LAYERS, int(first_token))

    def abort(self, reason: str = "aborted by the caller") -> None:
        self.sender.abort(self.request_id, reason)


class HandoffSender(Endpoint):
    side = "sender"

    def __init__(self, *args, **kwargs):
        self._outgoing: dict[str, OutgoingHandoff] = {}
        self._channels: dict[str, object] = {}
        self.channel_errors: dict[str, str] = {}  # peer -> why its channel failed
        super().__init__(*args, **kwargs)

    # ---- what the prefill worker uses ----

    def connect(self, peer: str, offer) -> None:
        """Pair with receiver `peer` using the offer from its accept(); raises LayoutMismatchError."""
        channel = self._open_channel(peer, offer)
        with self._lock:
            old, self._channels[peer] = self._channels.get(peer), channel
        if old is not None:
            old.close()

    def connected(self, peer: str) -> bool:
        with self._lock:
            return peer in self._channels

    def disconnect(self, peer: str) -> None:
        """Close the channel to receiver `peer` (removed from the cluster); unknown peers are a no-op."""
        with self._lock:
            channel = self._channels.pop(peer, None)
            self.channel_errors.pop(peer, None)
        if channel is not None:
            channel.close()

    def break_channel(self, peer: str, why: str) -> None:
        """Close the channel to `peer` as a dead wire would: its hand-offs fail and the peer
        stays known as broken (channel_errors) until connect() pairs it again."""
        with self._lock:
            channel = self._channels.get(peer)
        if channel is not None:
            channel.close()
            self._channel_broken(channel, peer, ChannelClosedError(why))

    def begin(self, target: HandoffTarget, num_tokens: int, src_block_ids: list[int], src_slot: int | None, timeout_s: float | None = None,
              *, first_token: int | None = None, computed_tokens: int | None = None) -> OutgoingHandoff:
        """Start a hand-off before (or while) the prefill runs; rows go out as layers are marked
        done or, with computed_tokens (the prompt tokens already computed in every layer), as
        tokens_done() reports chunks finished. A streaming hand-off's timeout counts from its
        latest progress, since it spans the rest of the prefill.

        Moves the tokens in the first ceil(num_tokens / block_size) ids of src_block_ids to the
        first ceil(num_tokens / receiver's block size) of target.dst_block_ids (longer lists are
        fine: extra ids are not touched; the block sizes may differ, kvtransfer/grid.py).
        """
        rid = target.request_id
        if num_tokens < 1:
            raise ValueError(f"request {rid}: num_tokens must be >= 1, got {num_tokens}")
        if (src_slot is None) != (target.dst_slot is None):
            raise ValueError(f"request {rid}: source slot {src_slot} and destination slot {target.dst_slot} must both be set or both None")
        with self._lock:  # the channel knows the receiver's block size, so it is looked up first
            channel = self._channels.get(target.receiver)
            if channel is None:
                why = self.channel_errors.get(target.receiver, "not connected")
                raise ChannelClosedError(f"request {rid}: no channel to receiver {target.receiver!r} ({why})")
            blocks = self.layout.num_blocks_for(num_tokens)  # 0 without attention layers: ids are bookkeeping only
            dst_blocks = channel.grid.peer_blocks_for(self.layout, num_tokens)
            if len(src_block_ids) < blocks or len(target.dst_block_ids) < dst_blocks:
                raise ValueError(f"request {rid}: {num_tokens} tokens need {blocks} source and {dst_blocks} destination blocks; "
                                 f"got {len(src_block_ids)} source, {len(target.dst_block_ids)} destination ids")
            self.cache.check_rows(list(src_block_ids)[:blocks], src_slot, f"request {rid} (sender)")
            job = OutgoingHandoff(self, target, num_tokens, list(src_block_ids)[:blocks], list(target.dst_block_ids)[:dst_blocks],
                                  src_slot, timeout_s or self.config.timeout_s)
            if computed_tokens is not None:
                job.streaming, job.ready_tokens = True, max(0, min(int(computed_tokens), num_tokens))
            if first_token is not None:  # send(): the prefill is over; the channel must see it finished from the start
                event = record_compute_event(self.cache)
                job.ready_layer, job.first_token = ALL_LAYERS, int(first_token)
                job.ready_events = [(ALL_LAYERS, event)] if event is not None else []
            if rid in self._outgoing:
                raise ValueError(f"request {rid} is already being sent by {self.name}")
            job.channel = channel
            self._outgoing[rid] = job
        channel.submit(job)
        return job

    def send(
        self,
        target: HandoffTarget,
        num_tokens: int,
        src_block_ids: list[int],
        src_slot: int | None,
        first_token: int,
        timeout_s: float | None = None,
    ) -> OutgoingHandoff:
        """begin() + finish() for a prefill that already ran to the end."""
        return self.begin(target, num_tokens, src_block_ids, src_slot, timeout_s, first_token=first_token)

    def abort(self, request_id: str, reason: str = "aborted by the caller") -> None:
        self._fail(request_id, HandoffAbortedError(f"request {request_id}: {reason} (sender {self.name})"))

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._outgoing)

    # ---- internals ----

    def _open_channel(self, peer: str, offer):
        raise NotImplementedError

    def _mark_ready(self, job: OutgoingHandoff, layer: float, first_token: int | None, tokens: int | None = None) -> None:
        event = record_compute_event(self.cache)
        with self._lock:
            if layer < job.ready_layer:
                raise ValueError(f"request {job.request_id}: layer {layer} marked done after layer {job.ready_layer}")
            if tokens is not None and not job.streaming:
                raise ValueError(f"request {job.request_id}: tokens_done() on a hand-off not begun with computed_tokens")
            job.ready_layer = layer
            if tokens is not None:
                job.ready_tokens = max(job.ready_tokens, min(int(tokens), job.num_tokens))
                job.tokens_event = event
            elif event is not None:
                job.ready_events.append((layer, event))
            if layer == ALL_LAYERS:
                job.ready_tokens = job.num_tokens
            if first_token is not None:
                job.first_token = first_token
            if job.streaming:
                job.deadline = max(job.deadline, time.monotonic() + job.timeout_s)
            self._changed.notify_all()
        if job.channel is not None:
            job.channel.progress(job)

    def _fail(self, request_id: str, error: TransferError, only_if=None) -> None:
        with self._lock:
            job = self._outgoing.get(request_id)
            if job is None or job.state in (ABORTING, DONE, FAILED) or (only_if and not only_if(job)):
                return
            job.error, was = error, job.state
            job.state = ABORTING
            self._changed.notify_all()
        if was == QUEUED:
            self._finalize(job, ok=False)
        elif job.streaming:  # the channel ends its stream, telling the receiver
            job.channel.progress(job)

    def _finalize(self, job: OutgoingHandoff, ok: bool, why: str = "") -> None:
        with self._lock:
            if self._outgoing.pop(job.request_id, None) is None:
                return
            ok = ok and job.state == ON_WIRE
            job.state = DONE if ok else FAILED
            if not ok and job.error is None:
                job.error = HandoffAbortedError(f"request {job.request_id}: {why or 'failed'} (sender {self.name})")
        fields = {"first_token": job.first_token, "num_tokens": job.num_tokens}
        if not ok:
            fields["error"] = str(job.error)
        self._deliver([self._result(job.request_id, ok, job.started, **fields)])

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [j for j in self._outgoing.values() if j.state in (QUEUED, ON_WIRE) and now >= j.deadline]
        for j in late:
            error = HandoffTimeoutError(
                f"request {j.request_id}: hand-off timed out after {j.timeout_s}s while {j.state} (sender {self.name})"
            )
            self._fail(j.request_id, error, only_if=lambda x, j=j: x is j)

    # ---- what channels call ----

    def _start(self, job: OutgoingHandoff, channel) -> bool:
        """The channel takes the job onto the wire; False if it already failed (skip it)."""
        with self._lock:
            if job.state != QUEUED:
                return False
            job.state = ON_WIRE
            return True

    def _wait_ready(self, job: OutgoingHandoff, layer: float):
        """Wait until `layer` is computed. Returns (True, CUDA event or None) or (False, None) if the job failed."""
        with self._lock:
            while job.state == ON_WIRE and job.ready_layer < layer:
                self._changed.wait(0.1)
            if job.state != ON_WIRE:
                return False, None
            event = next((e for lay, e in job.ready_events if lay >= layer), None)
            return True, event

    def _abort_jobs_of(self, channel, error: Exception) -> None:
        """Fail every hand-off this channel owns; each is reported once the channel lets go of it."""
        with self._lock:
            rids = [j.request_id for j in self._outgoing.values() if j.channel is channel]
        for rid in rids:
            self._fail(rid, ChannelClosedError(f"request {rid}: {error}"), only_if=lambda job: job.channel is channel)

    def _channel_broken(self, channel, peer: str, error: Exception) -> None:
        with self._lock:
            if self._channels.get(peer) is channel:
                del self._channels[peer]
                self.channel_errors[peer] = str(error)
            victims = [j for j in self._outgoing.values() if j.channel is channel]
            for j in victims:
                j.error = j.error or ChannelClosedError(f"request {j.request_id}: channel to {peer} broke: {error}")
        for j in victims:
            self._finalize(j, ok=False)

    def _close_channels(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.items()), {}
        for peer, channel in channels:
            channel.close()
            self._channel_broken(channel, peer, ChannelClosedError(f"sender {self.name} closed"))
