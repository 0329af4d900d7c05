"""Which heads and channels each tensor-parallel rank owns. No torch.

The same functions size the sharded modules (engine.tp.shard) and describe the sharded caches,
so what a layer computes on rank r and what the map says rank r holds cannot drift apart.

Rules (Megatron-style; `size` ranks):
- attention: query heads split evenly; KV heads split evenly when num_kv_heads >= size, else
  each is kept whole by size // num_kv_heads consecutive ranks (rank r keeps KV head
  r * num_kv_heads // size, the one its query heads read in the un-sharded model).
- Mamba (v1): d_inner channels split evenly.
- Mamba2: heads split evenly; the B/C groups split evenly when n_groups % size == 0, else each
  rank keeps the one group its heads read (n_groups = 1: all of B and C, on every rank). Conv
  channels are then [its x channels, its B group(s), its C group(s)]: not one contiguous slice.
- Gated DeltaNet: value heads split evenly; key heads as KV heads above; conv channels are
  [its q heads, its k heads, its v heads].
- short conv (LFM2): hidden channels split evenly.
- an MTP head's hidden row (engine.mtp): whole on every rank (its layer's KV as attention).
Anything else, or sizes that do not divide, raises ValueError naming the problem.

A cache layer's shard map (`layer_shards`) is derived from its un-sharded LayerCacheSpec alone,
so the two sides of a hand-off between different TP sizes can both compute it. Every state
tensor (per sequence) and the KV rows (per token: [kv_heads, head_dim]) are split along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass

Span = tuple[int, int]  # [start, stop) in un-sharded indices


def even_split(n: int, size: int, rank: int, what: str) -> Span:
    if n % size:
        raise ValueError(f"tensor parallel size {size}: {what} ({n}) is not divisible by {size}")
    k = n // size
    return (rank * k, (rank + 1) * k)


def spread(n: int, size: int, rank: int, what: str) -> tuple[Span, bool]:
    """(span, replicated): split evenly when n % size == 0, else, when size % n == 0, one whole
    item per rank, item r * n // size (so each item is kept by size // n consecutive ranks)."""
    if n % size == 0:
        return even_split(n, size, rank, what), False
    if size % n == 0:
        item = rank * n // size
        return (item, item + 1), True
    raise ValueError(f"tensor parallel size {size}: {what} ({n}) neither divide evenly over the "
                     f"ranks nor divide the TP size (replicated)")


def scaled(span: Span, unit: int, offset: int = 0) -> Span:
    """Item span -> the span of their `unit` channels each, shifted by `offset`."""
    return (offset + span[0] * unit, offset + span[1] * unit)


def expand(spans) -> list[int]:
    return [i for a, b in spans for i in range(a, b)]


# ----------------------------------------------------------------------------- per layer kind

@dataclass(frozen=True)
class AttentionLayout:
    q_heads: Span
    kv_heads: Span
    kv_replicated: bool


def attention_layout(num_heads: int, num_kv_heads: int, size: int, rank: int) -> AttentionLayout:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"attention heads ({num_heads}) are not a multiple of KV heads ({num_kv_heads})")
    q = even_split(num_heads, size, rank, "attention heads")
    kv, replicated = spread(num_kv_heads, size, rank, "KV heads")
    return AttentionLayout(q, kv, replicated)


@dataclass(frozen=True)
class Mamba2Layout:
    heads: Span
    groups: Span
    groups_replicated: bool
    conv: tuple[Span, Span, Span]  # x, B, C channels in un-sharded conv coordinates


def mamba2_layout(num_heads: int, head_dim: int, n_groups: int, d_state: int,
                  size: int, rank: int) -> Mamba2Layout:
    if n_groups <= 0 or num_heads % n_groups:
        raise ValueError(f"Mamba2 heads ({num_heads}) are not a multiple of n_groups ({n_groups})")
    heads = even_split(num_heads, size, rank, "Mamba2 heads")
    groups, replicated = spread(n_groups, size, rank, "Mamba2 n_groups")
    d_ssm, group_width = num_heads * head_dim, n_groups * d_state
    conv = (scaled(heads, head_dim), scaled(groups, d_state, d_ssm),
            scaled(groups, d_state, d_ssm + group_width))
    return Mamba2Layout(heads, groups, replicated, conv)


@dataclass(frozen=True)
class DeltaNetLayout:
    k_heads: Span
    v_heads: Span
    k_replicated: bool
    conv: tuple[Span, Span, Span]  # q, k, v channels in un-sharded conv coordinates


def deltanet_layout(num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                    size: int, rank: int) -> DeltaNetLayout:
    if num_k_heads <= 0 or num_v_heads % num_k_heads:
        raise ValueError(f"Gated DeltaNet value heads ({num_v_heads}) are not a multiple of key "
                         f"heads ({num_k_heads})")
    v = even_split(num_v_heads, size, rank, "Gated DeltaNet value heads")
    k, replicated = spread(num_k_heads, size, rank, "Gated DeltaNet key heads")
    key_dim = num_k_heads * k_head_dim
    conv = (scaled(k, k_head_dim), scaled(k, k_head_dim, key_dim), scaled(v, v_head_dim, 2 * key_dim))
    return DeltaNetLayout(k, v, replicated, conv)


# ----------------------------------------------------------------------------- cache shard map

@dataclass(frozen=True)
class TensorShard:
    """One rank's part of one cache tensor: along dim 0 of the per-sequence state tensor (or of
    the per-token [kv_heads, head_dim] K and V rows, name "kv"), the un-sharded indices `spans`
    in local order; the other dims whole. `replicated`: some of them other ranks hold too."""

    name: str
    full_shape: tuple[int, ...]
    spans: tuple[Span, ...]
    replicated: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(b - a for a, b in self.spans), *self.full_shape[1:])

    def indices(self) -> list[int]:
        return expand(self.spans)


@dataclass(frozen=True)
class LayerShard:
    kv: TensorShard | None
    state: tuple[TensorShard, ...]  # in the order the layer declares its state tensors


def _state_shards(layer, size: int, rank: int) -> tuple[TensorShard, ...]:
    shapes = {t.name: tuple(t.shape) for t in layer.state}
    kind = layer.state_kind
    if kind == "mamba" and set(shapes) == {"conv", "ssm"}:
        span = even_split(shapes["ssm"][0], size, rank, "Mamba d_inner channels")
        spans = {"conv": ((span,), False), "ssm": ((span,), False)}
    elif kind == "mamba2" and set(shapes) == {"conv", "ssm"}:
        heads, head_dim, d_state = shapes["ssm"]
        groups, rest = divmod(shapes["conv"][0] - heads * head_dim, 2 * d_state)
        if rest or groups <= 0:
            raise ValueError(f"layer {layer.kind!r}: Mamba2 conv width {shapes['conv'][0]} does not fit "
                             f"{heads} heads of {head_dim} plus B/C groups of {d_state}")
        lay = mamba2_layout(heads, head_dim, groups, d_state, size, rank)
        spans = {"conv": (lay.conv, lay.groups_replicated), "ssm": ((lay.heads,), False)}
    elif kind == "gated_deltanet" and set(shapes) == {"conv", "recurrent"}:
        v_heads, k_dim, v_dim = shapes["recurrent"]
        k_heads, rest = divmod(shapes["conv"][0] - v_heads * v_dim, 2 * k_dim)
        if rest or k_heads <= 0:
            raise ValueError(f"layer {layer.kind!r}: Gated DeltaNet conv width {shapes['conv'][0]} does "
                             f"not fit {v_heads} value heads of {v_dim} plus q/k heads of {k_dim}")
        lay = deltanet_layout(k_heads, v_heads, k_dim, v_dim, size, rank)
        spans = {"conv": (lay.conv, lay.k_replicated), "recurrent": ((lay.v_heads,), False)}
    elif kind == "short_conv" and set(shapes) == {"conv"}:
        spans = {"conv": ((even_split(shapes["conv"][0], size, rank, "short conv channels"),), False)}
    elif kind == "mtp_hidden" and set(shapes) == {"hidden"}:  # an MTP head's g: whole on every rank
        spans = {"hidden": (((0, shapes["hidden"][0]),), size > 1)}
    else:
        raise ValueError(f"tensor parallelism: layer kind {layer.kind!r} with state kind {kind!r} "
                         f"({', '.join(shapes)}) is not supported at TP size {size}")
    return tuple(TensorShard(name, shapes[name], *spans[name]) for name in shapes)


def layer_shards(layer, size: int) -> list[LayerShard]:
    """Per rank, what of an un-sharded layer cache (engine.models.hybrid.LayerCacheSpec) it owns."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be positive, got {size}")
    out = []
    for rank in range(size):
        kv = None
        if layer.kv is not None:
            span, replicated = spread(layer.kv.num_kv_heads, size, rank, f"layer {layer.kind!r} KV heads")
            kv = TensorShard("kv", (layer.kv.num_kv_heads, layer.kv.head_dim), (span,), replicated)
        out.append(LayerShard(kv, _state_shards(layer, size, rank) if layer.state else ()))
    return out


def model_shards(spec, size: int) -> list[list[LayerShard]]:
    """[rank][layer] shard map of an un-sharded engine.models.hybrid.ModelSpec."""
    per_layer = [layer_shards(layer, size) for layer in spec.layers]
    return [[shards[rank] for shards in per_layer] for rank in range(size)]


# ----------------------------------------------------------------------------- hand-off routes

@dataclass(frozen=True)
class Piece:
    """Copy `length` rows along dim 0 from the source rank's local index `src_start` to the
    destination's local index `dst_start`."""

    src_rank: int
    src_start: int
    dst_start: int
    length: int


def routes(sources: list[TensorShard], dest: TensorShard, prefer: int = 0) -> list[Piece]:
    """Where each of `dest`'s indices lies among the source ranks' shards of the same tensor (at
    another TP size). An index several sources hold comes from the first of them, counting from
    rank `prefer`. Pieces in destination order; ValueError if the sources miss an index."""
    if any(s.full_shape != dest.full_shape for s in sources):
        raise ValueError(f"{dest.name}: source and destination shard different tensors")
    order = [(prefer + i) % len(sources) for i in range(len(sources))]
    pieces: list[Piece] = []
    dst_offset = 0
    for a, b in dest.spans:
        todo = [(a, b)]
        for rank in order:
            src_offset, left = 0, []
            for c, d in sources[rank].spans:
                left = []
                for x, y in todo:
                    s, e = max(x, c), min(y, d)
                    if s >= e:
                        left.append((x, y))
                        continue
                    pieces.append(Piece(rank, src_offset + s - c, dst_offset + s - a, e - s))
                    left += [r for r in ((x, s), (e, y)) if r[0] < r[1]]
                todo = left
                src_offset += d - c
            if not todo:
                break
        if todo:
            raise ValueError(f"{dest.name}: indices {todo} are held by no source rank")
        dst_offset += b - a
    return sorted(pieces, key=lambda p: p.dst_start)


def layer_routes(layer, src_size: int, dst_size: int, dst_rank: int) -> dict[str, list[Piece]]:
    """For destination rank `dst_rank` of a layer sharded `dst_size` ways, the pieces of each of
    its cache tensors ("kv" and the state tensor names) held by a `src_size`-way sharding."""
    src, dst = layer_shards(layer, src_size), layer_shards(layer, dst_size)[dst_rank]
    out = {}
    if dst.kv is not None:
        out["kv"] = routes([s.kv for s in src], dst.kv, prefer=dst_rank)
    for i, tensor in enumerate(dst.state):
        out[tensor.name] = routes([s.state[i] for s in src], tensor, prefer=dst_rank)
    return out
