"""What the cache stores narrower than the layers compute: recurrent state at half width
(engine.state_format, `mamba_state_dtype`) and KV blocks in FP8 (engine.kv_format,
`kv_cache_dtype`).

CacheFormat turns a model's spec into the cache's (the formats are in the spec, so the cache's
tensors, its byte counts, the hand-off's layout and a tier's fingerprint all follow from it).
NarrowCache is what a cache with such layers hands the model (LayerCaches.narrow): the working
caches a narrow layer runs on, loaded before and stored after it (HybridLM.run_layer), one part
per kind of format.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.kv_format import KV_DTYPES, NarrowKV, narrow_kv_spec
from engine.models import LayerCaches, ModelSpec
from engine.models.batch import ForwardBatch
from engine.state_format import STATE_DTYPES, NarrowState, narrow_state_spec


@dataclass(frozen=True)
class CacheFormat:
    state_dtype: str = "float32"  # a STATE_DTYPES name
    kv_dtype: str = "auto"  # a KV_DTYPES key
    kv_scales: dict = field(default_factory=dict)  # {layer: {"k": scale, "v": scale}}: engine.kv_format

    def __post_init__(self):
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_state_dtype: {self.state_dtype!r} not in {list(STATE_DTYPES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_dtype!r} not in {list(KV_DTYPES)}")

    def for_rank(self, full_spec: ModelSpec, size: int, rank: int) -> CacheFormat:
        """This format as tensor-parallel rank `rank` of `size` stores its shard of a model whose
        un-sharded spec is `full_spec`: a scale per KV head becomes those of the heads the rank
        keeps (engine.tp.plan); per-tensor scales stay."""
        if size == 1 or not any(isinstance(s, tuple) for pair in self.kv_scales.values() for s in pair.values()):
            return self
        from engine.tp.plan import model_shards

        shards = model_shards(full_spec, size)[rank]
        return replace(self, kv_scales={
            layer: {name: tuple(s[i] for i in shards[layer].kv.indices()) if isinstance(s, tuple) else s
                    for name, s in pair.items()}
            for layer, pair in self.kv_scales.items()})

    def apply(self, spec: ModelSpec) -> ModelSpec:
        return narrow_kv_spec(narrow_state_spec(spec, self.state_dtype), self.kv_dtype, self.kv_scales)


def narrow_kv_layers(spec: ModelSpec) -> list[int]:
    return [i for i in spec.attention_layers if spec.layers[i].kv.stored_dtype is not None]


def kv_working_bytes_per_block(spec: ModelSpec, dtype: torch.dtype, block_size: int) -> int:
    """The working rows NarrowKV keeps per block, in the compute dtype: per row shape, as many
    as the layer holding the most tensors of that shape."""
    counts: dict[tuple, int] = {}
    for i in narrow_kv_layers(spec):
        kv = spec.layers[i].kv
        shape = (kv.num_kv_heads, kv.head_dim)
        counts[shape] = max(counts.get(shape, 0), len(kv.names))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(n * block_size * heads * dim * itemsize for (heads, dim), n in counts.items())


class NarrowCache:
    """The working caches of the layers whose storage is narrow, and the load / store around
    each one's forward."""

    def __init__(self, pool: LayerCaches, parts: list):
        kv, state = list(pool.kv), list(pool.state)
        for part in parts:
            part.place(kv, state)
        self.working = LayerCaches(kv, state)
        self._parts = {i: [p for p in parts if p.holds(i)] for i in range(len(kv))}
        self.state = next((p for p in parts if isinstance(p, NarrowState)), None)
        self.kv = next((p for p in parts if isinstance(p, NarrowKV)), None)
        # What a layer is handed: the working caches, with its own entries set per step by `load`
        # (its working rows, or its pools where it reads them in place).
        self.handed = LayerCaches(list(kv), list(state))

    @classmethod
    def of(cls, pool: LayerCaches, spec: ModelSpec, num_block_rows: int, num_slot_rows: int,
           dtype: torch.dtype) -> NarrowCache | None:
        parts = []
        state_layers = [i for i, layer in enumerate(spec.layers) if any(t.stored_dtype for t in layer.state)]
        if state_layers:
            parts.append(NarrowState(pool, state_layers, num_slot_rows))
        kv_layers = narrow_kv_layers(spec)
        if kv_layers:
            parts.append(NarrowKV(pool, spec, kv_layers, num_block_rows, dtype))
        return cls(pool, parts) if parts else None

    def holds(self, layer: int) -> bool:
        return bool(self._parts.get(layer))

    def load(self, layer: int, batch: ForwardBatch, readers: frozenset[str] = frozenset()) -> LayerCaches:
        """The caches to run `layer` on this step, each part's rows loaded: its working rows, or,
        for the kinds its modules can be handed in place (`readers`, HybridLM.in_place_readers:
        "kv", "state"), what that part hands on this step (its pool where the step allows)."""
        for part in self._parts[layer]:
            handed = part.load(layer, batch, part.reads_kind in readers)
            (self.handed.kv if part is self.kv else self.handed.state)[layer] = handed
        return self.handed

    def store(self, layer: int, batch: ForwardBatch, readers: frozenset[str] = frozenset()) -> None:
        for part in self._parts[layer]:
            part.store(layer, batch, part.reads_kind in readers)

    def fill_plan(self, entry, layer: int) -> bool:
        """Whether `layer` can join a one-call decode plan (engine.decode_stack), its entry told
        what to load and store: narrow state can (cpu_state.cpp), FP8 KV cannot (its layer takes
        the layer path)."""
        if any(not isinstance(part, NarrowState) for part in self._parts[layer]):
            return False
        self.state.fill_plan(entry, layer)
        return True
