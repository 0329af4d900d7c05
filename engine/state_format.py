"""Recurrent state stored narrower than the layers compute it (`mamba_state_dtype`).

A recurrent layer computes its state in float32 and, by default, the cache keeps it so. With
`mamba_state_dtype` bfloat16 or float16 the cache keeps every recurrent layer's state tensors
at half width: half the bytes per sequence on a decode worker, in a hand-off and in a prefix
cache entry. On the CPU the layers themselves do not change: around each such layer's forward,
NarrowState loads the step's slots from the narrow pool into one float32 working buffer,
the layer runs on it exactly as on a float32 pool, and the rows go back rounded. The working
buffer holds one layer at a time (every layer of the same state shape shares it), so the
memory saved is all but that one layer's float32 copy.

The rounding is stochastic: up or down with the probability that makes its expected value the
float32 value, so a state that changes by less than half a unit in the last place per token
still drifts where float32 would (round-to-nearest would leave it where it is). Its random
bits are a hash of the value, the element's index and the sequence's length after the step,
not a generator's: a request's state is the same whether it ran alone, in a batch, or on a
prefill worker that handed it off, and the same on every run (tests/test_state_format.py).
The float32 state each step starts from is what was stored: drift against a float32 cache is
measured (splitserve bench quant), not assumed. The rounding's torch definition and the
one-pass Triton store and load that CUDA runs are engine.kernels.state_round; on the CPU,
cpu_state.cpp does the same in C++.

An all-decode step on Triton skips the working rows where the layer's mixer can (Mamba,
Mamba2, Gated DeltaNet, KDA and short conv: `reads_narrow_state_in_place`): it is handed the pool itself,
and its decode kernels read each slot exactly and store it rounded as the store would, the
same hash and bits (engine.kernels.state_round's load_state / store_state), so the step
computes and stores what the working rows give, bit for bit (tests/test_state_format.py).

A prefix cache's checkpoints, its tiers and the hand-off copy the narrow rows as they are;
the hand-off's layout handshake compares every tensor's dtype, so a pair that disagrees on
the format is refused with both dtypes named (kvtransfer.layout).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.kernels import native, uses_triton
from engine.kernels.state_round import state_load_triton, state_store_triton, stochastic_round
from engine.models import LayerCaches, ModelSpec
from engine.models.batch import ForwardBatch

STATE_DTYPES = ("float32", "bfloat16", "float16")
FORMATS = {torch.bfloat16: 1, torch.float16: 2}  # cpu_state.cpp's format codes (0: none)


def narrow_state_spec(spec: ModelSpec, state_dtype: str) -> ModelSpec:
    """`spec` with every float32 recurrent state tensor stored as `state_dtype`."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"mamba_state_dtype: {state_dtype!r} not in {list(STATE_DTYPES)}")
    if state_dtype == "float32":
        return spec
    layers = tuple(dataclasses.replace(layer, state=tuple(
        dataclasses.replace(t, stored_dtype=state_dtype) if t.dtype == "float32" else t for t in layer.state))
        for layer in spec.layers)
    return dataclasses.replace(spec, layers=layers)


def working_bytes(spec: ModelSpec, num_slot_rows: int) -> int:
    """The float32 working buffers NarrowState allocates for `spec`: per row shape, as many
    as the layer holding the most tensors of that shape."""
    counts: dict[tuple, int] = {}
    for layer in spec.layers:
        mine: dict[tuple, int] = {}
        for t in layer.state:
            if t.stored_dtype is not None:
                mine[t.shape] = mine.get(t.shape, 0) + 1
        for shape, n in mine.items():
            counts[shape] = max(counts.get(shape, 0), n)
    total = 0
    for shape, n in counts.items():
        numel = 1
        for d in shape:
            numel *= d
        total += n * numel * 4 * num_slot_rows
    return total


class NarrowState:
    """The float32 working rows of a cache whose recurrent state is stored narrow, and the load /
    store around each such layer's forward (engine.cache_formats.NarrowCache)."""

    def __init__(self, pool: LayerCaches, narrow_layers: list[int], num_slot_rows: int):
        self.pool = pool
        self.layers = set(narrow_layers)
        buffers: dict[tuple, list[torch.Tensor]] = {}  # per row shape; a layer's j-th tensor of it: the j-th
        self.working: dict[int, tuple[torch.Tensor, ...]] = {}
        for i in narrow_layers:
            rows, used = [], {}
            for t in pool.state[i]:
                shape = tuple(t.shape[1:])
                j = used[shape] = used.get(shape, -1) + 1
                shared = buffers.setdefault(shape, [])
                if j == len(shared):
                    shared.append(torch.zeros((num_slot_rows, *shape), dtype=torch.float32, device=t.device))
                rows.append(shared[j])
            self.working[i] = tuple(rows)
        # On the CPU the load and the rounded store are one C++ pass each (cpu_state.cpp, the
        # same arithmetic as stochastic_round), where the kernels are built.
        self.native = bool(narrow_layers) and pool.state[narrow_layers[0]][0].device.type == "cpu" \
            and native.available()
        self.buffers = [t for shared in buffers.values() for t in shared]
        self._elements: dict[tuple, torch.Tensor] = {}
        self._batch: ForwardBatch | None = None
        self._rows = self._positions = None

    def place(self, kv: list, state: list) -> None:
        """Point the working caches' state entries of these layers at the working rows."""
        for i, rows in self.working.items():
            state[i] = rows

    @property
    def working_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    reads_kind = "state"  # what a layer's modules must say they take in place (HybridLM.in_place_readers)

    def _in_place(self, layer: int, batch: ForwardBatch, pool_ok: bool) -> bool:
        """An all-decode step on Triton whose layer may be handed the pool (`pool_ok`): its decode
        kernels read and round the half-width slots themselves."""
        return pool_ok and not batch.prefill_rows and uses_triton(self.pool.state[layer][0])

    def load(self, layer: int, batch: ForwardBatch, pool_ok: bool) -> tuple[torch.Tensor, ...]:
        """What layer `layer` is handed this step: the pool itself (see _in_place), or the
        working rows with the step's slots loaded into them."""
        if self._in_place(layer, batch, pool_ok):
            return self.pool.state[layer]
        rows, _ = self._step(batch)
        for working, stored in zip(self.working[layer], self.pool.state[layer]):
            if uses_triton(working):  # one pass (engine.kernels.state_round)
                state_load_triton(stored, working, rows)
            elif self.native:
                native.call("state_load", pool=stored, working=working, slots=rows, rows=rows.numel(),
                            row_numel=working[0].numel(), format=FORMATS[stored.dtype])
            else:
                working.index_copy_(0, rows, stored.index_select(0, rows).float())
        return self.working[layer]

    def store(self, layer: int, batch: ForwardBatch, pool_ok: bool) -> None:
        """The step's slots of `layer` back into the pool, stochastically rounded (nothing where
        the layer had the pool in place)."""
        if self._in_place(layer, batch, pool_ok):
            return
        rows, positions = self._step(batch)
        for working, stored in zip(self.working[layer], self.pool.state[layer]):
            if uses_triton(working):  # one pass, as the C++ store (engine.kernels.state_round)
                state_store_triton(working, stored, rows, positions)
            elif self.native:
                native.call("state_store", working=working, pool=stored, slots=rows, positions=positions,
                            rows=rows.numel(), row_numel=working[0].numel(), format=FORMATS[stored.dtype])
            else:
                elements = self._element_index(working)
                stored.index_copy_(0, rows, stochastic_round(working.index_select(0, rows), stored.dtype,
                                                             positions, elements))

    def fill_plan(self, entry, layer: int) -> None:
        """A one-call decode plan's entry for `layer` (engine.kernels.decode_plan.LayerPlan, its
        state fields already at the working rows): the pool tensors to load and store around it."""
        pools, working = self.pool.state[layer], self.working[layer]
        if len(pools) > 2:
            raise ValueError(f"layer {layer}: the one-call decode stack stores at most two narrow state tensors")
        entry.narrow_format = FORMATS[pools[0].dtype]
        for t, (pool, rows) in enumerate(zip(pools, working)):
            entry.narrow_pool[t], entry.narrow_work[t], entry.narrow_numel[t] = \
                pool.data_ptr(), rows.data_ptr(), rows[0].numel()

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's slots and each one's sequence length after the step, once per batch. A
        decode-only batch reads them from its decode tensors alone (a replayed static batch
        keeps no per-row lists)."""
        if self._batch is not batch:
            if batch.prefill_rows:
                device = batch.input_ids.device
                self._rows = torch.tensor(batch.state_slots, dtype=torch.long).to(device)
                self._positions = torch.tensor(batch.context_lens, dtype=torch.long).to(device)
            else:
                self._rows, self._positions = batch.decode_slots, batch.decode_context_lens
            self._rows, self._positions = self._rows.contiguous(), self._positions.contiguous()  # the kernels' rule
            self._batch = batch
        return self._rows, self._positions

    def _element_index(self, working: torch.Tensor) -> torch.Tensor:
        key = (tuple(working.shape[1:]), working.device)
        if key not in self._elements:
            self._elements[key] = torch.arange(working[0].numel(), device=working.device).view(working.shape[1:])
        return self._elements[key]
