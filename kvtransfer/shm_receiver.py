"""Receiver half of the shared-memory transport: grants at expect(), finds landings by sweeping.

expect() grants the reservation in the grant table (kvtransfer/grant_table.py); a sender
claims it, writes and marks it done without a message. A sweep (each poll(), wait_for(),
and the watchdog every watchdog_interval_s) turns done rows into results, on the caller's
thread: a decode loop that polls each step sees a landing at its next step, with no thread
to wake. The control socket carries only the handshake; its end tells that a sender is gone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid

from kvtransfer.control import ControlSocket
from kvtransfer.errors import ChannelClosedError, HandoffAbortedError, LayoutMismatchError, TransferError
from kvtransfer.grant_table import (CLAIM, CLAIMER, DONE, DONE_NS, FIRST_TOKEN, MAX_ROWS, NUM_TOKENS, PROGRESS,
                                    STATUS, STATUS_OK, STATUS_REFUSED, GrantTable, request_key)
from kvtransfer.layout import CacheLayout
from kvtransfer.messages import HandoffResult, ShmOffer
from kvtransfer.receiver import DONE as DONE_STATE
from kvtransfer.receiver import FAILED, LANDING, REVOKING, WAITING, HandoffReceiver, Incoming

CLOSE_GRACE_S = 2.0  # close(): how long a sender still writing a revoked request may take to let go


class ShmReceiver(HandoffReceiver):
    """Moves the cache's storage into shared memory at construction (see kvtransfer/shm.py)."""

    transport = "shm"
    _sweep_interval_s = 0.0005

    def __init__(self, *args, **kwargs):
        from kvtransfer.shm import share_cache_storage

        self._sweeping = threading.Lock()  # one sweep at a time: record locks do not exclude our own threads
        super().__init__(*args, **kwargs)
        try:
            self._shared = share_cache_storage(self.cache)
        except BaseException:  # (a /dev/shm too small for the cache): nothing left running
            self._abandon()
            raise
        rows = max(1, min(MAX_ROWS, self.cache.num_blocks + self.cache.num_slots))
        self._table = GrantTable.create(rows)
        self._free_rows = list(range(rows - 1, -1, -1))
        self._next_gen = 1
        self._tokens: dict[str, str] = {}
        self._next_peer_index = 1
        self._socket_name = f"\0kvtransfer-{self.name}-{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._socket_name)
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self._accepter = threading.Thread(target=self._accept_loop, name=f"kvtransfer-shm-listen-{self.name}", daemon=True)
        self._accepter.start()

    def accept(self, peer: str) -> ShmOffer:
        token = uuid.uuid4().hex
        with self._lock:
            self._tokens[token] = peer
        return ShmOffer(self.name, self._socket_name, token)

    # ---- grants and sweeps ----

    def _rows_landed(self, incoming: Incoming) -> int:
        row = self._table.rows[incoming.row]
        return int(row[PROGRESS]) if row[CLAIM] == incoming.gen else 0

    def _reserve(self, incoming: Incoming) -> None:
        if not self._free_rows:
            raise TransferError(
                f"request {incoming.target.request_id}: receiver {self.name} has {self._table.num_rows} reservations open, no room for more"
            )
        target = incoming.target
        incoming.row, incoming.gen = self._free_rows.pop(), self._next_gen
        self._next_gen += 1
        self._table.grant(
            incoming.row,
            request_key(target.request_id),
            incoming.gen,
            target.digest(),
            len(target.dst_block_ids),
            target.dst_slot,
        )

    def _fail(self, request_id: str, error: TransferError, only_if=None) -> bool:
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None or incoming.state == DONE_STATE:
                return False
            if incoming.state in (REVOKING, FAILED):
                return True
            if only_if and not only_if(incoming):
                return False
            incoming.error, incoming.state = error, REVOKING
            self._table.revoke(incoming.row)  # before taking the row's lock: see grant_table.py
        self._sweep()
        return True

    def _sweep(self) -> None:
        results, failed = [], []
        with self._sweeping:
            with self._lock:
                live = [i for i in self._incoming.values() if i.row is not None]
            if not live:
                return
            table = self._table
            marks = table.rows[[i.row for i in live]][:, [CLAIM, DONE]]
            for incoming, (claim, done) in zip(live, marks.tolist()):
                if incoming.state == WAITING and claim == incoming.gen:
                    incoming.state = LANDING  # informational: a sender is writing
                if done != incoming.gen and incoming.state != REVOKING:
                    continue
                if not table.lock(incoming.row, wait=False):
                    continue  # the sender still holds it: it lets go at once when done, at its next check when revoked
                try:
                    row = table.rows[incoming.row].tolist()
                finally:
                    table.unlock(incoming.row)
                outcome = self._settle(incoming, row)
                if outcome == "ok":
                    # elapsed_s ends when the sender marked it done: when poll() could first have reported it
                    results.append(HandoffResult(incoming.target.request_id, True, self.side, first_token=row[FIRST_TOKEN],
                                                 num_tokens=row[NUM_TOKENS], elapsed_s=row[DONE_NS] / 1e9 - incoming.started))
                elif outcome == "failed":
                    failed.append(incoming)
        self._deliver(results)
        for incoming in failed:
            self._finalize_failed(incoming)

    def _settle(self, incoming: Incoming, row: list[int]) -> str | None:
        """The row is final (we held its lock after the sender let go): "ok", "failed" or None (already reported)."""
        with self._lock:
            rid = incoming.target.request_id
            if self._incoming.get(rid) is not incoming:
                return None
            done = row[DONE] == incoming.gen
            if done:
                incoming.num_tokens = row[NUM_TOKENS]
            self._table.revoke(incoming.row)
            self._free_rows.append(incoming.row)
            incoming.row = None
            if done and row[STATUS] == STATUS_OK and incoming.state in (WAITING, LANDING):
                incoming.state = DONE_STATE
                del self._incoming[rid]
                return "ok"
            if incoming.error is None:
                refused = done and row[STATUS] == STATUS_REFUSED
                incoming.error = HandoffAbortedError(
                    f"request {rid}: refused by receiver {self.name}: sender's destination rows differ from the reservation"
                    if refused
                    else f"request {rid}: aborted by the sender"
                )
            incoming.state = REVOKING
            return "failed"

    # ---- channels: handshake, then only liveness ----

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._welcome, args=(conn,), daemon=True).start()

    def _welcome(self, conn: socket.socket) -> None:
        from kvtransfer.shm import PROTOCOL_VERSION

        control = ControlSocket(conn)
        control.settimeout(self.config.connect_timeout_s)
        peer = None
        try:
            hello, _ = control.recv()
            with self._lock:
                peer = self._tokens.pop(hello.get("token", ""), None)
                index, self._next_peer_index = self._next_peer_index, self._next_peer_index + 1
            if hello.get("kind") != "hello" or peer is None:
                raise ChannelClosedError("unknown or reused offer token")
            if hello.get("version") != PROTOCOL_VERSION:
                raise ChannelClosedError(f"peer speaks shm protocol {hello.get('version')}, this is {PROTOCOL_VERSION}")
            try:
                self.layout.check_compatible(CacheLayout.from_dict(hello["layout"]), f"receiver {self.name}", f"sender {peer}")
            except LayoutMismatchError as error:
                control.send("refused", error=str(error), layout=self.layout.to_dict())
                self._channel_failed_to_open(peer, error)
                control.close()
                return
            fds, sizes, places = self._shared
            rows = {"block": self.cache.num_blocks, "slot": self.cache.num_slots}
            control.send("welcome", fds=[*fds, self._table.fd], layout=self.layout.to_dict(), sizes=sizes, places=places,
                         rows=rows, grant_rows=self._table.num_rows, peer_index=index)
            control.settimeout(None)
        except Exception as error:  # a peer that cannot pair gets disconnected, nothing else
            if peer is not None:
                self._channel_failed_to_open(peer, error)
            control.close()
            return
        self._install_channel(peer, ShmReceiverChannel(self, peer, index, control))

    def _peer_gone(self, channel: ShmReceiverChannel, error: Exception) -> None:
        """Fail what that sender claimed and did not finish (its locks went with it, or go as it lets go)."""
        with self._lock:
            self.channel_errors[channel.peer] = str(error)
            if self._channels.get(channel.peer) is channel:
                del self._channels[channel.peer]
            live = [i for i in self._incoming.values() if i.row is not None]
            marks = self._table.rows[[i.row for i in live]][:, [CLAIM, CLAIMER, DONE]].tolist() if live else []
            victims = [i for i, (claim, claimer, done) in zip(live, marks) if claim == i.gen and claimer == channel.index and done != i.gen]
        for i in victims:
            rid = i.target.request_id
            self._fail(rid, ChannelClosedError(f"request {rid}: channel from {channel.peer} broke: {error}"), only_if=lambda x, i=i: x is i)

    def _close_channels(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop now
        with contextlib.suppress(OSError):
            self._listener.close()
        self._accepter.join(timeout=2)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            leftover = list(self._incoming)
        for channel in channels:
            channel.close()
        for rid in leftover:
            self._fail(rid, ChannelClosedError(f"request {rid}: receiver {self.name} closed"))
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.001)
            self._sweep()
        with self._lock:  # a sender frozen mid-write past the grace: reported anyway (docs/kvtransfer.md, Limits)
            stuck = list(self._incoming.values())
        for incoming in stuck:
            self._finalize_failed(incoming)
        self._table.close()


class ShmReceiverChannel:
    def __init__(self, receiver: ShmReceiver, peer: str, index: int, control: ControlSocket):
        self.receiver, self.peer, self.index, self.control = receiver, peer, index, control
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-shm-recv-{receiver.name}-{peer}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.control.close()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            message, _ = self.control.recv()  # blocks, without the GIL, until the sender goes away
            error: Exception = ChannelClosedError(f"unexpected control message {message.get('kind')!r} from sender {self.peer}")
        except Exception as exc:
            error = exc
        self.control.close()
        self.receiver._peer_gone(self, error)
