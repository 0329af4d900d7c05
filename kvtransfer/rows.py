"""Moving rows (blocks or slots) between cache tensors and packed buffers.

Every tensor is handled as a [rows, row_bytes] byte matrix, so one code path serves all
dtypes (bfloat16 included). On CPU the copy is a numpy slice assignment per run of
consecutive ids: a plain memcpy per run, measured at memcpy speed, where torch's
index_select/index_copy_ on bfloat16 ran at a third of it. On CUDA it is one
index_select + index_copy_ pair per tensor on the current stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.layout import BLOCK, CacheLayout, TensorSpec

_ALIGN = 64


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


def plan_packing(layout: CacheLayout, num_blocks: int, pipelined: bool) -> PackPlan:
    """Where each tensor's rows of one request sit in the packed buffer; identical on both sides."""
    groups = [[layer] for layer in layout.layers] if pipelined else [layout.layers]
    segments, offset = [], 0
    for layers in groups:
        start, entries = offset, []
        for layer in layers:
            for spec in layout.specs_of_layer(layer):
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


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal stretches where both id lists step by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_rows(src, src_ids: list[int], dst, dst_ids: list[int]) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for byte-row matrices of equal row width."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"row count mismatch: {len(src_ids)} source rows, {len(dst_ids)} destination rows")
    if isinstance(src, np.ndarray):
        for s, d, n in runs(src_ids, dst_ids):
            dst[d : d + n] = src[s : s + n]
        return
    device = src.device
    src_index = torch.tensor(src_ids, dtype=torch.long).to(device, non_blocking=True)
    dst_index = torch.tensor(dst_ids, dtype=torch.long).to(device, non_blocking=True)
    dst.index_copy_(0, dst_index, src.index_select(0, src_index))


def request_rows(spec: TensorSpec, block_ids: list[int], slot: int | None) -> list[int]:
    return list(block_ids) if spec.role == BLOCK else [slot]
