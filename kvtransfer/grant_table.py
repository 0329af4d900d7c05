"""The shm transport's grant table: one shared-memory row per reservation, so a hand-off
needs no control message on its critical path.

The receiver owns the table (a memfd it passes to each sender at the handshake) and grants
a row at expect(); a sender finds it by request id, claims it, writes the request's cache
rows and marks it done, all without waiting for the receiver; the receiver sees the result
when it next sweeps (poll(), wait_for(), its watchdog).

Each row has two halves with one writer each. The receiver writes KEY..SLOT and GEN last
(a grant is live while GEN holds its generation; generations are never reused, so a stale
sender cannot mistake a later grant of the same row for its own). The sender writes
CLAIM..DONE_NS, DONE last. Exclusion comes from a POSIX record lock on the row's bytes:

- a sender holds it from claim to done/abort, and checks GEN under it before each write;
- the receiver revokes by zeroing GEN and then reports a failure only once it can take the
  lock itself: after that no sender writes the rows (a later claimer sees GEN changed);
- a sender that dies releases its locks with its process, so a crash cannot hang a row.

Record locks belong to a process, not a thread, and closing any descriptor of the file drops
them: each side serialises its own threads, and a sender keeps its descriptor open while any
of its channels to that receiver may hold a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os

import numpy as np

(KEY0, KEY1, GEN, DIGEST, NUM_BLOCKS, SLOT,  # receiver's half
 CLAIM, CLAIMER, STATUS, NUM_TOKENS, FIRST_TOKEN, DONE_NS, DONE,  # sender's half
 PROGRESS) = range(14)  # sender's: block rows written so far by a hand-off streamed while its prompt prefills
ROW_WORDS = 16
ROW_BYTES = ROW_WORDS * 8
STATUS_OK, STATUS_ABORTED, STATUS_REFUSED = 1, 2, 3
MAX_ROWS = 4096


def request_key(request_id: str) -> tuple[int, int]:
    digest = hashlib.blake2b(request_id.encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True)


class GrantTable:
    def __init__(self, fd: int, num_rows: int):
        self.fd, self.num_rows = fd, num_rows
        self._map = mmap.mmap(fd, num_rows * ROW_BYTES, flags=mmap.MAP_SHARED)
        self.rows = np.frombuffer(self._map, dtype=np.int64).reshape(num_rows, ROW_WORDS)

    @classmethod
    def create(cls, num_rows: int) -> GrantTable:
        fd = os.memfd_create("kvtransfer-grants", os.MFD_CLOEXEC)
        os.ftruncate(fd, num_rows * ROW_BYTES)
        return cls(fd, num_rows)

    # ---- record locks on one row ----

    def lock(self, row: int, wait: bool = True) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB, ROW_BYTES, row * ROW_BYTES)
            return True
        except (BlockingIOError, PermissionError):
            return False

    def unlock(self, row: int) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, ROW_BYTES, row * ROW_BYTES)

    # ---- receiver ----

    def grant(self, row: int, key: tuple[int, int], gen: int, digest: int, num_blocks: int, slot: int | None) -> None:
        r = self.rows[row]
        r[GEN] = 0
        r[KEY0], r[KEY1], r[DIGEST], r[NUM_BLOCKS], r[SLOT] = key[0], key[1], digest, num_blocks, -1 if slot is None else slot
        r[GEN] = gen  # last: the grant is visible only once complete

    def revoke(self, row: int) -> None:
        self.rows[row, GEN] = 0

    # ---- sender ----

    def find(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """(row, generation) of the live grant for this key, if any."""
        rows = self.rows
        hits = np.flatnonzero((rows[:, KEY0] == key[0]) & (rows[:, KEY1] == key[1]) & (rows[:, GEN] != 0))
        return (int(hits[0]), int(rows[hits[0], GEN])) if hits.size else None

    def finish(self, row: int, gen: int, status: int, num_tokens: int, first_token: int, done_ns: int) -> None:
        r = self.rows[row]
        r[STATUS], r[NUM_TOKENS], r[FIRST_TOKEN], r[DONE_NS] = status, num_tokens, first_token, done_ns
        r[DONE] = gen  # last: the receiver reads the fields above only after seeing this

    def close(self) -> None:
        self.rows = None
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with it
            pass
        os.close(self.fd)
