"""Tensor-parallel building blocks: row-parallel linears, reductions, a vocab-parallel
embedding, a gated RMS norm whose groups may span ranks, in-place slicing helpers, and the
plan protocol each layer kind implements in its own module.

Column-parallel linears need no module of their own: a linear keeps the rows (output features)
of its shard, in place (`keep_rows`), and its forward is unchanged.

A kind shards itself: a mixer's `tp_plan(group)`, an FFN's `tp_partial_plan(group)` (its output
then this rank's partial sum, all-reduced once around the whole FFN by Reduced) and a layer's
`tp_layer_plan(group, memo)` validate first and return an `apply()` that mutates, or None where
the module is not of the kind they know (a subclass that changed its forward in ways its base's
sharding would get silently wrong). engine.tp.shard validates a whole model before it applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.tp.group import TPGroup

Apply = Callable[[], None]


def check_linear(linear, what: str, row_sliceable: bool = False) -> None:
    """A plain nn.Linear, a linear that shards itself (`tp_keep_rows` and `tp_columns`: an FP8
    linear, engine.models.fp8_linear), or, where only its rows are kept, one that says its
    forward is F.linear times per-row work (`tp_row_sliceable`, Falcon-H1's ScaledLinear)."""
    if type(linear) is nn.Linear or shards_itself(linear) \
            or (row_sliceable and getattr(type(linear), "tp_row_sliceable", False)):
        return
    allowed = "nn.Linear or a row-sliceable linear" if row_sliceable else "nn.Linear"
    raise ValueError(f"tensor parallelism: {what} is a {type(linear).__name__}, not {allowed}")


def shards_itself(linear) -> bool:
    return hasattr(type(linear), "tp_keep_rows") and hasattr(type(linear), "tp_columns")


def span(bounds) -> list[int]:
    return list(range(*bounds))


def all_of(applies: list[Apply]) -> Apply:
    def apply():
        for a in applies:
            a()
    return apply


def partial_ffn_plan(ffn: nn.Module, group: TPGroup) -> Apply:
    """Make an FFN return this rank's partial sum (the caller all-reduces it once)."""
    plan = getattr(ffn, "tp_partial_plan", None)
    apply = plan(group) if plan is not None else None
    if apply is None:
        raise ValueError(f"tensor parallelism: FFN kind {type(ffn).__name__} is not supported at TP size {group.size}")
    return apply


def reduced_ffn_plan(owner: nn.Module, name: str, group: TPGroup) -> Apply:
    """Shard owner.<name> (an FFN) into partial sums and wrap it in one all-reduce."""
    inner = partial_ffn_plan(getattr(owner, name), group)

    def apply():
        inner()
        setattr(owner, name, Reduced(getattr(owner, name), group))
    return apply


def index(positions, device) -> torch.Tensor:
    return torch.as_tensor(list(positions), dtype=torch.long, device=device)


def take(t: torch.Tensor, dim: int, positions) -> nn.Parameter:
    """A new parameter holding `t`'s entries at `positions` along `dim` (a copy: the un-sharded
    tensor can be freed)."""
    return nn.Parameter(t.detach().index_select(dim, index(positions, t.device)).clone(),
                        requires_grad=False)


def set_param(module: nn.Module, name: str, t: torch.Tensor, dim: int, positions) -> None:
    """module.<name> = t's entries at `positions` along `dim`; a weight that shards itself
    (stacked FP8 experts, with their scales) takes them itself."""
    setattr(module, name, t.tp_take(dim, positions) if hasattr(t, "tp_take") else take(t, dim, positions))


def keep_rows(linear: nn.Linear, rows) -> None:
    """Column parallelism in place: keep output features `rows` of a linear (and its bias). The
    caller has checked the linear's forward is F.linear plus per-row work (check_linear)."""
    rows = list(rows)
    if shards_itself(linear):
        linear.tp_keep_rows(rows)
        return
    with torch.no_grad():
        set_param(linear, "weight", linear.weight, 0, rows)
        if linear.bias is not None:
            set_param(linear, "bias", linear.bias, 0, rows)
    linear.out_features = len(rows)


class RowParallelLinear(nn.Module):
    """y = x_shard @ W[:, cols]^T, the rank's partial sum of the un-sharded linear, with the bias
    added by rank 0 only (so the sum over ranks adds it once). reduce=True: all-reduced here;
    False: the caller reduces (several partial sums added first, then one all-reduce)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup, reduce: bool):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None and group.rank == 0 else None
        self.group, self.reduce = group, reduce
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def of(cls, linear: nn.Module, cols, group: TPGroup, reduce: bool, what: str) -> nn.Module:
        """Row parallelism for `linear` (a linear that shards itself returns its own kind)."""
        if shards_itself(linear):
            part = linear.tp_columns(list(cols), keep_bias=group.rank == 0)
            return Reduced(part, group) if reduce else part
        if type(linear) is not nn.Linear:  # a subclass may do more than F.linear: refuse
            raise ValueError(f"tensor parallelism: {what} is a {type(linear).__name__}, not an nn.Linear")
        with torch.no_grad():
            weight = take(linear.weight, 1, cols).data
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, bias, group, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.group.all_reduce(y) if self.reduce else y


class Reduced(nn.Module):
    """Wraps a module whose output is this rank's partial sum: all-reduces it."""

    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


def vocab_shard(full: torch.Tensor, group: TPGroup) -> tuple[nn.Parameter, int, int]:
    """This rank's rows [start, stop) of a [vocab, hidden] table, zero-padded to
    ceil(vocab / size) rows: every rank the same shape, so logits all-gather in equal parts."""
    vocab = full.shape[0]
    rows = -(-vocab // group.size)
    start = min(vocab, group.rank * rows)
    stop = min(vocab, start + rows)
    shard = full.detach().new_zeros(rows, full.shape[1])
    shard[: stop - start] = full.detach()[start:stop]
    return nn.Parameter(shard, requires_grad=False), start, stop


class VocabParallelEmbedding(nn.Module):
    """The rank's vocab rows (`vocab_shard`); tokens outside them look up zeros, and the
    all-reduce adds the one rank's row that holds each token."""

    def __init__(self, full: torch.Tensor, group: TPGroup):
        super().__init__()
        self.weight, self.start, self.stop = vocab_shard(full, group)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        h = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(h)


class ShardedGatedRMSNorm(nn.Module):
    """GatedRMSNorm over channels [c0, c1) of a norm whose groups of `group_size` channels may
    span ranks: each rank sums its channels' squares per (global) group, the sums are
    all-reduced, and each channel is normalised by its group's mean square."""

    def __init__(self, norm: nn.Module, channels: tuple[int, int], group: TPGroup):
        super().__init__()
        c0, c1 = channels
        self.weight = take(norm.weight, 0, range(c0, c1))
        self.group_size, self.eps, self.norm_before_gate = norm.group_size, norm.eps, norm.norm_before_gate
        self.num_groups = norm.weight.shape[0] // norm.group_size
        self.register_buffer("group_of", torch.arange(c0, c1, device=norm.weight.device) // norm.group_size,
                             persistent=False)
        self.group = group

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, shape = y.dtype, y.shape
        y = y.float().reshape(-1, shape[-1])
        if not self.norm_before_gate:
            y = y * F.silu(z.float().reshape(-1, shape[-1]))
        y = self.weight * self._group_rms(y).to(dtype).reshape(shape)
        if self.norm_before_gate:
            y = y * F.silu(z.to(y.dtype))
        return y

    def normalise_gated(self, gated: torch.Tensor) -> torch.Tensor:
        """The norm alone, for a float32 y * silu(z) computed elsewhere (norm_before_gate=False)."""
        return self.weight * self._group_rms(gated.reshape(-1, gated.shape[-1])).reshape(gated.shape)

    def _group_rms(self, y: torch.Tensor) -> torch.Tensor:
        """y [rows, my channels] float32, each channel over its (global) group's mean square."""
        sums = y.new_zeros(y.shape[0], self.num_groups).index_add_(1, self.group_of, y.pow(2))
        sums = self.group.all_reduce(sums)
        return y * torch.rsqrt(sums / self.group_size + self.eps).index_select(1, self.group_of)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over channels [c0, c1) of a norm over all `full` channels, which ranks split: each
    rank sums its channels' squares, the sums are all-reduced, and every channel is normalised by
    the mean square of all of them (OLMo's query and key norms over all heads)."""

    def __init__(self, norm: nn.Module, channels: tuple[int, int], group: TPGroup):
        super().__init__()
        c0, c1 = channels
        self.weight = take(norm.weight, 0, range(c0, c1))
        self.eps, self.full, self.group = norm.eps, norm.weight.shape[0], group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        sums = self.group.all_reduce(y.pow(2).sum(-1, keepdim=True))
        return self.weight * (y * torch.rsqrt(sums / self.full + self.eps)).to(dtype)

