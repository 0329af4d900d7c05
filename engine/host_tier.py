"""The lower tiers' common parts, and the host-memory tier (engine.tiered_cache says how the
tiers work together).

An entry is one usable prefix: the KV of every block of its hash chain and, for a model with
recurrent layers, the checkpoint that makes it usable (every state tensor's row after its last
token). Each tier evicts by the pool's rule (engine.prefix_cache): recency plus the compute a
hit saves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.prefix_cache import CHECKPOINT_COMPUTE_WEIGHT


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


def unfit_tensors(tensors: dict[str, torch.Tensor], num_blocks: int, shapes: dict[str, tuple]) -> str | None:
    """Why an entry's `tensors` (of a chain of `num_blocks` blocks) are not rows of a cache whose
    rows are `shapes` (name -> (one row's shape, dtype)); None where they are."""
    if set(tensors) != set(shapes):
        return f"tensors {sorted(tensors)} are not the cache's {sorted(shapes)}"
    for name, tensor in tensors.items():
        shape, dtype = shapes[name]
        want = (num_blocks, *shape) if name.startswith("kv:") else tuple(shape)
        if tuple(tensor.shape) != want or tensor.dtype != dtype:
            return f"{name} is {tuple(tensor.shape)} {tensor.dtype}, not {want} {dtype}"
    return None


def least_useful(candidates: list[tuple[object, float, int]]) -> object:
    """Of (item, last used, tokens), the one the pool's rule evicts first."""
    oldest, newest = min(c[1] for c in candidates), max(c[1] for c in candidates)
    shortest, longest = min(c[2] for c in candidates), max(c[2] for c in candidates)

    def utility(candidate) -> float:
        recency = (candidate[1] - oldest) / max(1e-9, newest - oldest)
        saved = (candidate[2] - shortest) / max(1, longest - shortest)
        return recency + CHECKPOINT_COMPUTE_WEIGHT * saved

    return min(candidates, key=utility)[0]


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
