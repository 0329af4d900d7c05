"""The olmo_hybrid family (OLMo Hybrid, Ai2): gated delta-rule linear attention layers and
OLMo 3 full-attention layers, per `layer_types`.

The two kinds of layer are built differently:
- a linear-attention layer is pre-norm (h + mixer(norm(h)), then h + mlp(norm(h))): a plain
  DecoderLayer whose mixer is the Gated DeltaNet kind with OLMo's projections: q, k, v, the gate
  g (the norm's z), b and a each their own linear, beta doubled where linear_allow_neg_eigval
  (a range of [0, 2]), the output norm's epsilon fixed at 1e-5 as in FLA;
- a full-attention layer is post-norm, as OLMo 2/3's (h + norm(attention(h)), then
  h + norm(mlp(h))), its queries and keys RMS-normalised over all heads together before rotary,
  no rotary at all (NoPE) where the config has no rope_theta.
The recurrent state, its cache and hand-off are the Gated DeltaNet kind's, unchanged. Neither
layer runs in the CPU one-call decode (their layer path is exact). Under tensor parallelism both
shard by heads; the attention's q/k norms over all heads then all-reduce their sums of squares,
so the KV heads must split evenly over the ranks (a replicated KV head would count twice).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import PagedAttention
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, first_present, qkv_conv_weight, rotary_of, top_level_name
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.hybrid import DecoderLayer, HybridLM, LayerCacheSpec, ModelSpec, mixer_cache_spec
from engine.models.layers import GatedMLP, RMSNorm
from engine.tp.group import TPGroup
from engine.tp.parallel import (Apply, RowParallelLinear, ShardedRMSNorm, all_of, check_linear, keep_rows,
                                reduced_ffn_plan, set_param, span)
from engine.tp.plan import attention_layout, deltanet_layout, expand, scaled

LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
O_NORM_EPS = 1e-5  # FLA's FusedRMSNormGated default, which OLMo Hybrid's checkpoints were trained with


class OlmoGatedDeltaNet(GatedDeltaNetMixer):
    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, act: str, allow_neg_eigval: bool):
        super().__init__(hidden, num_k_heads, num_v_heads, k_head_dim, v_head_dim, conv_kernel, act, O_NORM_EPS)
        del self.in_proj_qkvz, self.in_proj_ba
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.b_proj = nn.Linear(hidden, num_v_heads, bias=False)
        self.a_proj = nn.Linear(hidden, num_v_heads, bias=False)
        self.beta_scale = 2.0 if allow_neg_eigval else 1.0

    def project(self, hidden: torch.Tensor):
        qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), dim=-1)
        z = self.g_proj(hidden).view(hidden.shape[0], self.num_v_heads, self.v_head_dim)
        return qkv, z, self.b_proj(hidden), self.a_proj(hidden)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        beta, g = super().gates(b, a)
        return (beta if self.beta_scale == 1.0 else beta * self.beta_scale), g

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Value heads split, key heads split or replicated (engine.tp.plan), as the kind's own
        plan, on OLMo's separate projections; o_proj (out_proj) row-parallel."""
        if type(self) is not OlmoGatedDeltaNet:
            return None
        lay = deltanet_layout(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim,
                              group.size, group.rank)
        for name in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj", "out_proj"):
            check_linear(getattr(self, name), f"Gated DeltaNet {name}")
        k_rows, v_rows = span(scaled(lay.k_heads, self.k_head_dim)), span(scaled(lay.v_heads, self.v_head_dim))
        v_heads, conv = span(lay.v_heads), expand(lay.conv)

        def apply():
            for name, rows in (("q_proj", k_rows), ("k_proj", k_rows), ("v_proj", v_rows), ("g_proj", v_rows),
                               ("a_proj", v_heads), ("b_proj", v_heads)):
                keep_rows(getattr(self, name), rows)
            set_param(self, "conv_weight", self.conv_weight, 0, conv)
            set_param(self, "dt_bias", self.dt_bias, 0, v_heads)
            set_param(self, "A_log", self.A_log, 0, v_heads)
            self.out_proj = RowParallelLinear.of(self.out_proj, v_rows, group, True, "Gated DeltaNet o_proj")
            self.num_k_heads = lay.k_heads[1] - lay.k_heads[0]
            self.num_v_heads = len(v_heads)
            self.key_dim = self.num_k_heads * self.k_head_dim
            self.value_dim = self.num_v_heads * self.v_head_dim
            self.conv_dim = len(conv)
        return apply


class OlmoAttention(PagedAttention):
    """Attention whose queries and keys are RMS-normalised over all heads together (one norm of
    heads x head_dim channels each) before rotary."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, rotary, eps: float):
        super().__init__(hidden, heads, kv_heads, head_dim, bias, bias, rotary)
        self.q_norm, self.k_norm = RMSNorm(heads * head_dim, eps), RMSNorm(kv_heads * head_dim, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        return self.o_proj(self.attend(q, k, v, batch, kv_cache).reshape(tokens, -1))

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Heads split; the q/k norms over all heads become ShardedRMSNorms (KV heads must split
        evenly: a replicated one would count twice in the shared sum); o_proj row-parallel."""
        if type(self) is not OlmoAttention:
            return None
        lay = attention_layout(self.num_heads, self.num_kv_heads, group.size, group.rank)
        if lay.kv_replicated:
            raise ValueError(f"tensor parallelism: OLMo attention's k norm spans all {self.num_kv_heads} KV "
                             f"heads, which do not split over TP size {group.size}")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            check_linear(getattr(self, name), f"attention {name}")
        q_span, kv_span = scaled(lay.q_heads, self.head_dim), scaled(lay.kv_heads, self.head_dim)

        def apply():
            keep_rows(self.q_proj, span(q_span))
            keep_rows(self.k_proj, span(kv_span))
            keep_rows(self.v_proj, span(kv_span))
            self.q_norm = ShardedRMSNorm(self.q_norm, q_span, group)
            self.k_norm = ShardedRMSNorm(self.k_norm, kv_span, group)
            self.o_proj = RowParallelLinear.of(self.o_proj, span(q_span), group, True, "attention o_proj")
            self.num_heads = lay.q_heads[1] - lay.q_heads[0]
            self.num_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
        return apply


class PostNormLayer(nn.Module):
    """h + norm(attention(h)), then h + norm(mlp(h)). Submodule names follow the checkpoint's."""

    kind = "attention"

    def __init__(self, attention: OlmoAttention, mlp: GatedMLP, hidden: int, eps: float):
        super().__init__()
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def cache_spec(self) -> LayerCacheSpec:
        return mixer_cache_spec(self.kind, self.self_attn)

    def tp_layer_plan(self, group: TPGroup, memo: dict) -> Apply | None:
        """The attention as it shards (its output all-reduced), then the MLP's partial sums
        all-reduced before its post-norm."""
        attention = self.self_attn.tp_plan(group) if type(self) is PostNormLayer else None
        return None if attention is None else all_of([attention, reduced_ffn_plan(self, "mlp", group)])

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, index: int) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(h, batch, caches.kv[index]))
        return h + self.post_feedforward_layernorm(self.mlp(h))


def _layer_types(cfg: ConfigReader, layers_n: int) -> list[str]:
    types = cfg.get("layer_types", list, None)
    if types is None:  # as transformers derives it: full attention every 4th layer, and at least the last
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers_n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    if len(types) != layers_n or any(t not in LAYER_KINDS for t in types):
        raise cfg.unsupported("layer_types", f"expected {layers_n} entries from {sorted(LAYER_KINDS)}")
    return types


def build_olmo_hybrid(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, None) or heads
    if heads % kv_heads:
        raise cfg.unsupported("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    head_dim = cfg.get("head_dim", int, None) or hidden // heads
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    act = cfg.get("hidden_act", str, "silu")
    inter = cfg.positive_int("intermediate_size")
    k_heads = cfg.get("linear_num_key_heads", int, None) or heads
    v_heads = cfg.get("linear_num_value_heads", int, None) or heads
    if v_heads % k_heads:
        raise cfg.unsupported("linear_num_value_heads", f"is not a multiple of linear_num_key_heads={k_heads}")
    k_dim = cfg.get("linear_key_head_dim", int, None) or int(0.75 * hidden / k_heads)
    v_dim = cfg.get("linear_value_head_dim", int, None) or 2 * k_dim
    types = _layer_types(cfg, layers_n)
    max_position = cfg.positive_int("max_position_embeddings", 65536)
    rope = cfg.get("rope_parameters", dict, None)
    rotary = rotary_of(cfg, head_dim, max_position) if rope and rope.get("rope_theta") is not None else None
    layers = []
    for kind in types:
        mlp = GatedMLP(hidden, inter, act)
        if kind == "full_attention":
            attention = OlmoAttention(hidden, heads, kv_heads, head_dim, cfg.get("attention_bias", bool, False),
                                      rotary, eps)
            layers.append(PostNormLayer(attention, mlp, hidden, eps))
        else:
            mixer = OlmoGatedDeltaNet(hidden, k_heads, v_heads, k_dim, v_dim,
                                      cfg.positive_int("linear_conv_kernel_dim", 4), act,
                                      cfg.get("linear_allow_neg_eigval", bool, True))
            layers.append(DecoderLayer("gated_deltanet", RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), mlp))
    spec = ModelSpec("olmo_hybrid", cfg.positive_int("vocab_size"), hidden, max_position, _eos_ids(cfg),
                     cfg.get("bos_token_id", int, None))
    return HybridLM(spec, layers, RMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, False))


_LINEAR = {"out_proj": "o_proj", "norm": "o_norm"}
_PRE_NORM = {"input_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn": "mlp"}
# OLMo's own checkpoint names, which transformers renames on load (and writes back on save)
_OLMO_NAMES = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


def olmo_hybrid_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.norm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part == "mixer":  # a linear-attention layer's Gated DeltaNet
        if rest == "conv_weight":
            return lambda w: qkv_conv_weight(w, f"{p}.linear_attn")
        module, _, tail = rest.partition(".")
        return f"{p}.linear_attn.{_LINEAR.get(module, module)}{'.' + tail if tail else ''}"
    part = _PRE_NORM.get(part, part)
    if part in _OLMO_NAMES:
        return first_present(f"{p}.{_OLMO_NAMES[part]}.{rest}", f"{p}.{part}.{rest}")
    return f"{p}.{part}.{rest}"


FAMILIES = {"olmo_hybrid": (build_olmo_hybrid, olmo_hybrid_names)}
