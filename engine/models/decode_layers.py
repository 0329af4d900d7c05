"""A decode step's decoder layers as one C++ call (engine/kernels/cpu_decode.cpp).

On the CPU a Jamba or Llama decode step spent about 0.2 ms a layer in Python between its C++
calls (norms, residual adds, each one-call mixer's and FFN's argument set-up): a sixth of the
step at 64 sequences. Where every layer is a plain DecoderLayer (a residual multiplier allowed)
or a Falcon-H1 layer (attention beside Mamba2, multipliers folded), whose norms are RMSNorms
(Qwen3-Next's once folded), whose mixer runs as one call (MambaMixer, Mamba2Mixer,
GatedDeltaNetMixer, ShortConvMixer, PagedAttention, LFM2's and Qwen3-Next's normed attention; or
a squared-ReLU MLP in the mixer's place, Nemotron-H's) and whose FFN does too (GatedMLP,
SparseMoE, routed plus shared experts, the shared one gated or not, or none), the whole stack
runs as one call of the same kernels in the same order, so the hidden states are the bits of the
layer-by-layer path. Where only some layers fit, each run of them is one call and the others take
the layer path between the runs (SegmentedPlan: Zamba2's hybrid layers, Nemotron-H's MoE). A
prefill in the batch, tensor parallelism or a GPU takes the layer path throughout.

A plan holds raw pointers to the weights and caches: it is built once the weights are packed
(which is when they are final) and rebuilt when the caches it points at change.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.kernels import cpu, native, uses_cpu_kernel
from engine.models.attention import NormedAttention, PagedAttention
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.families_falcon_h1 import FalconH1Layer
from engine.models.families_lfm2 import Lfm2Attention
from engine.models.families_qwen3_next import GatedAttention, OffsetRMSNorm, SharedExpertMoE
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.hybrid import DecoderLayer, FFNMixer
from engine.models.layers import ACTIVATIONS, GatedMLP, RMSNorm, SparseMoE, SummedFFN
from engine.models.mamba2 import Mamba2Mixer
from engine.models.nemotron_moe import NemotronMLP
from engine.models.short_conv import ShortConvMixer
from engine.models.ssm import MambaMixer

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAMBA, ATTENTION, MAMBA2, RELU2_MLP, GATED_DELTANET, NORMED_ATTENTION, SHORT_CONV = 1, 2, 3, 4, 5, 6, 7
NO_FFN, SWIGLU_MLP, MOE = 0, 1, 2
ATTENTIONS = (PagedAttention, GatedAttention, Lfm2Attention)  # the attention layers with a one-call decode
HIDDEN_BUFFERS = 7  # cpu_decode.cpp's per-step buffers of [rows, hidden]


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
        ("groups", I64), ("gate_norm_group", I64), ("gate_norm_first", I64), ("gate_norm", P), ("dt_lo", F32), ("dt_hi", F32), ("gate_norm_eps", F32),
        ("residual_scale", F32), ("shared_inter", I64), ("shared_panels", P),
        ("mlp_inter", I64), ("up_panels", P), ("up_bias", P), ("down_panels", P), ("down_bias", P),
        ("key_heads", I64), ("value_heads", I64), ("key_dim", I64), ("value_dim", I64),
        ("q_norm", P), ("k_norm", P), ("qk_norm_eps", F32), ("gated", I64), ("shared_gate_panels", P),
        ("ssm_heads", I64), ("ssm_head_dim", I64), ("parallel_attention", I64),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class _Needs:
    """Scratch a layer's mixer or FFN takes per row: floats and (the MoE's) ints, plus fixed ints."""

    floats: int = 0
    ints: int = 0
    fixed_ints: int = 0


class DecodeLayersPlan:
    """Every layer's LayerPlan, what they point at that nothing else holds, and the step's needs."""

    def __init__(self, plans: ctypes.Array, keep: list, rotary: list, needs: _Needs, uses_slots: bool,
                 uses_kv: bool):
        self.plans, self._keep, self._rotary, self._needs = plans, keep, rotary, needs
        self.uses_slots, self.uses_kv = uses_slots, uses_kv

    def run(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states after the last layer, for h [rows, hidden] of an all-decode CPU batch."""
        rows, hidden = h.shape
        step_tables = []  # this step's rotary tables, alive through the call
        for entry, rotary in self._rotary:
            cos, sin = rotary._tables(batch.positions, torch.float32)
            entry.cos, entry.sin, entry.rotary_dim = cos.data_ptr(), sin.data_ptr(), cos.shape[1]
            step_tables.append((cos, sin))
        tables = cpu.ids(batch.decode_block_tables) if self.uses_kv else None
        out = torch.empty(rows, hidden)
        native.call("decoder_layers", ctypes.addressof(self.plans), len(self.plans), h, rows, hidden,
                    cpu.ids(batch.decode_slots) if self.uses_slots else None,
                    cpu.ids(batch.kv_write_index) if self.uses_kv else None, tables,
                    0 if tables is None else tables.shape[1],
                    cpu.ids(batch.decode_context_lens) if self.uses_kv else None,
                    torch.empty(rows * (HIDDEN_BUFFERS * hidden + self._needs.floats)),
                    torch.empty(rows * self._needs.ints + self._needs.fixed_ints, dtype=torch.long), out)
        return out


class SegmentedPlan:
    """A decode step's layers as runs: each run of consecutive layers that fit is one call of
    its DecodeLayersPlan; a layer that does not fit takes the layer path on its own."""

    def __init__(self, segments: list[tuple[int, DecodeLayersPlan | None]]):
        self.segments = segments  # (first layer, its run's plan, or None for that one layer)

    def run(self, h: torch.Tensor, batch: ForwardBatch, run_layer) -> torch.Tensor:
        """h after every layer; run_layer(index, h) runs one layer on the layer path."""
        for first, plan in self.segments:
            h = run_layer(first, h) if plan is None else plan.run(h, batch)
        return h


def build_plan(layers, caches: LayerCaches) -> SegmentedPlan | None:
    """The plan for these layers over these caches, or None where no layer can run in it."""
    if native.library().decoder_layer_plan_bytes() != ctypes.sizeof(LayerPlan):
        raise RuntimeError("engine/kernels/cpu_decode.cpp's LayerPlan and decode_layers.LayerPlan differ")
    planned = [_plan_layer(layer, caches, index) for index, layer in enumerate(layers)]
    if not any(planned):
        return None
    segments, run = [], []
    for index, layer_plan in enumerate([*planned, None]):
        if layer_plan is not None:
            run.append(layer_plan)
            continue
        if run:
            segments.append((index - len(run), _segment(run)))
            run = []
        if index < len(layers):
            segments.append((index, None))
    return SegmentedPlan(segments)


def _segment(run: list) -> DecodeLayersPlan:
    """One call's plan over consecutive layers' (entry, keep, rotary, needs)."""
    plans = (LayerPlan * len(run))(*(entry for entry, _, _, _ in run))  # copies of the entries
    keep = [tensor for _, kept, _, _ in run for tensor in kept]
    rotary = [(plans[i], r) for i, (_, _, layer_rotary, _) in enumerate(run) for r in layer_rotary]
    needs = _Needs(max(n.floats for *_, n in run), max(n.ints for *_, n in run),
                   max(max(n.fixed_ints for *_, n in run), 1))
    # Every mixer with per-sequence state has a conv state; every attention a K cache.
    return DecodeLayersPlan(plans, keep, rotary, needs, any(e.conv_state for e in plans), any(e.k_cache for e in plans))


def _plan_layer(layer, caches: LayerCaches, index: int):
    """(its LayerPlan entry, tensors the entry points at that nothing else holds, the rotary
    embeddings whose tables the entry takes each step, its needs), or None where the layer cannot
    run in one call."""
    parts = _layer_parts(layer)
    if parts is None or not _norm_fits(parts[0]):
        return None
    input_norm, mixer, beside, ffn_norm, ffn, residual_scale = parts
    entry, keep, rotary = LayerPlan(), [], []
    entry.input_norm, entry.input_eps = input_norm.weight.data_ptr(), input_norm.eps
    entry.residual_scale = residual_scale
    mixer_needs = _plan_mixer(entry, mixer, caches, index, keep, rotary)
    if mixer_needs is None:
        return None
    if beside is not None:  # Falcon-H1's attention beside its Mamba2 mixer
        if type(beside) is not PagedAttention or not _all_cpu(caches.kv[index]) or not beside.fits_one_call():
            return None
        mixer_needs = _Needs(max(mixer_needs.floats, _plan_attention(entry, beside, caches.kv[index], rotary).floats))
        entry.parallel_attention = 1
    if ffn is None:
        ffn_needs = _Needs()
        entry.ffn = NO_FFN
    elif _norm_fits(ffn_norm) and (ffn_parts := _ffn_parts(ffn)) is not None:
        entry.ffn_norm, entry.ffn_eps = ffn_norm.weight.data_ptr(), ffn_norm.eps
        first, shared, shared_gate = ffn_parts
        ffn_needs = _plan_moe(entry, first, input_norm.weight.numel()) if type(first) is SparseMoE \
            else _plan_mlp(entry, first)
        if shared is not None:
            inter = shared.down_proj.in_features
            entry.shared_inter, entry.shared_panels = inter, shared.one_call_pointers().data_ptr()
            entry.shared_gate_panels = _ptr(shared_gate)
            ffn_needs = _Needs(max(ffn_needs.floats, 3 * inter), ffn_needs.ints, ffn_needs.fixed_ints)
    else:
        return None
    needs = _Needs(max(mixer_needs.floats, ffn_needs.floats), ffn_needs.ints, ffn_needs.fixed_ints)
    return entry, keep, rotary, needs


def _layer_parts(layer):
    """(input norm, mixer, an attention beside the mixer or None, FFN norm, FFN, residual scale)
    of a DecoderLayer, or of a Falcon-H1 layer whose multipliers are folded into its weights;
    None for any other layer."""
    if type(layer) is DecoderLayer:
        return layer.input_norm, layer.mixer, None, layer.ffn_norm, layer.ffn, layer.residual_scale
    if type(layer) is FalconH1Layer and layer.attn_in == layer.attn_out == layer.ssm_out == 1.0:
        return layer.input_layernorm, layer.mamba, layer.self_attn, layer.pre_ff_layernorm, layer.feed_forward, 1.0
    return None


def _plan_mixer(entry: LayerPlan, mixer, caches: LayerCaches, index: int, keep: list, rotary: list) -> _Needs | None:
    """Fill the mixer's fields of `entry`, where it runs as one call; its needs, or None."""
    state, kv = caches.state[index], caches.kv[index]
    if isinstance(mixer, Mamba2Mixer) and _all_cpu(state) and mixer.fits_one_call():  # Falcon-H1's once folded
        return _plan_mamba2(entry, mixer, state, keep)
    if type(mixer) is MambaMixer and _all_cpu(state) and mixer.fits_one_call():
        return _plan_mamba(entry, mixer, state, keep)
    if type(mixer) is FFNMixer and _relu2_mlp_fits(mixer.ffn):
        return _plan_relu2_mlp(entry, mixer.ffn)
    if type(mixer) is GatedDeltaNetMixer and _all_cpu(state) and mixer.fits_one_call():
        return _plan_gated_deltanet(entry, mixer, state, keep)
    if type(mixer) is ShortConvMixer and _all_cpu(state) and mixer.fits_one_call():
        return _plan_short_conv(entry, mixer, state)
    if type(mixer) in ATTENTIONS and _all_cpu(kv) and mixer.fits_one_call():
        entry.mixer = NORMED_ATTENTION if isinstance(mixer, NormedAttention) else ATTENTION
        return _plan_attention(entry, mixer, kv, rotary)
    return None


def _ffn_parts(ffn):
    """(the MLP or routed experts, a shared MLP added to them or None, the packed panels of the
    shared MLP's sigmoid gate or None) where every part runs as one call: GatedMLP, SparseMoE, a
    SummedFFN of a GatedMLP or of a SparseMoE and a GatedMLP (Granite's routed and shared experts),
    or a SharedExpertMoE (Qwen3-Next's, the shared expert gated)."""
    gate = None
    if type(ffn) is SharedExpertMoE:
        parts, gate = [ffn.routed, ffn.shared], getattr(ffn.shared_gate, "packed_weight", None)
        if gate is None or ffn.shared_gate.bias is not None:
            return None
    else:
        parts = list(ffn.parts) if type(ffn) is SummedFFN else [ffn]
    # a GatedMLP subclass whose forward is GatedMLP's (Falcon-H1's, its multipliers folded) counts as one
    kinds = [GatedMLP if isinstance(part, GatedMLP) and part.packs_fused() else type(part) for part in parts]
    if kinds not in ([GatedMLP], [SparseMoE], [SparseMoE, GatedMLP]) or not all(p.fits_one_call() for p in parts):
        return None
    return parts[0], (parts[1] if len(parts) == 2 else None), (None if gate is None else gate.panels)


def _norm_fits(norm) -> bool:
    """A plain RMSNorm, or Qwen3-Next's once its offset is folded into the weight (then the same)."""
    plain = type(norm) is RMSNorm or (type(norm) is OffsetRMSNorm and not norm.offset)
    return plain and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()


def _all_cpu(tensors) -> bool:
    return tensors is not None and all(uses_cpu_kernel(t) for t in tensors)


def _plan_mamba(entry: LayerPlan, mixer: MambaMixer, state, keep: list) -> _Needs:
    conv_state, ssm_state = state
    A = -torch.exp(mixer.A_log.float())  # as forward computes it each call; the weights are final
    keep.append(A)
    norms = (mixer.dt_norm, mixer.b_norm, mixer.c_norm)
    entry.mixer = MAMBA
    entry.d_inner, entry.d_state, entry.dt_rank, entry.d_conv = mixer.d_inner, mixer.d_state, mixer.dt_rank, mixer.d_conv
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), _ptr(mixer.in_proj.bias)
    entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), _ptr(mixer.conv_bias)
    entry.x_panels = mixer.x_proj.packed_weight.panels.data_ptr()
    if mixer.dt_norm is not None:
        entry.dt_norm, entry.b_norm, entry.c_norm = (n.weight.data_ptr() for n in norms)
        entry.bcdt_eps = mixer.dt_norm.eps
    entry.dt_panels, entry.dt_bias = mixer.dt_proj.packed_weight.panels.data_ptr(), _ptr(mixer.dt_proj.bias)
    entry.A, entry.D = A.data_ptr(), mixer.D.data_ptr()
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), _ptr(mixer.out_proj.bias)
    return _Needs(floats=mixer.one_call_scratch())


def _plan_mamba2(entry: LayerPlan, mixer: Mamba2Mixer, state, keep: list) -> _Needs:
    conv_state, ssm_state = state
    A, D = mixer.decay_and_skip()  # the weights are final
    keep += [A, D]
    norm = mixer.norm
    entry.mixer = MAMBA2
    entry.ssm_heads, entry.ssm_head_dim, entry.groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
    entry.d_state, entry.d_conv = mixer.d_state, mixer.d_conv
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), _ptr(mixer.in_proj.bias)
    entry.conv_state, entry.ssm_state = conv_state.data_ptr(), ssm_state.data_ptr()
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), _ptr(mixer.conv_bias)
    entry.dt_bias, entry.A, entry.D = mixer.dt_bias.data_ptr(), A.data_ptr(), D.data_ptr()
    entry.dt_lo, entry.dt_hi = cpu.dt_bounds(mixer.dt_limit)
    if norm is not None:
        entry.gate_norm, entry.gate_norm_group, entry.gate_norm_eps = norm.weight.data_ptr(), norm.group_size, norm.eps
        entry.gate_norm_first = int(norm.norm_before_gate)
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), _ptr(mixer.out_proj.bias)
    return _Needs(floats=mixer.one_call_scratch())


def _relu2_mlp_fits(mlp) -> bool:
    return (type(mlp) is NemotronMLP and mlp.act is ACTIVATIONS["relu2"]
            and all(getattr(m, "packed_weight", None) is not None for m in (mlp.up_proj, mlp.down_proj))
            and all(p.dtype == torch.float32 and p.is_contiguous() for p in mlp.parameters()))


def _plan_relu2_mlp(entry: LayerPlan, mlp: NemotronMLP) -> _Needs:
    entry.mixer, entry.mlp_inter = RELU2_MLP, mlp.up_proj.out_features
    entry.up_panels, entry.up_bias = mlp.up_proj.packed_weight.panels.data_ptr(), _ptr(mlp.up_proj.bias)
    entry.down_panels, entry.down_bias = mlp.down_proj.packed_weight.panels.data_ptr(), _ptr(mlp.down_proj.bias)
    return _Needs(floats=mlp.up_proj.out_features)


def _plan_gated_deltanet(entry: LayerPlan, mixer: GatedDeltaNetMixer, state, keep: list) -> _Needs:
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
    return _Needs(floats=mixer.one_call_scratch())


def _plan_short_conv(entry: LayerPlan, mixer: ShortConvMixer, state) -> _Needs:
    (conv_state,) = state
    entry.mixer, entry.d_conv, entry.conv_state = SHORT_CONV, mixer.kernel, conv_state.data_ptr()
    entry.in_panels, entry.in_bias = mixer.in_proj.packed_weight.panels.data_ptr(), _ptr(mixer.in_proj.bias)
    entry.conv_weight, entry.conv_bias = mixer.conv_weight.data_ptr(), _ptr(mixer.conv_bias)
    entry.out_panels, entry.out_bias = mixer.out_proj.packed_weight.panels.data_ptr(), _ptr(mixer.out_proj.bias)
    return _Needs(floats=mixer.one_call_scratch())


def _plan_attention(entry: LayerPlan, mixer: PagedAttention, kv, rotary: list) -> _Needs:
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
    entry.qkv_panels, entry.qkv_bias = packed.panels.data_ptr(), _ptr(bias)
    entry.o_panels, entry.o_bias = mixer.o_proj.packed_weight.panels.data_ptr(), _ptr(mixer.o_proj.bias)
    entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    return _Needs(floats=mixer._one_call_kernel()[2])


def _plan_moe(entry: LayerPlan, moe: SparseMoE, hidden: int) -> _Needs:
    inter, k = moe.down.shape[2], moe.top_k
    entry.ffn, entry.experts, entry.top_k, entry.normalize, entry.inter = MOE, moe.num_experts, k, int(moe.normalize_top_k), inter
    entry.router_panels, entry.expert_panels = moe.router.packed_weight.panels.data_ptr(), moe.panel_pointers.data_ptr()
    # moe_layer's scratch: router logits, then per pick its weight, routed row, expert output, experts' work
    return _Needs(floats=moe.num_experts + k * (1 + 2 * hidden + 3 * inter), ints=3 * k, fixed_ints=moe.num_experts)


def _plan_mlp(entry: LayerPlan, mlp: GatedMLP) -> _Needs:
    inter = mlp.down_proj.in_features
    entry.ffn, entry.inter, entry.expert_panels = SWIGLU_MLP, inter, mlp.one_call_pointers().data_ptr()
    return _Needs(floats=3 * inter, fixed_ints=1)
