"""Moving rows (blocks or slots) between cache tensors and packed buffers.

Every tensor is handled as a [rows, row_bytes] byte matrix, so one code path serves all
dtypes (bfloat16 included). On CPU a request's rows of one tensor move in one pass of a
compiled loop with the GIL released (kvtransfer/row_kernel.py; numpy's row gather/scatter
without numba), one memcpy when both sides are packed, or one libc memmove per run of
consecutive ids (over GATHER_SCATTER_MAX_BYTES per tensor); torch's index_select/index_copy_
on bfloat16 ran at a third of numpy's speed. On CUDA it is one index_select + index_copy_
pair per tensor on the current stream.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.layout import BLOCK, SLOT, CacheLayout, TensorSpec

try:
    from kvtransfer.row_kernel import copy_row_ids
except ImportError:  # numba is optional: numpy's copies below
    copy_row_ids = None

_ALIGN = 64
_memmove_releasing_gil = ctypes.memmove
# The same libc memmove called with the GIL held. A thread that releases the GIL for a copy
# of a few microseconds may wait a whole switch interval to get it back from a busy engine
# thread; a long copy is worth releasing it for.
_memmove_holding_gil = ctypes.PyDLL(None).memmove
_memmove_holding_gil.argtypes, _memmove_holding_gil.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_void_p
RELEASE_GIL_FROM_BYTES = 4 << 20
GATHER_SCATTER_MAX_BYTES = 8 << 20  # per tensor; above, the two copies of a gather/scatter cost more than the calls


@dataclass(frozen=True)
class PackedEntry:
    spec: TensorSpec
    offset: int  # byte offset inside the packed hand-off buffer
    rows: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.spec.row_bytes


@dataclass(frozen=True)
class Segment:
    """One wire message: the rows of one layer (pipelined) or of all layers."""

    layers: tuple[int, ...]
    offset: int
    nbytes: int
    entries: tuple[PackedEntry, ...]


@dataclass(frozen=True)
class PackPlan:
    segments: tuple[Segment, ...]
    total_bytes: int


def plan_packing(layout: CacheLayout, num_blocks: int, pipelined: bool, with_slots: bool = True) -> PackPlan:
    """Where each tensor's rows of one part of a request sit in the packed buffer (num_blocks
    block rows each; the slot rows only with_slots, as the final part has them); identical on
    both sides."""
    groups = [[layer] for layer in layout.layers] if pipelined else [layout.layers]
    segments, offset = [], 0
    for layers in groups:
        start, entries = offset, []
        for layer in layers:
            for spec in layout.specs_of_layer(layer):
                if spec.role != BLOCK and not with_slots:
                    continue
                entry = PackedEntry(spec, offset, num_blocks if spec.role == BLOCK else 1)
                entries.append(entry)
                offset += -(-entry.nbytes // _ALIGN) * _ALIGN
        if entries:
            segments.append(Segment(tuple(layers), start, offset - start, tuple(entries)))
    return PackPlan(tuple(segments), offset)


def byte_rows(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The tensor as a [rows, row_bytes] byte matrix sharing its memory (numpy on CPU)."""
    rows = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)
    return rows.numpy() if rows.device.type == "cpu" else rows


def packed_rows(buffer: torch.Tensor, entry: PackedEntry) -> np.ndarray | torch.Tensor:
    rows = buffer[entry.offset : entry.offset + entry.nbytes].view(entry.rows, entry.spec.row_bytes)
    return rows.numpy() if rows.device.type == "cpu" else rows


class RowMap:
    """Which source row goes to which destination row, prepared once per request and reused
    for every tensor of that role (the run scan costs as much as a copy call per row)."""

    def __init__(self, src_ids: list[int], dst_ids: list[int]):
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"row count mismatch: {len(src_ids)} source rows, {len(dst_ids)} destination rows")
        self.src_ids, self.dst_ids = list(src_ids), list(dst_ids)
        self._indices: dict = {}
        if self.src_ids:
            self.src_array, self.dst_array = np.asarray(self.src_ids, dtype=np.intp), np.asarray(self.dst_ids, dtype=np.intp)
            self.bounds = (min(self.src_ids), max(self.src_ids), min(self.dst_ids), max(self.dst_ids))
            # A side whose ids are one ascending stretch (a packed buffer) is a slice: one copy, no gather.
            self.src_slice, self.dst_slice = (_as_slice(ids) for ids in (self.src_ids, self.dst_ids))

    @functools.cached_property
    def runs(self) -> list[tuple[int, int, int]]:
        """Only big scattered copies use these; a hand-off's maps are built on its critical path."""
        return runs(self.src_ids, self.dst_ids)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._indices:
            self._indices[device] = tuple(torch.tensor(ids, dtype=torch.long).to(device) for ids in (self.src_ids, self.dst_ids))
        return self._indices[device]


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal stretches where both id lists step by one."""
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))


def copy_rows(src, dst, rows: RowMap) -> None:
    """dst[rows.dst_ids[i]] = src[rows.src_ids[i]] for byte-row matrices of equal row width."""
    if not rows.src_ids:
        return
    if isinstance(src, np.ndarray):
        lo_src, hi_src, lo_dst, hi_dst = rows.bounds  # slices and raw copies below: bounds checked here, always
        if lo_src < 0 or hi_src >= src.shape[0]:
            _out_of_bounds(rows.src_ids, src.shape[0], "source")
        if lo_dst < 0 or hi_dst >= dst.shape[0]:
            _out_of_bounds(rows.dst_ids, dst.shape[0], "destination")
        if src.shape[1] != dst.shape[1] or not (src.flags.c_contiguous and dst.flags.c_contiguous and dst.flags.writeable):
            raise ValueError("rows must be contiguous byte matrices of equal width (destination writable)")
        width = src.shape[1]
        if rows.src_slice is not None and rows.dst_slice is not None:
            dst[rows.dst_slice] = src[rows.src_slice]  # one memcpy
            return
        if copy_row_ids is not None and len(rows.src_ids) * width <= GATHER_SCATTER_MAX_BYTES:
            copy_row_ids(src, dst, rows.src_array, rows.dst_array)  # one pass, GIL released
            return
        if rows.src_slice is not None or rows.dst_slice is not None or len(rows.src_ids) * width <= GATHER_SCATTER_MAX_BYTES:
            # numpy's row gather/scatter: one C loop instead of a call per run at
            # hand-off sizes (for two scattered sides it copies twice, through a temporary).
            rows_in = src[rows.src_slice] if rows.src_slice is not None else src[rows.src_array]
            if rows.dst_slice is not None:
                dst[rows.dst_slice] = rows_in
            else:
                dst[rows.dst_array] = rows_in
            return
        # Big scattered copies: one libc memmove per run, straight from source to destination
        # (glibc's, with non-temporal stores for big rows under SHM_SENDER_ENV).
        src_base, dst_base = src.ctypes.data, dst.ctypes.data
        for s, d, n in rows.runs:
            memmove = _memmove_holding_gil if n * width < RELEASE_GIL_FROM_BYTES else _memmove_releasing_gil
            memmove(dst_base + d * width, src_base + s * width, n * width)
        return
    src_index, dst_index = rows.indices(src.device)
    dst.index_copy_(0, dst_index, src.index_select(0, src_index))


def _out_of_bounds(ids: list[int], rows: int, what: str) -> None:
    raise IndexError(f"{what} row ids outside [0, {rows}): {sorted(i for i in ids if not 0 <= i < rows)[:5]}")


def _as_slice(ids: list[int]) -> slice | None:
    return slice(ids[0], ids[0] + len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) else None


def request_maps(layout: CacheLayout, src_blocks: list[int], src_slot: int | None,
                 dst_blocks: list[int], dst_slot: int | None) -> dict[str, RowMap]:
    """{BLOCK: map of the request's blocks, SLOT: map of its slot}; either side may be packed."""
    maps = {BLOCK: RowMap(src_blocks, dst_blocks)}
    if layout.has_slots:
        maps[SLOT] = RowMap([src_slot], [dst_slot])
    return maps


def packed(count: int) -> list[int]:
    """Row ids of a packed buffer: the request's rows in order."""
    return list(range(count))
