"""Sharding each mixer and FFN kind of the zoo in place, for one rank.

Every `plan_*` function validates first and returns an `apply()` that mutates: shard_model
validates the whole model before it changes anything. Modules are matched by exact type: a
subclass may have changed its forward in ways its base's sharding would get silently wrong.

After sharding, a mixer's output is already all-reduced (it is added to the replicated
residual); an FFN's output is the rank's partial sum, reduced once by a Reduced wrapper around
the whole FFN (routed experts + shared expert: one all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from engine.models.attention import PagedAttention
from engine.models.families_falcon_h1 import FalconH1MLP, FalconH1Mixer, ScaledLinear
from engine.models.families_lfm2 import Lfm2Attention
from engine.models.families_qwen3_next import GatedAttention, SharedExpertMoE
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.layers import GatedMLP, GatedRMSNorm, SparseMoE, SummedFFN
from engine.models.mamba2 import Mamba2Mixer
from engine.models.nemotron_moe import NemotronMLP, NemotronMoE
from engine.models.short_conv import ShortConvMixer
from engine.models.ssm import MambaMixer
from engine.tp.group import TPGroup
from engine.tp.parallel import RowParallelLinear, keep_rows, set_param, sliced_gated_norm
from engine.tp.plan import attention_layout, deltanet_layout, even_split, expand, mamba2_layout, scaled

Apply = Callable[[], None]


def check_linear(linear, what: str, row_sliceable: bool = False) -> None:
    allowed = (nn.Linear, ScaledLinear) if row_sliceable else (nn.Linear,)
    if type(linear) not in allowed:
        raise ValueError(f"tensor parallelism: {what} is a {type(linear).__name__}, not "
                         f"{' or '.join(t.__name__ for t in allowed)}")


def _span(span) -> list[int]:
    return list(range(*span))


# ----------------------------------------------------------------------------- attention

def plan_attention(attn: PagedAttention, group: TPGroup) -> Apply:
    """Query heads split; KV heads split or replicated (engine.tp.plan); o_proj row-parallel."""
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    lay = attention_layout(heads, kv_heads, group.size, group.rank)
    for name in ("q_proj", "k_proj", "v_proj"):
        check_linear(getattr(attn, name), f"attention {name}", row_sliceable=True)
    check_linear(attn.o_proj, "attention o_proj")
    q_unit = attn.q_proj.out_features // heads  # GatedAttention: query then gate, per head
    q_rows = _span(scaled(lay.q_heads, q_unit))
    kv_rows = _span(scaled(lay.kv_heads, head_dim))
    cols = _span(scaled(lay.q_heads, head_dim))

    def apply():
        keep_rows(attn.q_proj, q_rows)
        keep_rows(attn.k_proj, kv_rows)
        keep_rows(attn.v_proj, kv_rows)
        attn.o_proj = RowParallelLinear.of(attn.o_proj, cols, group, True, "attention o_proj")
        attn.num_heads = lay.q_heads[1] - lay.q_heads[0]
        attn.num_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
    return apply


# ----------------------------------------------------------------------------- FFNs

def plan_partial_ffn(ffn: nn.Module, group: TPGroup) -> Apply:
    """Make an FFN return this rank's partial sum (the caller all-reduces it once)."""
    size, rank = group.size, group.rank
    if type(ffn) in (GatedMLP, FalconH1MLP):
        rows = _span(even_split(ffn.gate_proj.out_features, size, rank, "MLP intermediate size"))
        check_linear(ffn.gate_proj, "MLP gate_proj")
        check_linear(ffn.up_proj, "MLP up_proj")
        check_linear(ffn.down_proj, "MLP down_proj")

        def apply():
            keep_rows(ffn.gate_proj, rows)
            keep_rows(ffn.up_proj, rows)
            ffn.down_proj = RowParallelLinear.of(ffn.down_proj, rows, group, False, "MLP down_proj")
        return apply
    if type(ffn) is NemotronMLP:
        rows = _span(even_split(ffn.up_proj.out_features, size, rank, "MLP intermediate size"))
        check_linear(ffn.up_proj, "MLP up_proj")
        check_linear(ffn.down_proj, "MLP down_proj")

        def apply():
            keep_rows(ffn.up_proj, rows)
            ffn.down_proj = RowParallelLinear.of(ffn.down_proj, rows, group, False, "MLP down_proj")
        return apply
    if type(ffn) is SparseMoE:
        inter = ffn.down.shape[2]
        rows = _span(even_split(inter, size, rank, "MoE expert intermediate size"))

        def apply():  # gate_up stacks [gate; up] per expert: keep the same rows of each half
            set_param(ffn, "gate_up", ffn.gate_up, 1, rows + [inter + r for r in rows])
            set_param(ffn, "down", ffn.down, 2, rows)
        return apply
    if type(ffn) is SummedFFN:
        return _all([plan_partial_ffn(part, group) for part in ffn.parts])
    if type(ffn) is SharedExpertMoE:  # routed + sigmoid(gate(x)) * shared: linear in both
        return _all([plan_partial_ffn(ffn.routed, group), plan_partial_ffn(ffn.shared, group)])
    if type(ffn) is NemotronMoE:
        rows = _span(even_split(ffn.up.shape[1], size, rank, "MoE expert intermediate size"))
        shared = plan_partial_ffn(ffn.shared, group)
        if ffn.fc2_latent is not None:
            check_linear(ffn.fc2_latent, "MoE fc2_latent")

        def apply():
            set_param(ffn, "up", ffn.up, 1, rows)
            set_param(ffn, "down", ffn.down, 2, rows)
            if ffn.fc2_latent is not None:  # linear in the routed partial sums: bias on rank 0 only
                ffn.fc2_latent = RowParallelLinear.of(ffn.fc2_latent, range(ffn.fc2_latent.in_features),
                                                      group, False, "MoE fc2_latent")
            shared()
        return apply
    raise ValueError(f"tensor parallelism: FFN kind {type(ffn).__name__} is not supported at TP size {size}")


def _all(applies: list[Apply]) -> Apply:
    def apply():
        for a in applies:
            a()
    return apply


# ----------------------------------------------------------------------------- recurrent mixers

def plan_mamba(m: MambaMixer, group: TPGroup) -> Apply:
    """Channels split; x_proj row-parallel (dt, B, C all-reduced before use), dt_proj
    column-parallel, out_proj row-parallel."""
    d = m.d_inner
    ch = _span(even_split(d, group.size, group.rank, "Mamba d_inner channels"))
    check_linear(m.in_proj, "Mamba in_proj")
    check_linear(m.dt_proj, "Mamba dt_proj")
    check_linear(m.x_proj, "Mamba x_proj")
    check_linear(m.out_proj, "Mamba out_proj")

    def apply():
        keep_rows(m.in_proj, ch + [d + c for c in ch])  # x then gate
        set_param(m, "conv_weight", m.conv_weight, 0, ch)
        if m.conv_bias is not None:
            set_param(m, "conv_bias", m.conv_bias, 0, ch)
        m.x_proj = RowParallelLinear.of(m.x_proj, ch, group, True, "Mamba x_proj")
        keep_rows(m.dt_proj, ch)
        set_param(m, "A_log", m.A_log, 0, ch)
        set_param(m, "D", m.D, 0, ch)
        m.out_proj = RowParallelLinear.of(m.out_proj, ch, group, True, "Mamba out_proj")
        m.d_inner = len(ch)
    return apply


def plan_mamba2(m: Mamba2Mixer, group: TPGroup) -> Apply:
    """Heads split, B/C groups split or replicated (engine.tp.plan); conv channels, dt, dt_bias,
    A_log and D follow; the gated norm all-reduces when its groups span ranks."""
    lay = mamba2_layout(m.num_heads, m.head_dim, m.n_groups, m.d_state, group.size, group.rank)
    check_linear(m.in_proj, "Mamba2 in_proj")
    check_linear(m.out_proj, "Mamba2 out_proj")
    if m.norm is not None and type(m.norm) is not GatedRMSNorm:
        raise ValueError(f"tensor parallelism: Mamba2 norm is a {type(m.norm).__name__}, not a GatedRMSNorm")
    ssm = scaled(lay.heads, m.head_dim)
    conv = expand(lay.conv)
    # in_proj rows: z (d_ssm), then the conv input xBC (conv_dim), then dt (one per head).
    rows = (_span(ssm) + [m.d_ssm + c for c in conv]
            + [m.d_ssm + m.conv_dim + h for h in range(*lay.heads)])
    heads = _span(lay.heads)

    def apply():
        keep_rows(m.in_proj, rows)
        set_param(m, "conv_weight", m.conv_weight, 0, conv)
        if m.conv_bias is not None:
            set_param(m, "conv_bias", m.conv_bias, 0, conv)
        for name in ("dt_bias", "A_log", "D"):
            set_param(m, name, getattr(m, name), 0, heads)
        if m.norm is not None:
            m.norm = sliced_gated_norm(m.norm, ssm, group)
        m.out_proj = RowParallelLinear.of(m.out_proj, _span(ssm), group, True, "Mamba2 out_proj")
        m.num_heads = len(heads)
        m.n_groups = lay.groups[1] - lay.groups[0]
        m.d_ssm = ssm[1] - ssm[0]
        m.conv_dim = len(conv)
    return apply


def plan_deltanet(m: GatedDeltaNetMixer, group: TPGroup) -> Apply:
    """Value heads split, key heads split or replicated (engine.tp.plan); out_proj row-parallel."""
    lay = deltanet_layout(m.num_k_heads, m.num_v_heads, m.k_head_dim, m.v_head_dim, group.size, group.rank)
    check_linear(m.in_proj_qkvz, "Gated DeltaNet in_proj_qkvz")
    check_linear(m.in_proj_ba, "Gated DeltaNet in_proj_ba")
    check_linear(m.out_proj, "Gated DeltaNet out_proj")
    dk, dv, r = m.k_head_dim, m.v_head_dim, m.num_v_heads // m.num_k_heads
    qkvz, ba = [], []
    # Both projections are grouped by key head (GatedDeltaNetMixer.split_projections): per key
    # head q, k, the v's of its r value heads, their z's; and its r b's, then its r a's.
    for kh in range(*lay.k_heads):
        base = kh * (2 * dk + 2 * r * dv)
        mine = [v - kh * r for v in range(*lay.v_heads) if v // r == kh]
        qkvz += list(range(base, base + 2 * dk))
        qkvz += [base + 2 * dk + j * dv + i for j in mine for i in range(dv)]
        qkvz += [base + 2 * dk + r * dv + j * dv + i for j in mine for i in range(dv)]
        ba += [kh * 2 * r + j for j in mine] + [kh * 2 * r + r + j for j in mine]
    conv = expand(lay.conv)
    v_heads = _span(lay.v_heads)
    out_cols = _span(scaled(lay.v_heads, dv))

    def apply():
        keep_rows(m.in_proj_qkvz, qkvz)
        keep_rows(m.in_proj_ba, ba)
        set_param(m, "conv_weight", m.conv_weight, 0, conv)
        set_param(m, "dt_bias", m.dt_bias, 0, v_heads)
        set_param(m, "A_log", m.A_log, 0, v_heads)
        m.out_proj = RowParallelLinear.of(m.out_proj, out_cols, group, True, "Gated DeltaNet out_proj")
        m.num_k_heads = lay.k_heads[1] - lay.k_heads[0]
        m.num_v_heads = len(v_heads)
        m.key_dim, m.value_dim = m.num_k_heads * dk, m.num_v_heads * dv
        m.conv_dim = len(conv)
    return apply


def plan_short_conv(m: ShortConvMixer, group: TPGroup) -> Apply:
    """Channels split: each of the B, C and x gates, the conv and its state; out_proj row-parallel."""
    h = m.hidden
    ch = _span(even_split(h, group.size, group.rank, "short conv channels"))
    check_linear(m.in_proj, "short conv in_proj")
    check_linear(m.out_proj, "short conv out_proj")

    def apply():
        keep_rows(m.in_proj, ch + [h + c for c in ch] + [2 * h + c for c in ch])
        set_param(m, "conv_weight", m.conv_weight, 0, ch)
        if m.conv_bias is not None:
            set_param(m, "conv_bias", m.conv_bias, 0, ch)
        m.out_proj = RowParallelLinear.of(m.out_proj, ch, group, True, "short conv out_proj")
        m.hidden = len(ch)
    return apply


MIXERS = {PagedAttention: plan_attention, GatedAttention: plan_attention, Lfm2Attention: plan_attention,
          MambaMixer: plan_mamba, Mamba2Mixer: plan_mamba2, FalconH1Mixer: plan_mamba2,
          GatedDeltaNetMixer: plan_deltanet, ShortConvMixer: plan_short_conv}
