"""The lfm2 family: config.json -> HybridLM, and our parameter names -> HF tensor names.

LFM2 (Liquid AI) interleaves gated short-conv layers (engine.models.short_conv) with GQA
attention layers whose queries and keys are RMS-normalised per head before rope; every layer
has a SwiGLU FFN. Its final norm is called `embedding_norm` but runs after the last layer.
Older config.json files spell some keys differently (tie_embedding, block_ff_dim,
full_attn_idxs, top-level rope_theta); they are read as transformers reads them.
"""

from __future__ import annotations

import math

from engine.models.attention import NormedAttention
from engine.models.checkpoint import ConfigReader
from engine.models.families import _eos_ids, rotary_of, top_level_name
from engine.models.hybrid import DecoderLayer, HybridLM, ModelSpec
from engine.models.layers import GatedMLP, RMSNorm
from engine.models.short_conv import ShortConvMixer

LAYER_KINDS = {"full_attention": "attention", "conv": "short_conv"}
DEFAULT_ROPE_THETA = 1_000_000.0  # LFM2's default, not the usual 10000


class Lfm2Attention(NormedAttention):
    """Attention with q_layernorm / k_layernorm, RMSNorms over each head that run before rope."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, rotary):
        super().__init__(hidden, heads, kv_heads, head_dim, False, rotary, RMSNorm(head_dim, eps),
                         RMSNorm(head_dim, eps), gated=False)


def _layer_types(cfg: ConfigReader, layers_n: int) -> list[str]:
    types = cfg.get("layer_types", list, None)
    if types is None:  # older configs: attention at full_attn_idxs (all layers if absent)
        at = cfg.get("full_attn_idxs", list, None)
        if at is None:
            return ["full_attention"] * layers_n
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers_n for i in at):
            raise cfg.unsupported("full_attn_idxs", f"indices must be integers in [0, {layers_n})")
        return ["full_attention" if i in at else "conv" for i in range(layers_n)]
    if len(types) != layers_n or any(t not in LAYER_KINDS for t in types):
        raise cfg.unsupported("layer_types", f"expected {layers_n} entries from {sorted(LAYER_KINDS)}")
    return types


def _ffn_size(cfg: ConfigReader) -> int:
    """transformers' Lfm2MLP width: with auto-adjust, 2/3 of the configured size, and only when
    block_ffn_dim_multiplier is set, scaled by it and rounded up to block_multiple_of."""
    key = "block_ff_dim" if "block_ff_dim" in cfg.config else "intermediate_size"
    size = cfg.positive_int(key, 12288)
    if cfg.get("block_auto_adjust_ff_dim", bool, True):
        size = int(2 * size / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", float, 1.0, allow_none=True)
        if multiplier is not None:
            multiple = cfg.positive_int("block_multiple_of", 256)
            size = multiple * math.ceil(int(multiplier * size) / multiple)
    if size <= 0:
        raise cfg.unsupported(key, f"gives an FFN width of {size} after block_auto_adjust_ff_dim")
    return size


def _rotary(cfg: ConfigReader, head_dim: int, max_position: int):
    rope = cfg.get("rope_parameters", dict, None) or cfg.get("rope_scaling", dict, None) or {}
    for key, value in (("rope_parameters", rope.get("partial_rotary_factor", 1.0)),
                       ("partial_rotary_factor", cfg.get("partial_rotary_factor", (int, float), 1.0))):
        if value != 1.0:  # transformers' lfm2 rotates whole heads
            raise cfg.unsupported(key, "partial rotary embeddings are not supported for lfm2")
    config = dict(cfg.config)
    config.setdefault("rope_theta", DEFAULT_ROPE_THETA)
    return rotary_of(ConfigReader(config, cfg.path), head_dim, max_position)


def build_lfm2(cfg: ConfigReader, ffn_of_layer=None) -> HybridLM:
    """`ffn_of_layer(index, hidden)`: each layer's FFN where a variant changes it (LFM2-MoE's
    experts); LFM2's own SwiGLU otherwise."""
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise cfg.unsupported("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    head_dim = cfg.positive_int("head_dim", None) or hidden // heads
    eps = cfg.get("norm_eps", float, 1e-5)
    kernel = cfg.positive_int("conv_L_cache", 3)
    conv_bias = cfg.get("conv_bias", bool, False)
    if ffn_of_layer is None:
        ffn_size = _ffn_size(cfg)
        ffn_of_layer = lambda index, width: GatedMLP(width, ffn_size, "silu")  # noqa: E731 - hidden_act is not read
    types = _layer_types(cfg, layers_n)
    max_position = cfg.positive_int("max_position_embeddings", 128000)
    rotary = _rotary(cfg, head_dim, max_position) if "full_attention" in types else None
    layers = []
    for index, kind in enumerate(LAYER_KINDS[t] for t in types):
        mixer = (Lfm2Attention(hidden, heads, kv_heads, head_dim, eps, rotary) if kind == "attention"
                 else ShortConvMixer(hidden, kernel, conv_bias))
        layers.append(DecoderLayer(kind, RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps),
                                   ffn_of_layer(index, hidden)))
    spec = ModelSpec(cfg.config["model_type"], cfg.positive_int("vocab_size"), hidden, max_position,
                     _eos_ids(cfg), cfg.get("bos_token_id", int, None))
    # tie_embedding (older configs) wins over tie_word_embeddings, as in transformers.
    tie = cfg.get("tie_embedding", bool, None)
    tie = cfg.get("tie_word_embeddings", bool, True) if tie is None else tie
    return HybridLM(spec, layers, RMSNorm(hidden, eps), tie)


_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ATTENTION = {"q_proj.weight": "q_proj.weight", "q_norm.weight": "q_layernorm.weight",
              "k_proj.weight": "k_proj.weight", "k_norm.weight": "k_layernorm.weight",
              "v_proj.weight": "v_proj.weight", "o_proj.weight": "out_proj.weight"}


def lfm2_names(name: str):
    if (top := top_level_name(name, "model.embed_tokens.weight", "model.embedding_norm.weight")) is not None:
        return top
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part in ("input_norm", "ffn_norm"):
        return f"{p}.{'operator_norm' if part == 'input_norm' else 'ffn_norm'}.{rest}"
    if part == "ffn":
        proj, tail = rest.split(".", 1)
        return f"{p}.feed_forward.{_FFN[proj]}.{tail}"
    if rest in _ATTENTION:
        return f"{p}.self_attn.{_ATTENTION[rest]}"
    if rest == "conv_weight":  # stored as a Conv1d weight [hidden, 1, L_cache]
        return lambda w: w.get(f"{p}.conv.conv.weight").squeeze(1)
    if rest == "conv_bias":
        return f"{p}.conv.conv.bias"
    return f"{p}.conv.{rest}"  # in_proj, out_proj


FAMILIES = {"lfm2": (build_lfm2, lfm2_names)}
