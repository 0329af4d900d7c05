"""Decode rows that share a state slot: how every decode state kernel runs them.

A VERIFY step (engine.phase) runs a sequence's pending token and its drafts as consecutive
decode rows of its one slot (engine.model_runner.verify_host_batch). Each of those rows must
read the state the row before it left, so the decode state kernels (conv update, Mamba and
Mamba2 state updates, the gated delta step) take `slot_runs=True` to mean: rows that share a
slot are adjacent, and run in row order.

- C++ (engine/kernels/cpu_kernels.cpp `state_threads`): such rows go to one thread, in order,
  whether asked or not.
- Triton: the program of a run's first row runs the whole run, its state slice in registers
  and stored once after the run's last row (`slot_rows`); the programs of the run's other rows
  do nothing. A half-width pool is then rounded once per run, not once per row, so the engine
  runs verify steps this way only on float32 state.
- torch references: the rows run in waves whose slots are distinct (`slot_waves`), the k-th
  row of every run in wave k.

Without `slot_runs` (every plain decode step, and the CUDA graphs captured for them) slots
must be distinct and each row is a program of its own, as before: the padded rows of a graph
all share the scratch slot, and would otherwise run as one long run.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import device_function, tl


@device_function
def slot_rows(slots_ptr, row, rows, mask, SLOT_RUNS: tl.constexpr):
    """(slot, end, mask) for the program of decode row `row` of `rows`: it runs rows row..end-1
    of slot `slot` and stores the state under `mask`. Without SLOT_RUNS, its own row. With it,
    where `row` begins a run of adjacent rows sharing a slot, the whole run; where it does not,
    nothing (end = row, the mask empty: the run's first program runs it). (The mask is compared
    as a tensor: Triton's interpreter does not broadcast a scalar condition into one.)"""
    slot = tl.load(slots_ptr + row).to(tl.int64)  # int64: slot * stride may exceed 2**31
    if SLOT_RUNS:
        before = tl.load(slots_ptr + row - 1, mask=row > 0, other=-1).to(tl.int64)
        end = row + 1
        after = tl.load(slots_ptr + end, mask=end < rows, other=-1).to(tl.int64)
        while after == slot:
            end += 1
            after = tl.load(slots_ptr + end, mask=end < rows, other=-1).to(tl.int64)
        end = tl.where(before == slot, row, end)
        mask = mask & (tl.zeros_like(mask.to(tl.int32)) + row < end)
    else:
        end = row + 1
    return slot, end, mask


def slot_waves(slots: torch.Tensor) -> list[torch.Tensor]:
    """The rows of each wave, in order: wave k holds the k-th row of every run of adjacent rows
    that share a slot, so a wave's slots are distinct and each row comes after the rows before
    it in its run. (Reads the slots on the host.)"""
    waves: list[list[int]] = []
    previous, depth = None, 0
    for row, slot in enumerate(slots.tolist()):
        depth = depth + 1 if slot == previous else 0
        previous = slot
        if depth == len(waves):
            waves.append([])
        waves[depth].append(row)
    return [torch.tensor(rows, dtype=torch.long, device=slots.device) for rows in waves]


def in_waves(slots: torch.Tensor, out: torch.Tensor, update) -> torch.Tensor:
    """out[rows] = update(rows) for each wave of `slot_waves(slots)`, in order: a torch
    reference's per-row update run so that rows sharing a slot see each other's state."""
    for rows in slot_waves(slots):
        out[rows] = update(rows).to(out.dtype)
    return out
