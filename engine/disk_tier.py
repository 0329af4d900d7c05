"""The disk tier: prefix-cache entries (engine.host_tier.Entry) as files in one folder.

An entry is one safetensors file, `<tokens>-<last block hash>.safetensors`, in a folder named
by the cache's fingerprint (the model's files, dtype, block size and cache layout), so a
worker never reads an entry made for another layout, and entries outlive the worker. A file is
written under a temporary name and renamed into place: a crash leaves no file that reads as a
whole entry. Its metadata holds the chain's keys and a checksum of its bytes; a file that does
not verify is removed and the request computes the prefix instead.

Writes run on a writer thread; reads for requests still queued run on a reader thread
(`prefetch`), so a request admitted later finds its entry already read and verified. The
reader only reads: what a read finds is acted on (used, or refused and removed) on the
engine's thread, in `get`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.host_tier import Entry, least_useful_first, unfit_tensors

log = logging.getLogger(__name__)
PREFETCH_LIMIT = 8  # entries read ahead and not yet asked for (a request that left leaves one)
LISTING_S = 1.0  # how old the folder's listing may be before a lookup that misses lists it again
USAGE_S = 2.0  # how old the folder's totals (bytes, entries) may be: stats and the writer's room check
HEADROOM = 0.1  # a write over budget frees down to this fraction below it, so the next ones list nothing


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskTier:
    """Entry files in one folder. Writes run on a thread of their own (a spill must not wait
    for the disk): an entry queued and not yet written is served from the queue."""

    def __init__(self, root: str, budget: int, fingerprint: str):
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget, self.fingerprint = budget, fingerprint
        for stale in self.dir.glob(".tmp-*"):  # a write a crash interrupted: never an entry
            stale.unlink(missing_ok=True)
        self.write_errors = self.removed_bad = 0
        self.events = None  # engine.cache_events.CacheEvents
        self.pending: dict[Path, Entry] = {}  # queued for the writer, by the file they become
        self._lock = threading.Lock()
        self._queue: queue.Queue[Path] = queue.Queue()
        threading.Thread(target=self._writer, name="disk-cache-writer", daemon=True).start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-cache-reader")
        self.prefetched: OrderedDict[Path, Future] = OrderedDict()  # by file: (tensors, why bad)
        self.prefetch_hits = 0
        self._names: set[str] = set()  # entry files in the folder, as last listed (and kept since)
        self._listed_at = float("-inf")
        self._bytes = self._entries = 0  # the folder's totals, as last listed (and kept since)
        self._usage_at = float("-inf")

    def flush(self) -> None:
        """Wait until every queued entry is written (or failed)."""
        self._queue.join()

    def _writer(self) -> None:
        while True:
            path = self._queue.get()
            try:
                with self._lock:
                    entry = self.pending.get(path)
                if entry is not None:
                    self._write(entry, path)
            finally:
                with self._lock:
                    self.pending.pop(path, None)
                self._queue.task_done()

    def path(self, key: bytes, end: int) -> Path:
        return self.dir / entry_name(key, end)

    def may_hold(self, key: bytes, end: int) -> bool:
        """Whether an entry for (key, end) is queued, written here, or was in the folder when it
        was last listed: no file system call for a prefix never written. The listing is redone
        on a miss once it is LISTING_S old, for entries other workers sharing the folder wrote."""
        name = entry_name(key, end)
        if name in self._names:
            return True
        if time.monotonic() - self._listed_at < LISTING_S:
            return False
        listed = {item.name for item in os.scandir(self.dir) if item.name.endswith(".safetensors")
                  and not item.name.startswith(".")}
        with self._lock:
            self._names = listed | {path.name for path in self.pending}
        self._listed_at = time.monotonic()
        return name in self._names

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) of the folder's entry files: a listing (a stat per file) at most
        every USAGE_S, kept current meanwhile by this worker's own writes and removals."""
        if time.monotonic() - self._usage_at >= USAGE_S:
            self._relist()
        return self._bytes, self._entries

    def _relist(self) -> list[tuple[Path, float, int, int]]:
        """files(), with the totals set from them."""
        files = self.files()
        with self._lock:
            self._bytes, self._entries, self._usage_at = sum(f[3] for f in files), len(files), time.monotonic()
        return files

    def _count(self, nbytes: int, entries: int) -> None:
        with self._lock:  # other workers sharing the folder may have removed what is counted
            self._bytes, self._entries = max(0, self._bytes + nbytes), max(0, self._entries + entries)

    def _remove(self, path: Path, nbytes: int | None = None) -> None:
        if nbytes is None:
            try:
                nbytes = path.stat().st_size
            except FileNotFoundError:
                nbytes = None  # gone already: nothing to count
        path.unlink(missing_ok=True)
        if nbytes is not None:
            self._count(-nbytes, -1)
        self._names.discard(path.name)
        if self.events is not None:
            self.events.dropped("disk", *key_of(path))

    def held(self) -> list[tuple[bytes, int]]:
        """(key, tokens) of every entry file."""
        return [key_of(path) for path, *_ in self.files()]

    def files(self) -> list[tuple[Path, float, int, int]]:
        """(path, last used, tokens, bytes) of every entry file."""
        out = []
        for item in os.scandir(self.dir):
            if item.name.endswith(".safetensors") and not item.name.startswith("."):
                stat = item.stat()
                out.append((Path(item.path), stat.st_mtime, int(item.name.split("-", 1)[0]), stat.st_size))
        return out

    def put(self, entry: Entry) -> None:
        path = self.path(entry.keys[-1], entry.end)
        with self._lock:
            if path in self.pending or path.exists():
                return
            self.pending[path] = entry
            self._names.add(path.name)
        self._queue.put(path)

    def _write(self, entry: Entry, path: Path) -> None:
        tmp = self.dir / f".tmp-{os.getpid()}-{path.name}"
        tensors = {name: t.contiguous() for name, t in entry.tensors.items()}
        metadata = {"fingerprint": self.fingerprint, "keys": b"".join(entry.keys).hex(), "end": str(entry.end),
                    "checksum": checksum(tensors)}
        try:
            self._make_room(entry.nbytes)
            save_file(tensors, tmp, metadata=metadata)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._count(path.stat().st_size, 1)
            if self.events is not None:
                self.events.stored("disk", entry.keys[-1], entry.end)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._names.discard(path.name)
            self.write_errors += 1
            log.warning("disk cache: entry of %d tokens not written (%s)", entry.end,
                        "disk full" if e.errno == errno.ENOSPC else e)

    def _make_room(self, nbytes: int) -> None:
        """Before a write of `nbytes`: where the folder would go over budget, remove the least
        useful files (each file's time of last use) until it is HEADROOM below it."""
        if self.usage()[0] + nbytes <= self.budget:
            return
        files = self._relist()
        used = sum(f[3] for f in files)
        for path, _, _, size in least_useful_first([(f, f[1], f[2]) for f in files]) if files else ():
            if used + nbytes <= self.budget * (1 - HEADROOM):
                break
            self._remove(path, size)
            used -= size

    def prefetch(self, key: bytes, end: int, keys: list[bytes], shapes: dict[str, tuple]) -> bool:
        """Start reading the entry's file on the reader thread, for a request still queued;
        whether there is a file (or a queued write) for it."""
        if not self.may_hold(key, end):
            return False
        path = self.path(key, end)
        with self._lock:
            queued = path in self.pending
        if queued or path in self.prefetched:
            return True
        if not path.exists():
            return False
        self.prefetched[path] = self._reader.submit(self._read, path, keys, shapes)
        while len(self.prefetched) > PREFETCH_LIMIT:
            self.prefetched.popitem(last=False)[1].cancel()
        return True

    def get(self, key: bytes, end: int, keys: list[bytes], shapes: dict[str, tuple]) -> Entry | None:
        """The entry for `keys` if its file exists and verifies against the chain and the
        cache's shapes (`shapes`: name -> (one row's shape, dtype)); a file that does not is
        removed. A read the reader thread did ahead is used where it verified."""
        path = self.path(key, end)
        with self._lock:
            queued = self.pending.get(path)
        if queued is not None:
            return Entry(list(keys), end, queued.tensors) if queued.keys == keys else None
        ahead = self.prefetched.pop(path, None)
        tensors, bad = ahead.result() if ahead is not None else (None, "not read")
        if bad is None:
            self.prefetch_hits += 1
        else:  # not read ahead, or the file changed or went while it was read: read it now
            if not self.may_hold(key, end) or not path.exists():
                return None
            tensors, bad = self._read(path, keys, shapes)
        if bad is not None:
            log.warning("disk cache: %s refused (%s) and removed", path.name, bad)
            self._remove(path)
            self.removed_bad += 1
            return None
        try:
            os.utime(path)  # recency, for the disk's own eviction
        except FileNotFoundError:
            pass  # evicted by the writer since it was read: the entry read stays good
        return Entry(list(keys), end, tensors)

    def _read(self, path: Path, keys: list[bytes], shapes: dict[str, tuple]) -> tuple[dict, str | None]:
        """(the file's tensors, None) where it verifies, else ({}, why not). Reads only."""
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # truncated, gone, or not a safetensors file at all
            return {}, f"unreadable ({type(e).__name__})"
        if meta.get("fingerprint") != self.fingerprint or meta.get("keys") != b"".join(keys).hex():
            return {}, "another layout or chain"
        unfit = unfit_tensors(tensors, len(keys), shapes)
        if unfit is not None:
            return {}, f"tensor shapes: {unfit}"
        if meta.get("checksum") != checksum(tensors):
            return {}, "checksum"
        return tensors, None


def entry_name(key: bytes, end: int) -> str:
    return f"{end}-{key.hex()}.safetensors"


def key_of(path: Path) -> tuple[bytes, int]:
    """An entry file's (last block key, tokens), from its name."""
    end, key = path.name.removesuffix(".safetensors").split("-", 1)
    return bytes.fromhex(key), int(end)


def cache_fingerprint(model_dir: str, dtype: str, block_size: int, cache) -> str:
    """What a disk entry must match to be read back: the model's files (config.json whole;
    each weight file's name, size and first and last MiB), dtype, block size, and every cache
    tensor's name, kind and per-token shape."""
    digest = hashlib.blake2b(digest_size=12)
    root = Path(model_dir)
    digest.update((root / "config.json").read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    layout = [(name, kind, role, list(t.shape[2:] if role == "block" else t.shape[1:]), str(t.dtype))
              for name, _, kind, role, t in cache.handoff_tensors()]
    digest.update(json.dumps([dtype, block_size, layout]).encode())
    return digest.hexdigest()
