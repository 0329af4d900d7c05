"""Paged-attention decode: one query token per sequence over its paged KV cache (GQA).

q: [B, H, Dh]; k_cache, v_cache: [num_blocks, block_size, KVH, Dh]; block_tables: int64
[B, max_blocks] (padding 0); context_lens: int64 [B], >= 1, counting the current token, which
is already in the cache (write-then-read). Query head h reads KV head h // (H // KVH). With a
sliding window only keys at positions >= context_len - window are seen.

A cache stored in FP8 (engine.kv_format) is read in place: `kv_scales` (K's and V's, float32
[KVH] each) dequantize each value as it is read, to q's dtype, as the format's load into working
rows would; `last_kv` (K and V [B, KVH, Dh]) are the rows at each sequence's last position, the
step's own token at full precision, read instead of the cache's. The result is then the one
over the dequantized rows, without writing them anywhere.

The Triton path is flash-decoding: program (b, kv_head, split) runs an online softmax over
its share of the context for all query heads of that KV head at once (for wide heads, MLA's,
16 of them a program), token tiles resolved
to (block, offset) one token at a time, so tiles may straddle blocks of any size. With more
than one split a second kernel merges the partial (max, sum, acc) triples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import device_function, interpreting, jit, next_power_of_2, tl
from engine.kernels.float_bits import FP8_FORMATS, fp8_as_bytes, fp8_value

MAX_SPLITS = 64
WIDE_HEAD = 512  # a padded head dim from which a program takes 16 query heads (see the launch)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None, out=None, kv_scales=None, last_kv=None):
    _check(q, k_cache, v_cache, block_tables, context_lens, kv_scales, last_kv)
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    max_len = int(context_lens.max()) if q.shape[0] else 0
    blocks = block_tables[:, : -(-max_len // block_size)]
    keys, values = (_rows(cache, blocks, max_len) for cache in (k_cache, v_cache))  # [B, L, KVH, Dh]
    if kv_scales is not None:  # dequantized to q's dtype, as the format's working rows hold them
        keys, values = ((rows * s[:, None]).to(q.dtype).float() for rows, s in zip((keys, values), kv_scales))
    if last_kv is not None:
        last = (context_lens - 1).clamp(min=0)
        for rows, own in zip((keys, values), last_kv):
            rows[torch.arange(q.shape[0], device=q.device), last] = own.float()
    keys = keys.repeat_interleave(heads // kv_heads, dim=2)
    values = values.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    k_pos = torch.arange(max_len, device=q.device)[None, :]
    visible = k_pos < context_lens[:, None]
    if sliding_window is not None:
        visible &= k_pos >= context_lens[:, None] - sliding_window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    values = values.masked_fill(~visible[:, :, None, None], 0.0)  # whatever lies there, even NaN
    y = torch.einsum("bhl,blhd->bhd", F.softmax(scores, dim=-1), values)
    if out is None:
        return y.to(q.dtype)
    out.copy_(y)
    return out


def _rows(cache, blocks, max_len):
    """cache's rows of `blocks` [B, n], [B, max_len, KVH, Dh] in float32 (float8 rows move as
    bytes: torch's CPU index ops do not take float8 dtypes)."""
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        picked = cache.view(torch.uint8)[blocks].view(cache.dtype)
    else:
        picked = cache[blocks]
    return picked.flatten(1, 2)[:, :max_len].float()


def paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  sliding_window=None, out=None, num_splits=None, tile=None,
                                  kv_scales=None, last_kv=None):
    """num_splits: context partitions per (sequence, KV head); None picks one from the SM count.
    tile: tokens per inner-loop step (power of 2, >= 16)."""
    _check(q, k_cache, v_cache, block_tables, context_lens, kv_scales, last_kv)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride() or out.stride(2) != 1:
        raise ValueError("q, out and the caches need a unit stride in the head dimension, "
                         "and k_cache and v_cache the same strides")
    group = heads // kv_heads
    dim_pad = max(16, next_power_of_2(head_dim))
    # A program keeps its query heads' rows [heads, DIM_PAD] and a tile of keys and values on
    # chip. Wide heads (MLA's latent rows: 576) under many query heads would need 200-400 KB of
    # shared memory, past an A100's 163 KB (past every GPU's at 128 heads): there a program
    # takes 16 query heads and 16 tokens a tile, each block of heads reading the cache itself.
    wide = dim_pad >= WIDE_HEAD
    group_block = 16 if wide else max(16, next_power_of_2(group))
    group_blocks = -(-group // group_block)
    tile = tile or (16 if wide or not _on_gpu(q) else 64)
    # Without a host sync on context_lens the table width bounds every context.
    max_tiles = -(-block_tables.shape[1] * block_size // tile)
    if num_splits is None:
        num_splits = _default_splits(q, batch * kv_heads * group_blocks, max_tiles)
    num_splits = max(1, min(num_splits, max_tiles, MAX_SPLITS))
    split_len = -(-max_tiles // num_splits) * tile
    # Triton 3.9's interpreter multiplies the raw bits of bfloat16 dot operands; upcast there.
    dot_fp32 = (q.dtype if kv_scales is not None else k_cache.dtype) == torch.float32 or interpreting()
    mantissa, min_exponent = FP8_FORMATS.get(k_cache.dtype, (0, 0))
    as_bytes = fp8_as_bytes(k_cache)
    if as_bytes:  # read as bytes, decoded in the kernel (engine.kernels.float_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    meta = dict(GROUP=group, GROUP_BLOCK=group_block, GROUP_BLOCKS=group_blocks, HEAD_DIM=head_dim,
                DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile,
                HAS_WINDOW=sliding_window is not None, SCALED=kv_scales is not None, HAS_LAST=last_kv is not None,
                AS_BYTES=as_bytes, MANTISSA_BITS=mantissa, MIN_EXPONENT=min_exponent,
                DOT_FP32=dot_fp32, DOT_PRECISION="ieee" if dot_fp32 else "tf32")
    window = int(sliding_window or 0)
    k_scale, v_scale = kv_scales if kv_scales is not None else (q, q)  # unread without SCALED
    k_last, v_last = last_kv if last_kv is not None else (q, q)  # unread without HAS_LAST
    common = (q, k_cache, v_cache, block_tables, context_lens, float(scale), window, split_len,
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              block_tables.stride(0), k_scale, v_scale, k_last, v_last, k_last.stride(0), k_last.stride(1),
              v_last.stride(0), v_last.stride(1))
    # float32 dot operands, double-buffered, take 150-200 KB of shared memory at head dims of
    # 256 and more (an A100 gives a block 163 KB); one stage takes 86-132 KB
    meta.update(num_stages=1 if dot_fp32 and not interpreting() else 3)
    if num_splits == 1:
        _decode_split_kernel[(batch, kv_heads * group_blocks, 1)](
            *common, out, out, out, out.stride(0), out.stride(1), 0, 0, 0, SPLIT_OUT=False, **meta)
        return out
    acc = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    row_max = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    row_sum = torch.empty_like(row_max)
    _decode_split_kernel[(batch, kv_heads * group_blocks, num_splits)](
        *common, acc, row_max, row_sum, acc.stride(0), acc.stride(1), acc.stride(2),
        row_max.stride(0), row_max.stride(1), SPLIT_OUT=True, **meta)
    _merge_splits_kernel[(batch, heads)](
        acc, row_max, row_sum, out, num_splits, acc.stride(0), acc.stride(1), acc.stride(2),
        row_max.stride(0), row_max.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=meta["DIM_PAD"], SPLIT_PAD=next_power_of_2(num_splits))
    return out


def _on_gpu(q) -> bool:
    return q.is_cuda


def _sm_count(q) -> int:
    return torch.cuda.get_device_properties(q.device).multi_processor_count


def _default_splits(q, programs, max_tiles):
    if not _on_gpu(q):
        return 1
    return max(1, min(-(-2 * _sm_count(q) // programs), max_tiles))


def _check(q, k_cache, v_cache, block_tables, context_lens, kv_scales=None, last_kv=None):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} must be [B, H, Dh]; k_cache {tuple(k_cache.shape)} and "
                         f"v_cache {tuple(v_cache.shape)} the same [blocks, block_size, KVH, Dh]")
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads of dim "
                         f"{k_cache.shape[3]} (H must be a multiple of KVH)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens "
                         f"{tuple(context_lens.shape)} do not match batch {batch}")
    if (k_cache.dtype.itemsize == 1) != (kv_scales is not None):
        raise ValueError(f"a {k_cache.dtype} cache takes kv_scales exactly when it is stored in FP8")
    if kv_scales is not None and any(s.shape != (kv_heads,) or s.dtype != torch.float32 for s in kv_scales):
        raise ValueError(f"kv_scales must be float32 [{kv_heads}] each (one per KV head), got "
                         f"{[(tuple(s.shape), s.dtype) for s in kv_scales]}")
    if last_kv is not None and any(t.shape != (batch, kv_heads, head_dim) or t.stride(2) != 1 or t.dtype != q.dtype
                                   for t in last_kv):
        raise ValueError(f"last_kv must be two [{batch}, {kv_heads}, {head_dim}] rows in q's dtype with a unit "
                         f"stride in the head dimension, got {[(tuple(t.shape), t.dtype) for t in last_kv]}")


@device_function
def _tile_values(cache_ptr, offsets, mask, scale, own, is_own, q, q_ptr, SCALED: tl.constexpr,
                 HAS_LAST: tl.constexpr, AS_BYTES: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                 MIN_EXPONENT: tl.constexpr):
    """A token tile's K or V rows in the dot's dtype (q's): as the cache holds them, or an FP8
    cache's times the scale, rounded to q's dtype as the format's working rows hold them; at
    the row's own position (`is_own`), its own token's row."""
    values = tl.load(cache_ptr + offsets, mask=mask, other=0.0)
    if SCALED:
        values = fp8_value(values, MANTISSA_BITS, MIN_EXPONENT) if AS_BYTES else values.to(tl.float32)
        values = (values * scale).to(q_ptr.dtype.element_ty)
    values = values.to(q.dtype)
    if HAS_LAST:
        values = tl.where(is_own[:, None], own[None, :], values)
    return values


@jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, scale, window, split_len,
                         q_stride_b, q_stride_h, cache_stride_block, cache_stride_slot,
                         cache_stride_head, tables_stride_b,
                         k_scale_ptr, v_scale_ptr, k_last_ptr, v_last_ptr, k_last_stride_b, k_last_stride_h,
                         v_last_stride_b, v_last_stride_h,
                         out_ptr, max_ptr, sum_ptr, out_stride_b, out_stride_h, out_stride_split,
                         stat_stride_b, stat_stride_h,
                         SPLIT_OUT: tl.constexpr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr,
                         GROUP_BLOCKS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, HAS_WINDOW: tl.constexpr, SCALED: tl.constexpr,
                         HAS_LAST: tl.constexpr, AS_BYTES: tl.constexpr, MANTISSA_BITS: tl.constexpr,
                         MIN_EXPONENT: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // GROUP_BLOCKS
    g = (tl.program_id(1) % GROUP_BLOCKS) * GROUP_BLOCK + tl.arange(0, GROUP_BLOCK)  # this block's query heads
    split = tl.program_id(2)
    dim = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    dim_ok = dim < HEAD_DIM
    context = tl.load(lens_ptr + b).to(tl.int32)

    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + dim[None, :],
                mask=g_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) * scale
    if not DOT_FP32:  # the dtype the values are read as: the cache's, or q's where FP8 is dequantized
        if SCALED:
            q = q.to(q_ptr.dtype.element_ty)
        else:
            q = q.to(k_ptr.dtype.element_ty)
    # an FP8 cache's scales (its KV head's), and each row's own token (both unread otherwise)
    k_scale = tl.load(k_scale_ptr + kv_head) if SCALED else 1.0
    v_scale = tl.load(v_scale_ptr + kv_head) if SCALED else 1.0
    own = b * k_last_stride_b + kv_head * k_last_stride_h + dim
    k_own = tl.load(k_last_ptr + own, mask=dim_ok & HAS_LAST, other=0.0).to(q.dtype)
    own = b * v_last_stride_b + kv_head * v_last_stride_h + dim
    v_own = tl.load(v_last_ptr + own, mask=dim_ok & HAS_LAST, other=0.0).to(q.dtype)

    first = split * split_len
    if HAS_WINDOW:
        first = tl.maximum(first, context - window)
    last = tl.minimum(context, (split + 1) * split_len)
    row_max = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, DIM_PAD], tl.float32)
    # Every tile starts below `last`, so it holds a visible key and row_max becomes finite.
    for start in range(first, last, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = pos < last
        block = tl.load(tables_ptr + b * tables_stride_b + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        rows = (block.to(tl.int64) * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot
                + kv_head * cache_stride_head)
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        offsets = rows[:, None] + dim[None, :]
        is_own = pos == context - 1
        k = _tile_values(k_ptr, offsets, kv_mask, k_scale, k_own, is_own, q, q_ptr, SCALED, HAS_LAST, AS_BYTES,
                         MANTISSA_BITS, MIN_EXPONENT)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_BLOCK, TILE]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        p = tl.exp(scores - new_max[:, None])
        correction = tl.exp(row_max - new_max)
        v = _tile_values(v_ptr, offsets, kv_mask, v_scale, v_own, is_own, q, q_ptr, SCALED, HAS_LAST, AS_BYTES,
                         MANTISSA_BITS, MIN_EXPONENT)
        acc = acc * correction[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        row_max = new_max

    out_mask = g_ok[:, None] & dim_ok[None, :]
    if SPLIT_OUT:
        base = b * out_stride_b + split * out_stride_split
        tl.store(out_ptr + base + heads[:, None] * out_stride_h + dim[None, :], acc, mask=out_mask)
        stat = b * stat_stride_b + heads * stat_stride_h + split
        tl.store(max_ptr + stat, row_max, mask=g_ok)
        tl.store(sum_ptr + stat, row_sum, mask=g_ok)
    else:
        y = acc / row_sum[:, None]
        tl.store(out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + dim[None, :], y,
                 mask=out_mask)


@jit
def _merge_splits_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, num_splits,
                         acc_stride_b, acc_stride_h, acc_stride_split, stat_stride_b, stat_stride_h,
                         out_stride_b, out_stride_h,
                         HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLIT_PAD)
    dim = tl.arange(0, DIM_PAD)
    split_ok = split < num_splits
    dim_ok = dim < HEAD_DIM
    stat = b * stat_stride_b + head * stat_stride_h + split
    # A split that lies wholly outside the context (or the window) has max -inf and weight 0.
    split_max = tl.load(max_ptr + stat, mask=split_ok, other=float("-inf"))
    split_sum = tl.load(sum_ptr + stat, mask=split_ok, other=0.0)
    weight = tl.exp(split_max - tl.max(split_max, axis=0))
    acc = tl.load(acc_ptr + b * acc_stride_b + head * acc_stride_h + split[:, None] * acc_stride_split
                  + dim[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    y = tl.sum(acc * weight[:, None], axis=0) / tl.sum(split_sum * weight, axis=0)
    tl.store(out_ptr + b * out_stride_b + head * out_stride_h + dim, y, mask=dim_ok)
