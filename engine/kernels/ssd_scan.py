"""The SSD scan of a Mamba2 layer over one sequence's prefill tokens, from an initial state.

Definition (`ssd_scan_ref`, one token at a time), per head h of group g:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t (outer) B_t,g ;  y_t = h_t . C_t,g
with x: [L, H, P], dt: [L, H] (final: bias, softplus and limits applied), A: [H],
B, C: [L, G, N], h0: [H, P, N]. Returns y [L, H, P] (no D skip) and h_L, both float32.

`ssd_chunk_scan_ref` computes the same with chunks of `chunk_size` tokens and no Python loop
over tokens: within a chunk, y is a masked (C B^T) product weighted by the decays between
positions (exact segment sums, not differences of a long cumsum, which lose digits); across
chunks one [H, P, N] state is carried. Where a sequence's prefill is split across engine
steps, each piece starts from the state the previous piece left, so chunk boundaries need
not align with the steps: only the float summation order changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_scan_ref(x, dt, A, B, C, h0):
    heads, groups = x.shape[1], B.shape[1]
    B = B.float().repeat_interleave(heads // groups, dim=1)
    C = C.float().repeat_interleave(heads // groups, dim=1)
    h = h0.float().clone()
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t].float() * A.float())[:, None, None]
        h = h * decay + (dt[t, :, None] * x[t].float())[:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
    return torch.stack(ys) if ys else x.new_zeros(x.shape, dtype=torch.float32), h


def _segment_sums(a):
    """a: [c, l, H] per-step log decays -> [c, H, l, l] with entry (i, j) = sum a[j+1..i]
    for j <= i, -inf above the diagonal."""
    chunk = a.shape[1]
    a = a.permute(0, 2, 1)[..., None].expand(*a.shape[:1], a.shape[2], chunk, chunk)  # [c,H,l(i),l(j)]
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).tril(-1)
    sums = a.masked_fill(~strict, 0.0).cumsum(dim=-2)
    return sums.masked_fill(~strict.logical_or(torch.eye(chunk, dtype=torch.bool, device=a.device)),
                            float("-inf"))


def ssd_chunk_scan_ref(x, dt, A, B, C, h0, chunk_size):
    length, heads, head_dim = x.shape
    groups = B.shape[1]
    chunk = max(1, min(chunk_size, length))
    pad = (-length) % chunk
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    x_dt = x.float() * dt[..., None]
    a = dt * A.float()  # [L, H] log decay per step

    def chunks(t):
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).view(-1, chunk, *t.shape[1:])

    x_dt, a, B, C = chunks(x_dt), chunks(a), chunks(B), chunks(C)  # padded steps: a = 0, x = 0
    prefix = a.cumsum(dim=1)  # [c, l, H]: sum a[0..l]
    suffix = a.flip(1).cumsum(dim=1).flip(1) - a  # sum a[l+1..end]

    # Within each chunk: y_i += sum_j<=i (C_i . B_j) exp(sum a[j+1..i]) dt_j x_j
    weights = torch.einsum("cihn,cjhn->chij", C, B) * torch.exp(_segment_sums(a))
    y = torch.einsum("chij,cjhp->cihp", weights, x_dt)
    # Each chunk's own contribution to the state at its end, from zero.
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", B, torch.exp(suffix), x_dt)
    chunk_decay = torch.exp(prefix[:, -1])  # [c, H]
    starts = []
    h = h0.float()
    for c in range(x_dt.shape[0]):  # one [H, P, N] step per chunk, not per token
        starts.append(h)
        h = h * chunk_decay[c][:, None, None] + chunk_states[c]
    starts = torch.stack(starts)  # [c, H, P, N]: state entering each chunk
    y = y + torch.einsum("clhn,chpn->clhp", C, starts) * torch.exp(prefix)[..., None]
    return y.reshape(-1, heads, head_dim)[:length], h
