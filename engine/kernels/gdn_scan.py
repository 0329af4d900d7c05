"""The gated delta rule of a Gated DeltaNet layer (Qwen3-Next's linear attention).

Definition (`gated_delta_rule_ref`, one token at a time), per value head h reading key head
h // (Hv / Hk), with a state S [dk, dv] (float32):
    q_t, k_t <- L2-normalised (x / sqrt(|x|^2 + 1e-6)); q_t also scaled by dk^-1/2
    S   <- exp(g_t) S                                   g_t <= 0: the per-head decay
    S   <- S + k_t (outer) beta_t (v_t - S^T k_t)       the delta rule: write only what S
                                                        does not already predict for k_t
    o_t  = S^T q_t
with q, k: [L, Hk, dk]; v: [L, Hv, dv]; g, beta: [L, Hv]; h0: [Hv, dk, dv]. Returns o
[L, Hv, dv] and S_L, both float32. The normalisation is part of the rule (as in the fla
kernels' use_qk_l2norm_in_kernel) so that a fused kernel can do it in registers.

The decay may also be per key channel, g: [L, Hv, dk] (Kimi Delta Attention): then
S <- diag(exp(g_t)) S, each row of S decaying at its own rate. The per-head decay is the case
where g_t is the same for every channel; every function here takes either shape, and the
per-head one runs exactly as it did before the per-channel form existed.

`chunk_gated_delta_rule_ref` computes the same over chunks of `chunk_size` tokens with no
Python loop over tokens. Within a chunk entered with state S0, write D(i, j) = exp(g[j+1..i]
summed) for j <= i and P_i = exp(g[start..i] summed). The values actually written,
u_j = beta_j (v_j - P_j S0^T k_j - sum_{m<j} D(j, m) (k_j . k_m) u_m), solve one unit lower
triangular system per chunk, (I + A) U = beta V - (beta P K) S0 with
A[j, m] = beta_j D(j, m) k_j . k_m (m < j), so U = W - X S0 where W and X (the solutions
against beta V and beta P K) do not depend on S0 and are found for every chunk at once. Then
    o_i = P_i S0^T q_i + sum_{m<=i} D(i, m) (q_i . k_m) u_m
    S   = P_last S0 + sum_m exp(g[m+1..last] summed) k_m (outer) u_m
and only this [Hv, dk, dv] state is carried from chunk to chunk. Every decay exponent is a
sum over a contiguous run of steps, accumulated over that run only, never a difference of two
chunk-long cumsums (those lose digits when g is large and negative). Where a prefill is split
across engine steps each piece starts from the state the previous one left, so chunk
boundaries need not align with steps: only the float summation order changes.

`gated_delta_step_ref` is one decode token for a batch of sequences on the engine's slot
pool: read state[slots], apply one step of the definition, write the rows back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.state_round import in_place_pool, store_slots
from engine.kernels.slot_runs import in_waves

L2_EPS = 1e-6


def prepare_qk(q, k, num_v_heads):
    """float32, L2-normalised, q scaled by dk^-1/2; key heads repeated to serve value heads
    (key head j serves value heads j*r .. j*r + r-1). q, k: [..., Hk, dk] -> [..., Hv, dk]."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * q.shape[-1] ** -0.5
    repeat = num_v_heads // k.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q, k


def per_channel(g, beta) -> bool:
    """Whether the decay g is per key channel ([..., H, dk]) rather than per head ([..., H])."""
    return g.dim() == beta.dim() + 1


def _step(S, q, k, v, g, beta):
    """One token of the rule, batched over leading dims: S [..., H, dk, dv]; q, k [..., H, dk]
    (prepared); v [..., H, dv]; g [..., H] or [..., H, dk], beta [..., H]. Returns (o [..., H, dv], new S)."""
    S = S * (torch.exp(g)[..., None] if per_channel(g, beta) else torch.exp(g)[..., None, None])
    predicted = torch.einsum("...kv,...k->...v", S, k)
    S = S + k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :]
    return torch.einsum("...kv,...k->...v", S, q), S


def gated_delta_rule_ref(q, k, v, g, beta, h0):
    check_rule(q, k, v, g, beta, h0)
    q, k = prepare_qk(q, k, v.shape[1])
    v, g, beta = v.float(), g.float(), beta.float()
    S = h0.float().clone()
    outs = []
    for t in range(v.shape[0]):
        o, S = _step(S, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    return (torch.stack(outs) if outs else v.new_zeros(v.shape)), S


def _segment_sums(g):
    """g: [c, l, H] -> [c, H, l, l] with entry (i, j) = sum g[j+1..i] for j <= i, -inf above."""
    chunk = g.shape[1]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    strict = lower.tril(-1)
    g = g.permute(0, 2, 1)[..., None].expand(g.shape[0], g.shape[2], chunk, chunk)  # [c, H, i, j] = g_i
    sums = g.masked_fill(~strict, 0.0).cumsum(dim=-2)  # running sum down column j of g_i, i > j
    return sums.masked_fill(~lower, float("-inf"))


def chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, chunk_size):
    check_rule(q, k, v, g, beta, h0)
    length, heads, v_dim = v.shape
    k_dim = k.shape[2]
    if length == 0:
        return v.new_zeros(v.shape, dtype=torch.float32), h0.float().clone()
    q, k = prepare_qk(q, k, heads)
    chunk = max(1, min(chunk_size, length))
    pad = (-length) % chunk

    def chunks(t):  # [L, ...] -> [c, l, ...]; padded steps: g = 0, beta = 0, so they change nothing
        return F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad)).view(-1, chunk, *t.shape[1:])

    if per_channel(g, beta):
        return _chunk_rule_per_channel(*(chunks(t) for t in (q, k, v, g, beta)), h0, length)
    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    n_chunks = q.shape[0]
    prefix = g.cumsum(dim=1)  # [c, l, H]: g[start..l]
    suffix = g.flip(1).cumsum(dim=1).flip(1) - g  # g[l+1..end]
    decay = torch.exp(_segment_sums(g))  # [c, H, i, j] = D(i, j), 0 above the diagonal

    k_beta = k * beta[..., None]
    A = (torch.einsum("cihd,cjhd->chij", k_beta, k) * decay).tril(-1)
    rhs = torch.cat((v * beta[..., None], k_beta * torch.exp(prefix)[..., None]), dim=-1)
    eye = torch.eye(chunk, dtype=A.dtype, device=A.device)
    solved = torch.linalg.solve_triangular(A + eye, rhs.transpose(1, 2), upper=False, unitriangular=True)
    W, X = solved.split([v_dim, k_dim], dim=-1)  # [c, H, l, dv], [c, H, l, dk]

    attend = torch.einsum("cihd,cjhd->chij", q, k) * decay  # D(i, m) q_i . k_m, m <= i
    q_read = (q * torch.exp(prefix)[..., None]).transpose(1, 2)  # [c, H, l, dk]: reads S0
    k_write = (k * torch.exp(suffix)[..., None]).transpose(1, 2)  # writes into the chunk's end state
    chunk_decay = torch.exp(prefix[:, -1])[..., None, None]  # [c, H, 1, 1]

    out = torch.empty(n_chunks, heads, chunk, v_dim, dtype=torch.float32, device=v.device)
    S = h0.float()
    for c in range(n_chunks):  # one [H, dk, dv] state per chunk, not per token
        U = W[c] - X[c] @ S
        out[c] = q_read[c] @ S + attend[c] @ U
        S = S * chunk_decay[c] + k_write[c].transpose(-1, -2) @ U
    return out.transpose(1, 2).reshape(-1, heads, v_dim)[:length], S


def _chunk_rule_per_channel(q, k, v, g, beta, h0, length):
    """chunk_gated_delta_rule_ref's chunks with a decay per key channel (g [c, l, Hv, dk]): the
    same solve, with every D(i, j) a vector over dk that weights the products k_j . k_m and
    q_i . k_m channel by channel. The [H, l, l, dk] decays are built one chunk at a time."""
    n_chunks, chunk, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).tril()
    strict = lower.tril(-1)
    eye = torch.eye(chunk, dtype=torch.float32, device=g.device)
    out = torch.empty(n_chunks, chunk, heads, v_dim, dtype=torch.float32, device=v.device)
    S = h0.float()
    for c in range(n_chunks):
        qc, kc, vc, gc, bc = q[c], k[c], v[c], g[c], beta[c]  # [l, H, dk] ... [l, H]
        prefix = gc.cumsum(dim=0)  # [l, H, dk]: g[start..i]
        suffix = gc.flip(0).cumsum(dim=0).flip(0) - gc  # g[i+1..end]
        # D(i, j) per channel, i >= j: sum g[j+1..i] down column j ([H, i, j, dk]).
        rows = gc.permute(1, 0, 2)[:, :, None, :].expand(heads, chunk, chunk, k_dim)
        sums = rows.masked_fill(~strict[None, :, :, None], 0.0).cumsum(dim=1)
        decay = torch.exp(sums.masked_fill(~lower[None, :, :, None], float("-inf")))
        k_beta = kc * bc[..., None]
        A = torch.einsum("jhd,mhd,hjmd->hjm", k_beta, kc, decay) * strict
        rhs = torch.cat((vc * bc[..., None], k_beta * torch.exp(prefix)), dim=-1).transpose(0, 1)
        solved = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
        W, X = solved.split([v_dim, k_dim], dim=-1)  # [H, l, dv], [H, l, dk]
        U = W - X @ S
        attend = torch.einsum("ihd,mhd,himd->him", qc, kc, decay)
        q_read = (qc * torch.exp(prefix)).transpose(0, 1)  # [H, l, dk]
        out[c] = (q_read @ S + attend @ U).transpose(0, 1)
        k_write = (kc * torch.exp(suffix)).transpose(0, 1)
        S = S * torch.exp(prefix[-1])[..., None] + k_write.transpose(-1, -2) @ U
    return out.reshape(-1, heads, v_dim)[:length], S


def gated_delta_step_ref(state, slots, q, k, v, g, beta, positions=None, slot_runs=False):
    """state: [slots, Hv, dk, dv] (rows `slots` read, updated, written back; slots distinct
    unless `slot_runs`: engine.kernels.slot_runs); slots: int64 [b]; q, k: [b, Hk, dk];
    v: [b, Hv, dv]; g: [b, Hv] or [b, Hv, dk]; beta: [b, Hv]; positions: int64 [b], each row's
    sequence length after the step, for a half-width pool. Returns o [b, Hv, dv] float32."""
    check_step(state, slots, q, k, v, g, beta)
    if slot_runs:
        return in_waves(slots, torch.empty(v.shape, dtype=torch.float32, device=v.device),
                        lambda rows: gated_delta_step_ref(state, slots[rows], q[rows], k[rows], v[rows], g[rows],
                                                          beta[rows], None if positions is None else positions[rows]))
    in_place_pool(state, positions)
    q, k = prepare_qk(q, k, v.shape[1])
    o, S = _step(state.index_select(0, slots).float(), q, k, v.float(), g.float(), beta.float())
    store_slots(state, slots, S, positions)
    return o


def _check_shapes(wanted, context):
    for name, (tensor, shape) in wanted.items():
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} ({context})")


def _check_heads(q, v):
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"shapes: q {tuple(q.shape)} (want [L, Hk, dk]), v {tuple(v.shape)} (want [L, Hv, dv])")
    if q.shape[1] == 0 or v.shape[1] % q.shape[1]:
        raise ValueError(f"{v.shape[1]} value heads are not a multiple of {q.shape[1]} key heads")


def _decay_shape(g, rows, heads, k_dim):
    """The shape g must have: per head, or per key channel where it has a third dimension."""
    return (rows, heads, k_dim) if g.dim() == 3 else (rows, heads)


def check_rule(q, k, v, g, beta, h0):
    _check_heads(q, v)
    length, k_heads, k_dim = q.shape
    heads, v_dim = v.shape[1:]
    _check_shapes({"k": (k, q.shape), "v": (v, (length, heads, v_dim)), "g": (g, _decay_shape(g, length, heads, k_dim)),
                   "beta": (beta, (length, heads)), "h0": (h0, (heads, k_dim, v_dim))},
                  f"q is {tuple(q.shape)}, v {tuple(v.shape)}")


def check_step(state, slots, q, k, v, g, beta):
    _check_heads(q, v)
    batch, k_heads, k_dim = q.shape
    heads, v_dim = v.shape[1:]
    if state.dim() != 4:
        raise ValueError(f"state has shape {tuple(state.shape)}, expected [slots, Hv, dk, dv]")
    _check_shapes({"k": (k, q.shape), "v": (v, (batch, heads, v_dim)), "g": (g, _decay_shape(g, batch, heads, k_dim)),
                   "beta": (beta, (batch, heads)), "slots": (slots, (batch,)),
                   "state": (state, (state.shape[0], heads, k_dim, v_dim))},
                  f"q is {tuple(q.shape)}, v {tuple(v.shape)}")
