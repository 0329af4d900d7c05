"""Attention over a paged KV cache, for a varlen batch mixing prefills and decodes.

Write-then-read: every step first stores its tokens' K and V into the sequence's blocks, then
attends over the blocks. Prefill rows attend all in one varlen call over the paged cache where
that runs (engine.kernels.varlen_attention: CUDA in half precision), else one sequence at a time
(their queries are many); decode rows are gathered into one padded batch and attend together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu, cpu_kernels_ready, native, paged_attention_decode, uses_cpu_kernel, uses_triton
from engine.kernels import varlen_attention
from engine.kernels.varlen_attention import VarlenRows
from engine.kernels.decode_plan import ATTENTION, NORMED_ATTENTION, LayerPlan, Needs, all_cpu, pointer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, span
from engine.tp.plan import attention_layout, scaled
from engine.models.batch import ForwardBatch, Fp8Blocks
from engine.models.hybrid import KVSpec
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.packed_linear import fused_linear, pack_fused


class PagedAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool, out_bias: bool, rotary: RotaryEmbedding | None,
                 sliding_window: int | None = None, scale: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=out_bias)
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.qkv_fused = None

    def pack_weights(self) -> int:
        """q, k and v as one packed GEMM on CPU (engine.models.packed_linear.pack_fused), where
        the projections run through `project` as defined here."""
        if type(self).forward is not PagedAttention.forward or type(self).project is not PagedAttention.project:
            return 0
        self.qkv_fused = pack_fused(self.q_proj, self.k_proj, self.v_proj)
        return int(self.qkv_fused is not None)

    def kv_spec(self) -> KVSpec:
        return KVSpec(self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(x, batch, kv_cache):
            return self._decode_in_one_call(x, batch, kv_cache)
        q, k, v = self.project(x, batch)
        return self.o_proj(self.attend(q, k, v, batch, kv_cache).reshape(x.shape[0], -1))

    def _decodes_in_one_call(self, x: torch.Tensor, batch: ForwardBatch, kv_cache) -> bool:
        """Every row a decode on the CPU kernels, float32, q/k/v fused and o_proj packed (neither
        under tensor parallelism, nor where a subclass projects its own way; packing implies
        float32 weights): then forward's kernels run as one C++ call (engine/kernels/cpu_layers.cpp)."""
        # decode_tokens is slice(None) only when every row is a decode on the CPU (ForwardBatch).
        return (isinstance(batch.decode_tokens, slice) and isinstance(kv_cache, tuple) and self.fits_one_call()
                and uses_cpu_kernel(x) and all(uses_cpu_kernel(t) for t in kv_cache))

    def fits_one_call(self) -> bool:
        return self.qkv_fused is not None and getattr(self.o_proj, "packed_weight", None) is not None

    # ---- the one-call decode plan (engine.kernels.decode_plan)

    decode_kind = ATTENTION

    def runs_as_its_kind(self) -> bool:
        """Whether this module's forward is the one its kind defines: a subclass that changes it
        is neither planned into the one-call decode nor sharded as this kind."""
        return type(self) is PagedAttention

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Query heads split; KV heads split or replicated (engine.tp.plan); o_proj row-parallel."""
        if not self.runs_as_its_kind():
            return None
        lay = attention_layout(self.num_heads, self.num_kv_heads, group.size, group.rank)
        for name in ("q_proj", "k_proj", "v_proj"):
            check_linear(getattr(self, name), f"attention {name}", row_sliceable=True)
        check_linear(self.o_proj, "attention o_proj")
        q_unit = self.q_proj.out_features // self.num_heads  # gated: query then gate, per head
        q_rows = span(scaled(lay.q_heads, q_unit))
        kv_rows = span(scaled(lay.kv_heads, self.head_dim))
        cols = span(scaled(lay.q_heads, self.head_dim))

        def apply():
            keep_rows(self.q_proj, q_rows)
            keep_rows(self.k_proj, kv_rows)
            keep_rows(self.v_proj, kv_rows)
            self.o_proj = RowParallelLinear.of(self.o_proj, cols, group, True, "attention o_proj")
            self.num_heads = lay.q_heads[1] - lay.q_heads[0]
            self.num_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
        return apply

    def plan_decode(self, entry: LayerPlan, state, kv, keep: list, rotary: list) -> Needs | None:
        """This attention as a layer's mixer in a decode step's one-call plan."""
        if not (self.runs_as_its_kind() and all_cpu(kv) and self.fits_one_call()):
            return None
        entry.mixer = self.decode_kind
        return self.fill_decode_plan(entry, kv, rotary)

    def plan_beside(self, entry: LayerPlan, kv, rotary: list) -> Needs | None:
        """This attention beside a layer's mixer, on the same input (Falcon-H1's)."""
        if type(self) is not PagedAttention or not (all_cpu(kv) and self.fits_one_call()):
            return None
        return self.fill_decode_plan(entry, kv, rotary)

    def fill_decode_plan(self, entry: LayerPlan, kv, rotary: list) -> Needs:
        """The attention fields (not the mixer kind); its rotary embedding, if any, joins
        `rotary` (the entry takes its tables each step)."""
        if self.rotary is not None:
            rotary.append(self.rotary)
        k_cache, v_cache = kv
        packed, bias, _ = self.qkv_fused
        entry.heads, entry.kv_heads, entry.head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        entry.block_size, entry.window, entry.scale = k_cache.shape[1], int(self.sliding_window or 0), float(self.scale)
        entry.qkv_panels, entry.qkv_bias = packed.panels.data_ptr(), pointer(bias)
        entry.o_panels, entry.o_bias = self.o_proj.packed_weight.panels.data_ptr(), pointer(self.o_proj.bias)
        entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        return Needs(floats=self._one_call_kernel()[2])

    def _decode_in_one_call(self, x: torch.Tensor, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        rows = x.shape[0]
        packed, bias, _ = self.qkv_fused
        cos, sin, tables = self._one_call_tables(batch)
        kernel, extra, scratch = self._one_call_kernel()
        o_proj = self.o_proj.packed_weight
        out = torch.empty(rows, o_proj.out_features)
        native.call(kernel, h=x, rows=rows, hidden=x.shape[1], out_width=o_proj.out_features, heads=self.num_heads,
                    kv_heads=self.num_kv_heads, head_dim=self.head_dim, qkv_panels=packed.panels, qkv_bias=bias,
                    cos=cos, sin=sin, rotary_dim=0 if cos is None else cos.shape[1], k_cache=k_cache,
                    v_cache=v_cache, write_index=cpu.ids(batch.kv_write_index), tables=tables,
                    table_width=tables.shape[1], lens=cpu.ids(batch.decode_context_lens),
                    block_size=k_cache.shape[1], scale=float(self.scale), window=int(self.sliding_window or 0),
                    o_panels=o_proj.panels, o_bias=self.o_proj.bias, scratch=torch.empty(rows * scratch), out=out,
                    **extra)
        return out

    def _one_call_kernel(self) -> tuple[str, dict, int]:
        """The C++ layer a one-call decode runs, its own arguments, its scratch floats per row."""
        return "attention_decode", {}, (3 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def _one_call_tables(self, batch: ForwardBatch):
        """What a one-call decode reads besides the weights: the rotary tables (None without
        rotary) and the block tables."""
        cos = sin = None
        if self.rotary is not None:
            cos, sin = self.rotary._tables(batch.positions, torch.float32)
        return cos, sin, cpu.ids(batch.decode_block_tables)

    def project(self, x: torch.Tensor, batch: ForwardBatch):
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim], rotary applied."""
        tokens = x.shape[0]
        q, k, v = fused_linear(x, self.qkv_fused, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        return q, k, v

    # Every way this kind runs goes through `attend`, which takes FP8 blocks in place.
    reads_fp8_in_place = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               kv_cache: tuple[torch.Tensor, torch.Tensor] | Fp8Blocks) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend: [T, heads, head_dim]."""
        pool = None
        if isinstance(kv_cache, Fp8Blocks):  # FP8 blocks: the decode rows read them in place
            if kv_cache.working is None:  # an all-decode step: row i's one token is token i
                kv_cache.store((k, v), batch.kv_write_index)
                return self._attend_decodes_in_pool(q, k, v, batch, kv_cache)
            pool, kv_cache = kv_cache, kv_cache.working  # the prefill rows' blocks, dequantized
        k_cache, v_cache = kv_cache
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, batch.kv_write_index, k.to(k_cache.dtype))
        flat_v.index_copy_(0, batch.kv_write_index, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        if batch.prefill_rows and not self._prefills_in_one_call(q, batch, k_cache, v_cache, out):
            for row in batch.prefill_rows:
                start, end = batch.query_starts[row], batch.query_starts[row + 1]
                context = batch.context_lens[row]
                if context == end - start:  # whole sequence in this step: no need to read the cache
                    keys, values = k[start:end], v[start:end]
                else:
                    keys, values = self._gather(k_cache, v_cache, batch.block_tables[row], context)
                out[start:end] = self._attend_one(q[start:end], keys, values, context)
        if batch.decode_rows:
            idx = batch.decode_tokens
            if pool is not None:
                out[idx] = self._attend_decodes_in_pool(q[idx], k[idx], v[idx], batch, pool)
            else:
                out[idx] = self._attend_decodes(q[idx], k_cache, v_cache, batch)
        return out

    def _attend_decodes_in_pool(self, q, k, v, batch: ForwardBatch, pool: Fp8Blocks) -> torch.Tensor:
        """The decode rows (q, k, v [B, heads, head_dim], one token each) over FP8 blocks read in
        place through their scales, each row's own K and V at full precision."""
        return paged_attention_decode(q, *pool.tensors, batch.decode_block_tables, batch.decode_context_lens,
                                      self.scale, self.sliding_window, kv_scales=pool.scales, last_kv=(k, v))

    def _prefills_in_one_call(self, q, batch: ForwardBatch, k_cache, v_cache, out) -> bool:
        """Every prefill row in one varlen call over the paged cache, where it runs
        (engine.kernels.varlen_attention: CUDA, half precision); False leaves them to the rows loop."""
        if not varlen_attention.available(q, k_cache):
            return False
        rows = VarlenRows.of(batch)
        o = varlen_attention.varlen_attention(q[rows.tokens], k_cache, v_cache, rows, self.scale, self.sliding_window)
        if o is None:
            return False
        out[rows.tokens] = o
        return True

    def _gather(self, k_cache, v_cache, block_table, context):
        blocks = block_table[: -(-context // k_cache.shape[1])]
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[:context]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[:context]
        return keys, values

    def _attend_one(self, q, keys, values, context):
        """q: [n, H, D] for the last n positions of a sequence whose cache holds `context` tokens."""
        if all(map(cpu.rows_of_heads, (q, keys, values))) and cpu_kernels_ready():  # the device first: no build on a GPU
            return cpu.prefill_attention_cpu(q, keys, values, self.scale, self.sliding_window)
        n = q.shape[0]
        mask = None
        # A whole causal prompt needs no mask: SDPA then skips the blocks above the diagonal.
        if n != context or (self.sliding_window is not None and context > self.sliding_window):
            q_pos = torch.arange(context - n, context, device=q.device)[:, None]
            k_pos = torch.arange(context, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
            values.to(q.dtype).transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=self.scale,
            is_causal=mask is None, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.squeeze(0).transpose(0, 1)

    def _attend_decodes(self, q, k_cache, v_cache, batch: ForwardBatch):
        """q: [B, H, D], one query per decode sequence, all attending in one padded call."""
        if uses_triton(q) or uses_cpu_kernel(k_cache):  # reads the pool in place
            return paged_attention_decode(q, k_cache, v_cache, batch.decode_block_tables,
                                          batch.decode_context_lens, self.scale, self.sliding_window)
        block_size = k_cache.shape[1]
        lens = batch.decode_context_lens
        max_len = int(lens.max())
        num_blocks = -(-max_len // block_size)
        blocks = batch.decode_block_tables[:, :num_blocks].reshape(-1)
        shape = (q.shape[0], num_blocks * block_size, self.num_kv_heads, self.head_dim)
        # index_select copies whole block rows; advanced indexing (cache[blocks]) goes element by element.
        keys = k_cache.index_select(0, blocks).view(shape)[:, :max_len].to(q.dtype)  # [B, L, KVH, D]
        values = v_cache.index_select(0, blocks).view(shape)[:, :max_len].to(q.dtype)
        k_pos = torch.arange(max_len, device=q.device)[None, :]
        mask = k_pos < lens[:, None]
        if self.sliding_window is not None:
            mask &= k_pos > (lens[:, None] - 1 - self.sliding_window)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.squeeze(2)


class NormedAttention(PagedAttention):
    """Attention whose queries and keys are RMS-normalised per head before rotary (LFM2,
    Qwen3-Next) and, where `gated`, whose q_proj yields per head the query then a gate (head_dim
    each) and whose output is multiplied by sigmoid(gate) before o_proj (Qwen3-Next). On the CPU
    the three projections run as one packed GEMM, the norms, rotary and the gate as C++ kernels,
    and an all-decode step as one call of them (normed_attention_decode)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: RotaryEmbedding | None, q_norm: RMSNorm, k_norm: RMSNorm, gated: bool):
        super().__init__(hidden, num_heads, num_kv_heads, head_dim, bias, bias, rotary)
        self.gated = gated
        self.q_proj = nn.Linear(hidden, (1 + gated) * num_heads * head_dim, bias=bias)
        self.q_norm, self.k_norm = q_norm, k_norm

    def pack_weights(self) -> int:
        self.qkv_fused = pack_fused(self.q_proj, self.k_proj, self.v_proj)
        return int(self.qkv_fused is not None)

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self._decodes_in_one_call(x, batch, kv_cache):
            return self._decode_in_one_call(x, batch, kv_cache)
        tokens, heads, size = x.shape[0], self.num_heads, self.head_dim
        q_and_gate, k, v = fused_linear(x, self.qkv_fused, self.q_proj, self.k_proj, self.v_proj)
        q_and_gate = q_and_gate.reshape(tokens * heads, (1 + self.gated) * size)
        q = self.q_norm(q_and_gate[:, :size]).view(tokens, heads, size)  # reads the queries in place
        k = self.k_norm(k.reshape(tokens * self.num_kv_heads, size)).view(tokens, self.num_kv_heads, size)
        v = v.view(tokens, self.num_kv_heads, size)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        out = self.attend(q, k, v, batch, kv_cache).reshape(tokens, -1)
        if not self.gated:
            return self.o_proj(out)
        gate = q_and_gate[:, size:]
        if uses_cpu_kernel(out) and gate.dtype == torch.float32:
            return self.o_proj(cpu.sigmoid_gate_cpu(out, gate.view(tokens, heads, size)))
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))

    def fits_one_call(self) -> bool:
        """The PagedAttention conditions, with both norms plain RMSNorms (Qwen3-Next's once folded)
        of one epsilon, float32."""
        return (super().fits_one_call() and not self.q_norm.offset and not self.k_norm.offset
                and self.q_norm.eps == self.k_norm.eps
                and self.q_norm.weight.dtype == self.k_norm.weight.dtype == torch.float32)

    decode_kind = NORMED_ATTENTION

    def runs_as_its_kind(self) -> bool:
        return type(self).forward is NormedAttention.forward

    def fill_decode_plan(self, entry: LayerPlan, kv, rotary: list) -> Needs:
        entry.qk_norm_eps, entry.gated = self.q_norm.eps, int(self.gated)
        entry.q_norm, entry.k_norm = self.q_norm.weight.data_ptr(), self.k_norm.weight.data_ptr()
        return super().fill_decode_plan(entry, kv, rotary)

    def _one_call_kernel(self) -> tuple[str, dict, int]:
        extra = dict(q_norm=self.q_norm.weight, k_norm=self.k_norm.weight, norm_eps=float(self.q_norm.eps),
                     gated=int(self.gated))
        return "normed_attention_decode", extra, (4 * self.num_heads + 3 * self.num_kv_heads) * self.head_dim
