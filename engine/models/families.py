"""config.json -> HybridLM, and our parameter names -> HF tensor names, per model family."""

from __future__ import annotations

import math

import torch

from engine.models.attention import PagedAttention
from engine.models.checkpoint import CheckpointError, ConfigReader
from engine.models.hybrid import DecoderLayer, HybridLM, ModelSpec
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, SparseMoE
from engine.models.ssm import MambaMixer


def _eos_ids(cfg: ConfigReader) -> list[int]:
    eos = cfg.config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(e) for e in eos]


def top_level_name(name: str, embed: str, final_norm: str) -> str | None:
    """HF name of our embedding, LM head or final norm parameter; None for layer parameters."""
    return {"embed.weight": embed, "lm_head.weight": "lm_head.weight", "final_norm.weight": final_norm}.get(name)


# ----------------------------------------------------------------------------- Jamba

def build_jamba(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, heads)
    attn_period, attn_offset = cfg.positive_int("attn_layer_period"), cfg.get("attn_layer_offset", int)
    exp_period, exp_offset = cfg.positive_int("expert_layer_period"), cfg.get("expert_layer_offset", int)
    for key, off, per in (("attn_layer_offset", attn_offset, attn_period),
                          ("expert_layer_offset", exp_offset, exp_period)):
        if not 0 <= off < per:
            raise cfg.unsupported(key, f"must be in [0, period={per})")
    num_experts = cfg.positive_int("num_experts", 1)
    top_k = cfg.positive_int("num_experts_per_tok", 2)
    if num_experts > 1 and top_k > num_experts:
        raise cfg.unsupported("num_experts_per_tok", f"exceeds num_experts={num_experts}")
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    act = cfg.get("hidden_act", str, "silu")
    inter = cfg.positive_int("intermediate_size")
    d_inner = cfg.positive_int("mamba_expand", 2) * hidden
    dt_rank = cfg.get("mamba_dt_rank", (int, str), "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else dt_rank
    if not isinstance(dt_rank, int):
        raise cfg.unsupported("mamba_dt_rank", "expected an integer or 'auto'")
    d_state, d_conv = cfg.positive_int("mamba_d_state", 16), cfg.positive_int("mamba_d_conv", 4)
    kinds = ["attention" if i % attn_period == attn_offset else "mamba" for i in range(layers_n)]
    spec = ModelSpec("jamba", cfg.positive_int("vocab_size"), hidden,
                     cfg.get("max_position_embeddings", int, None), _eos_ids(cfg),
                     cfg.get("bos_token_id", int, None))
    layers = []
    for i, kind in enumerate(kinds):
        if kind == "attention":
            mixer = PagedAttention(hidden, heads, kv_heads, hidden // heads, False, False, None)
        else:
            mixer = MambaMixer(hidden, d_inner, d_state, d_conv, dt_rank,
                               cfg.get("mamba_conv_bias", bool, True),
                               cfg.get("mamba_proj_bias", bool, False), act, eps)
        if num_experts > 1 and i % exp_period == exp_offset:
            ffn = SparseMoE(hidden, inter, num_experts, top_k, act, normalize_top_k=False)
        else:
            ffn = GatedMLP(hidden, inter, act)
        layers.append(DecoderLayer(kind, RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), ffn))
    return HybridLM(spec, layers, RMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, False))


def jamba_names(name: str):
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if name == "final_norm.weight":
        return "model.final_layernorm.weight"
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part == "input_norm":
        return f"{p}.input_layernorm.{rest}"
    if part == "ffn_norm":
        return f"{p}.pre_ff_layernorm.{rest}"
    if part == "ffn":
        return _moe_or_mlp(f"{p}.feed_forward", rest)
    if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"{p}.self_attn.{rest}"
    return _mamba_mixer(f"{p}.mamba", rest, norm_names=("dt_layernorm", "b_layernorm", "c_layernorm"))


def _moe_or_mlp(p: str, rest: str):
    if rest == "router.weight":
        return f"{p}.router.weight"
    if rest == "gate_up":
        return lambda w: _stacked_experts(w, p, ("gate_proj", "up_proj"), "gate_up_proj")
    if rest == "down":
        return lambda w: _stacked_experts(w, p, ("down_proj",), "down_proj")
    return f"{p}.{rest}"


def first_present(*names: str):
    """A tensor source: the first of these tensors the checkpoint has (the error names the last
    where none is), for families whose checkpoints come under two sets of names."""
    return lambda w: w.get(next((n for n in names if n in w), names[-1]))


def qkv_conv_weight(w, p: str) -> torch.Tensor:
    """[channels, kernel]: one Conv1d over q | k | v at `p`, or three (q_conv1d, k_conv1d,
    v_conv1d) concatenated, as the original OLMo Hybrid and Kimi Linear checkpoints keep them."""
    if f"{p}.conv1d.weight" in w:
        return w.get(f"{p}.conv1d.weight").squeeze(1)
    return torch.cat([w.get(f"{p}.{x}_conv1d.weight") for x in "qkv"]).squeeze(1)


def _stacked_experts(weights, p, parts, fused_name):
    if f"{p}.experts.{fused_name}" in weights:
        return weights.get(f"{p}.experts.{fused_name}")
    experts = []
    e = 0
    while f"{p}.experts.{e}.{parts[0]}.weight" in weights:
        experts.append(torch.cat([weights.get(f"{p}.experts.{e}.{part}.weight") for part in parts]))
        e += 1
    if not experts:
        raise CheckpointError(f"{weights.model_dir}: missing tensor {p}.experts.0.{parts[0]}.weight "
                              f"(or fused {p}.experts.{fused_name})")
    return torch.stack(experts)


def _mamba_mixer(p: str, rest: str, norm_names=None):
    if rest == "conv_weight":
        return lambda w: w.get(f"{p}.conv1d.weight").squeeze(1)
    if rest == "conv_bias":
        return f"{p}.conv1d.bias"
    if norm_names and rest.startswith(("dt_norm", "b_norm", "c_norm")):
        which = ("dt_norm", "b_norm", "c_norm").index(rest.split(".")[0])
        return f"{p}.{norm_names[which]}.weight"
    return f"{p}.{rest}"


# ----------------------------------------------------------------------------- Mamba

def build_mamba(cfg: ConfigReader) -> HybridLM:
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    d_inner = cfg.get("intermediate_size", int, None) or cfg.positive_int("expand", 2) * hidden
    dt_rank = cfg.get("time_step_rank", (int, str), "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else dt_rank
    d_state, d_conv = cfg.positive_int("state_size", 16), cfg.positive_int("conv_kernel", 4)
    eps = cfg.get("layer_norm_epsilon", float, 1e-5)
    act = cfg.get("hidden_act", str, "silu")
    residual_fp32 = cfg.get("residual_in_fp32", bool, True)
    spec = ModelSpec("mamba", cfg.positive_int("vocab_size"), hidden, eos_token_ids=_eos_ids(cfg),
                     bos_token_id=cfg.get("bos_token_id", int, None))
    layers = [
        DecoderLayer("mamba", RMSNorm(hidden, eps),
                     MambaMixer(hidden, d_inner, d_state, d_conv, dt_rank,
                                cfg.get("use_conv_bias", bool, True), cfg.get("use_bias", bool, False),
                                act, None),
                     residual_fp32=residual_fp32)
        for _ in range(layers_n)
    ]
    return HybridLM(spec, layers, RMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, True))


def mamba_names(name: str):
    if name == "embed.weight":
        return "backbone.embeddings.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if name == "final_norm.weight":
        return "backbone.norm_f.weight"
    _, i, part, rest = name.split(".", 3)
    p = f"backbone.layers.{i}"
    if part == "input_norm":
        return f"{p}.norm.{rest}"
    return _mamba_mixer(f"{p}.mixer", rest)


# ----------------------------------------------------------------------------- Llama family

def rotary_of(cfg: ConfigReader, head_dim: int, max_position: int) -> RotaryEmbedding:
    """RoPE from rope_parameters (transformers 5) or rope_scaling / rope_theta (older configs)."""
    rope = dict(cfg.get("rope_parameters", dict, None) or cfg.get("rope_scaling", dict, None) or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", float, 10000.0)))
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor",
                                                cfg.get("partial_rotary_factor", float, 1.0))))
    try:
        return RotaryEmbedding(head_dim, rotary_dim, theta, rope, max_position)
    except (ValueError, KeyError) as e:
        raise cfg.unsupported("rope_parameters", str(e)) from None


def build_llama(cfg: ConfigReader) -> HybridLM:
    model_type = cfg.config["model_type"]
    hidden = cfg.positive_int("hidden_size")
    layers_n = cfg.positive_int("num_hidden_layers")
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, heads)
    head_dim = cfg.get("head_dim", int, None) or hidden // heads
    eps = cfg.get("rms_norm_eps", float, 1e-6)
    act = cfg.get("hidden_act", str, "silu")
    max_position = cfg.positive_int("max_position_embeddings", 2048)
    qkv_bias = model_type == "qwen2" or cfg.get("attention_bias", bool, False)
    out_bias = model_type != "qwen2" and cfg.get("attention_bias", bool, False)
    window = cfg.get("sliding_window", int, None)
    layer_types = cfg.get("layer_types", list, None)
    if model_type == "qwen2" and not cfg.get("use_sliding_window", bool, False):
        window = None
    spec = ModelSpec(model_type, cfg.positive_int("vocab_size"), hidden, max_position=max_position,
                     eos_token_ids=_eos_ids(cfg), bos_token_id=cfg.get("bos_token_id", int, None))
    rotary = rotary_of(cfg, head_dim, max_position)
    layers = []
    for i in range(layers_n):
        sliding = layer_types[i] == "sliding_attention" if layer_types else window is not None
        mixer = PagedAttention(hidden, heads, kv_heads, head_dim, qkv_bias, out_bias, rotary,
                               window if sliding else None)
        ffn = GatedMLP(hidden, cfg.positive_int("intermediate_size"), act,
                       bias=cfg.get("mlp_bias", bool, False))
        layers.append(DecoderLayer("attention", RMSNorm(hidden, eps), mixer, RMSNorm(hidden, eps), ffn))
    return HybridLM(spec, layers, RMSNorm(hidden, eps), cfg.get("tie_word_embeddings", bool, False))


def llama_names(name: str):
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if name == "final_norm.weight":
        return "model.norm.weight"
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    return {"input_norm": f"{p}.input_layernorm.{rest}",
            "ffn_norm": f"{p}.post_attention_layernorm.{rest}",
            "mixer": f"{p}.self_attn.{rest}", "ffn": f"{p}.mlp.{rest}"}[part]


FAMILIES = {
    "jamba": (build_jamba, jamba_names),
    "mamba": (build_mamba, mamba_names),
    "llama": (build_llama, llama_names),
    "mistral": (build_llama, llama_names),
    "qwen2": (build_llama, llama_names),
}
