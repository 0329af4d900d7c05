"""Row gather/scatter for the hand-off: a request's KV blocks or state slot, packed and unpacked.

A "row" is dim 0 of a cache tensor (one KV block, one state slot). copy: dst[dst_ids[i]] =
src[src_ids[i]], where ids None means 0..n-1; gather (packed[i] = src[ids[i]]) and scatter
(dst[ids[i]] = packed[i]) are its two one-sided forms. `last_row_elems` copies only the first
that many elements of the last row (a partly filled last block); the rest of that row is
left as it was. Destination ids must be distinct. The Triton path moves bytes in the widest word (8/4/2/1 bytes) that divides the
row, its offset and the tail, so one kernel serves every dtype.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import device_function, jit, tl

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def copy_rows_ref(src, src_ids, dst, dst_ids, last_row_elems=None):
    """src: [R, ...]; dst: [R', ...] with the same row shape and dtype; ids: int64 [n] or None."""
    rows, width = _check(src, src_ids, dst, dst_ids, last_row_elems)
    if rows == 0:
        return dst
    flat_src, flat_dst = src.reshape(src.shape[0], -1), dst.view(dst.shape[0], -1)
    src_rows = src_ids if src_ids is not None else torch.arange(rows, device=src.device)
    dst_rows = dst_ids if dst_ids is not None else torch.arange(rows, device=dst.device)
    full = rows - 1 if last_row_elems is not None else rows
    flat_dst.index_copy_(0, dst_rows[:full], flat_src.index_select(0, src_rows[:full]))
    if last_row_elems is not None:
        flat_dst[dst_rows[-1], :last_row_elems] = flat_src[src_rows[-1], :last_row_elems]
    return dst


def copy_rows_triton(src, src_ids, dst, dst_ids, last_row_elems=None):
    rows, width = _check(src, src_ids, dst, dst_ids, last_row_elems)
    if rows == 0 or width == 0:
        return dst
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("row copy needs contiguous source and destination")
    item = src.element_size()
    row_bytes, tail_bytes = width * item, (width if last_row_elems is None else last_row_elems) * item
    word = next(w for w in _WORDS if row_bytes % w == tail_bytes % w == 0
                and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
    src_words = src.view(torch.uint8).view(src.shape[0], row_bytes).view(_WORDS[word])
    dst_words = dst.view(torch.uint8).view(dst.shape[0], row_bytes).view(_WORDS[word])
    row_words = row_bytes // word
    block = 1024
    while -(-row_words // block) > 65535:  # grid dim 1 limit on CUDA
        block *= 2
    _copy_rows_kernel[(rows, -(-row_words // block))](
        src_words, src_ids if src_ids is not None else src_words,
        dst_words, dst_ids if dst_ids is not None else dst_words,
        rows, row_words, tail_bytes // word, src_words.stride(0), dst_words.stride(0),
        HAS_SRC_IDS=src_ids is not None, HAS_DST_IDS=dst_ids is not None, BLOCK=block,
    )
    return dst


def gather_rows_ref(src, ids, out=None, last_row_elems=None):
    """src: [R, ...]; ids: int64 [n]. Returns out [n, ...]."""
    return copy_rows_ref(src, ids, _packed_like(src, ids, out, last_row_elems), None, last_row_elems)


def gather_rows_triton(src, ids, out=None, last_row_elems=None):
    return copy_rows_triton(src, ids, _packed_like(src, ids, out, last_row_elems), None, last_row_elems)


def scatter_rows_ref(packed, ids, dst, last_row_elems=None):
    """packed: [n, ...]; ids: int64 [n]; dst: [R, ...], written at rows `ids`. Returns dst."""
    return copy_rows_ref(packed, None, dst, ids, last_row_elems)


def scatter_rows_triton(packed, ids, dst, last_row_elems=None):
    return copy_rows_triton(packed, None, dst, ids, last_row_elems)


def _packed_like(src, ids, out, last_row_elems):
    if out is not None:
        return out
    shape = (ids.shape[0], *src.shape[1:])
    if last_row_elems is not None:  # the unwritten tail of the last row reads as zeros
        return torch.zeros(shape, dtype=src.dtype, device=src.device)
    return torch.empty(shape, dtype=src.dtype, device=src.device)


def _check(src, src_ids, dst, dst_ids, last_row_elems):
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"row mismatch: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}")
    counts = {len(src_ids) if src_ids is not None else src.shape[0],
              len(dst_ids) if dst_ids is not None else dst.shape[0]}
    if len(counts) != 1:
        raise ValueError(f"row count mismatch: {src.shape[0] if src_ids is None else len(src_ids)} source "
                         f"rows, {dst.shape[0] if dst_ids is None else len(dst_ids)} destination rows")
    width = src[0].numel() if src.shape[0] else dst[0].numel()
    if last_row_elems is not None and not 0 <= last_row_elems <= width:
        raise ValueError(f"last_row_elems={last_row_elems} outside [0, {width}]")
    return counts.pop(), width


@jit
def _copy_rows_kernel(src_ptr, src_ids_ptr, dst_ptr, dst_ids_ptr, rows, row_words, last_row_words,
                      src_stride, dst_stride, HAS_SRC_IDS: tl.constexpr, HAS_DST_IDS: tl.constexpr,
                      BLOCK: tl.constexpr):
    i = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = tl.where(i == rows - 1, last_row_words, row_words)
    ok = col < width
    src_row = i.to(tl.int64)
    if HAS_SRC_IDS:
        src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_row = i.to(tl.int64)
    if HAS_DST_IDS:
        dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    words = tl.load(src_ptr + src_row * src_stride + col, mask=ok)
    tl.store(dst_ptr + dst_row * dst_stride + col, words, mask=ok)


@device_function
def indexed_row(rows_ptr, row_numel, BLOCK: tl.constexpr):
    """For kernels over (row index, BLOCK elements) of whole rows: this program's row, read from
    the index tensor at program 0's index, and its elements: (their offsets in the flat rows,
    their indices within the row, the mask)."""
    row = tl.load(rows_ptr + tl.program_id(0))
    elements = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row * row_numel + elements, elements, elements < row_numel
