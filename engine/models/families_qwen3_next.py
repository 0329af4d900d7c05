"""The qwen3_next family: config.json -> HybridLM, and our parameter names -> HF tensor names.

Qwen3-Next stacks Gated DeltaNet layers ("linear_attention") and gated full attention
("full_attention") per `layer_types` (or every `full_attention_interval`-th layer); each layer
has an FFN: a sparse MoE with a sigmoid-gated shared expert, or a dense gated MLP on the
layers in `mlp_only_layers` and those off the `decoder_sparse_step` period. Its RMSNorms
(layer norms, final norm, q/k norms) scale by (1 + weight): the checkpoint stores weights
centred on zero. The Gated DeltaNet's own output norm scales by weight alone.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import cpu, uses_cpu_kernel
from engine.kernels.decode_plan import LayerPlan, Needs, plan_shared_mlp
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, all_of, partial_ffn_plan
from engine.models.attention import NormedAttention
from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, _stacked_experts, rotary_of, top_level_name
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.hybrid import DecoderLayer, HybridLM, ModelSpec
from engine.models.layers import ACTIVATIONS, GatedMLP, RMSNorm, RotaryEmbedding, SparseMoE
from engine.models.mtp_head import MTPHead

GDN_CHUNK_SIZE = 64  # tokens per chunk of the prefill scan (an engine choice; fla uses 64 too)
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
ATTENTION_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


class OffsetRMSNorm(RMSNorm):
    """RMSNorm computed in float32 and scaled by (1 + weight) before casting back. At load a
    float32 weight takes the 1 in (fold_scales, the same float32 sum the forward would compute),
    after which it is a plain RMSNorm: (1 + w) x and w' x with w' = 1 + w are the same bits. A
    bf16 weight is left as it is: 1 + w would round to bf16, where the forward keeps float32."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)
        self.offset = 1.0

    def fold_scales(self) -> None:
        if self.weight.dtype != torch.float32:
            return
        with torch.no_grad():
            self.weight.add_(self.offset)
        self.offset = 0.0

    def fits_decode_plan(self) -> bool:
        """Once the offset is folded into a float32 weight, a plain RMSNorm to the decode plan."""
        return not self.offset and self.weight.dtype == torch.float32 and self.weight.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset:
            return super().forward(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.offset:
            return super().add_and_norm(x, residual)
        h = residual + x
        return h, self(h)


class GatedAttention(NormedAttention):
    """Full attention with an output gate: q_proj yields per head the query (head_dim) then a
    gate (head_dim); q and k are normalised per head (OffsetRMSNorm) before rotary; the
    attention output is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: RotaryEmbedding | None, eps: float):
        super().__init__(hidden, num_heads, num_kv_heads, head_dim, bias, rotary, OffsetRMSNorm(head_dim, eps),
                         OffsetRMSNorm(head_dim, eps), gated=True)


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k) plus a shared expert scaled by sigmoid(shared_gate(x))."""

    def __init__(self, routed: SparseMoE, shared: GatedMLP, hidden: int):
        super().__init__()
        self.routed = routed
        self.shared = shared
        self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed, gate, shared = self.routed(x), self.shared_gate(x), self.shared(x)
        if uses_cpu_kernel(routed) and uses_cpu_kernel(gate) and uses_cpu_kernel(shared):
            return cpu.sigmoid_gated_add_cpu(routed, gate, shared)  # the routed output is this call's own
        return routed + torch.sigmoid(gate) * shared

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        """routed + sigmoid(gate(x)) * shared is linear in both: each as its own kind (the gate
        replicated)."""
        if type(self) is not SharedExpertMoE:
            return None
        return all_of([partial_ffn_plan(self.routed, group), partial_ffn_plan(self.shared, group)])

    def plan_ffn(self, entry: LayerPlan, hidden: int) -> Needs | None:
        """Routed experts plus the gated shared expert in a decode step's one-call plan."""
        gate = getattr(self.shared_gate, "packed_weight", None)
        if gate is None or self.shared_gate.bias is not None:
            return None
        if not (self.routed.plans_as_moe() and self.shared.plans_as_mlp()):
            return None
        return plan_shared_mlp(entry, self.shared, gate.panels, self.routed.plan_ffn(entry, hidden))


def _layer_types(cfg: ConfigReader, layers_n: int) -> list[str]:
    types = cfg.get("layer_types", list, None)
    if types is None:  # older configs: full attention every full_attention_interval-th layer
        interval = cfg.positive_int("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers_n)]
    if len(types) != layers_n or any(t not in LAYER_KINDS for t in types):
        raise cfg.unsupported("layer_types", f"expected {layers_n} entries from {sorted(LAYER_KINDS)}")
    return types


def _rotary(cfg: ConfigReader, head_dim: int, max_position: int) -> RotaryEmbedding:
    """RoPE on the first partial_rotary_factor of each head, 0.25 where the config names none
    (transformers' default for this family; rope_parameters' value wins over a top-level one)."""
    config = {**cfg.config, "partial_rotary_factor": cfg.config.get("partial_rotary_factor", 0.25)}
    return rotary_of(ConfigReader(config, cfg.path), head_dim, max_position)


def _ffn(cfg: ConfigReader, hidden: int, act: str, num_experts: int) -> nn.Module:
    """The MoE block where num_experts > 0, else the dense MLP."""
    if not num_experts:
        return GatedMLP(hidden, cfg.positive_int("intermediate_size", 5632), act)
    top_k = cfg.positive_int("num_experts_per_tok", 10)
    if top_k > num_experts:
        raise cfg.unsupported("num_experts_per_tok", f"exceeds num_experts={num_experts}")
    routed = SparseMoE(hidden, cfg.positive_int("moe_intermediate_size", 512), num_experts, top_k, act,
                       normalize_top_k=cfg.get("norm_topk_prob", bool, True))
    shared = GatedMLP(hidden, cfg.positive_int("shared_expert_intermediate_size", 512), act)
    return SharedExpertMoE(routed, shared, hidden)


def _attention_maker(cfg: ConfigReader, hidden: int, eps: float, max_position: int):
    """A maker of the gated attention mixers, sharing one rotary table."""
    heads = cfg.positive_int("num_attention_heads", 16)
    kv_heads = cfg.positive_int("num_key_value_heads", 2)
    if heads % kv_heads:
        raise cfg.unsupported("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    head_dim = cfg.positive_int("head_dim", 256)
    rotary = _rotary(cfg, head_dim, max_position)
    bias = cfg.get("attention_bias", bool, False)
    return lambda: GatedAttention(hidden, heads, kv_heads, head_dim, bias, rotary, eps)


def _layer_ffn(cfg: ConfigReader, index: int, hidden: int, act: str) -> nn.Module:
    """Layer `index`'s FFN: sparse unless the layer is in mlp_only_layers or off the
    decoder_sparse_step period (or the model has no experts)."""
    num_experts = cfg.get("num_experts", int, 512)
    if num_experts < 0:
        raise cfg.unsupported("num_experts", "expected a non-negative integer")
    mlp_only = cfg.get("mlp_only_layers", list, [])
    if any(not isinstance(i, int) or isinstance(i, bool) for i in mlp_only):
        raise cfg.unsupported("mlp_only_layers", "expected a list of layer indices")
    sparse_step = cfg.positive_int("decoder_sparse_step", 1)
    sparse = num_experts > 0 and index not in mlp_only and (index + 1) % sparse_step == 0
    return _ffn(cfg, hidden, act, num_experts if sparse else 0)


def build_qwen3_next(cfg: ConfigReader, chunk_size: int = GDN_CHUNK_SIZE) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    act = cfg.get("hidden_act", str, "silu")
    if act not in ACTIVATIONS:
        raise cfg.unsupported("hidden_act", f"supported: {sorted(ACTIVATIONS)}")
    types = _layer_types(cfg, layers_n)
    max_position = cfg.positive_int("max_position_embeddings", 32768)

    attention = _attention_maker(cfg, hidden, eps, max_position) if "full_attention" in types else None
    k_heads = cfg.positive_int("linear_num_key_heads", 16)
    v_heads = cfg.positive_int("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise cfg.unsupported("linear_num_value_heads", f"is not a multiple of linear_num_key_heads={k_heads}")
    k_dim, v_dim = cfg.positive_int("linear_key_head_dim", 128), cfg.positive_int("linear_value_head_dim", 128)
    conv_kernel = cfg.positive_int("linear_conv_kernel_dim", 4)

    layers = []
    for i, layer_type in enumerate(types):
        kind = LAYER_KINDS[layer_type]
        if kind == "attention":
            mixer = attention()
        else:
            mixer = GatedDeltaNetMixer(hidden, k_heads, v_heads, k_dim, v_dim, conv_kernel, act, eps, chunk_size)
        layers.append(DecoderLayer(kind, OffsetRMSNorm(hidden, eps), mixer, OffsetRMSNorm(hidden, eps),
                                   _layer_ffn(cfg, i, hidden, act)))
    spec = ModelSpec(cfg.config["model_type"], cfg.positive_int("vocab_size"), hidden, max_position,
                     _eos_ids(cfg), cfg.get("bos_token_id", int, None))
    return HybridLM(spec, layers, OffsetRMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, False))


def build_qwen3_next_mtp(cfg: ConfigReader) -> MTPHead:
    """The checkpoint's multi-token-prediction head (`mtp.*`, which transformers ignores): one
    gated-attention layer whose FFN follows the rule of the model's layer 0."""
    layers_n = cfg.get("num_nextn_predict_layers", int, 1)
    if layers_n != 1:
        raise cfg.unsupported("num_nextn_predict_layers", f"an MTP head of one layer is served, not {layers_n}")
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    act = cfg.get("hidden_act", str, "silu")
    attention = _attention_maker(cfg, hidden, eps, cfg.positive_int("max_position_embeddings", 32768))
    layer = DecoderLayer("attention", OffsetRMSNorm(hidden, eps), attention(), OffsetRMSNorm(hidden, eps),
                         _layer_ffn(cfg, 0, hidden, act))
    return MTPHead(hidden, layer, lambda: OffsetRMSNorm(hidden, eps))


def qwen3_next_mtp_names(name: str):
    part, rest = name.split(".", 1)
    if part == "layer":
        part, rest = rest.split(".", 1)
        return layer_tensor_name("mtp.layers.0", part, rest)
    return f"mtp.{name}"


def qwen3_next_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.norm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    return layer_tensor_name(f"model.layers.{i}", part, rest)


def layer_tensor_name(p: str, part: str, rest: str):
    """Our `<part>.<rest>` of a decoder layer -> its HF tensor under the prefix `p` (a layer of
    the model, or the MTP head's layer: engine.models.mtp_head)."""
    if part in ("input_norm", "ffn_norm"):
        return f"{p}.{'input_layernorm' if part == 'input_norm' else 'post_attention_layernorm'}.{rest}"
    if part == "ffn":
        return _ffn_name(f"{p}.mlp", rest)
    if rest.split(".")[0] in ATTENTION_PARAMS:
        return f"{p}.self_attn.{rest}"
    if rest == "conv_weight":
        return lambda w: w.get(f"{p}.linear_attn.conv1d.weight").squeeze(1)
    return f"{p}.linear_attn.{rest}"


def _ffn_name(p: str, rest: str):
    if rest == "routed.router.weight":
        return f"{p}.gate.weight"
    if rest == "routed.gate_up":
        return lambda w: _stacked_experts(w, p, ("gate_proj", "up_proj"), "gate_up_proj")
    if rest == "routed.down":
        return lambda w: _stacked_experts(w, p, ("down_proj",), "down_proj")
    if rest == "shared_gate.weight":
        return f"{p}.shared_expert_gate.weight"
    if rest.startswith("shared."):
        return f"{p}.shared_expert.{rest.removeprefix('shared.')}"
    return f"{p}.{rest}"  # a dense layer's gate_proj / up_proj / down_proj


FAMILIES = {"qwen3_next": (build_qwen3_next, qwen3_next_names)}
MTP_HEADS = {"qwen3_next": (build_qwen3_next_mtp, qwen3_next_mtp_names)}
