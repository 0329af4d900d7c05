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
not align with the steps: only the float summation order changes. `ssd_chunk_scan_varlen_ref`
is the same for several sequences at once (each from its own state), as a step's prefill rows.

`ssd_chunk_scan_triton` is the same algorithm in three launches: per chunk, the state it
adds from zero and its total log decay; per head, a sequential pass over the chunks that
turns those into the state entering each chunk (and h_L); per chunk, the output. Decay
exponents are sums over a run of steps built from pieces of that run (cumsums local to a tile
of at most 64 steps plus running tile totals), never a difference of two chunk-long cumsums.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import jit, next_power_of_2, tl


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
    check_chunk_scan(x, dt, A, B, C, h0)
    y, h = ssd_chunk_scan_varlen_ref(x, dt, A, B, C, h0[None], [0, x.shape[0]], chunk_size)
    return y, h[0]


def ssd_chunk_scan_varlen_ref(x, dt, A, B, C, h0, bounds: list[int], chunk_size):
    """Sequences back to back (`bounds`: host offsets 0, ..., T), each from its own state h0[n]
    [N, H, P, N]: y [T, H, P] and the final states [N, H, P, N]. Each sequence is padded to
    whole chunks with steps that change nothing (no decay, no input), so every chunk of every
    sequence goes through each product at once, and one state per sequence is carried across
    chunk positions together."""
    heads, head_dim = x.shape[1:]
    groups, lengths = B.shape[1], [end - start for start, end in zip(bounds, bounds[1:])]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"every sequence needs a token: bounds {bounds}")
    chunk = max(1, min(chunk_size, max(lengths)))
    layout = _padded_layout(bounds, chunk, x.shape[0])
    index, kept, grid, real = (t.to(x.device, non_blocking=True) for t in layout)  # no wait for queued work
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [T, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    x_dt = x.float() * dt[..., None]
    a = dt * A.float()  # [T, H] log decay per step

    def chunks(t):
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return t.index_select(0, index).view(-1, chunk, *t.shape[1:])

    x_dt, a, B, C = chunks(x_dt), chunks(a), chunks(B), chunks(C)  # padded steps: a = 0, x = 0
    prefix = a.cumsum(dim=1)  # [c, l, H]: sum a[0..l]
    suffix = a.flip(1).cumsum(dim=1).flip(1) - a  # sum a[l+1..end]

    # Within each chunk: y_i += sum_j<=i (C_i . B_j) exp(sum a[j+1..i]) dt_j x_j
    weights = torch.einsum("cihn,cjhn->chij", C, B) * torch.exp(_segment_sums(a))
    y = torch.einsum("chij,cjhp->cihp", weights, x_dt)
    # Each chunk's own contribution to the state at its end, from zero.
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", B, torch.exp(suffix), x_dt)
    chunk_decay = torch.exp(prefix[:, -1])  # [c, H]
    decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, heads)])[grid]  # [N, j, H]
    adds = torch.cat([chunk_states, chunk_states.new_zeros(1, *chunk_states.shape[1:])])[grid]
    starts = []
    h = h0.float()
    for j in range(grid.shape[1]):  # one [N, H, P, N] step per chunk position, not per token
        starts.append(h)
        h = h * decay[:, j][..., None, None] + adds[:, j]
    starts = torch.stack(starts, dim=1)  # [N, j, H, P, N]: state entering each chunk
    starts = starts.flatten(0, 1).index_select(0, real)  # [c, H, P, N], in chunk order
    y = y + torch.einsum("clhn,chpn->clhp", C, starts) * torch.exp(prefix)[..., None]
    return y.reshape(-1, heads, head_dim).index_select(0, kept), h


def _padded_layout(bounds: list[int], chunk: int, pad_row: int):
    """Host index tensors of the padded layout: `index`, the token each padded step reads
    (sequence n's tokens, then `pad_row`, an appended zero row, up to whole chunks); `kept`, the
    padded steps that are real tokens, in token order; `grid` [N, most chunks], the chunk at
    position j of sequence n, or the count of chunks (an appended chunk that keeps the state as
    it is); `real`, where each chunk sits in the flattened grid."""
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    counts = -(-lengths // chunk)
    padded = counts * chunk
    seq = torch.repeat_interleave(torch.arange(len(lengths)), padded)
    offset = torch.arange(int(padded.sum())) - torch.repeat_interleave(padded.cumsum(0) - padded, padded)
    inside = offset < lengths[seq]
    index = torch.where(inside, starts[seq] + offset, pad_row)
    firsts = counts.cumsum(0) - counts
    position = torch.arange(int(counts.max()))
    grid = torch.where(position < counts[:, None], firsts[:, None] + position, int(counts.sum()))
    chunk_seq = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    real = chunk_seq * len(position) + (torch.arange(int(counts.sum())) - firsts[chunk_seq])
    return index, inside.nonzero().squeeze(1), grid, real


def check_chunk_scan(x, dt, A, B, C, h0):
    if x.dim() != 3 or B.dim() != 3:
        raise ValueError(f"shapes: x {tuple(x.shape)} (want [L, H, P]), B {tuple(B.shape)} (want [L, G, N])")
    length, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    if groups == 0 or heads % groups:
        raise ValueError(f"{heads} heads are not a multiple of {groups} groups")
    wanted = {"dt": (dt, (length, heads)), "A": (A, (heads,)), "B": (B, (length, groups, d_state)),
              "C": (C, (length, groups, d_state)), "h0": (h0, (heads, head_dim, d_state))}
    for name, (tensor, shape) in wanted.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} (x is {tuple(x.shape)})")


def ssd_chunk_scan_triton(x, dt, A, B, C, h0, chunk_size):
    check_chunk_scan(x, dt, A, B, C, h0)
    length, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    h0 = h0.float().contiguous()  # read only: it may be a view of the engine's state pool
    if length == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device), h0.clone()
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    chunk = max(1, min(chunk_size, length))
    n_chunks = -(-length // chunk)
    # Every block is at least 16 wide: tl.dot's minimum on GPUs; masks cover the padding.
    n_pad = max(16, next_power_of_2(d_state))
    block_l = max(16, min(64, next_power_of_2(chunk), 4096 // n_pad))
    block_p = max(16, min(64, next_power_of_2(head_dim)))
    tiles = -(-chunk // block_l)
    p_blocks = -(-head_dim // block_p)
    kw = dict(device=x.device, dtype=torch.float32)
    states = torch.empty(n_chunks, heads, head_dim, d_state, **kw)
    chunk_decay = torch.empty(n_chunks, heads, **kw)  # log decay across each whole chunk
    y = torch.empty(length, heads, head_dim, **kw)
    h_last = torch.empty(heads, head_dim, d_state, **kw)
    strides = (x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), A.stride(0),
               B.stride(0), B.stride(1))

    _chunk_state_kernel[(n_chunks, heads, p_blocks)](
        x, dt, A, B, states, chunk_decay, length, chunk, heads, head_dim, d_state, heads // groups, *strides,
        TILES=tiles, BLOCK_L=block_l, BLOCK_P=block_p, N_PAD=n_pad)
    size = head_dim * d_state
    block = min(1024, next_power_of_2(size))
    _state_passing_kernel[(heads, -(-size // block))](
        states, chunk_decay, h0, h_last, n_chunks, heads, size, BLOCK=block)
    _chunk_output_kernel[(n_chunks * tiles, heads, p_blocks)](
        x, dt, A, B, C, states, y, length, chunk, tiles, heads, head_dim, d_state, heads // groups, *strides,
        C.stride(0), C.stride(1), y.stride(0), y.stride(1),
        BLOCK_L=block_l, BLOCK_P=block_p, N_PAD=n_pad)
    return y, h_last


@jit
def _chunk_state_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, states_ptr, decay_ptr,
                        length, chunk, heads, head_dim, d_state, heads_per_group,
                        x_stride_l, x_stride_h, dt_stride_l, dt_stride_h, A_stride, B_stride_l, B_stride_g,
                        TILES: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                        N_PAD: tl.constexpr):
    """states[c, h] = sum over the chunk's steps l of exp(a[l+1..end]) dt_l x_l (outer) B_l;
    decay[c, h] = a[0..end]."""
    c = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    p_ok = p < head_dim
    n_ok = n < d_state
    A = tl.load(A_ptr + head * A_stride).to(tl.float32)

    acc = tl.zeros([BLOCK_P, N_PAD], dtype=tl.float32)
    after = tl.zeros([], dtype=tl.float32)  # sum of a over the chunk's steps past the tile
    for back in range(TILES):  # last tile first, so `after` is known for each
        l = (TILES - 1 - back) * BLOCK_L + tl.arange(0, BLOCK_L)  # noqa: E741 (the SSD papers' step index)
        t = c.to(tl.int64) * chunk + l  # int64: t * stride may exceed 2**31
        ok = (l < chunk) & (t < length)  # padded steps: dt = 0, so no decay and no input
        dt = tl.load(dt_ptr + t * dt_stride_l + head * dt_stride_h, mask=ok, other=0.0).to(tl.float32)
        a = dt * A
        suffix = tl.cumsum(a, axis=0, reverse=True) - a + after  # a[l+1..end of chunk]
        x = tl.load(x_ptr + t[:, None] * x_stride_l + head * x_stride_h + p[None, :],
                    mask=ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
        B = tl.load(B_ptr + t[:, None] * B_stride_l + group * B_stride_g + n[None, :],
                    mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        xw = x * (tl.exp(suffix) * dt)[:, None]
        acc += tl.dot(tl.trans(xw), B, input_precision="ieee")  # not tf32: it keeps ~3 significant digits
        after += tl.sum(a, axis=0)

    row = (c.to(tl.int64) * heads + head) * head_dim
    tl.store(states_ptr + (row + p[:, None]) * d_state + n[None, :], acc,
             mask=p_ok[:, None] & n_ok[None, :])
    if tl.program_id(2) == 0:
        tl.store(decay_ptr + c * heads + head, after)


@jit
def _state_passing_kernel(states_ptr, decay_ptr, h0_ptr, h_last_ptr, n_chunks, heads, size,
                          BLOCK: tl.constexpr):
    """In place: states[c, h] <- the state entering chunk c; h_last <- the state after the last."""
    head = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = e < size
    h = tl.load(h0_ptr + head * size + e, mask=ok, other=0.0)
    for c in range(n_chunks):
        at = states_ptr + (c * heads + head).to(tl.int64) * size + e
        own = tl.load(at, mask=ok, other=0.0)
        tl.store(at, h, mask=ok)
        h = h * tl.exp(tl.load(decay_ptr + c * heads + head)) + own
    tl.store(h_last_ptr + head * size + e, h, mask=ok)


@jit
def _chunk_output_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, states_ptr, y_ptr,
                         length, chunk, tiles, heads, head_dim, d_state, heads_per_group,
                         x_stride_l, x_stride_h, dt_stride_l, dt_stride_h, A_stride, B_stride_l, B_stride_g,
                         C_stride_l, C_stride_g, y_stride_l, y_stride_h,
                         BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr):
    """y_i = sum_{j<=i in the chunk} (C_i . B_j) exp(a[j+1..i]) dt_j x_j + exp(a[0..i]) C_i . h_c
    for the rows i of one tile of one chunk, h_c the state entering the chunk."""
    c = tl.program_id(0) // tiles
    m = tl.program_id(0) % tiles
    head = tl.program_id(1)
    group = head // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    r = tl.arange(0, BLOCK_L)
    p_ok = p < head_dim
    n_ok = n < d_state
    A = tl.load(A_ptr + head * A_stride).to(tl.float32)

    i = m * BLOCK_L + r
    t_i = c.to(tl.int64) * chunk + i  # int64: t * stride may exceed 2**31
    ok_i = (i < chunk) & (t_i < length)
    dt_i = tl.load(dt_ptr + t_i * dt_stride_l + head * dt_stride_h, mask=ok_i, other=0.0).to(tl.float32)
    a_i = dt_i * A
    prefix_i = tl.cumsum(a_i, axis=0)  # a[tile start..i]
    C_i = tl.load(C_ptr + t_i[:, None] * C_stride_l + group * C_stride_g + n[None, :],
                  mask=ok_i[:, None] & n_ok[None, :], other=0.0).to(tl.float32)

    # The diagonal tile: a[j+1..i] summed exactly, as a column-wise cumsum of a masked to k > j.
    below = r[:, None] > r[None, :]
    seg = tl.cumsum(tl.where(below, a_i[:, None], 0.0), axis=0)
    B_i = tl.load(B_ptr + t_i[:, None] * B_stride_l + group * B_stride_g + n[None, :],
                  mask=ok_i[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    x_i = tl.load(x_ptr + t_i[:, None] * x_stride_l + head * x_stride_h + p[None, :],
                  mask=ok_i[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    cb = tl.dot(C_i, tl.trans(B_i), input_precision="ieee")  # not tf32: it keeps ~3 significant digits
    w = tl.where(below | (r[:, None] == r[None, :]), cb * tl.exp(seg), 0.0)
    acc = tl.dot(w, x_i * dt_i[:, None], input_precision="ieee")

    # Earlier tiles, nearest first: a[j+1..i] = (j's tile after j) + (tiles between) + (i's tile to i).
    between = tl.zeros([], dtype=tl.float32)
    for back in range(m):
        j = (m - 1 - back) * BLOCK_L + r
        t_j = c.to(tl.int64) * chunk + j
        ok_j = t_j < length  # j < i's tile start < chunk
        dt_j = tl.load(dt_ptr + t_j * dt_stride_l + head * dt_stride_h, mask=ok_j, other=0.0).to(tl.float32)
        a_j = dt_j * A
        suffix_j = tl.cumsum(a_j, axis=0, reverse=True) - a_j
        B_j = tl.load(B_ptr + t_j[:, None] * B_stride_l + group * B_stride_g + n[None, :],
                      mask=ok_j[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        x_j = tl.load(x_ptr + t_j[:, None] * x_stride_l + head * x_stride_h + p[None, :],
                      mask=ok_j[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
        cb = tl.dot(C_i, tl.trans(B_j), input_precision="ieee")
        w = cb * tl.exp(prefix_i[:, None] + between + suffix_j[None, :])
        acc += tl.dot(w, x_j * dt_j[:, None], input_precision="ieee")
        between += tl.sum(a_j, axis=0)

    # The state entering the chunk, decayed to each row: `between` is now a[chunk start..tile start).
    state = states_ptr + ((c.to(tl.int64) * heads + head) * head_dim + p[None, :]) * d_state + n[:, None]
    h_T = tl.load(state, mask=n_ok[:, None] & p_ok[None, :], other=0.0)  # [N, P]
    acc += tl.exp(prefix_i + between)[:, None] * tl.dot(C_i, h_T, input_precision="ieee")
    tl.store(y_ptr + t_i[:, None] * y_stride_l + head * y_stride_h + p[None, :], acc,
             mask=ok_i[:, None] & p_ok[None, :])
