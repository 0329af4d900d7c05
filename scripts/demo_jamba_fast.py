"""Training-time forward pass for transformers' ``JambaForCausalLM``.

transformers runs Jamba's selective scan as a Python loop over every token
when the CUDA ``mamba-ssm`` kernels are absent, which makes CPU training slow.
``fast_forward`` computes the same function with the *same parameters* (it
reads the modules of a real ``JambaForCausalLM``, so the state dict is the
HF one by construction) but runs the selective scan as a custom autograd
function: an in-place loop over time with no autograd graph per step, and a
hand-written backward pass (a reverse scan).

Used only by ``scripts/train_demo_model.py``; the training script checks
that HF's own forward on the saved checkpoint matches this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _sum_n(m, v):
    """(b, T, d, n) x (b, T, n) -> (b, T, d): sum over n."""
    return (m * v.unsqueeze(2)).sum(-1)


def _sum_d(v, m):
    """(b, T, d) x (b, T, d, n) -> (b, T, n): sum over d (a batched row-vector product)."""
    b, T, d, n = m.shape
    return torch.bmm(v.reshape(b * T, 1, d), m.reshape(b * T, d, n)).view(b, T, n)


class SelectiveScan(torch.autograd.Function):
    """y_t = C_t . h_t,  h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t,  h_{-1} = 0.

    Shapes: x, dt (B, L, D); A (D, N); Bm, Cm (B, L, N). Runs outside
    autograd, over blocks of ``block`` time steps (small enough to stay in
    cache), with an in-place loop over the steps of a block; the backward
    pass is written out by hand (a reverse scan over the saved states)."""

    @staticmethod
    def forward(ctx, x, dt, A, Bm, Cm, block):
        b, L, d = x.shape
        y = x.new_empty(b, L, d)
        a_blocks, h_blocks = [], []
        h = None
        for s0 in range(0, L, block):
            s1 = min(s0 + block, L)
            a = torch.exp(dt[:, s0:s1].unsqueeze(-1) * A)  # decays in (0, 1]
            hs = (dt[:, s0:s1] * x[:, s0:s1]).unsqueeze(-1) * Bm[:, s0:s1].unsqueeze(2)
            if h is not None:
                hs[:, 0].addcmul_(a[:, 0], h)
            for t in range(1, s1 - s0):
                hs[:, t].addcmul_(a[:, t], hs[:, t - 1])
            y[:, s0:s1] = _sum_n(hs, Cm[:, s0:s1])
            h = hs[:, -1]
            a_blocks.append(a)
            h_blocks.append(hs)
        ctx.block = block
        ctx.a_blocks, ctx.h_blocks = a_blocks, h_blocks  # intermediates (neither inputs nor outputs)
        ctx.save_for_backward(x, dt, A, Bm, Cm)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, dt, A, Bm, Cm = ctx.saved_tensors
        block = ctx.block
        a_blocks, h_blocks = ctx.a_blocks, ctx.h_blocks
        b, L, d = x.shape
        gx = torch.empty_like(x)
        gdt = torch.empty_like(dt)
        gB = torch.empty_like(Bm)
        gC = torch.empty_like(Cm)
        gA = torch.zeros_like(A)
        carry = None  # a_{t+1} * g_{t+1} for the first step after the current block
        for k, s0 in reversed(list(enumerate(range(0, L, block)))):
            s1 = min(s0 + block, L)
            xk, dtk, Bk, Ck, gyk = x[:, s0:s1], dt[:, s0:s1], Bm[:, s0:s1], Cm[:, s0:s1], gy[:, s0:s1]
            a, hs = a_blocks[k], h_blocks[k]
            gC[:, s0:s1] = _sum_d(gyk, hs)
            g = gyk.unsqueeze(-1) * Ck.unsqueeze(2)  # direct dLoss/dh_t, then reverse scan
            if carry is not None:
                g[:, -1].add_(carry)
            for t in range(s1 - s0 - 2, -1, -1):
                g[:, t].addcmul_(a[:, t + 1], g[:, t + 1])
            carry = a[:, 0] * g[:, 0]
            # g is now dLoss/du_t with u_t = dt_t x_t B_t
            g_dtx = _sum_n(g, Bk)
            gB[:, s0:s1] = _sum_d(dtk * xk, g)
            # dLoss/dlog a_t = g_t * a_t * h_{t-1}
            g.mul_(a)
            g[:, 1:].mul_(hs[:, :-1])
            if k > 0:
                g[:, 0].mul_(h_blocks[k - 1][:, -1])
            else:
                g[:, 0].zero_()
            gdt[:, s0:s1] = g_dtx * xk + (g * A).sum(-1)
            gA += (g * dtk.unsqueeze(-1)).sum((0, 1))
            gx[:, s0:s1] = g_dtx * dtk
        return gx, gdt, gA, gB, gC, None


def selective_scan(x, dt, A, Bm, Cm, block: int = 16):
    return SelectiveScan.apply(x, dt, A, Bm, Cm, block)


def reference_scan(x, dt, A, Bm, Cm):
    """Token-by-token reference (as in transformers), for tests."""
    a = torch.exp(dt.unsqueeze(-1) * A)
    u = (dt * x).unsqueeze(-1) * Bm.unsqueeze(2)
    h = torch.zeros_like(u[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = a[:, t] * h + u[:, t]
        ys.append((h * Cm[:, t].unsqueeze(1)).sum(-1))
    return torch.stack(ys, dim=1)


def mamba_forward(m, hs: torch.Tensor) -> torch.Tensor:
    L = hs.shape[1]
    proj = m.in_proj(hs)  # (B, L, 2D)
    xs, gate = proj.chunk(2, dim=-1)
    xs = F.conv1d(
        xs.transpose(1, 2), m.conv1d.weight, m.conv1d.bias, padding=m.conv_kernel_size - 1, groups=m.intermediate_size
    )[:, :, :L]
    xs = F.silu(xs).transpose(1, 2)  # (B, L, D)
    ts, Bm, Cm = torch.split(m.x_proj(xs), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    ts = rms_norm(ts, m.dt_layernorm)
    Bm = rms_norm(Bm, m.b_layernorm)
    Cm = rms_norm(Cm, m.c_layernorm)
    dt = F.softplus(ts @ m.dt_proj.weight.t() + m.dt_proj.bias.float())
    A = -torch.exp(m.A_log.float())
    y = selective_scan(xs, dt, A, Bm, Cm)
    y = y + xs * m.D
    y = y * F.silu(gate)
    return m.out_proj(y)


def attention_forward(attn, hs: torch.Tensor) -> torch.Tensor:
    b, L, _ = hs.shape
    hd = attn.head_dim
    q = attn.q_proj(hs).view(b, L, -1, hd).transpose(1, 2)
    k = attn.k_proj(hs).view(b, L, -1, hd).transpose(1, 2)
    v = attn.v_proj(hs).view(b, L, -1, hd).transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    return attn.o_proj(o.transpose(1, 2).reshape(b, L, -1))


def moe_forward(moe, hs: torch.Tensor):
    """Dense evaluation of HF's top-k MoE (fine for a handful of experts).

    Returns the output and the router logits (for the load-balancing loss)."""
    b, L, h = hs.shape
    flat = hs.reshape(-1, h)
    logits = F.linear(flat, moe.router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    topw, topi = torch.topk(probs, moe.top_k, dim=-1)
    weights = torch.zeros_like(probs).scatter(1, topi, topw).to(hs.dtype)  # (T, E), unnormalised like HF
    ex = moe.experts
    gu = torch.einsum("th,eoh->eto", flat, ex.gate_up_proj)  # (E, T, 2I)
    g, u = gu.chunk(2, dim=-1)
    act = ex.act_fn(g) * u
    out = torch.einsum("eti,ehi->eth", act, ex.down_proj)  # (E, T, H)
    out = torch.einsum("eth,te->th", out, weights)
    return out.view(b, L, h), logits


def mlp_forward(mlp, hs):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(hs)) * mlp.up_proj(hs))


def fast_forward(model, input_ids: torch.Tensor):
    """Logits of ``JambaForCausalLM`` ``model`` for ``input_ids`` (B, L), plus router logits."""
    core = model.model
    hs = core.embed_tokens(input_ids)
    router_logits = []
    for layer in core.layers:
        res = hs
        x = rms_norm(hs, layer.input_layernorm)
        if hasattr(layer, "mamba"):
            x = mamba_forward(layer.mamba, x)
        else:
            x = attention_forward(layer.self_attn, x)
        hs = res + x
        res = hs
        x = rms_norm(hs, layer.pre_ff_layernorm)
        ff = layer.feed_forward
        if hasattr(ff, "router"):
            x, rl = moe_forward(ff, x)
            router_logits.append(rl)
        else:
            x = mlp_forward(ff, x)
        hs = res + x
    hs = rms_norm(hs, core.final_layernorm)
    return model.lm_head(hs), router_logits


def load_balancing_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss, same formula as transformers' ``load_balancing_loss_func``."""
    if not router_logits:
        return torch.zeros(())
    logits = torch.cat(router_logits, dim=0)
    probs = torch.softmax(logits, dim=-1)
    _, sel = torch.topk(probs, top_k, dim=-1)
    mask = F.one_hot(sel, num_experts).float()  # (T, k, E)
    tokens_per_expert = mask.mean(dim=0)  # (k, E)
    router_prob = probs.mean(dim=0)  # (E,)
    return torch.sum(tokens_per_expert * router_prob.unsqueeze(0)) * num_experts
