"""The decode side: reservations, landing, completion signal, timeouts.

A request moves WAITING (reserved, nothing arrived) -> LANDING (a channel is writing its
rows) -> DONE, or to FAILED from any of them. A LANDING request that fails goes through
REVOKING until its channel confirms it stopped writing; only then is the failure reported,
so freed blocks are never written late.
"""

from __future__ import annotations

import threading
import time

from kvtransfer.endpoint import Endpoint, record_compute_event
from kvtransfer.errors import ChannelClosedError, HandoffAbortedError, HandoffTimeoutError, TransferError
from kvtransfer.messages import HandoffTarget

WAITING, LANDING, REVOKING, DONE, FAILED = "waiting", "landing", "revoking", "done", "failed"


class Incoming:
    """One reserved request on the receiver."""

    def __init__(self, target: HandoffTarget, timeout_s: float, compute_ready):
        self.target = target
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.timeout_s = timeout_s
        self.state = WAITING
        self.channel = None
        self.num_tokens = 0
        self.dst_block_ids: list[int] = []  # the rows being written, set when landing starts
        self.rows_landed = 0  # a hand-off streamed in parts: its block rows landed so far, in order
        self.rows_renewed = 0  # rows landed when keep_waiting last renewed it
        self.compute_ready = compute_ready  # CUDA event: last use of these rows by the previous owner
        self.write_lock = threading.Lock()  # held by a channel while it writes this request's rows
        self.error: TransferError | None = None
        self.row: int | None = None  # shm: this reservation's row of the grant table, and its generation
        self.gen = 0

    @property
    def live(self) -> bool:
        return self.state == LANDING


class HandoffReceiver(Endpoint):
    side = "receiver"

    def __init__(self, *args, **kwargs):
        self._incoming: dict[str, Incoming] = {}
        self._channels: dict[str, object] = {}
        self.channel_errors: dict[str, str] = {}  # peer -> why its channel failed (e.g. layout mismatch)
        super().__init__(*args, **kwargs)

    # ---- what the decode worker uses ----

    def accept(self, peer: str):
        """Open a channel for sender `peer`; returns the offer the caller hands to sender.connect()."""
        raise NotImplementedError

    def expect(self, target: HandoffTarget, timeout_s: float | None = None) -> None:
        """Register a reservation; call when the blocks and slot are reserved, before the prefill."""
        if target.receiver != self.name:
            raise ValueError(f"request {target.request_id}: target names receiver {target.receiver!r}, this is {self.name!r}")
        blocks = list(target.dst_block_ids) if self.layout.has_blocks else []
        self.cache.check_rows(blocks, target.dst_slot, f"request {target.request_id} (receiver)")
        incoming = Incoming(target, timeout_s or self.config.timeout_s, record_compute_event(self.cache))
        with self._lock:
            if self._closed:
                raise ChannelClosedError(f"receiver {self.name} is closed")
            if target.request_id in self._incoming:
                raise ValueError(f"request {target.request_id} is already expected on {self.name}")
            self._reserve(incoming)
            self._incoming[target.request_id] = incoming

    def keep_waiting(self, request_id: str) -> bool:
        """Restart the timeout of a reservation whose hand-off has not begun, or streams while
        its prompt prefills and has landed more rows since the last renewal (the router's word
        that the sender is alive and still working on the request); False otherwise: a hand-off
        that stalled keeps its deadline."""
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None or incoming.state not in (WAITING, LANDING):
                return False
            if incoming.state == LANDING:
                landed = self._rows_landed(incoming)
                if landed <= incoming.rows_renewed:
                    return False
                incoming.rows_renewed = landed
            incoming.deadline = max(incoming.deadline, time.monotonic() + incoming.timeout_s)
            return True

    def _rows_landed(self, incoming: Incoming) -> int:
        """Block rows of a streamed hand-off landed so far (called under the lock)."""
        return incoming.rows_landed

    def abort(self, request_id: str, reason: str = "aborted by the caller") -> bool:
        """Revoke a hand-off not yet landed; False when there is none (never reserved here, or all
        its rows landed a moment ago: the caller then aborts the request in its engine)."""
        return self._fail(request_id, HandoffAbortedError(f"request {request_id}: {reason} (receiver {self.name})"))

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._incoming)

    def _reserve(self, incoming: Incoming) -> None:
        """Called under the lock as a reservation is registered (shm grants its rows here)."""

    # ---- channels ----

    def _install_channel(self, peer: str, channel) -> None:
        """Make `channel` the one for `peer`, closing any previous one (or this one if closing)."""
        with self._lock:
            closing = self._stop.is_set()
            old = self._channels.get(peer)
            if not closing:
                self._channels[peer] = channel
                self.channel_errors.pop(peer, None)
        for stale in (old, channel if closing else None):
            if stale is not None:
                stale.close()

    def _channel_failed_to_open(self, peer: str, error: Exception) -> None:
        with self._lock:
            self.channel_errors[peer] = f"{type(error).__name__}: {error}"

    # ---- failure paths ----

    def _fail(self, request_id: str, error: TransferError, only_if=None) -> bool:
        """Fail a hand-off in flight; False when none is (absent or landed), True when it is
        failed now or already was."""
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None or incoming.state == DONE:
                return False
            if incoming.state in (REVOKING, FAILED):
                return True
            if only_if is not None and not only_if(incoming):
                return False
            incoming.error = error
            channel, was = incoming.channel, incoming.state
            incoming.state = REVOKING
        if was == WAITING or channel.release(incoming):
            self._finalize_failed(incoming)
        return True

    def _finalize_failed(self, incoming: Incoming) -> None:
        with self._lock:
            if self._incoming.pop(incoming.target.request_id, None) is None:
                return
            incoming.state = FAILED
        error = incoming.error or ChannelClosedError(f"request {incoming.target.request_id}: failed")
        self._deliver([self._result(incoming.target.request_id, False, incoming.started, num_tokens=incoming.num_tokens, error=str(error))])

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [i for i in self._incoming.values() if i.state in (WAITING, LANDING) and now >= i.deadline]
        for i in late:
            rid = i.target.request_id
            self._fail(
                rid,
                HandoffTimeoutError(
                    f"request {rid}: hand-off timed out after {i.timeout_s}s while {i.state} (receiver {self.name})"
                ),
                only_if=lambda x, i=i: x is i,
            )

    # ---- what channels call ----

    def _claim(
        self, request_id: str, num_tokens: int, num_rows: int, dst_digest: int, dst_slot: int | None, channel
    ) -> tuple[Incoming | None, str]:
        """A sender announced a request; returns (incoming, "") if its rows may be written, else (None, why)."""
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None:
                return None, f"request {request_id} is not expected on receiver {self.name} (never reserved, timed out or aborted)"
            if incoming.state != WAITING:
                return None, f"request {request_id} is {incoming.state} on receiver {self.name}, not waiting"
            target = incoming.target
            why = ""
            blocks, expected_rows = self.layout.num_blocks_for(num_tokens), channel.grid.wire_rows(self.layout, num_tokens)
            if num_rows != expected_rows:
                why = f"{num_rows} block rows for {num_tokens} tokens, expected {expected_rows}"
            elif blocks > len(target.dst_block_ids):
                why = f"{num_tokens} tokens need {blocks} blocks, receiver reserved {len(target.dst_block_ids)}"
            elif dst_slot != target.dst_slot or dst_digest != target.digest():
                why = "sender's destination rows differ from the reservation"
            if not why:
                incoming.state, incoming.channel, incoming.num_tokens = LANDING, channel, num_tokens
                incoming.dst_block_ids = list(target.dst_block_ids)[:blocks]
                return incoming, ""
        error = HandoffAbortedError(f"request {request_id}: refused by receiver {self.name}: {why}")
        self._fail(request_id, error)
        return None, str(error)

    def _continue(self, request_id: str, first_row: int, channel) -> tuple[Incoming | None, str]:
        """A later part of a hand-off streamed in parts; (incoming, "") if it may be written,
        else (None, why): the request is gone (revoked, timed out, aborted) or out of step."""
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None or incoming.state != LANDING or incoming.channel is not channel:
                return None, f"request {request_id} is not landing from this sender on receiver {self.name} (revoked, timed out or aborted)"
            if incoming.rows_landed == first_row:
                return incoming, ""
            why = f"part starts at block row {first_row}, but {incoming.rows_landed} rows landed"
        error = HandoffAbortedError(f"request {request_id}: refused by receiver {self.name}: {why}")
        self._fail(request_id, error)
        return None, str(error)

    def _landed(self, incoming: Incoming, ok: bool, first_token: int | None, why: str = "") -> None:
        """The channel is done writing `incoming` (all rows landed if ok)."""
        with self._lock:
            if incoming.state == LANDING and ok:
                incoming.state = DONE
                self._incoming.pop(incoming.target.request_id, None)
                result = self._result(
                    incoming.target.request_id,
                    True,
                    incoming.started,
                    first_token=first_token,
                    num_tokens=incoming.num_tokens,
                )
            else:
                result = None
                if incoming.error is None:
                    rid = incoming.target.request_id
                    why = (why or "aborted by the sender").removeprefix(f"request {rid}: ")
                    incoming.error = HandoffAbortedError(f"request {rid}: {why}")
        if result is not None:
            self._deliver([result])
        elif incoming.state in (LANDING, REVOKING):
            self._finalize_failed(incoming)

    def _channel_broken(self, channel, peer: str, error: Exception) -> None:
        with self._lock:
            self.channel_errors[peer] = str(error)
            if self._channels.get(peer) is channel:
                del self._channels[peer]
            victims = [i for i in self._incoming.values() if i.channel is channel and i.state in (LANDING, REVOKING)]
            for i in victims:
                i.state = REVOKING
                i.error = i.error or ChannelClosedError(f"request {i.target.request_id}: channel from {peer} broke: {error}")
        for i in victims:
            self._finalize_failed(i)

    def _close_channels(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        with self._lock:
            leftover = list(self._incoming.values())
        for i in leftover:
            i.error = i.error or ChannelClosedError(f"request {i.target.request_id}: receiver {self.name} closed")
            i.state = REVOKING
            self._finalize_failed(i)
