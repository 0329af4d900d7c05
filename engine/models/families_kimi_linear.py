"""The kimi_linear family (Kimi Linear, Moonshot AI): Kimi Delta Attention layers and multi-head
latent attention layers per `layer_types`, a SwiGLU MLP in the first layers and DeepSeek-V3
style experts after them (`mlp_layer_types`, or `first_k_dense_replace`).

- Kimi Delta Attention (KDA) is the gated delta rule with a decay per key channel instead of per
  head: a parameterisation of the Gated DeltaNet kind, not a kind of its own. Its state (the
  conv's last inputs of q | k | v and the [heads, dk, dv] delta-rule state) means exactly what
  the Gated DeltaNet kind's means, so the slot pool, the prefix cache's checkpoints, the
  hand-off and the TP shard map take it unchanged; only the decay's shape differs, and the
  rule's kernels (engine.kernels.gdn_scan) take either shape. q, k and v are separate
  projections under one short conv (SiLU); the decay is -exp(A_log[h]) softplus(f_b(f_a(x)) +
  dt_bias) per channel; beta = sigmoid(b_proj(x)); the output is RMS-normalised per head and
  gated by sigmoid(g_b(g_a(x))).
- The full-attention layers are MLA with no rotary embedding (engine.models.mla): the cache keeps
  one latent row per token; decode attends in the latent space.
- The experts route as DeepSeek-V3's (engine.models.nemotron_moe.grouped_sigmoid_route), plus
  `num_shared_experts` (at least one) shared experts as one MLP of that many times the width;
  every MLP, expert and the KDA conv use hidden_act.

Config keys are read under transformers' names and under the original checkpoint's
(num_experts / n_routed_experts, num_experts_per_token / num_experts_per_tok, ...), the layer
pattern from `layer_types` or `linear_attn_config`'s 1-indexed `kda_layers` and
`full_attn_layers`; tensors under transformers' names or the original ones
(block_sparse_moe, experts.E.w1/w2/w3, per-projection convs, the forget gate's tensors at the
attention's top level).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, _stacked_experts, first_present, qkv_conv_weight, top_level_name
from engine.models.gated_deltanet import GatedDeltaNetMixer, HeadGatedRMSNorm
from engine.models.hybrid import DecoderLayer, HybridLM, ModelSpec
from engine.models.layers import GatedMLP, RMSNorm, SparseMoE, SummedFFN
from engine.models.mla import LatentAttention
from engine.models.nemotron_moe import grouped_sigmoid_route
from engine.models.expert_dispatch import dispatch_experts
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, set_param, span
from engine.tp.plan import deltanet_layout, expand, scaled

LATENT_EPS = 1e-6  # transformers' (and DeepSeek's) q_a / kv_a norms: their default epsilon, not rms_norm_eps


class SigmoidGatedRMSNorm(HeadGatedRMSNorm):
    """Per-head RMS norm in float32 (the weight too), times sigmoid(z): KDA's output norm."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y.float()
        y = self.weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))
        return (y * torch.sigmoid(z.float())).to(dtype)


class KimiDeltaAttention(GatedDeltaNetMixer):
    """The Gated DeltaNet kind with equal key and value heads, a decay per key channel and
    Kimi's projections (module docstring). `a` below is the forget gate's projection [T, H * dk]."""

    def __init__(self, hidden: int, heads: int, head_dim: int, conv_kernel: int, act: str, eps: float):
        super().__init__(hidden, heads, heads, head_dim, head_dim, conv_kernel, act, eps)
        del self.in_proj_qkvz, self.in_proj_ba
        width = heads * head_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))  # per channel, where the Gated DeltaNet kind's is per head
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.norm = SigmoidGatedRMSNorm(head_dim, eps)

    def project(self, hidden: torch.Tensor):
        tokens = hidden.shape[0]
        qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), dim=-1)
        z = self.g_b_proj(self.g_a_proj(hidden)).view(tokens, self.num_v_heads, self.v_head_dim)
        return qkv, z, self.b_proj(hidden), self.f_b_proj(self.f_a_proj(hidden))

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta = sigmoid(b) [T, H]; g = -exp(A_log) softplus(a + dt_bias) [T, H, dk], float32."""
        a = (a.float() + self.dt_bias.float()).view(a.shape[0], self.num_v_heads, self.k_head_dim)
        return b.sigmoid().float(), self.decay()[:, None] * F.softplus(a)

    def tp_plan(self, group: TPGroup) -> Apply | None:
        """Heads split evenly (engine.tp.plan's Gated DeltaNet layout with equal key and value
        heads); the low-rank projections' first halves and the norm weight replicated; o_proj
        row-parallel."""
        if type(self) is not KimiDeltaAttention:
            return None
        lay = deltanet_layout(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim,
                              group.size, group.rank)
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "out_proj")
        for name in names:
            check_linear(getattr(self, name), f"Kimi Delta Attention {name}")
        rows = span(scaled(lay.v_heads, self.v_head_dim))
        heads, conv = span(lay.v_heads), expand(lay.conv)

        def apply():
            for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj"):
                keep_rows(getattr(self, name), rows)
            keep_rows(self.b_proj, heads)
            set_param(self, "conv_weight", self.conv_weight, 0, conv)
            set_param(self, "dt_bias", self.dt_bias, 0, rows)
            set_param(self, "A_log", self.A_log, 0, heads)
            self.out_proj = RowParallelLinear.of(self.out_proj, rows, group, True, "Kimi Delta Attention o_proj")
            self.num_k_heads = self.num_v_heads = len(heads)
            self.key_dim = self.value_dim = len(rows)
            self.conv_dim = len(conv)
        return apply


class GroupRoutedMoE(SparseMoE):
    """SparseMoE's gated experts under DeepSeek-V3's routing, the router in float32 as
    transformers keeps it. Router and correction bias replicated under TP; experts shard as
    SparseMoE's."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, n_group: int,
                 topk_group: int, normalize: bool, scaling: float, act: str):
        super().__init__(hidden, intermediate, num_experts, top_k, act, normalize)
        self.correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(F.linear(x.float(), self.router.weight.float()))
        return dispatch_experts(x, experts, weights.to(x.dtype), self.num_experts, self._expert,
                                (self.gate_up, self.down, self._between))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_route(logits, self.correction_bias, self.n_group, self.topk_group, self.top_k,
                                     self.normalize_top_k, self.scaling)

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        return self.tp_partial_plan_of_experts(group) if type(self) is GroupRoutedMoE else None


def _first(cfg: ConfigReader, keys: tuple[str, ...], kind, default):
    """The value of the first of `keys` the config has (transformers' name or the original's)."""
    for key in keys:
        if cfg.config.get(key) is not None:
            return key, cfg.get(key, kind)
    return keys[0], default


def _layer_types(cfg: ConfigReader, layers_n: int, linear: dict) -> list[str]:
    types = cfg.get("layer_types", list, None)
    key = "layer_types"
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        key, types = "linear_attn_config", [None] * layers_n
        try:
            for kind, listed in (("full_attention", linear["full_attn_layers"]), ("linear_attention", linear["kda_layers"])):
                for layer in listed:
                    types[int(layer) - 1] = kind  # 1-indexed in the original config
        except (TypeError, ValueError, IndexError):
            raise cfg.unsupported(key, f"kda_layers / full_attn_layers must be 1-indexed layers of {layers_n}") from None
    elif types is None:  # as transformers derives it
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers_n)]
    if len(types) != layers_n or any(t not in ("linear_attention", "full_attention") for t in types):
        raise cfg.unsupported(key, f"expected {layers_n} entries of linear_attention or full_attention")
    return types


def _mlp_types(cfg: ConfigReader, layers_n: int) -> list[str]:
    types = cfg.get("mlp_layer_types", list, None)
    if types is None:
        dense = cfg.get("first_k_dense_replace", int, 1)
        types = ["dense" if i < dense else "sparse" for i in range(layers_n)]
    if len(types) != layers_n or any(t not in ("dense", "sparse") for t in types):
        raise cfg.unsupported("mlp_layer_types", f"expected {layers_n} entries of dense or sparse")
    return types


def _moe_of(cfg: ConfigReader, hidden: int, act: str):
    key, experts = _first(cfg, ("num_experts", "n_routed_experts", "num_local_experts"), int, 256)
    k_key, top_k = _first(cfg, ("num_experts_per_token", "num_experts_per_tok"), int, 8)
    g_key, n_group = _first(cfg, ("num_expert_group", "n_group"), int, 1)
    topk_group = cfg.get("topk_group", int, 1)
    s_key, shared = _first(cfg, ("num_shared_experts", "n_shared_experts"), int, 1)
    _, normalize = _first(cfg, ("moe_renormalize", "norm_topk_prob"), bool, True)
    if experts <= 0 or not 0 < top_k <= experts:
        raise cfg.unsupported(k_key, f"must be in [1, {key}={experts}]")
    if n_group <= 0 or experts % n_group or not 0 < topk_group <= n_group or experts // n_group < 2:
        raise cfg.unsupported(g_key, f"{experts} experts cannot form {n_group} groups of two or more "
                              f"with topk_group={topk_group}")
    if cfg.get("moe_router_activation_func", str, "sigmoid") != "sigmoid":
        raise cfg.unsupported("moe_router_activation_func", "only sigmoid routing is supported")
    if shared <= 0:  # transformers then still builds (and saves) a shared expert of width 0
        raise cfg.unsupported(s_key, "at least one shared expert is required")
    width, scaling = cfg.positive_int("moe_intermediate_size"), cfg.get("routed_scaling_factor", float, 1.0)

    def moe() -> nn.Module:
        routed = GroupRoutedMoE(hidden, width, experts, top_k, n_group, topk_group, normalize, scaling, act)
        return SummedFFN(routed, GatedMLP(hidden, width * shared, act))
    return moe


def build_kimi_linear(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    eps = cfg.get("rms_norm_eps", float, 1e-5)
    act = cfg.get("hidden_act", str, "silu")
    if cfg.get("mla_use_nope", bool, True) is not True:
        raise cfg.unsupported("mla_use_nope", "only Kimi Linear's position-free MLA is supported")
    linear = cfg.get("linear_attn_config", dict, None) or {}
    head_dim = int(linear.get("head_dim", cfg.get("linear_head_dim", int, 128)))
    linear_heads = int(linear.get("num_heads", cfg.get("linear_num_heads", int, 32)))
    conv_kernel = int(linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", int, 4)))
    if min(head_dim, linear_heads, conv_kernel) <= 0:
        raise cfg.unsupported("linear_attn_config", "head_dim, num_heads and short_conv_kernel_size must be positive")
    types, mlp_types = _layer_types(cfg, layers_n, linear), _mlp_types(cfg, layers_n)
    q_lora = cfg.get("q_lora_rank", int, None, allow_none=True)
    if q_lora is not None and q_lora <= 0:
        raise cfg.unsupported("q_lora_rank", "must be positive or null")
    v_dim = cfg.get("v_head_dim", int, None, allow_none=True) or 128
    mla = (heads, q_lora, cfg.positive_int("kv_lora_rank"), cfg.get("qk_nope_head_dim", int, 128),
           cfg.get("qk_rope_head_dim", int, 64), v_dim, cfg.get("attention_bias", bool, False), LATENT_EPS)
    if mla[3] < 0 or mla[4] < 0 or mla[3] + mla[4] <= 0:
        raise cfg.unsupported("qk_nope_head_dim", f"and qk_rope_head_dim={mla[4]} must give a positive query width")
    moe = _moe_of(cfg, hidden, act) if "sparse" in mlp_types else None
    dense_width = cfg.positive_int("intermediate_size")
    layers = []
    for kind, mlp_kind in zip(types, mlp_types):
        if kind == "full_attention":
            layer_kind, mixer = "latent_attention", LatentAttention(hidden, *mla)
        else:
            layer_kind, mixer = "kimi_delta_attention", KimiDeltaAttention(hidden, linear_heads, head_dim,
                                                                           conv_kernel, act, eps)
        ffn = moe() if mlp_kind == "sparse" else GatedMLP(hidden, dense_width, act)
        layers.append(DecoderLayer(layer_kind, RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), ffn))
    _, max_position = _first(cfg, ("model_max_length", "max_position_embeddings"), int, 1048576)
    spec = ModelSpec("kimi_linear", cfg.positive_int("vocab_size"), hidden, max_position, _eos_ids(cfg),
                     cfg.get("bos_token_id", int, None))
    # Never tied, whatever tie_word_embeddings says: transformers ties nothing for this family
    # (its _tied_weights_keys is empty) and saves lm_head apart.
    return HybridLM(spec, layers, RMSNorm(hidden, eps), False)


# Our mixer parameter names -> transformers' (both kinds sit under self_attn, and share q_proj and o_proj)
_RENAMED = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm",
            "out_proj": "o_proj", "norm": "o_norm"}
_FORGET_GATE = ("f_a_proj", "f_b_proj", "dt_bias", "A_log")


def _mixer_name(p: str, rest: str):
    module, _, tail = rest.partition(".")
    if rest == "conv_weight":  # one conv over q | k | v, or the original's three
        return lambda w: qkv_conv_weight(w, p)
    if module in _FORGET_GATE:  # under forget_gate in transformers, at the top in the original
        mine = f"{p}.forget_gate.{rest}"
        if rest == "A_log":  # stored [1, 1, heads, 1]
            return lambda w: w.get(mine if mine in w else f"{p}.A_log").reshape(-1)
        return first_present(f"{p}.{rest}", mine)
    return f"{p}.{_RENAMED.get(module, module)}{'.' + tail if tail else ''}"


def _ffn_name(p: str, rest: str):
    """The original names (block_sparse_moe, experts.E.w1/w2/w3: what transformers writes) or
    transformers' runtime ones (mlp, stacked gate_up_proj / down_proj)."""
    roots = (f"{p}.block_sparse_moe", f"{p}.mlp")
    part, _, tail = rest.partition(".")
    if part != "parts":  # a dense MLP
        return first_present(*(f"{r}.{rest}" for r in roots))
    index, _, tail = tail.partition(".")
    if index == "1":  # the shared experts
        return first_present(*(f"{r}.shared_experts.{tail}" for r in roots))
    if tail == "router.weight":
        return first_present(*(f"{r}.gate.weight" for r in roots))
    if tail == "correction_bias":
        return first_present(*(f"{r}.gate.e_score_correction_bias" for r in roots))
    fused, halves = {"gate_up": ("gate_up_proj", ("w1", "w3")), "down": ("down_proj", ("w2",))}[tail]
    return lambda w: _stacked_experts(w, roots[1] if f"{roots[1]}.experts.{fused}" in w else roots[0], halves, fused)


def kimi_linear_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.norm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part == "input_norm":
        return f"{p}.input_layernorm.{rest}"
    if part == "ffn_norm":
        return f"{p}.post_attention_layernorm.{rest}"
    if part == "ffn":
        return _ffn_name(p, rest)
    return _mixer_name(f"{p}.self_attn", rest)


FAMILIES = {"kimi_linear": (build_kimi_linear, kimi_linear_names)}
