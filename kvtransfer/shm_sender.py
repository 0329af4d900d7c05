"""Sender half of the shared-memory transport: writes rows straight into the peer's mapped cache."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading

from kvtransfer.control import ControlSocket
from kvtransfer.errors import ChannelClosedError, HandoffAbortedError
from kvtransfer.rows import byte_rows, copy_rows, request_maps
from kvtransfer.sender import ALL_LAYERS, ON_WIRE

log = logging.getLogger(__name__)


class ShmSenderChannel:
    def __init__(self, sender, peer: str, control: ControlSocket, maps: list, dst_rows: dict):
        self.sender, self.peer, self.control = sender, peer, control
        self._maps = maps  # keeps the peer's shared memory mapped while dst_rows are in use
        self._dst_rows = dst_rows
        self._src_rows = {name: byte_rows(t) for name, t in sender.cache.tensors.items()}
        self._granted: set[str] = set()
        self._dead: Exception | None = None
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name=f"kvtransfer-shm-send-{sender.name}-{peer}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"kvtransfer-shm-ctl-{sender.name}-{peer}", daemon=True)
        self._writer.start()
        self._reader.start()

    def submit(self, job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._stop_writing(ChannelClosedError(f"channel to {self.peer} closed by sender {self.sender.name}"))
        self._writer.join(timeout=10)
        self.control.close()
        self._reader.join(timeout=5)

    # ---- control messages from the receiver ----

    def _read_loop(self) -> None:
        try:
            while True:
                message, _ = self.control.recv()
                kind, rid = message["kind"], message["request_id"]
                if kind == "grant":
                    with self.sender._lock:
                        if rid in self.sender._outgoing:  # else it failed meanwhile; the writer says so
                            self._granted.add(rid)
                        self.sender._changed.notify_all()
                elif kind in ("refuse", "revoke"):
                    why = message.get("error") or f"revoked by receiver {self.peer} (timeout or abort there)"
                    self.sender._fail(rid, HandoffAbortedError(f"request {rid}: {why}"), only_if=lambda job: job.channel is self)
        except Exception as error:
            self._stop_writing(error)

    def _stop_writing(self, error: Exception) -> None:
        with self.sender._lock:
            if self._dead is None:
                self._dead = error
            self.sender._changed.notify_all()
        self.sender._abort_jobs_of(self, ChannelClosedError(f"channel to {self.peer} closed: {error}"))
        self._queue.put(None)

    # ---- the writer ----

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None and self._dead is None:
            if self.sender._start(job, self):
                self._write(job)
        self.sender._channel_broken(self, self.peer, self._dead or ChannelClosedError("channel closed"))

    def _wait_granted(self, job) -> bool:
        with self.sender._lock:
            while job.state == ON_WIRE and job.request_id not in self._granted and self._dead is None:
                self.sender._changed.wait(0.1)
            self._granted.discard(job.request_id)
            return job.state == ON_WIRE and self._dead is None

    def _write(self, job) -> None:
        target, rid = job.target, job.request_id
        try:
            self.control.send("begin", request_id=rid, num_tokens=job.num_tokens, num_blocks=len(job.src_block_ids), digest=target.digest(), slot=target.dst_slot)
            ok = self._wait_granted(job)
            layout = self.sender.layout
            maps = request_maps(layout, job.src_block_ids, job.src_slot, job.dst_block_ids, target.dst_slot)
            groups = [[layer] for layer in layout.layers] if self.sender.config.pipeline_layers else [layout.layers]
            for group in groups:
                ok = ok and self.sender._wait_ready(job, group[-1])[0]  # False once revoked or aborted
                if not ok:
                    break
                for spec in (s for layer in group for s in layout.specs_of_layer(layer)):
                    copy_rows(self._src_rows[spec.name], self._dst_rows[spec.name], maps[spec.role])
            ok = ok and self.sender._wait_ready(job, ALL_LAYERS)[0]
            if ok:
                self.control.send("done", request_id=rid, first_token=job.first_token)
            else:
                with contextlib.suppress(ChannelClosedError):
                    self.control.send("aborted", request_id=rid, error=str(job.error or "aborted by the sender"))
        except ChannelClosedError as error:
            ok = False
            self._stop_writing(error)
        self.sender._finalize(job, ok=ok)
