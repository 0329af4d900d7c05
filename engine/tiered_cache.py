"""Tiers below the prefix cache's pool (engine.prefix_cache): host memory, then a directory.

An entry is one usable prefix: the KV of every block of its hash chain and, for a model with
recurrent layers, the checkpoint that makes it usable (every state tensor's row after its last
token). It moves whole: spilled from the pool when the pool evicts it under pressure, pushed
from host memory to disk when host memory is full, dropped from disk when the disk budget is;
each tier evicts by the pool's rule (recency plus the compute a hit saves). A request about to
be admitted whose longest tier entry goes past its pool hit gets that entry loaded back into
the pool (its blocks indexed, its checkpoint in a checkpoint row), where the scheduler then
finds it as any pool hit.

On disk an entry is one safetensors file, `<tokens>-<last block hash>.safetensors`, in a
folder named by the cache's fingerprint (the model's files, dtype, block size and cache
layout), so a worker never reads an entry made for another layout, and entries outlive the
worker. A file is written under a temporary name and renamed into place: a crash leaves no
file that reads as a whole entry. Its metadata holds the chain's keys and a checksum of its
bytes; a file that does not verify is removed and the request computes the prefix instead.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.prefix_cache import CHECKPOINT_COMPUTE_WEIGHT, PrefixCache, block_hashes

log = logging.getLogger(__name__)
LOAD_OWNER = "#tier-load"  # holds an entry's blocks while they are filled


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0  # host-memory tier budget; 0: none
    disk_dir: str | None = None  # disk tier folder; None: none
    disk_bytes: int = 0  # disk tier budget

    def __post_init__(self):
        for name in ("host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name.replace('_bytes', '_cache_bytes')}: must be a non-negative integer, "
                                 f"got {value!r}")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("disk_cache_dir and disk_cache_bytes go together: "
                             f"got disk_cache_dir={self.disk_dir!r}, disk_cache_bytes={self.disk_bytes}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


@dataclass
class Entry:
    keys: list[bytes]  # the chain's block hashes, root first
    end: int  # tokens the prefix covers
    tensors: dict[str, torch.Tensor]  # "kv:<name>": [blocks, ...]; "state:<name>": one row (CPU)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def least_useful(candidates: list[tuple[object, float, int]]) -> object:
    """Of (item, last used, tokens), the one the pool's rule evicts first."""
    oldest, newest = min(c[1] for c in candidates), max(c[1] for c in candidates)
    shortest, longest = min(c[2] for c in candidates), max(c[2] for c in candidates)

    def utility(candidate) -> float:
        recency = (candidate[1] - oldest) / max(1e-9, newest - oldest)
        saved = (candidate[2] - shortest) / max(1, longest - shortest)
        return recency + CHECKPOINT_COMPUTE_WEIGHT * saved

    return min(candidates, key=utility)[0]


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class HostTier:
    def __init__(self, budget: int):
        self.budget = budget
        self.entries: dict[bytes, Entry] = {}  # by the chain's last key
        self.nbytes = 0
        self.events = None  # engine.cache_events.CacheEvents

    def put(self, entry: Entry) -> list[Entry]:
        """Keep `entry`; what no longer fits, least useful first (to go down a tier)."""
        out = []
        if entry.nbytes > self.budget:
            return [entry]
        self.entries[entry.keys[-1]] = entry
        self.nbytes += entry.nbytes
        if self.events is not None:
            self.events.stored("host", entry.keys[-1], entry.end)
        while self.nbytes > self.budget:
            victim = least_useful([(e, e.last_used, e.end) for e in self.entries.values()])
            out.append(self.take(victim.keys[-1]))
        return out

    def take(self, key: bytes) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            if self.events is not None:
                self.events.dropped("host", key, entry.end)
        return entry


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
        return self.dir / f"{end}-{key.hex()}.safetensors"

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
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
            if self.events is not None:
                self.events.stored("disk", entry.keys[-1], entry.end)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            log.warning("disk cache: entry of %d tokens not written (%s)", entry.end,
                        "disk full" if e.errno == errno.ENOSPC else e)

    def _make_room(self, nbytes: int) -> None:
        files = self.files()
        used = sum(f[3] for f in files)
        while files and used + nbytes > self.budget:
            victim = least_useful([(f, f[1], f[2]) for f in files])
            self._remove(victim[0])
            files.remove(victim)
            used -= victim[3]

    def get(self, key: bytes, end: int, keys: list[bytes], shapes: dict[str, tuple]) -> Entry | None:
        """The entry for `keys` if its file exists and verifies against the chain and the
        cache's shapes (`shapes`: name -> (one row's shape, dtype)); a file that does not is
        removed."""
        path = self.path(key, end)
        with self._lock:
            queued = self.pending.get(path)
        if queued is not None:
            return Entry(list(keys), end, queued.tensors) if queued.keys == keys else None
        if not path.exists():
            return None
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            bad = None
            if meta.get("fingerprint") != self.fingerprint or meta.get("keys") != b"".join(keys).hex():
                bad = "another layout or chain"
            elif {n: (tuple(t.shape[1:] if n.startswith("kv:") else t.shape), t.dtype)
                  for n, t in tensors.items()} != shapes \
                    or any(t.shape[0] != len(keys) for n, t in tensors.items() if n.startswith("kv:")):
                bad = "tensor shapes"
            elif meta.get("checksum") != checksum(tensors):
                bad = "checksum"
        except Exception as e:  # truncated or not a safetensors file at all
            tensors, bad = {}, f"unreadable ({type(e).__name__})"
        if bad is not None:
            log.warning("disk cache: %s refused (%s) and removed", path.name, bad)
            self._remove(path)
            self.removed_bad += 1
            return None
        os.utime(path)  # recency, for the disk's own eviction
        return Entry(list(keys), end, tensors)


class TieredCache:
    """The engine's tiers: spill from the pool, promote back into it."""

    def __init__(self, config: TierConfig, cache, blocks, prefix_cache: PrefixCache, fingerprint: str):
        self.config = config
        self.cache, self.blocks, self.prefix_cache = cache, blocks, prefix_cache
        self.host = HostTier(config.host_bytes) if config.host_bytes else None
        self.disk = DiskTier(config.disk_dir, config.disk_bytes, fingerprint) if config.disk_dir else None
        block_size = blocks.block_size
        self.block_size = block_size
        self.kv_tensors = cache.block_tensors()
        self.state_tensors = cache.whole_state_tensors() if prefix_cache.needs_state else []
        self.row_shapes = {f"kv:{n}": (tuple(t.shape[1:]), t.dtype) for n, t in self.kv_tensors}
        self.row_shapes.update({f"state:{n}": (tuple(t.shape[1:]), t.dtype) for n, t in self.state_tensors})
        self.spills = self.host_hits = self.disk_hits = self.loaded_tokens = 0
        prefix_cache.on_evict = self.spill

    def attach_events(self, events) -> None:
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.events = events

    def held(self) -> list[tuple[str, bytes, int]]:
        """(tier, key, tokens) of every entry the tiers hold."""
        host = [("host", key, e.end) for key, e in list(self.host.entries.items())] if self.host is not None else []
        return host + ([("disk", key, end) for key, end in self.disk.held()] if self.disk is not None else [])

    # ------------------------------------------------------------------ down

    @torch.inference_mode()
    def spill(self, keys: list[bytes], blocks: list[int], checkpoint: int | None, end: int) -> None:
        """A prefix the pool evicts: copied out whole, into the highest tier with room."""
        if self.host is not None and keys[-1] in self.host.entries:
            self.host.entries[keys[-1]].last_used = time.monotonic()
            return
        index = torch.tensor(blocks, device=self.kv_tensors[0][1].device) if self.kv_tensors else None
        tensors = {f"kv:{n}": t.index_select(0, index).cpu() for n, t in self.kv_tensors}
        if checkpoint is not None:
            row = self.cache.checkpoint_row(checkpoint)
            # a copy: on the CPU, t[row].cpu() would be a view of a row the pool reuses
            tensors.update({f"state:{n}": t[row].to("cpu", copy=True) for n, t in self.state_tensors})
        entry = Entry(list(keys), end, tensors)
        self.spills += 1
        below = self.host.put(entry) if self.host is not None else [entry]
        if self.disk is not None:
            for pushed in below:
                self.disk.put(pushed)

    # ------------------------------------------------------------------ up

    def promote(self, request) -> int:
        """Before `request` is admitted: load its longest tier entry that goes past its pool hit
        into the pool. Tokens loaded (0: none)."""
        if request.tier_checked:
            return 0
        size = self.block_size
        request.block_hashes = block_hashes(request.all_token_ids, size, request.block_hashes)
        hashes = request.block_hashes
        hit = self.prefix_cache.lookup(hashes, request.num_tokens).num_tokens
        for i in range(len(hashes) - 1, -1, -1):
            end = (i + 1) * size
            if end >= request.num_tokens:
                continue  # one token is always computed
            if end <= hit:
                break
            entry = self._find(hashes[: i + 1], end)
            if entry is None:
                continue
            if not self._load(entry):
                return 0  # no room in the pool now: looked up again in a later step
            if self.host is not None and self.host.take(entry.keys[-1]) is not None:
                self.host_hits += 1  # in the pool now; evicted again, it is spilled again
            else:
                self.disk_hits += 1
            self.loaded_tokens += end
            request.tier_checked = True
            return end
        request.tier_checked = True
        return 0

    def _find(self, keys: list[bytes], end: int) -> Entry | None:
        if self.host is not None and (entry := self.host.entries.get(keys[-1])) is not None:
            return entry
        if self.disk is not None:
            return self.disk.get(keys[-1], end, keys, self.row_shapes)
        return None

    @torch.inference_mode()
    def _load(self, entry: Entry) -> bool:
        """The entry's missing blocks filled and indexed, its checkpoint in a row; False (and
        nothing taken) where the pool has no room for it now."""
        nodes, size = self.prefix_cache.nodes, self.block_size
        present = [nodes[key].block for key in entry.keys if key in nodes]
        if present:
            self.blocks.share(LOAD_OWNER, present)  # kept while the rest is allocated
        try:
            if not self.blocks.can_allocate(LOAD_OWNER, len(entry.keys) * size):
                return False
            new = iter(self.blocks.allocate(LOAD_OWNER, len(entry.keys) * size)[len(present):])
            missing = [i for i, key in enumerate(entry.keys) if key not in nodes]
            table = [nodes[key].block if key in nodes else next(new) for key in entry.keys]
            if missing:
                rows = torch.tensor(missing)
                at = torch.tensor([table[i] for i in missing], device=self.kv_tensors[0][1].device)
                for name, tensor in self.kv_tensors:
                    tensor.index_copy_(0, at, entry.tensors[f"kv:{name}"][rows].to(tensor.device))
            self.prefix_cache.insert(entry.keys, table)
            if self.state_tensors:
                checkpoint = self.prefix_cache.take_checkpoint_row(entry.keys[-1])
                if checkpoint is None:
                    return False
                row = self.cache.checkpoint_row(checkpoint)
                for name, tensor in self.state_tensors:
                    tensor[row].copy_(entry.tensors[f"state:{name}"])
            return True
        finally:
            self.blocks.free(LOAD_OWNER)

    def flush(self) -> None:
        """Wait for the disk tier's queued writes."""
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict:
        out = {"tier_spills": self.spills, "tier_host_hits": self.host_hits, "tier_disk_hits": self.disk_hits,
               "tier_loaded_tokens": self.loaded_tokens}
        if self.host is not None:
            out.update(tier_host_bytes=self.host.nbytes, tier_host_entries=len(self.host.entries))
        if self.disk is not None:
            files = self.disk.files()
            out.update(tier_disk_bytes=sum(f[3] for f in files), tier_disk_entries=len(files),
                       tier_disk_write_errors=self.disk.write_errors, tier_disk_removed_bad=self.disk.removed_bad)
        return out


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
