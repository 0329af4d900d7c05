"""The lower tiers' common parts, and the host-memory tier (engine.tiered_cache says how the
tiers work together).

An entry is one usable prefix: the KV of every block of its hash chain and, for a model with
recurrent layers, the checkpoint that makes it usable (every state tensor's row after its last
token). Each tier evicts by the pool's rule (engine.prefix_cache): recency plus the compute a
hit saves.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.host_arena import ALIGNMENT, HostArena, Specs, footprint, specs_of
from engine.prefix_cache import CHECKPOINT_COMPUTE_WEIGHT

# The unit a transport moves host-tier bytes in (engine.prefix_exchange): large enough that an
# entry is few rows, small enough that rounding an entry up to whole rows wastes little.
ROW_BYTES = 1 << 16


def rows_of(nbytes: int) -> int:
    return -(-nbytes // ROW_BYTES)


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
    tensors: dict[str, torch.Tensor]  # "kv:<name>": [blocks, ...]; "state:<name>": one row (host memory)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def entry_specs(shapes: dict[str, tuple], num_blocks: int, with_state: bool = True) -> Specs:
    """The tensors of an entry of `num_blocks` blocks in a cache whose rows are `shapes` (name ->
    (one row's shape, dtype)): every block tensor's rows, and (`with_state`) every state row."""
    return {name: ((num_blocks, *shape) if name.startswith("kv:") else tuple(shape), dtype)
            for name, (shape, dtype) in shapes.items() if with_state or name.startswith("kv:")}


def unfit_tensors(tensors: dict[str, torch.Tensor], num_blocks: int, shapes: dict[str, tuple]) -> str | None:
    """Why an entry's `tensors` (of a chain of `num_blocks` blocks) are not rows of a cache whose
    rows are `shapes`; None where they are."""
    return unfit_specs(specs_of(tensors), num_blocks, shapes)


def unfit_specs(specs: Specs, num_blocks: int, shapes: dict[str, tuple]) -> str | None:
    """unfit_tensors for tensors shaped `specs`: an entry of every block tensor and every state
    row, or of the block tensors alone (no checkpoint)."""
    want = entry_specs(shapes, num_blocks)
    if set(specs) not in (set(want), {name for name in want if name.startswith("kv:")}):
        return f"tensors {sorted(specs)} are not the cache's {sorted(shapes)}"
    for name, (shape, dtype) in specs.items():
        if tuple(shape) != want[name][0] or dtype != want[name][1]:
            return f"{name} is {tuple(shape)} {dtype}, not {want[name][0]} {want[name][1]}"
    return None


def least_useful_first(candidates: list[tuple[object, float, int]]) -> Iterator[object]:
    """Of (item, last used, tokens), the items in the order the pool's rule evicts them, both
    terms scaled over these candidates once: a heap, so taking the first k costs O(n + k log n)."""
    oldest, newest = min(c[1] for c in candidates), max(c[1] for c in candidates)
    shortest, longest = min(c[2] for c in candidates), max(c[2] for c in candidates)

    def utility(candidate) -> float:
        recency = (candidate[1] - oldest) / max(1e-9, newest - oldest)
        saved = (candidate[2] - shortest) / max(1, longest - shortest)
        return recency + CHECKPOINT_COMPUTE_WEIGHT * saved

    ranked = [(utility(c), i, c[0]) for i, c in enumerate(candidates)]
    heapq.heapify(ranked)
    while ranked:
        yield heapq.heappop(ranked)[2]


class HostTier:
    """Entries in host memory, in an arena of the tier's budget (engine.host_arena), page-locked
    when the cache is on a GPU. Copies between the arena and a GPU are queued on the engine's
    stream: the stream keeps them in order among themselves and with the steps, and `wait()`
    holds any host-side access to the arena until they are done."""

    def __init__(self, budget: int, device: torch.device | str = "cpu", below: bool = False):
        self.budget = budget
        self.on_gpu = torch.device(device).type == "cuda"
        self.arena = HostArena(budget, pin=self.on_gpu)
        self.below = below  # a tier below takes what this one pushes out
        self.entries: dict[bytes, Entry] = {}  # by the chain's last key; tensors are views of the arena
        self._ranges: dict[bytes, tuple[int, int]] = {}  # by key: (offset, bytes) in the arena
        self.events = None  # engine.cache_events.CacheEvents
        self._copies = None  # a CUDA event after the last queued copy to or from the arena
        self._loading: set[bytes] = set()  # keys of entries being loaded into the pool: not evicted

    @property
    def nbytes(self) -> int:
        """Arena bytes the entries hold."""
        return self.budget - self.arena.free_bytes

    @contextlib.contextmanager
    def loading(self, key: bytes):
        """While the entry for `key` is copied into the pool: a spill the load causes (the pool
        evicting for its blocks or checkpoint row) must not push it out and reuse its range."""
        self._loading.add(key)
        try:
            yield
        finally:
            self._loading.discard(key)

    def put(self, entry: Entry) -> list[Entry]:
        """Keep a copy of `entry` (its tensors in host memory); what no longer fits, least
        useful first, `entry` itself among the candidates, to go down a tier (owning its
        tensors; only where a tier is below, and `entry` itself always)."""
        views, out = self.reserve(entry.keys, entry.end, specs_of(entry.tensors), entry.last_used)
        if views is None:
            return [*out, entry]
        self.wait()
        for name, view in views.items():
            view.copy_(entry.tensors[name])
        return out

    def reserve(self, keys: list[bytes], end: int, specs: Specs, last_used: float) -> tuple[dict | None, list[Entry]]:
        """Room for an entry of tensors shaped `specs`, held from now on: (its tensors, as
        views of the arena the caller fills before anything reads them; what went down to make
        room). (None, what went down) where the new entry itself is the least useful, or larger
        than the tier: it goes down as it is."""
        size = footprint(specs)
        offset, out = self._allocate(size, ALIGNMENT, Entry(keys, end, {}, last_used))
        if offset is None:
            return None, out
        return self.adopt(keys, end, specs, offset, size, last_used), out

    def reserve_rows(self, nbytes: int) -> tuple[int | None, list[Entry]]:
        """Whole ROW_BYTES rows of the arena for `nbytes`, held until `release_rows` or `adopt`
        (what a prefix fetched from another worker lands in, or an entry staged for one: the
        rows a transport moves, engine.prefix_exchange): (their offset, what went down to make
        room); None where the tier holds no such run even empty."""
        return self._allocate(rows_of(nbytes) * ROW_BYTES, ROW_BYTES, None)

    def release_rows(self, offset: int, nbytes: int) -> None:
        self.arena.release(offset, rows_of(nbytes) * ROW_BYTES)

    def adopt(self, keys: list[bytes], end: int, specs: Specs, offset: int, size: int | None = None,
              last_used: float | None = None) -> dict[str, torch.Tensor]:
        """Hold the entry whose tensors, shaped `specs`, are packed in the arena from `offset`
        (`size` bytes taken there: a `reserve_rows` range, or reserve's); its tensors."""
        views = self.arena.views(offset, specs)
        key = keys[-1]
        self.entries[key] = Entry(list(keys), end, views, time.monotonic() if last_used is None else last_used)
        self._ranges[key] = offset, rows_of(footprint(specs)) * ROW_BYTES if size is None else size
        if self.events is not None:
            self.events.stored("host", key, end)
        return views

    def rows(self) -> torch.Tensor:
        """The arena as [rows, 1, ROW_BYTES] bytes: what a transport's cache is made of."""
        count = self.budget // ROW_BYTES
        return self.arena.buffer[: count * ROW_BYTES].view(count, 1, ROW_BYTES)

    def _allocate(self, size: int, align: int, incoming: Entry | None) -> tuple[int | None, list[Entry]]:
        """An offset for `size` bytes, evicting the least useful entries until a run holds them
        (`incoming`, where given, among the candidates: None once it is the least useful)."""
        if size > self.budget:
            return None, []
        out, victims = [], None
        while (offset := self.arena.allocate(size, align)) is None:  # no run long enough: evict until one is
            if victims is None:
                held = [e for key, e in self.entries.items() if key not in self._loading]
                candidates = [(e, e.last_used, e.end) for e in held + [incoming] if e is not None]
                victims = least_useful_first(candidates) if candidates else iter(())
            victim = next(victims, None)
            if victim is None or victim is incoming:
                return None, out
            pushed = self._push_out(victim.keys[-1])
            if pushed is not None:
                out.append(pushed)
        return offset, out

    def take(self, key: bytes) -> Entry | None:
        """Drop the entry for `key`: its arena range is free for the next put, so the entry
        returned must not be read after that (use `copy` to keep it)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.arena.release(*self._ranges.pop(key))
            if self.events is not None:
                self.events.dropped("host", key, entry.end)
        return entry

    def copy(self, entry: Entry) -> Entry:
        """A held entry with tensors of its own, for readers outside the engine's stream."""
        self.wait()
        return Entry(list(entry.keys), entry.end, {n: t.clone() for n, t in entry.tensors.items()}, entry.last_used)

    def fence(self) -> None:
        """Mark the copies to or from the arena queued so far (on a GPU; nothing on the CPU)."""
        if self.on_gpu:
            self._copies = torch.cuda.Event()
            self._copies.record()

    def wait(self) -> None:
        """Until the marked copies are done (before the host reads or writes the arena)."""
        if self._copies is not None:
            self._copies.synchronize()
            self._copies = None

    def _push_out(self, key: bytes) -> Entry | None:
        entry = self.entries[key]
        kept = self.copy(entry) if self.below else None
        self.take(key)
        return kept
