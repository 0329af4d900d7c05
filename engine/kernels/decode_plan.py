"""The contract between a decode step's one-call layer stack (engine.decode_stack, running
engine/kernels/cpu_decode.cpp's decoder_layers) and the layer kinds that join it: the LayerPlan
struct, field for field cpu_decode.cpp's, the kind codes, and the helpers a kind uses to fill
its entry. Each layer kind fills its own fields (its `plan_decode` / `plan_ffn`, in its module);
`plan_layer` composes one layer's entry from its norms, mixer and FFN without knowing their kinds.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import uses_cpu_kernel

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAMBA, ATTENTION, MAMBA2, RELU2_MLP, GATED_DELTANET, NORMED_ATTENTION, SHORT_CONV, ZAMBA2_HYBRID = 1, 2, 3, 4, 5, 6, 7, 8
NO_FFN, SWIGLU_MLP, MOE = 0, 1, 2


class LayerPlan(ctypes.Structure):
    """cpu_decode.cpp's LayerPlan, field for field."""

    _fields_ = [
        ("mixer", I64), ("ffn", I64), ("input_norm", P), ("ffn_norm", P), ("input_eps", F32), ("ffn_eps", F32),
        ("d_inner", I64), ("d_state", I64), ("dt_rank", I64), ("d_conv", I64),
        ("in_panels", P), ("in_bias", P), ("conv_state", P), ("ssm_state", P),
        ("conv_weight", P), ("conv_bias", P), ("x_panels", P), ("dt_norm", P), ("b_norm", P), ("c_norm", P),
        ("dt_panels", P), ("dt_bias", P), ("A", P), ("D", P), ("out_panels", P), ("out_bias", P),
        ("bcdt_eps", F32), ("scale", F32),
        ("heads", I64), ("kv_heads", I64), ("head_dim", I64), ("rotary_dim", I64), ("block_size", I64), ("window", I64),
        ("qkv_panels", P), ("qkv_bias", P), ("cos", P), ("sin", P), ("o_panels", P), ("o_bias", P),
        ("k_cache", P), ("v_cache", P),
        ("experts", I64), ("top_k", I64), ("normalize", I64), ("inter", I64), ("router_panels", P), ("expert_panels", P),
        ("groups", I64), ("gate_norm_group", I64), ("gate_norm_first", I64), ("gate_norm", P),
        ("dt_lo", F32), ("dt_hi", F32), ("gate_norm_eps", F32),
        ("residual_scale", F32), ("shared_inter", I64), ("shared_panels", P),
        ("mlp_inter", I64), ("up_panels", P), ("up_bias", P), ("down_panels", P), ("down_bias", P),
        ("key_heads", I64), ("value_heads", I64), ("key_dim", I64), ("value_dim", I64),
        ("q_norm", P), ("k_norm", P), ("qk_norm_eps", F32), ("gated", I64), ("shared_gate_panels", P),
        ("ssm_heads", I64), ("ssm_head_dim", I64), ("parallel_attention", I64),
        ("embeddings", P), ("block_norm", P), ("pre_ff_norm", P), ("lora_down_panels", P), ("lora_up_panels", P),
        ("linear_panels", P), ("mamba_norm", P), ("block_eps", F32), ("pre_ff_eps", F32), ("mamba_norm_eps", F32),
        ("lora_rank", I64),
        ("narrow_format", I64), ("narrow_pool", P * 2), ("narrow_work", P * 2), ("narrow_numel", I64 * 2),
    ]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class Needs:
    """Scratch a layer's mixer or FFN takes per row: floats and (the MoE's) ints, plus fixed ints."""

    floats: int = 0
    ints: int = 0
    fixed_ints: int = 0


def all_cpu(tensors) -> bool:
    return tensors is not None and all(uses_cpu_kernel(t) for t in tensors)


def norm_fits(norm) -> bool:
    """A norm that says it runs as the plan's RMSNorm (RMSNorm.fits_decode_plan)."""
    fits = getattr(norm, "fits_decode_plan", None)
    return fits is not None and fits()


def plan_layer(layer_parts, caches, index: int):
    """One layer's (entry, tensors the entry points at that nothing else holds, the rotary
    embeddings whose tables the entry takes each step, its needs), composed from what its parts
    offer, or None where some part cannot run in one call. `layer_parts`: (input norm, mixer, an
    attention beside the mixer or None, FFN norm, FFN or None, residual scale)."""
    input_norm, mixer, beside, ffn_norm, ffn, residual_scale = layer_parts
    if not norm_fits(input_norm) or not hasattr(mixer, "plan_decode"):
        return None
    entry, keep, rotary = LayerPlan(), [], []
    entry.input_norm, entry.input_eps = input_norm.weight.data_ptr(), input_norm.eps
    entry.residual_scale = residual_scale
    mixer_needs = mixer.plan_decode(entry, caches.state[index], caches.kv[index], keep, rotary)
    if mixer_needs is None:
        return None
    if beside is not None:  # Falcon-H1's attention beside its Mamba2 mixer
        beside_needs = beside.plan_beside(entry, caches.kv[index], rotary)
        if beside_needs is None:
            return None
        mixer_needs = Needs(max(mixer_needs.floats, beside_needs.floats))
        entry.parallel_attention = 1
    if ffn is None:
        ffn_needs = Needs()
        entry.ffn = NO_FFN
    elif norm_fits(ffn_norm) and hasattr(ffn, "plan_ffn"):
        entry.ffn_norm, entry.ffn_eps = ffn_norm.weight.data_ptr(), ffn_norm.eps
        ffn_needs = ffn.plan_ffn(entry, input_norm.weight.numel())
        if ffn_needs is None:
            return None
    else:
        return None
    needs = Needs(max(mixer_needs.floats, ffn_needs.floats), ffn_needs.ints, ffn_needs.fixed_ints)
    return entry, keep, rotary, needs


def plan_shared_mlp(entry: LayerPlan, shared, gate_panels, needs: Needs) -> Needs:
    """A shared MLP added to the entry's routed experts or MLP (its panels; its sigmoid gate's
    packed panels or None): the needs of the whole FFN."""
    inter = shared.down_proj.in_features
    entry.shared_inter, entry.shared_panels = inter, shared.one_call_pointers().data_ptr()
    entry.shared_gate_panels = pointer(gate_panels)
    return Needs(max(needs.floats, 3 * inter), needs.ints, needs.fixed_ints)
