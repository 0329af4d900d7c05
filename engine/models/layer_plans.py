"""Each layer part's entry in a decode step's one-call plan (engine.models.decode_layers): the
LayerPlan struct, field for field cpu_decode.cpp's, and the functions that fill its fields for one
mixer, attention, MLP, MoE or Zamba2 hybrid layer from the modules' packed weights and the caches."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import cpu, uses_cpu_kernel
from engine.models.attention import NormedAttention, PagedAttention
from engine.models.batch import LayerCaches
from engine.models.families_lfm2 import Lfm2Attention
from engine.models.families_qwen3_next import GatedAttention, OffsetRMSNorm
from engine.models.families_zamba2 import HybridLayer
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.layers import ACTIVATIONS, GatedMLP, RMSNorm, SparseMoE
from engine.models.mamba2 import Mamba2Mixer
from engine.models.nemotron_moe import NemotronMLP
from engine.models.short_conv import ShortConvMixer
from engine.models.ssm import MambaMixer

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAMBA, ATTENTION, MAMBA2, RELU2_MLP, GATED_DELTANET, NORMED_ATTENTION, SHORT_CONV, ZAMBA2_HYBRID = 1, 2, 3, 4, 5, 6, 7, 8
NO_FFN, SWIGLU_MLP, MOE = 0, 1, 2
ATTENTIONS = (PagedAttention, GatedAttention, Lfm2Attention)  # the attention layers with a one-call decode


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
    ]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class Needs:
    """Scratch a layer's mixer or FFN takes per row: floats and (the MoE's) ints, plus fixed ints."""

    floats: int = 0
    ints: int = 0
    fixed_ints: int = 0


def norm_fits(norm) -> bool:
    """A plain RMSNorm, or Qwen3-Next's once its offset is folded into the weight (then the same)."""
    plain = type(norm) is RMSNorm or (type(norm) is OffsetRMSNorm and not norm.offset)
    return plain and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()


def all_cpu(tensors) -> bool:
    return tensors is not None and all(uses_cpu_kernel(t) for t in tensors)


def plan_mamba(entry: LayerPlan, mixer: MambaMixer, state, keep: list) -> Needs:
    conv_state, ssm_state = state
    A = -torch.exp(mixer.A_log.float())  # as forward computes it each call; the weights are final
    keep.append(A)
    norms = (mixer.dt_norm, mixer.b_norm, mixer.c_norm)
    entry.mixer = MAMBA
    entry.d_inner, entry.d_state, entry.dt_rank, entry.d_conv = mixer.d_inner, mixer.d_state, mixer.dt_rank, mixer.d_conv
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), pointer(mixer.in_proj.bias)
    entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), pointer(mixer.conv_bias)
    entry.x_panels = mixer.x_proj.packed_weight.panels.data_ptr()
    if mixer.dt_norm is not None:
        entry.dt_norm, entry.b_norm, entry.c_norm = (n.weight.data_ptr() for n in norms)
        entry.bcdt_eps = mixer.dt_norm.eps
    entry.dt_panels, entry.dt_bias = mixer.dt_proj.packed_weight.panels.data_ptr(), pointer(mixer.dt_proj.bias)
    entry.A, entry.D = A.data_ptr(), mixer.D.data_ptr()
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), pointer(mixer.out_proj.bias)
    return Needs(floats=mixer.one_call_scratch())


def plan_mamba2(entry: LayerPlan, mixer: Mamba2Mixer, state, keep: list) -> Needs:
    conv_state, ssm_state = state
    A, D = mixer.decay_and_skip()  # the weights are final
    keep += [A, D]
    norm = mixer.norm
    entry.mixer = MAMBA2
    entry.ssm_heads, entry.ssm_head_dim, entry.groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
    entry.d_state, entry.d_conv = mixer.d_state, mixer.d_conv
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), pointer(mixer.in_proj.bias)
    entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), pointer(mixer.conv_bias)
    entry.dt_bias, entry.A, entry.D = mixer.dt_bias.data_ptr(), A.data_ptr(), D.data_ptr()
    entry.dt_lo, entry.dt_hi = cpu.dt_bounds(mixer.dt_limit)
    if norm is not None:
        entry.gate_norm, entry.gate_norm_group, entry.gate_norm_eps = norm.weight.data_ptr(), norm.group_size, norm.eps
        entry.gate_norm_first = int(norm.norm_before_gate)
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), pointer(mixer.out_proj.bias)
    return Needs(floats=mixer.one_call_scratch())


def plan_zamba2_hybrid(layer: HybridLayer, caches: LayerCaches, index: int):
    """decode_layers._plan_layer for Zamba2's hybrid layer, where its shared attention (no q/k/v adapters), its
    shared MLP (the exact GELU), its linear and its Mamba2 mixer each run as one call."""
    block, attention, mixer = layer._block[0], layer.attention, layer.mamba
    adapter, state, kv = block.gate_up_adapters[str(layer.use)], caches.state[index], caches.kv[index]
    norms = (block.input_norm, block.pre_ff_norm, layer.mamba_norm)
    if not (attention.fits_one_call() and mixer.fits_one_call() and block.mlp_fits_one_call(adapter)
            and getattr(layer.linear, "packed_weight", None) is not None and all_cpu(kv) and all_cpu(state)
            and all(norm_fits(norm) for norm in norms)):
        return None
    entry, keep, rotary = LayerPlan(), [], []
    mamba_needs = plan_mamba2(entry, mixer, state, keep)
    attention_needs = plan_attention(entry, attention, kv, rotary)
    entry.mixer, entry.ffn = ZAMBA2_HYBRID, NO_FFN
    (entry.block_norm, entry.block_eps), (entry.pre_ff_norm, entry.pre_ff_eps), \
        (entry.mamba_norm, entry.mamba_norm_eps) = ((norm.weight.data_ptr(), norm.eps) for norm in norms)
    inter, rank = block.down_proj.in_features, adapter[0].out_features
    entry.mlp_inter, entry.lora_rank = inter, rank
    entry.up_panels, entry.up_bias = block.gate_up_proj.packed_weight.panels.data_ptr(), pointer(block.gate_up_proj.bias)
    entry.lora_down_panels = adapter[0].packed_weight.panels.data_ptr()
    entry.lora_up_panels = adapter[1].packed_weight.panels.data_ptr()
    entry.down_panels, entry.down_bias = block.down_proj.packed_weight.panels.data_ptr(), pointer(block.down_proj.bias)
    entry.linear_panels = layer.linear.packed_weight.panels.data_ptr()
    # cpu_decode.cpp zamba2_hybrid: [h | embeddings] and its norm, three rows of hidden, then the parts' own
    own = max(attention_needs.floats, 5 * inter + rank, mamba_needs.floats)
    return entry, keep, rotary, Needs(floats=7 * layer.linear.in_features + own)


def relu2_mlp_fits(mlp) -> bool:
    return (type(mlp) is NemotronMLP and mlp.act is ACTIVATIONS["relu2"]
            and all(getattr(m, "packed_weight", None) is not None for m in (mlp.up_proj, mlp.down_proj))
            and all(p.dtype == torch.float32 and p.is_contiguous() for p in mlp.parameters()))


def plan_relu2_mlp(entry: LayerPlan, mlp: NemotronMLP) -> Needs:
    entry.mixer, entry.mlp_inter = RELU2_MLP, mlp.up_proj.out_features
    entry.up_panels, entry.up_bias = mlp.up_proj.packed_weight.panels.data_ptr(), pointer(mlp.up_proj.bias)
    entry.down_panels, entry.down_bias = mlp.down_proj.packed_weight.panels.data_ptr(), pointer(mlp.down_proj.bias)
    return Needs(floats=mlp.up_proj.out_features)


def plan_gated_deltanet(entry: LayerPlan, mixer: GatedDeltaNetMixer, state, keep: list) -> Needs:
    conv_state, recurrent_state = state
    A, norm_weight = mixer.decay(), mixer.norm.per_channel(mixer.num_v_heads)  # the weights are final
    keep += [A, norm_weight]
    entry.mixer = GATED_DELTANET
    entry.key_heads, entry.value_heads = mixer.num_k_heads, mixer.num_v_heads
    entry.key_dim, entry.value_dim, entry.d_conv = mixer.k_head_dim, mixer.v_head_dim, mixer.conv_kernel
    entry.in_panels = mixer.in_proj_qkvz.packed_weight.panels.data_ptr()
    entry.x_panels = mixer.in_proj_ba.packed_weight.panels.data_ptr()
    entry.conv_state, entry.ssm_state = conv_state.data_ptr(), recurrent_state.data_ptr()
    entry.conv_weight, entry.A, entry.dt_bias = mixer.conv_weight.data_ptr(), A.data_ptr(), mixer.dt_bias.data_ptr()
    entry.gate_norm, entry.gate_norm_eps = norm_weight.data_ptr(), mixer.norm.eps
    entry.out_panels = mixer.out_proj.packed_weight.panels.data_ptr()
    return Needs(floats=mixer.one_call_scratch())


def plan_short_conv(entry: LayerPlan, mixer: ShortConvMixer, state) -> Needs:
    (conv_state,) = state
    entry.mixer, entry.d_conv, entry.conv_state = SHORT_CONV, mixer.kernel, conv_state.data_ptr()
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), pointer(mixer.in_proj.bias)
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), pointer(mixer.conv_bias)
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), pointer(mixer.out_proj.bias)
    return Needs(floats=mixer.one_call_scratch())


def plan_attention(entry: LayerPlan, mixer: PagedAttention, kv, rotary: list) -> Needs:
    """The attention fields (not the mixer kind: Falcon-H1's attention sits beside a Mamba2 mixer);
    its rotary embedding, if any, joins `rotary` (the entry takes its tables each step)."""
    if mixer.rotary is not None:
        rotary.append(mixer.rotary)
    k_cache, v_cache = kv
    packed, bias, _ = mixer.qkv_fused
    if isinstance(mixer, NormedAttention):
        entry.qk_norm_eps, entry.gated = mixer.q_norm.eps, int(mixer.gated)
        entry.q_norm, entry.k_norm = mixer.q_norm.weight.data_ptr(), mixer.k_norm.weight.data_ptr()
    entry.heads, entry.kv_heads, entry.head_dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    entry.block_size, entry.window, entry.scale = k_cache.shape[1], int(mixer.sliding_window or 0), float(mixer.scale)
    entry.qkv_panels, entry.qkv_bias = packed.panels.data_ptr(), pointer(bias)
    entry.o_panels, entry.o_bias = mixer.o_proj.packed_weight.panels.data_ptr(), pointer(mixer.o_proj.bias)
    entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    return Needs(floats=mixer._one_call_kernel()[2])


def plan_moe(entry: LayerPlan, moe: SparseMoE, hidden: int) -> Needs:
    inter, k = moe.down.shape[2], moe.top_k
    entry.ffn, entry.experts, entry.top_k, entry.normalize, entry.inter = MOE, moe.num_experts, k, int(moe.normalize_top_k), inter
    entry.router_panels, entry.expert_panels = moe.router.packed_weight.panels.data_ptr(), moe.panel_pointers.data_ptr()
    # moe_layer's scratch: router logits, then per pick its weight, routed row, expert output, experts' work
    return Needs(floats=moe.num_experts + k * (1 + 2 * hidden + 3 * inter), ints=3 * k, fixed_ints=moe.num_experts)


def plan_mlp(entry: LayerPlan, mlp: GatedMLP) -> Needs:
    inter = mlp.down_proj.in_features
    entry.ffn, entry.inter, entry.expert_panels = SWIGLU_MLP, inter, mlp.one_call_pointers().data_ptr()
    return Needs(floats=3 * inter, fixed_ints=1)
