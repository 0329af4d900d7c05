"""Sender half of the shared-memory transport: claims the receiver's grant and writes rows
straight into its mapped cache, on the thread that calls begin()/layer_done()/finish().

Copying inline costs the caller the copy itself (short at hand-off sizes) and saves waking a
transport thread, which under a busy engine loop waits for the GIL far longer than that.
"""

from __future__ import annotations

import threading
import time

from kvtransfer.control import ControlSocket
from kvtransfer.errors import ChannelClosedError, HandoffAbortedError
from kvtransfer.grid import Grid
from kvtransfer.grant_table import (CLAIM, CLAIMER, DIGEST, GEN, KEY0, KEY1, NUM_BLOCKS, PROGRESS, SLOT,
                                    STATUS_ABORTED, STATUS_OK, STATUS_REFUSED, GrantTable, request_key)
from kvtransfer.layout import BLOCK
from kvtransfer.rows import RowMap, byte_rows, copy_rows, request_maps
from kvtransfer.sender import ALL_LAYERS, ON_WIRE


class ShmSenderChannel:
    def __init__(self, sender, peer: str, control: ControlSocket, maps: list, dst_rows: dict, table: GrantTable, index: int,
                 grid: Grid):
        self.sender, self.peer, self.control, self.grid = sender, peer, control, grid
        self._maps = maps  # keeps the peer's shared memory mapped while dst_rows are in use
        self._dst_rows = dst_rows  # on the grid, like the source rows
        self._src_rows = grid.split_all({name: byte_rows(t) for name, t in sender.cache.tensors.items()}, sender.layout)
        self.table, self.index = table, index
        self._writing: dict[str, object] = {}  # request id -> job whose grant row this process has locked
        self._write_lock = threading.Lock()  # our threads' claims, copies and releases (record locks do not exclude them)
        self._dead: Exception | None = None
        self._reader = threading.Thread(target=self._watch_peer, name=f"kvtransfer-shm-ctl-{sender.name}-{peer}", daemon=True)
        self._reader.start()

    # ---- called by the sender on the caller's thread ----

    def submit(self, job) -> None:
        if not self.sender._start(job, self):
            return
        with self._write_lock:
            why = f"channel to {self.peer} closed: {self._dead}" if self._dead else self._claim(job)
        if why:
            self.sender._fail(job.request_id, HandoffAbortedError(f"request {job.request_id}: {why}"), only_if=lambda x: x is job)
        else:
            self.write_ready(job)

    def _claim(self, job) -> str:
        """Lock and claim the job's grant row; '' on success, else why not (the job writes nothing)."""
        rid, table = job.request_id, self.table
        key = request_key(rid)
        found = table.find(key)
        missing = f"refused by receiver {self.peer}: request {rid} is not expected there (never reserved, timed out or aborted)"
        if found is None:
            return missing
        row, gen = found
        table.lock(row)  # the receiver holds a row's lock only for a moment
        r = table.rows[row]
        if r[GEN] != gen or r[KEY0] != key[0] or r[KEY1] != key[1]:
            table.unlock(row)
            return missing
        if r[CLAIM] == gen:
            table.unlock(row)
            return f"refused by receiver {self.peer}: request {rid} was already claimed by another hand-off"
        target, slot = job.target, job.target.dst_slot
        if len(job.dst_block_ids) > r[NUM_BLOCKS] or r[SLOT] != (-1 if slot is None else slot) or r[DIGEST] != target.digest():
            table.finish(row, gen, STATUS_REFUSED, job.num_tokens, -1, time.monotonic_ns())
            table.unlock(row)
            return f"refused by receiver {self.peer}: sender's destination rows differ from the reservation"
        r[CLAIMER] = self.index
        r[PROGRESS] = 0
        r[CLAIM] = gen
        job.row, job.gen, job.copied, job.rows_copied = row, gen, 0, 0
        grid, n = self.grid, job.num_tokens
        job.src_rows, job.dst_rows = grid.my_rows(job.src_block_ids, n), grid.peer_rows(job.dst_block_ids, n)
        # A streaming job's block rows go as its chunks finish them (_copy_finished_rows): what
        # the layers copy at the end is its slot rows only.
        job.maps = request_maps(self.sender.layout, [] if job.streaming else job.src_rows, job.src_slot,
                                [] if job.streaming else job.dst_rows, slot)
        self._writing[rid] = job
        return ""

    def progress(self, job) -> None:
        self.write_ready(job)

    def write_ready(self, job) -> None:
        """Copy every layer marked ready (a streaming job: every block row its finished chunks
        wrote) and not yet copied; after the last, mark the row done."""
        layout, table = self.sender.layout, self.table
        revoked = done = False
        with self._write_lock:
            if self._writing.get(job.request_id) is not job or job.state != ON_WIRE:
                return
            if job.streaming and not self._copy_finished_rows(job):
                revoked = True
            upto = job.ready_layer if self.sender.config.pipeline_layers or job.ready_layer == ALL_LAYERS else -1
            if revoked:
                upto = -1
            layers = layout.layers
            while job.copied < len(layers) and layers[job.copied] <= upto:
                if table.rows[job.row, GEN] != job.gen:  # revoked: the receiver waits for our lock to go
                    revoked = True
                    break
                for spec in layout.specs_of_layer(layers[job.copied]):
                    copy_rows(self._src_rows[spec.name], self._dst_rows[spec.name], job.maps[spec.role])
                job.copied += 1
            if not revoked and upto == ALL_LAYERS:
                table.finish(job.row, job.gen, STATUS_OK, job.num_tokens, job.first_token, time.monotonic_ns())
                table.unlock(job.row)
                del self._writing[job.request_id]
                done = True
        if revoked:
            self._revoked(job)
        elif done:
            self.sender._finalize(job, ok=True)

    def _copy_finished_rows(self, job) -> bool:
        """A streaming job's block rows of the tokens computed so far (full wire rows only: the
        next chunk still writes a partial one); False if the receiver revoked the grant."""
        end = len(job.src_rows) if job.ready_layer == ALL_LAYERS else min(job.ready_tokens // self.grid.row_tokens, len(job.src_rows))
        if end <= job.rows_copied:
            return True
        if self.table.rows[job.row, GEN] != job.gen:
            return False
        rows = RowMap(job.src_rows[job.rows_copied:end], job.dst_rows[job.rows_copied:end])
        for spec in self.sender.layout.specs:
            if spec.role == BLOCK:
                copy_rows(self._src_rows[spec.name], self._dst_rows[spec.name], rows)
        job.rows_copied = end
        self.table.rows[job.row, PROGRESS] = end  # the receiver renews a reservation that moves (keep_waiting)
        return True

    def release(self, job) -> None:
        """The job failed: stop writing it, tell the receiver, let go of its row, report it."""
        with self._write_lock:
            if self._writing.get(job.request_id) is job:
                del self._writing[job.request_id]
                self.table.finish(job.row, job.gen, STATUS_ABORTED, job.num_tokens, -1, time.monotonic_ns())
                self.table.unlock(job.row)
        self.sender._finalize(job, ok=False)

    def check_revoked(self) -> None:
        """The sender's watchdog: fail jobs whose grant the receiver took back (timeout or abort there)."""
        with self._write_lock:
            revoked = [j for j in self._writing.values() if self.table.rows[j.row, GEN] != j.gen]
        for job in revoked:
            self._revoked(job)

    def _revoked(self, job) -> None:
        why = f"request {job.request_id}: revoked by receiver {self.peer} (timeout or abort there)"
        self.sender._fail(job.request_id, HandoffAbortedError(why), only_if=lambda x: x is job)

    # ---- channel lifetime ----

    def _watch_peer(self) -> None:
        try:
            message, _ = self.control.recv()  # blocks, without the GIL, until the receiver goes away
            error: Exception = ChannelClosedError(f"unexpected control message {message.get('kind')!r} from receiver {self.peer}")
        except Exception as exc:
            error = exc
        self._stop_writing(error)
        self.sender._channel_broken(self, self.peer, error)

    def _stop_writing(self, error: Exception) -> None:
        with self._write_lock:
            if self._dead is None:
                self._dead = error
        self.sender._abort_jobs_of(self, ChannelClosedError(f"channel to {self.peer} closed: {error}"))

    def close(self) -> None:
        self._stop_writing(ChannelClosedError(f"channel to {self.peer} closed by sender {self.sender.name}"))
        self.control.close()
        self._reader.join(timeout=5)
        self.sender._retire(self.table)
