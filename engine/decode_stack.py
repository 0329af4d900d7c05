"""A decode step's decoder layers as one C++ call (engine/kernels/cpu_decode.cpp), assembled
from what each layer offers and chosen by the model runner.

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
throughout. Each layer fills its own entry (its `plan_decode`, in its kind's module; the
contract is engine.kernels.decode_plan), so this module imports no layer class.

A plan holds raw pointers to the weights and caches: it is built once the weights are packed
(which is when they are final) and rebuilt when the caches it points at change.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu, native, uses_cpu_kernel
from engine.kernels.decode_plan import ZAMBA2_HYBRID, LayerPlan, Needs
from engine.models.batch import ForwardBatch, LayerCaches

HIDDEN_BUFFERS = 7  # cpu_decode.cpp's per-step buffers of [rows, hidden]


class DecodeLayersPlan:
    """Every layer's LayerPlan, what they point at that nothing else holds, and the step's needs."""

    def __init__(self, plans: ctypes.Array, keep: list, rotary: list, needs: Needs, uses_slots: bool,
                 uses_kv: bool, stores_narrow: bool = False):
        self.plans, self._keep, self._rotary, self._needs = plans, keep, rotary, needs
        self._reads_embeddings = [plans[i] for i in range(len(plans)) if plans[i].mixer == ZAMBA2_HYBRID]
        self.uses_slots, self.uses_kv = uses_slots, uses_kv
        self.uses_lens = uses_kv or stores_narrow  # a narrow store's rounding reads each row's length
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
        native.call("decoder_layers", plan=ctypes.addressof(self.plans), layers=len(self.plans), h=h, rows=rows,
                    hidden=hidden, slots=cpu.ids(batch.decode_slots) if self.uses_slots else None,
                    write_index=cpu.ids(batch.kv_write_index) if self.uses_kv else None, tables=tables,
                    table_width=0 if tables is None else tables.shape[1],
                    lens=cpu.ids(batch.decode_context_lens) if self.uses_lens else None, scratch=self._scratch[1],
                    ids=self._scratch[2], out=out)
        return out


class SegmentedPlan:
    """A decode step's layers as runs: each run of consecutive layers that fit is one call of
    its DecodeLayersPlan; a layer that does not fit takes the layer path on its own."""

    def __init__(self, segments: list[tuple[int, DecodeLayersPlan | None]]):
        self.segments = segments  # (first layer, its run's plan, or None for that one layer)
        self.whole = all(plan is not None for _, plan in segments)  # every layer in the one-call kernels

    def run(self, h: torch.Tensor, batch: ForwardBatch, run_layer,
            embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """h after every layer; run_layer(index, h) runs one layer on the layer path."""
        for first, plan in self.segments:
            h = run_layer(first, h) if plan is None else plan.run(h, batch, embeddings)
        return h


def build_plan(layers, caches: LayerCaches) -> SegmentedPlan | None:
    """The plan for these layers over these caches, or None where no layer can run in it. Where
    some layers' state is stored narrow, their entries point at the float32 working rows and
    load and store their pool's rows around the mixer (engine.state_format); a layer with FP8 KV
    takes the layer path (engine.cache_formats.NarrowCache.fill_plan)."""
    if native.library().decoder_layer_plan_bytes() != ctypes.sizeof(LayerPlan):
        raise RuntimeError("engine/kernels/cpu_decode.cpp's LayerPlan and decode_plan.LayerPlan differ")
    narrow = caches.narrow
    run_on = caches if narrow is None else narrow.working
    planned = [layer.plan_decode(run_on, index) if hasattr(layer, "plan_decode") and _packs_densely(layer) else None
               for index, layer in enumerate(layers)]
    if not any(planned):
        return None
    if narrow is not None:
        for index, layer_plan in enumerate(planned):
            if layer_plan is not None and narrow.holds(index) and not narrow.fill_plan(layer_plan[0], index):
                planned[index] = None
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


def _packs_densely(layer) -> bool:
    """Whether every module of the layer can join the stack's dense float32 panels; a module
    that must run its own way (an FP8 linear rounds its input) says so with
    `joins_decode_plan = False`, and its layer takes the layer path."""
    return all(getattr(module, "joins_decode_plan", True) for module in layer.modules())


def _segment(run: list) -> DecodeLayersPlan:
    """One call's plan over consecutive layers' (entry, keep, rotary, needs)."""
    plans = (LayerPlan * len(run))(*(entry for entry, _, _, _ in run))  # copies of the entries
    keep = [tensor for _, kept, _, _ in run for tensor in kept]
    rotary = [(plans[i], r) for i, (_, _, layer_rotary, _) in enumerate(run) for r in layer_rotary]
    needs = Needs(max(n.floats for *_, n in run), max(n.ints for *_, n in run),
                   max(max(n.fixed_ints for *_, n in run), 1))
    # Every mixer with per-sequence state has a conv state; every attention a K cache.
    return DecodeLayersPlan(plans, keep, rotary, needs, any(e.conv_state for e in plans), any(e.k_cache for e in plans),
                            any(e.narrow_format for e in plans))


class DecodeStack:
    """The one-call decode stack of a model on the CPU: a SegmentedPlan for a step whose every
    row decodes, rebuilt when the caches it points at move. Made once the weights are packed
    (ModelRunner), which is when the pointers it takes from them are final."""

    def __init__(self, model):
        self.model = model
        self._plan = (None, None)  # (the cache pointers it was built for, the plan)

    def plan(self, batch: ForwardBatch, caches: LayerCaches) -> SegmentedPlan | None:
        """The plan where this step can run runs of layers as one call each: every row a decode
        (decode_tokens a slice: on the CPU kernels), the model not sharded, some layer fits."""
        model = self.model
        if not (isinstance(batch.decode_tokens, slice) and uses_cpu_kernel(model.embed.weight)
                and getattr(model, "tp_group", None) is None):
            return None
        key = tuple(t.data_ptr() for t in caches.tensors())
        if self._plan[0] != key:
            self._plan = (key, build_plan(model.layers, caches))
        return self._plan[1]
