"""A decode step's decoder layers as one C++ call (engine/kernels/cpu_decode.cpp).

On the CPU the Python between a decode step's C++ calls (norms, residual adds, each one-call
mixer's and FFN's argument set-up) is a sizeable share of the step. Where every layer is a plain
DecoderLayer (a residual multiplier allowed) or a Falcon-H1 layer (attention beside Mamba2,
multipliers folded), whose norms are RMSNorms (Qwen3-Next's once folded), whose mixer runs as
one call (MambaMixer, Mamba2Mixer, GatedDeltaNetMixer, ShortConvMixer, PagedAttention, LFM2's
and Qwen3-Next's normed attention; or a squared-ReLU MLP in the mixer's place, Nemotron-H's) and
whose FFN does too (GatedMLP, SparseMoE, routed plus shared experts, the shared one gated or
not, or none), the whole stack runs as one call of the same kernels in the same order, so the
hidden states are the bits of the layer-by-layer path. Zamba2's hybrid layers (shared attention,
shared MLP, their own linear and Mamba2) join in where their attention has no q/k/v adapters and
their MLP the exact GELU. Where only some layers fit, each run of them is one call and the
others take the layer path between the runs (SegmentedPlan: Nemotron-H's MoE, Zamba2's hybrid
layers otherwise). A prefill in the batch, tensor parallelism or a GPU takes the layer path
throughout. Each layer part's entry is filled in engine.models.layer_plans.

A plan holds raw pointers to the weights and caches: it is built once the weights are packed
(which is when they are final) and rebuilt when the caches it points at change.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu, native, uses_cpu_kernel
from engine.models.attention import NormedAttention, PagedAttention
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.families_falcon_h1 import FalconH1Layer
from engine.models.families_qwen3_next import SharedExpertMoE
from engine.models.families_zamba2 import HybridLayer
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.hybrid import DecoderLayer, FFNMixer
from engine.models.layer_plans import (ATTENTION, ATTENTIONS, NO_FFN, NORMED_ATTENTION, ZAMBA2_HYBRID, LayerPlan,
                                       Needs, all_cpu, norm_fits, plan_attention, plan_gated_deltanet, plan_mamba,
                                       plan_mamba2, plan_mlp, plan_moe, plan_relu2_mlp, plan_short_conv,
                                       plan_zamba2_hybrid, pointer, relu2_mlp_fits)
from engine.models.layers import GatedMLP, SparseMoE, SummedFFN
from engine.models.mamba2 import Mamba2Mixer
from engine.models.short_conv import ShortConvMixer
from engine.models.ssm import MambaMixer

HIDDEN_BUFFERS = 7  # cpu_decode.cpp's per-step buffers of [rows, hidden]


class DecodeLayersPlan:
    """Every layer's LayerPlan, what they point at that nothing else holds, and the step's needs."""

    def __init__(self, plans: ctypes.Array, keep: list, rotary: list, needs: Needs, uses_slots: bool,
                 uses_kv: bool):
        self.plans, self._keep, self._rotary, self._needs = plans, keep, rotary, needs
        self._reads_embeddings = [plans[i] for i in range(len(plans)) if plans[i].mixer == ZAMBA2_HYBRID]
        self.uses_slots, self.uses_kv = uses_slots, uses_kv
        self._scratch = (0, None, None)  # (rows, floats, ints): the last step's, reused at the same batch size

    def run(self, h: torch.Tensor, batch: ForwardBatch, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states after the last layer, for h [rows, hidden] of an all-decode CPU batch
        (and the step's embeddings, contiguous, where a Zamba2 hybrid layer reads them)."""
        rows, hidden = h.shape
        if self._reads_embeddings and (embeddings is None or embeddings.shape != h.shape
                                       or not uses_cpu_kernel(embeddings)):
            raise ValueError("a Zamba2 hybrid layer's one call needs the step's embeddings, "
                             f"contiguous float32 {tuple(h.shape)} on the CPU")
        for entry in self._reads_embeddings:
            entry.embeddings = embeddings.data_ptr()
        step_tables = {}  # this step's rotary tables, alive through the call; one per rotary module
        for entry, rotary in self._rotary:
            if rotary not in step_tables:
                step_tables[rotary] = rotary._tables(batch.positions, torch.float32)
            cos, sin = step_tables[rotary]
            entry.cos, entry.sin, entry.rotary_dim = cos.data_ptr(), sin.data_ptr(), cos.shape[1]
        tables = cpu.ids(batch.decode_block_tables) if self.uses_kv else None
        if self._scratch[0] != rows:  # the kernel overwrites its scratch before reading it
            self._scratch = (rows, torch.empty(rows * (HIDDEN_BUFFERS * hidden + self._needs.floats)),
                             torch.empty(rows * self._needs.ints + self._needs.fixed_ints, dtype=torch.long))
        out = torch.empty(rows, hidden)
        native.call("decoder_layers", ctypes.addressof(self.plans), len(self.plans), h, rows, hidden,
                    cpu.ids(batch.decode_slots) if self.uses_slots else None,
                    cpu.ids(batch.kv_write_index) if self.uses_kv else None, tables,
                    0 if tables is None else tables.shape[1],
                    cpu.ids(batch.decode_context_lens) if self.uses_kv else None, self._scratch[1], self._scratch[2], out)
        return out


class SegmentedPlan:
    """A decode step's layers as runs: each run of consecutive layers that fit is one call of
    its DecodeLayersPlan; a layer that does not fit takes the layer path on its own."""

    def __init__(self, segments: list[tuple[int, DecodeLayersPlan | None]]):
        self.segments = segments  # (first layer, its run's plan, or None for that one layer)

    def run(self, h: torch.Tensor, batch: ForwardBatch, run_layer,
            embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """h after every layer; run_layer(index, h) runs one layer on the layer path."""
        for first, plan in self.segments:
            h = run_layer(first, h) if plan is None else plan.run(h, batch, embeddings)
        return h


def build_plan(layers, caches: LayerCaches) -> SegmentedPlan | None:
    """The plan for these layers over these caches, or None where no layer can run in it."""
    if native.library().decoder_layer_plan_bytes() != ctypes.sizeof(LayerPlan):
        raise RuntimeError("engine/kernels/cpu_decode.cpp's LayerPlan and layer_plans.LayerPlan differ")
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
    needs = Needs(max(n.floats for *_, n in run), max(n.ints for *_, n in run),
                   max(max(n.fixed_ints for *_, n in run), 1))
    # Every mixer with per-sequence state has a conv state; every attention a K cache.
    return DecodeLayersPlan(plans, keep, rotary, needs, any(e.conv_state for e in plans), any(e.k_cache for e in plans))


def _plan_layer(layer, caches: LayerCaches, index: int):
    """(its LayerPlan entry, tensors the entry points at that nothing else holds, the rotary
    embeddings whose tables the entry takes each step, its needs), or None where the layer cannot
    run in one call."""
    if type(layer) is HybridLayer:
        return plan_zamba2_hybrid(layer, caches, index)
    parts = _layer_parts(layer)
    if parts is None or not norm_fits(parts[0]):
        return None
    input_norm, mixer, beside, ffn_norm, ffn, residual_scale = parts
    entry, keep, rotary = LayerPlan(), [], []
    entry.input_norm, entry.input_eps = input_norm.weight.data_ptr(), input_norm.eps
    entry.residual_scale = residual_scale
    mixer_needs = _plan_mixer(entry, mixer, caches, index, keep, rotary)
    if mixer_needs is None:
        return None
    if beside is not None:  # Falcon-H1's attention beside its Mamba2 mixer
        if type(beside) is not PagedAttention or not all_cpu(caches.kv[index]) or not beside.fits_one_call():
            return None
        mixer_needs = Needs(max(mixer_needs.floats, plan_attention(entry, beside, caches.kv[index], rotary).floats))
        entry.parallel_attention = 1
    if ffn is None:
        ffn_needs = Needs()
        entry.ffn = NO_FFN
    elif norm_fits(ffn_norm) and (ffn_parts := _ffn_parts(ffn)) is not None:
        entry.ffn_norm, entry.ffn_eps = ffn_norm.weight.data_ptr(), ffn_norm.eps
        first, shared, shared_gate = ffn_parts
        ffn_needs = plan_moe(entry, first, input_norm.weight.numel()) if type(first) is SparseMoE \
            else plan_mlp(entry, first)
        if shared is not None:
            inter = shared.down_proj.in_features
            entry.shared_inter, entry.shared_panels = inter, shared.one_call_pointers().data_ptr()
            entry.shared_gate_panels = pointer(shared_gate)
            ffn_needs = Needs(max(ffn_needs.floats, 3 * inter), ffn_needs.ints, ffn_needs.fixed_ints)
    else:
        return None
    needs = Needs(max(mixer_needs.floats, ffn_needs.floats), ffn_needs.ints, ffn_needs.fixed_ints)
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


def _plan_mixer(entry: LayerPlan, mixer, caches: LayerCaches, index: int, keep: list, rotary: list) -> Needs | None:
    """Fill the mixer's fields of `entry`, where it runs as one call; its needs, or None."""
    state, kv = caches.state[index], caches.kv[index]
    if isinstance(mixer, Mamba2Mixer) and all_cpu(state) and mixer.fits_one_call():  # Falcon-H1's once folded
        return plan_mamba2(entry, mixer, state, keep)
    if type(mixer) is MambaMixer and all_cpu(state) and mixer.fits_one_call():
        return plan_mamba(entry, mixer, state, keep)
    if type(mixer) is FFNMixer and relu2_mlp_fits(mixer.ffn):
        return plan_relu2_mlp(entry, mixer.ffn)
    if type(mixer) is GatedDeltaNetMixer and all_cpu(state) and mixer.fits_one_call():
        return plan_gated_deltanet(entry, mixer, state, keep)
    if type(mixer) is ShortConvMixer and all_cpu(state) and mixer.fits_one_call():
        return plan_short_conv(entry, mixer, state)
    if type(mixer) in ATTENTIONS and all_cpu(kv) and mixer.fits_one_call():
        entry.mixer = NORMED_ATTENTION if isinstance(mixer, NormedAttention) else ATTENTION
        return plan_attention(entry, mixer, kv, rotary)
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
