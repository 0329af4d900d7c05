"""The falcon_h1 family: config.json -> HybridLM, and our parameter names -> HF tensor names.

Every Falcon-H1 layer runs a Mamba2 mixer and attention side by side on the same normed input
and adds both to the residual, then a gated MLP. muP-style multipliers scale the embedding,
the LM head, the key projection, attention's input and output, the SSM's input and output,
each of the five parts of the SSM's in_proj (z, x, B, C, dt) and the MLP's gate and output.

Each layer keeps both KV rows and Mamba2 state ("attention+mamba2"). Decode runs the engine's
Mamba2 recurrence, which clamps dt to time_step_limit exactly as the chunked prefill does
(transformers' own one-token path skips that clamp; its full-sequence forward, the reference
we judge against, applies it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.decode_plan import plan_layer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, all_of, reduced_ffn_plan
from engine.models.attention import PagedAttention
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, top_level_name, rotary_of
from engine.models.hybrid import HybridLM, LayerCacheSpec, ModelSpec
from engine.models.layers import ACTIVATIONS, GatedMLP, GatedRMSNorm, RMSNorm
from engine.models.mamba2 import Mamba2Mixer

NO_LIMIT = (0.0, float("inf"))


def _scale_rows(linear: nn.Linear, scale: float, rows: slice = slice(None), bias: bool = True) -> None:
    """Multiply the output rows of a loaded linear by a constant (its weight, and its bias unless
    the constant scaled the input instead)."""
    with torch.no_grad():
        linear.weight[rows] *= scale
        if bias and linear.bias is not None:
            linear.bias[rows] *= scale


def _times(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t if scale == 1.0 else t * scale


class ScaledLinear(nn.Linear):
    """nn.Linear whose output is multiplied by a constant; parameter names stay weight/bias."""

    tp_row_sliceable = True  # F.linear times a constant: keeping some rows keeps its meaning

    def __init__(self, in_features: int, out_features: int, bias: bool, scale: float):
        super().__init__(in_features, out_features, bias=bias)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _times(super().forward(x), self.scale)

    def folded(self) -> nn.Linear:
        """A plain nn.Linear on the same parameters with the scale multiplied in (it can then
        join q and v in one packed GEMM)."""
        _scale_rows(self, self.scale)
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        return plain


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2 with the input scaled by ssm_in_multiplier, the in_proj parts by ssm_multipliers,
    and out_proj's bias governed by projectors_bias (in_proj's by mamba_proj_bias)."""

    def __init__(self, *args, in_scale: float, part_scales: tuple[float, ...], out_bias: bool, **kw):
        super().__init__(*args, **kw)
        self.out_proj = nn.Linear(self.d_ssm, self.in_proj.in_features, bias=out_bias)
        self.in_scale = in_scale
        self.part_scales = part_scales  # z, x, B, C, dt

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, state) -> torch.Tensor:
        return super().forward(_times(hidden, self.in_scale), batch, state)

    def fold_scales(self) -> None:
        """The input scale and the five parts' scales, into in_proj's rows (z, x, B, C, dt)."""
        _scale_rows(self.in_proj, self.in_scale, bias=False)
        group = self.n_groups * self.d_state
        bounds = [0, self.d_ssm, 2 * self.d_ssm, 2 * self.d_ssm + group, 2 * self.d_ssm + 2 * group,
                  2 * self.d_ssm + 2 * group + self.num_heads]
        for scale, start, end in zip(self.part_scales, bounds, bounds[1:]):
            _scale_rows(self.in_proj, scale, slice(start, end))
        self.in_scale, self.part_scales = 1.0, (1.0,) * 5

    def tp_plan(self, group: TPGroup) -> Apply:
        return self.tp_plan_of_mamba2(group)  # the scales are folded into in_proj at load

    def splits_plainly(self) -> bool:
        """Once the scales are folded into in_proj (at load), forward is Mamba2's."""
        return self.in_scale == 1.0 and all(s == 1.0 for s in self.part_scales)

    def split_projection(self, zxbcdt: torch.Tensor):
        z, xbc, dt = super().split_projection(zxbcdt)
        if all(s == 1.0 for s in self.part_scales):
            return z, xbc, dt
        sz, sx, sb, sc, sdt = self.part_scales
        group = self.n_groups * self.d_state
        x, B, C = torch.split(xbc, [self.d_ssm, group, group], dim=-1)
        return z * sz, torch.cat([x * sx, B * sb, C * sc], dim=-1), dt * sdt


class FalconH1MLP(GatedMLP):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool,
                 gate_scale: float, down_scale: float):
        super().__init__(hidden, intermediate, act, bias)
        self.gate_scale, self.down_scale = gate_scale, down_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packs_fused():  # scales folded in: the fused gate/up and SwiGLU paths
            return super().forward(x)
        hidden = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_scale)
        return self.down_proj(hidden) * self.down_scale

    def fold_scales(self) -> None:
        _scale_rows(self.gate_proj, self.gate_scale)
        _scale_rows(self.down_proj, self.down_scale)
        self.gate_scale = self.down_scale = 1.0

    def packs_fused(self) -> bool:
        return self.gate_scale == 1.0 and self.down_scale == 1.0

    def tp_partial_plan(self, group: TPGroup) -> Apply:
        return self.tp_partial_plan_of_mlp(group)  # the scales multiply whole rows and columns


class FalconH1Layer(nn.Module):
    """h + ssm_out * mamba(n) + attn_out * attention(attn_in * n) with n = norm(h), then the MLP.
    Submodule names follow the checkpoint's so the name map stays trivial."""

    def __init__(self, hidden: int, eps: float, mamba: FalconH1Mixer, attention: PagedAttention,
                 mlp: FalconH1MLP, attn_in: float, attn_out: float, ssm_out: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mamba = mamba
        self.self_attn = attention
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = mlp
        self.attn_in, self.attn_out, self.ssm_out = attn_in, attn_out, ssm_out

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec("attention+mamba2", kv=self.self_attn.kv_spec(),
                              state_kind=self.mamba.state_kind, state=tuple(self.mamba.state_spec()))

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, index: int):
        normed = self.input_layernorm(h.to(self.input_layernorm.weight.dtype))
        ssm = _times(self.mamba(normed, batch, caches.state[index]), self.ssm_out)
        attn = _times(self.self_attn(_times(normed, self.attn_in), batch, caches.kv[index]), self.attn_out)
        h, normed = self.pre_ff_layernorm.add_and_norm(ssm + attn, h)  # h + (ssm + attn), normed in one pass
        return h + self.feed_forward(normed)

    def tp_layer_plan(self, group: TPGroup, memo: dict) -> Apply | None:
        if type(self) is not FalconH1Layer:
            return None
        mixer, attention = self.mamba.tp_plan(group), self.self_attn.tp_plan(group)
        if mixer is None or attention is None:
            return None
        return all_of([mixer, attention, reduced_ffn_plan(self, "feed_forward", group)])

    def plan_decode(self, caches: LayerCaches, index: int):
        """Attention beside Mamba2 on one input, in a decode step's one-call plan once the
        multipliers are folded into the weights (engine.kernels.decode_plan.plan_layer)."""
        if not self.attn_in == self.attn_out == self.ssm_out == 1.0:
            return None
        return plan_layer((self.input_layernorm, self.mamba, self.self_attn, self.pre_ff_layernorm,
                           self.feed_forward, 1.0), caches, index)

    def fold_scales(self) -> None:
        """attention's input scale into q/k/v (not their biases), the output scales into the
        projections that produce them: the forward then multiplies nothing."""
        attention = self.self_attn
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            _scale_rows(proj, self.attn_in, bias=False)
        if isinstance(attention.k_proj, ScaledLinear):
            attention.k_proj = attention.k_proj.folded()
        _scale_rows(attention.o_proj, self.attn_out)
        _scale_rows(self.mamba.out_proj, self.ssm_out)
        self.attn_in = self.attn_out = self.ssm_out = 1.0


class FalconH1LM(HybridLM):
    """HybridLM whose logits are multiplied by lm_head_multiplier (not divided: the same op)."""

    def __init__(self, *args, lm_head_scale: float, **kw):
        super().__init__(*args, **kw)
        self.lm_head_scale = lm_head_scale

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)
        return logits if self.lm_head_scale == 1.0 else logits * self.lm_head_scale


def _floats(cfg: ConfigReader, key: str, count: int) -> tuple[float, ...]:
    value = cfg.get(key, list, None)
    if value is None:
        return (1.0,) * count
    if len(value) != count or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                      for v in value):
        raise cfg.unsupported(key, f"expected a list of {count} numbers")
    return tuple(float(v) for v in value)


def _mamba_width(cfg: ConfigReader, hidden: int) -> tuple[int, int, int]:
    """(heads, head_dim, d_ssm). mamba_d_ssm absent means transformers' default 1024; an
    explicit null means mamba_expand * hidden_size."""
    heads = cfg.positive_int("mamba_n_heads", 128)
    d_ssm = cfg.config.get("mamba_d_ssm", 1024)
    if d_ssm is None:
        d_ssm = cfg.positive_int("mamba_expand", 2) * hidden
    elif not isinstance(d_ssm, int) or isinstance(d_ssm, bool) or d_ssm <= 0:
        raise cfg.unsupported("mamba_d_ssm", "expected a positive integer or null")
    head_dim = cfg.get("mamba_d_head", (int, str), "auto")
    if head_dim == "auto":
        if d_ssm % heads:
            raise cfg.unsupported("mamba_n_heads", f"does not divide the SSM width {d_ssm}")
        head_dim = d_ssm // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise cfg.unsupported("mamba_d_head", "expected a positive integer or 'auto'")
    if head_dim * heads != d_ssm:
        raise cfg.unsupported("mamba_d_head", f"{head_dim} * mamba_n_heads={heads} is not the "
                              f"SSM width {d_ssm} (mamba_d_ssm, or mamba_expand * hidden_size)")
    return heads, head_dim, d_ssm


def build_falcon_h1(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("rms_norm_eps", float, 1e-5)
    act = cfg.get("hidden_act", str, "silu")
    if act not in ACTIVATIONS:
        raise cfg.unsupported("hidden_act", f"supported: {sorted(ACTIVATIONS)}")
    max_position = cfg.positive_int("max_position_embeddings", 8192)

    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, None) or heads
    if kv_heads <= 0 or heads % kv_heads:
        raise cfg.unsupported("num_key_value_heads", f"must divide num_attention_heads={heads}")
    head_dim = cfg.get("head_dim", int, None) or hidden // heads
    # transformers' default RoPE for Falcon-H1 rotates the whole head whatever this says, while
    # its scaled variants honour it: refuse rather than guess which one a checkpoint meant.
    rope = cfg.get("rope_parameters", dict, None) or cfg.get("rope_scaling", dict, None) or {}
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", float, 1.0))) != 1.0:
        raise cfg.unsupported("partial_rotary_factor", "partial RoPE is not supported for falcon_h1")
    rotary = rotary_of(cfg, head_dim, max_position)

    m_heads, m_head_dim, d_ssm = _mamba_width(cfg, hidden)
    n_groups = cfg.positive_int("mamba_n_groups", 1)
    if m_heads % n_groups:
        raise cfg.unsupported("mamba_n_groups", f"does not divide mamba_n_heads={m_heads}")
    d_state = cfg.positive_int("mamba_d_state", 256)
    rms_norm = cfg.get("mamba_rms_norm", bool, False)
    before_gate = cfg.get("mamba_norm_before_gate", bool, True)
    part_scales = _floats(cfg, "ssm_multipliers", 5)
    gate_scale, down_scale = _floats(cfg, "mlp_multipliers", 2)
    attention_bias = cfg.get("attention_bias", bool, False)
    key_scale = cfg.get("key_multiplier", float, 1.0)

    layers = []
    for _ in range(cfg.positive_int("num_hidden_layers")):
        # Falcon-H1's gated norm normalises within each of the n_groups groups of channels.
        norm = GatedRMSNorm(d_ssm, d_ssm // n_groups, eps, before_gate) if rms_norm else None
        mamba = FalconH1Mixer(
            hidden, m_heads, m_head_dim, n_groups, d_state, cfg.positive_int("mamba_d_conv", 4),
            cfg.positive_int("mamba_chunk_size", 256), cfg.get("mamba_conv_bias", bool, True),
            cfg.get("mamba_proj_bias", bool, False), act, cfg.float_pair("time_step_limit", NO_LIMIT),
            norm, in_scale=cfg.get("ssm_in_multiplier", float, 1.0), part_scales=part_scales,
            out_bias=cfg.get("projectors_bias", bool, False))
        attention = PagedAttention(hidden, heads, kv_heads, head_dim, attention_bias, attention_bias,
                                   rotary)
        # key_multiplier scales k before RoPE; RoPE is linear, so scaling k_proj's output is it.
        attention.k_proj = ScaledLinear(hidden, kv_heads * head_dim, attention_bias, key_scale)
        mlp = FalconH1MLP(hidden, cfg.positive_int("intermediate_size"), act,
                          cfg.get("mlp_bias", bool, False), gate_scale, down_scale)
        layers.append(FalconH1Layer(hidden, eps, mamba, attention, mlp,
                                    cfg.get("attention_in_multiplier", float, 1.0),
                                    cfg.get("attention_out_multiplier", float, 1.0),
                                    cfg.get("ssm_out_multiplier", float, 1.0)))
    spec = ModelSpec("falcon_h1", cfg.positive_int("vocab_size"), hidden, max_position, _eos_ids(cfg),
                     cfg.get("bos_token_id", int, None))
    return FalconH1LM(spec, layers, RMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, False),
                      embedding_scale=cfg.get("embedding_multiplier", float, 1.0),
                      lm_head_scale=cfg.get("lm_head_multiplier", float, 1.0))


def falcon_h1_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.final_layernorm.weight")) is not None:
        return top
    _, i, rest = name.split(".", 2)
    p = f"model.layers.{i}"
    if rest == "mamba.conv_weight":
        return lambda w: w.get(f"{p}.mamba.conv1d.weight").squeeze(1)
    if rest == "mamba.conv_bias":
        return f"{p}.mamba.conv1d.bias"
    return f"{p}.{rest}"


FAMILIES = {"falcon_h1": (build_falcon_h1, falcon_h1_names)}
