"""Multi-head latent attention (MLA, as in DeepSeek-V2/V3 and Kimi Linear): a KV kind of its own.

Per token the layer projects one compressed row, kv_a_proj(x) = [c | k_shared]: the latent c
(kv_lora_rank channels, RMS-normalised) and a key part k_shared (qk_rope_head_dim channels)
shared by every head. The cache keeps exactly that row, [c | k_shared], once per token: one
tensor named "latent" of one KV head, kind "latent_attention" (engine.models.hybrid.KVSpec),
which the cache, the prefix cache, the hand-off and tensor parallelism move like any other
block tensor without knowing what it holds. Expanded K/V would cost
2 * heads * (qk_head_dim or v_head_dim) values per token instead (latent_cache_ratio).

Each head h expands the latent with its rows of kv_b_proj: k_h = [W_uk[h] c | k_shared],
v_h = W_uv[h] c, and attends with q_h = [q_nope | q_shared] at scale qk_head_dim^-1/2.

Two forms of the same attention:
- expanded (the reference, and prefill rows, where many queries share the expansion): gather
  the context's latent rows, expand K and V per head, attend causally;
- absorbed (decode rows): q_h . k_h = (W_uk[h]^T q_nope) . c + q_shared . k_shared, so the
  absorbed query [W_uk[h]^T q_nope | q_shared] attends over the cached rows themselves as one
  KV head for all query heads (the paged decode kernel, keys and values both the latent rows),
  and the head's output is W_uv[h] applied to the first kv_lora_rank channels of the result.
  Exact up to float summation order; the cache is read once per step, never expanded.

No rotary embedding: Kimi Linear's MLA is position-free (NoPE) and its shared key part is used
as projected. A rotary MLA (DeepSeek-V2/V3) would rotate q_shared and k_shared before the cache
write, and is not served yet (its family would refuse it).

Under tensor parallelism the heads split evenly over the ranks; the latent projection, its
norm and the cached rows are replicated (one KV head that every rank keeps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import paged_attention_decode
from engine.models.batch import ForwardBatch, Fp8Blocks
from engine.models.hybrid import KVSpec
from engine.models.layers import RMSNorm
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, span
from engine.tp.plan import even_split, scaled

LATENT_KIND = "latent_attention"


class LatentAttention(nn.Module):
    reads_weights = ("kv_b_proj",)  # decode multiplies its weight in, absorbed: it stays dense under FP8

    def __init__(self, hidden: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 nope_dim: int, shared_dim: int, v_dim: int, bias: bool, latent_eps: float):
        super().__init__()
        if min(num_heads, kv_lora_rank, v_dim) <= 0 or nope_dim < 0 or shared_dim < 0 or nope_dim + shared_dim <= 0:
            raise ValueError(f"latent attention: bad sizes heads={num_heads} kv_lora_rank={kv_lora_rank} "
                             f"nope={nope_dim} shared={shared_dim} v={v_dim}")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.shared_dim, self.v_dim = nope_dim, shared_dim, v_dim
        self.qk_dim = nope_dim + shared_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj = nn.Linear(hidden, kv_lora_rank + shared_dim, bias=bias)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden, bias=bias)
        self.scale = self.qk_dim ** -0.5
        self.absorb = True  # decode rows in the absorbed form; False: the expanded reference

    def kv_spec(self) -> KVSpec:
        return KVSpec(1, self.kv_lora_rank + self.shared_dim, names=("latent",), kind=LATENT_KIND)

    def latent_cache_ratio(self) -> float:
        """Cached values per token as expanded K and V over the latent row this layer keeps."""
        return self.num_heads * (self.qk_dim + self.v_dim) / (self.kv_lora_rank + self.shared_dim)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.qk_dim)

    def latent_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the rows the cache keeps, [T, kv_lora_rank + shared]: [norm(c) | k_shared]."""
        c, k_shared = self.kv_a_proj(x).split([self.kv_lora_rank, self.shared_dim], dim=-1)
        return torch.cat((self.kv_a_norm(c), k_shared), dim=-1)

    @property
    def reads_fp8_in_place(self) -> bool:
        """A step on Triton may hand this layer its FP8 latent rows in place (engine.models.batch.
        Fp8Blocks) when decode runs absorbed: the paged kernel then reads them through their scale."""
        return self.absorb

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: tuple[torch.Tensor] | Fp8Blocks) -> torch.Tensor:
        tokens = x.shape[0]
        q, rows = self.queries(x), self.latent_rows(x)
        pool = None
        if isinstance(kv_cache, Fp8Blocks):  # FP8 latent rows: the decode rows read them in place
            if kv_cache.working is None:  # an all-decode step: row i's one token is token i
                kv_cache.store((rows.to(q.dtype).view(tokens, 1, -1),), batch.kv_write_index)
                out = self._decodes_in_pool(q, rows, batch, kv_cache)
                return self.o_proj(out.reshape(tokens, -1))
            pool, kv_cache = kv_cache, kv_cache.working  # the prefill rows' blocks, dequantized
        (cache,) = kv_cache
        flat = cache.view(-1, cache.shape[-1])
        flat.index_copy_(0, batch.kv_write_index, rows.to(cache.dtype))  # write first, then read

        out = torch.empty(tokens, self.num_heads, self.v_dim, dtype=q.dtype, device=x.device)
        for row in batch.prefill_rows:
            start, end = batch.query_starts[row], batch.query_starts[row + 1]
            context = batch.context_lens[row]
            latent = rows[start:end] if context == end - start else _gather(cache, batch.block_tables[row], context)
            out[start:end] = self.attend_expanded(q[start:end], latent, context)
        if batch.decode_rows:
            idx = batch.decode_tokens
            if pool is not None:
                out[idx] = self._decodes_in_pool(q[idx], rows[idx], batch, pool)
            elif self.absorb:
                out[idx] = self.attend_absorbed(q[idx], cache, batch.decode_block_tables, batch.decode_context_lens)
            else:
                out[idx] = self.decode_expanded(q[idx], cache, batch.decode_block_tables, batch.decode_context_lens)
        return self.o_proj(out.reshape(tokens, -1))

    def _decodes_in_pool(self, q: torch.Tensor, rows: torch.Tensor, batch: ForwardBatch, pool: Fp8Blocks):
        """The decode rows (q, their latent rows; one token each), absorbed, over FP8 latent
        rows read in place through their scale, each row's own at full precision."""
        own = rows.to(q.dtype).view(rows.shape[0], 1, -1)
        (cache,), (scale,) = pool.tensors, pool.scales
        return self.attend_absorbed(q, cache, batch.decode_block_tables, batch.decode_context_lens,
                                    kv_scales=(scale, scale), last_kv=(own, own))

    def expand(self, latent: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [n, kv_lora_rank + shared] -> K [n, heads, qk_dim], V [n, heads, v_dim]."""
        n = latent.shape[0]
        c, k_shared = latent.to(dtype).split([self.kv_lora_rank, self.shared_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(n, self.num_heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_shared[:, None, :].expand(n, self.num_heads, self.shared_dim)), dim=-1)
        return k, v

    def attend_expanded(self, q: torch.Tensor, latent: torch.Tensor, context: int) -> torch.Tensor:
        """q [n, heads, qk_dim]: the last n positions of a sequence whose cached rows are `latent`
        [context, ...]. Returns [n, heads, v_dim]."""
        n = q.shape[0]
        k, v = self.expand(latent, q.dtype)
        mask = None
        if n != context:  # a continued chunk: its queries see the whole cached context before them
            mask = (torch.arange(context, device=q.device)[None, :]
                    <= torch.arange(context - n, context, device=q.device)[:, None])
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=self.scale, is_causal=mask is None)
        return o[0].transpose(0, 1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_uk [heads, nope, kv_lora_rank] and W_uv [heads, v_dim, kv_lora_rank]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def attend_absorbed(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, **fp8) -> torch.Tensor:
        """One query per decode row, q [B, heads, qk_dim], over the cached latent rows in place;
        `fp8`: an FP8 cache's kv_scales and last_kv (engine.kernels.paged_attention)."""
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.einsum("bhn,hnl->bhl", q[..., :self.nope_dim], w_uk.to(q.dtype))
        q_absorbed = torch.cat((q_latent, q[..., self.nope_dim:]), dim=-1)
        o = paged_attention_decode(q_absorbed, cache, cache, block_tables, context_lens, self.scale, **fp8)
        return torch.einsum("bhl,hvl->bhv", o[..., :self.kv_lora_rank].to(q.dtype), w_uv.to(q.dtype))

    def decode_expanded(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> torch.Tensor:
        """attend_absorbed's result by the expanded form, row by row (the reference it is held to)."""
        out = []
        for b, context in enumerate(context_lens.tolist()):
            out.append(self.attend_expanded(q[b:b + 1], _gather(cache, block_tables[b], context), context))
        return torch.cat(out) if out else q.new_empty(0, self.num_heads, self.v_dim)

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Heads split evenly: the query projection's and kv_b_proj's rows of this rank's heads,
        o_proj row-parallel over their value channels; the latent path replicated."""
        if type(self) is not LatentAttention:
            return None
        heads = even_split(self.num_heads, group.size, group.rank, "latent attention heads")
        q_last = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        for linear, what in ((q_last, "query projection"), (self.kv_b_proj, "kv_b_proj"), (self.o_proj, "o_proj")):
            check_linear(linear, f"latent attention {what}")
        q_rows = span(scaled(heads, self.qk_dim))
        kv_rows = span(scaled(heads, self.nope_dim + self.v_dim))
        out_cols = span(scaled(heads, self.v_dim))

        def apply():
            keep_rows(q_last, q_rows)
            keep_rows(self.kv_b_proj, kv_rows)
            self.o_proj = RowParallelLinear.of(self.o_proj, out_cols, group, True, "latent attention o_proj")
            self.num_heads = heads[1] - heads[0]
        return apply


def _gather(cache: torch.Tensor, block_table: torch.Tensor, context: int) -> torch.Tensor:
    """A sequence's first `context` cached rows, [context, row width]."""
    blocks = block_table[: -(-context // cache.shape[1])]
    return cache.index_select(0, blocks).flatten(0, 2)[:context]
