"""The Mamba2 (SSD) families: config.json -> HybridLM, and our parameter names -> HF tensor names.

mamba2 (Mamba2 only), bamba (Mamba2 + attention at attn_layer_indices, dense MLP),
granitemoehybrid (layer_types, MoE + shared expert or dense, rope or nope, Granite's
multipliers) and nemotron_h (one block per layer: Mamba2, attention, MLP or MoE).
"""

from __future__ import annotations

import math

from engine.models.attention import PagedAttention
from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, _stacked_experts, rotary_of, top_level_name
from engine.models.hybrid import DecoderLayer, FFNMixer, HybridLM, ModelSpec
from engine.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, SparseMoE, SummedFFN
from engine.models.mamba2 import Mamba2Mixer
from engine.models.nemotron_moe import NemotronMLP, NemotronMoE

NO_LIMIT = (0.0, math.inf)


def mamba2_mixer(cfg: ConfigReader, hidden: int, *, heads: str, head_dim: str, expand: str | None,
                 groups: str, state: str, conv: str, chunk: str, conv_bias: str, proj_bias: str,
                 act: str, eps: float, dt_limit: tuple[float, float] | None = None) -> Mamba2Mixer:
    """A Mamba2 mixer from a family's own config key names. `expand`: the key whose value times
    hidden_size is the mixer's width where the family sizes it that way (head_dim may then be
    "auto"); None where heads * head_dim alone is the width (Nemotron-H)."""
    num_heads = cfg.positive_int(heads)
    width = cfg.positive_int(expand, 2) * hidden if expand is not None else None
    dim = cfg.get(head_dim, (int, str), "auto" if width else ...)
    if dim == "auto" and width is not None:
        dim = width // num_heads
    if not isinstance(dim, int) or dim <= 0:
        raise cfg.unsupported(head_dim, "expected a positive integer (or 'auto')")
    if width is not None and dim * num_heads != width:
        raise cfg.unsupported(heads, f"{heads} * {head_dim} = {num_heads * dim} is not "
                              f"{expand} * hidden_size = {width}")
    n_groups = cfg.positive_int(groups, 1)
    if num_heads % n_groups:
        raise cfg.unsupported(groups, f"does not divide {heads}={num_heads}")
    d_inner = num_heads * dim
    return Mamba2Mixer(
        hidden, num_heads, dim, n_groups, cfg.positive_int(state, 128), cfg.positive_int(conv, 4),
        cfg.positive_int(chunk, 256), cfg.get(conv_bias, bool, True), cfg.get(proj_bias, bool, False),
        cfg.get(act, str, "silu"), dt_limit or cfg.float_pair("time_step_limit", NO_LIMIT),
        GatedRMSNorm(d_inner, d_inner // n_groups, eps))


def mamba2_names(p: str, rest: str):
    if rest == "conv_weight":
        return lambda w: w.get(f"{p}.conv1d.weight").squeeze(1)
    if rest == "conv_bias":
        return f"{p}.conv1d.bias"
    return f"{p}.{rest}"


def _attention(cfg: ConfigReader, hidden: int, rotary, scale: float | None = None) -> PagedAttention:
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, None) or heads
    head_dim = cfg.get("head_dim", int, None) or hidden // heads
    bias = cfg.get("attention_bias", bool, False)
    return PagedAttention(hidden, heads, kv_heads, head_dim, bias, bias, rotary, scale=scale)


def _head_dim(cfg: ConfigReader, hidden: int) -> int:
    return cfg.get("head_dim", int, None) or hidden // cfg.positive_int("num_attention_heads")


def _spec(cfg: ConfigReader, hidden: int, max_position: int | None) -> ModelSpec:
    return ModelSpec(cfg.config["model_type"], cfg.positive_int("vocab_size"), hidden, max_position,
                     _eos_ids(cfg), cfg.get("bos_token_id", int, None))


# ----------------------------------------------------------------------------- mamba2

def build_mamba2(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("layer_norm_epsilon", float, 1e-5)
    residual_fp32 = cfg.get("residual_in_fp32", bool, True)
    layers = []
    for _ in range(cfg.positive_int("num_hidden_layers")):
        mixer = mamba2_mixer(cfg, hidden, heads="num_heads", head_dim="head_dim", expand="expand",
                             groups="n_groups", state="state_size", conv="conv_kernel",
                             chunk="chunk_size", conv_bias="use_conv_bias", proj_bias="use_bias",
                             act="hidden_act", eps=eps)
        layers.append(DecoderLayer("mamba2", RMSNorm(hidden, eps), mixer, residual_fp32=residual_fp32))
    return HybridLM(_spec(cfg, hidden, None), layers, RMSNorm(hidden, eps),
                    cfg.get("tie_word_embeddings", bool, False))


def mamba2_family_names(name: str):
    if (top := top_level_name(name, "backbone.embeddings.weight", "backbone.norm_f.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"backbone.layers.{i}"
    return f"{p}.norm.{rest}" if part == "input_norm" else mamba2_names(f"{p}.mixer", rest)


# ----------------------------------------------------------------------------- bamba and granite

def _bamba_like_mixer(cfg: ConfigReader, hidden: int, eps: float) -> Mamba2Mixer:
    return mamba2_mixer(cfg, hidden, heads="mamba_n_heads", head_dim="mamba_d_head",
                        expand="mamba_expand", groups="mamba_n_groups", state="mamba_d_state",
                        conv="mamba_d_conv", chunk="mamba_chunk_size", conv_bias="mamba_conv_bias",
                        proj_bias="mamba_proj_bias", act="hidden_act", eps=eps)


def build_bamba(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("rms_norm_eps", float, 1e-5)
    layers_n = cfg.positive_int("num_hidden_layers")
    attention_at = cfg.get("attn_layer_indices", list, [])
    if any(not isinstance(i, int) or not 0 <= i < layers_n for i in attention_at):
        raise cfg.unsupported("attn_layer_indices", f"indices must be in [0, {layers_n})")
    max_position = cfg.positive_int("max_position_embeddings", 262144)
    rotary = rotary_of(cfg, _head_dim(cfg, hidden), max_position)
    layers = []
    for i in range(layers_n):
        if i in attention_at:
            kind, mixer = "attention", _attention(cfg, hidden, rotary)
        else:
            kind, mixer = "mamba2", _bamba_like_mixer(cfg, hidden, eps)
        ffn = GatedMLP(hidden, cfg.positive_int("intermediate_size"), cfg.get("hidden_act", str, "silu"),
                       bias=cfg.get("mlp_bias", bool, False))
        layers.append(DecoderLayer(kind, RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), ffn))
    return HybridLM(_spec(cfg, hidden, max_position), layers, RMSNorm(hidden, eps),
                    cfg.get("tie_word_embeddings", bool, False))


def bamba_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.final_layernorm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part in ("input_norm", "ffn_norm"):
        return f"{p}.{'input_layernorm' if part == 'input_norm' else 'pre_ff_layernorm'}.{rest}"
    if part == "ffn":
        return f"{p}.feed_forward.{rest}"
    if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"{p}.self_attn.{rest}"
    return mamba2_names(f"{p}.mamba", rest)


GRANITE_LAYER_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2",
                       "attention": "attention", "full_attention": "attention"}


def build_granitemoehybrid(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    layers_n = cfg.positive_int("num_hidden_layers")
    types = cfg.get("layer_types", list, None) or ["mamba"] * layers_n
    if len(types) != layers_n or any(t not in GRANITE_LAYER_TYPES for t in types):
        raise cfg.unsupported("layer_types", f"expected {layers_n} entries from {sorted(GRANITE_LAYER_TYPES)}")
    position = cfg.get("position_embedding_type", str, None, allow_none=True)
    if position not in (None, "rope", "nope"):
        raise cfg.unsupported("position_embedding_type", "supported: rope, nope (or null)")
    max_position = cfg.positive_int("max_position_embeddings", 2048)
    rotary = rotary_of(cfg, _head_dim(cfg, hidden), max_position) if position == "rope" else None
    act = cfg.get("hidden_act", str, "silu")
    num_experts = cfg.get("num_local_experts", int, 0)
    top_k = cfg.get("num_experts_per_tok", int, 2)
    if num_experts > 0 and not 0 < top_k <= num_experts:
        raise cfg.unsupported("num_experts_per_tok", f"must be in [1, num_local_experts={num_experts}]")
    residual = cfg.get("residual_multiplier", float, 1.0)
    attention_scale = cfg.get("attention_multiplier", float, 1.0)
    layers = []
    for kind in (GRANITE_LAYER_TYPES[t] for t in types):
        mixer = (_attention(cfg, hidden, rotary, scale=attention_scale) if kind == "attention"
                 else _bamba_like_mixer(cfg, hidden, eps))
        shared = GatedMLP(hidden, cfg.positive_int("shared_intermediate_size"), act)
        ffn = (SummedFFN(SparseMoE(hidden, cfg.positive_int("intermediate_size"), num_experts, top_k,
                                   act, normalize_top_k=True), shared)
               if num_experts > 0 else SummedFFN(shared))
        layers.append(DecoderLayer(kind, RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), ffn,
                                   residual_scale=residual))
    return HybridLM(_spec(cfg, hidden, max_position), layers, RMSNorm(hidden, eps),
                    cfg.get("tie_word_embeddings", bool, False),
                    embedding_scale=cfg.get("embedding_multiplier", float, 1.0),
                    logits_divisor=cfg.get("logits_scaling", float, 1.0))


def granite_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.norm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part in ("input_norm", "ffn_norm"):
        return f"{p}.{'input_layernorm' if part == 'input_norm' else 'post_attention_layernorm'}.{rest}"
    if part == "ffn":
        index, rest = rest.removeprefix("parts.").split(".", 1)
        if rest.startswith(("gate_proj", "up_proj", "down_proj")):  # the shared expert
            fused = f"{p}.shared_mlp.input_linear.weight"
            if rest.startswith("gate_proj"):
                return lambda w: w.get(fused).chunk(2)[0]
            if rest.startswith("up_proj"):
                return lambda w: w.get(fused).chunk(2)[1]
            return f"{p}.shared_mlp.output_linear.weight"
        moe = f"{p}.block_sparse_moe"
        return {"router.weight": f"{moe}.router.layer.weight",
                "gate_up": lambda w: _granite_experts(w, moe, "input_linear", "gate_up_proj"),
                "down": lambda w: _granite_experts(w, moe, "output_linear", "down_proj")}[rest]
    if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"{p}.self_attn.{rest}"
    return mamba2_names(f"{p}.mamba", rest)


def _granite_experts(weights, moe: str, legacy: str, fused: str):
    """Stacked experts as Granite checkpoints store them (input_linear / output_linear), or as
    newer transformers name them."""
    if f"{moe}.{legacy}.weight" in weights:
        return weights.get(f"{moe}.{legacy}.weight")
    return _stacked_experts(weights, moe, ("gate_proj", "up_proj") if fused == "gate_up_proj"
                            else ("down_proj",), fused)


# ----------------------------------------------------------------------------- nemotron_h

NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
NEMOTRON_KINDS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def build_nemotron_h(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("layer_norm_epsilon", float, 1e-5)
    types = cfg.get("layers_block_type", list, None) or cfg.get("layer_types", list, None)
    if types is None:
        pattern = cfg.get("hybrid_override_pattern", str)
        if any(c not in NEMOTRON_PATTERN for c in pattern):
            raise cfg.unsupported("hybrid_override_pattern", f"characters must be from {''.join(NEMOTRON_PATTERN)}")
        types = [NEMOTRON_PATTERN[c] for c in pattern]
    if not types or any(t not in NEMOTRON_KINDS for t in types):
        raise cfg.unsupported("layers_block_type", f"entries must be from {sorted(NEMOTRON_KINDS)}")
    if cfg.get("sliding_window", int, None) is not None:
        raise cfg.unsupported("sliding_window", "sliding-window attention is not supported for nemotron_h")
    # Nemotron-H's Mamba2 clamps dt from below at time_step_min, never from above.
    dt_limit = (cfg.get("time_step_min", float, 0.001), math.inf)
    layers = []
    for kind in (NEMOTRON_KINDS[t] for t in types):
        if kind == "mamba2":
            mixer = mamba2_mixer(cfg, hidden, heads="mamba_num_heads", head_dim="mamba_head_dim",
                                 expand=None, groups="n_groups", state="ssm_state_size",
                                 conv="conv_kernel", chunk="chunk_size", conv_bias="use_conv_bias",
                                 proj_bias="use_bias", act="mamba_hidden_act", eps=eps, dt_limit=dt_limit)
        elif kind == "attention":
            heads = cfg.positive_int("num_attention_heads")
            mixer = PagedAttention(hidden, heads, cfg.get("num_key_value_heads", int, None) or heads,
                                   _head_dim(cfg, hidden), False, False, None)  # NoPE, no biases
        elif kind == "mlp":
            mixer = FFNMixer(NemotronMLP(hidden, cfg.positive_int("intermediate_size"),
                                         cfg.get("mlp_hidden_act", str, "relu2"), cfg.get("mlp_bias", bool, False)))
        else:
            mixer = FFNMixer(NemotronMoE.from_config(cfg, hidden))
        layers.append(DecoderLayer(kind, RMSNorm(hidden, eps), mixer,
                                   residual_fp32=cfg.get("residual_in_fp32", bool, False)))
    return HybridLM(_spec(cfg, hidden, cfg.positive_int("max_position_embeddings", 4096)), layers,
                    # transformers never ties Nemotron-H's head (its checkpoints carry lm_head),
                    # whatever tie_word_embeddings says
                    RMSNorm(hidden, eps), tie_embeddings=False)


def nemotron_h_names(name: str):
    if (top := top_level_name(name, "backbone.embeddings.weight", "backbone.norm_f.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"backbone.layers.{i}"
    if part == "input_norm":
        return f"{p}.norm.{rest}"
    if rest.startswith("ffn."):
        return NemotronMoE.checkpoint_name(f"{p}.mixer", rest.removeprefix("ffn."))
    if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"{p}.mixer.{rest}"
    return mamba2_names(f"{p}.mixer", rest)


FAMILIES = {
    "mamba2": (build_mamba2, mamba2_family_names),
    "bamba": (build_bamba, bamba_names),
    "granitemoehybrid": (build_granitemoehybrid, granite_names),
    "nemotron_h": (build_nemotron_h, nemotron_h_names),
}
