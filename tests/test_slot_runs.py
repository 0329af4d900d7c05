"""Decode rows that share a state slot (engine.kernels.slot_runs): a verify step's tokens of one
sequence, run as consecutive decode rows of its slot. Every decode state kernel, asked with
`slot_runs`, must give what running those rows one call after another gives: the Triton
kernels (marker `triton`: compiled on a GPU, else under the interpreter), the torch references
and the C++ kernels alike. Plain rows between the runs, and pool rows outside the batch, must
come out as without runs."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import DEVICE, NAN, kernel_mode, requires_triton  # noqa: F401 (kernel_mode: a fixture) - first: it sets Triton's mode
from engine.kernels import cpu, cpu_kernels_ready
from engine.kernels._triton import jit, tl
from engine.kernels.conv_update import causal_conv1d_update_ref, causal_conv1d_update_triton
from engine.kernels.gdn_scan import gated_delta_step_ref
from engine.kernels.gdn_triton import gated_delta_step_triton
from engine.kernels.mamba2_update import mamba2_state_update_ref, mamba2_state_update_triton
from engine.kernels.slot_runs import slot_rows, slot_waves
from engine.kernels.ssm_update import selective_state_update_ref, selective_state_update_triton

# Runs of 3, 1 and 4 rows, a run at each end: slot 5's rows, slot 2's, then slot 7's.
SLOTS = [5, 5, 5, 2, 7, 7, 7, 7]
POOL_ROWS = 9


def _inputs(kind: str, rows: int, dtype=torch.float32) -> tuple[list, dict]:
    """(per-row tensors, the other arguments) of one decode state kernel, seeded."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

    if kind == "conv":
        return [rand(rows, 24)], {"weight": rand(24, 4), "bias": rand(24), "activation": "silu"}
    if kind == "mamba":
        return ([rand(rows, 24), rand(rows, 24, scale=0.1).abs(), rand(rows, 8), rand(rows, 8), rand(rows, 24)],
                {"A": -rand(24, 8).abs().float(), "D": rand(24), "dt_bias": rand(24), "dt_softplus": True})
    if kind == "mamba2":
        return ([rand(rows, 4, 8), rand(rows, 4), rand(rows, 2, 16), rand(rows, 2, 16)],
                {"A": -rand(4).abs().float(), "D": rand(4), "dt_bias": rand(4), "dt_softplus": True,
                 "dt_limit": (0.0, 4.0)})
    # the gated delta rule, a decay per key channel (Kimi Delta Attention's form)
    return ([rand(rows, 2, 8), rand(rows, 2, 8), rand(rows, 4, 16), -rand(rows, 4, 8).abs().float(),
             torch.sigmoid(rand(rows, 4).float())], {})


POOLS = {"conv": (24, 4), "mamba": (24, 8), "mamba2": (4, 8, 16), "gdn": (4, 8, 16)}
REFS = {"conv": causal_conv1d_update_ref, "mamba": selective_state_update_ref,
        "mamba2": mamba2_state_update_ref, "gdn": gated_delta_step_ref}
TRITON = {"conv": causal_conv1d_update_triton, "mamba": selective_state_update_triton,
          "mamba2": mamba2_state_update_triton, "gdn": gated_delta_step_triton}
CPU = {"conv": "causal_conv1d_update_cpu", "mamba": "selective_state_update_cpu",
       "mamba2": "mamba2_state_update_cpu", "gdn": "gated_delta_step_cpu"}


def _call(fn, kind, pool, slots, per_row, rest, **kwargs):
    if kind == "mamba":  # z goes by name: D and dt_bias sit between it and the positional ones
        *positional, z = per_row
        return fn(pool, slots, *positional[:2], rest["A"], *positional[2:], z=z,
                  **{k: v for k, v in rest.items() if k != "A"}, **kwargs)
    if kind == "mamba2":
        x, dt, B, C = per_row
        return fn(pool, slots, x, dt, rest["A"], B, C, **{k: v for k, v in rest.items() if k != "A"}, **kwargs)
    return fn(pool, slots, *per_row, **rest, **kwargs)


def _one_row_at_a_time(kind, pool, per_row, rest):
    """The definition: each row a call of its own, in order."""
    outs = []
    for row, slot in enumerate(SLOTS):
        slots = torch.tensor([slot], device=DEVICE)
        outs.append(_call(REFS[kind], kind, pool, slots, [t[row:row + 1] for t in per_row], rest).float())
    return torch.cat(outs)


def _check(kind, impl, atol):
    per_row, rest = _inputs(kind, len(SLOTS))
    pool = torch.randn(POOL_ROWS, *POOLS[kind], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_pool = pool.clone()
    want = _one_row_at_a_time(kind, want_pool, per_row, rest)
    got = _call(impl, kind, pool, torch.tensor(SLOTS, device=DEVICE), per_row, rest, slot_runs=True).float()
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    torch.testing.assert_close(pool, want_pool, atol=atol, rtol=atol)
    untouched = [s for s in range(POOL_ROWS) if s not in SLOTS]
    assert torch.equal(pool[untouched], want_pool[untouched])
    return got, pool


def test_waves_put_each_row_after_the_rows_before_it_in_its_run():
    waves = slot_waves(torch.tensor(SLOTS))
    assert [w.tolist() for w in waves] == [[0, 3, 4], [1, 5], [2, 6], [7]]
    assert [w.tolist() for w in slot_waves(torch.tensor([3, 1, 4]))] == [[0, 1, 2]]


@pytest.mark.parametrize("kind", list(POOLS))
def test_reference_runs_shared_slots_in_order(kind):
    _check(kind, REFS[kind], atol=1e-6)  # a wave of several rows may sum in another order than one row


@pytest.mark.parametrize("kind", list(POOLS))
def test_cpu_kernel_runs_shared_slots_in_order(kind):
    if not cpu_kernels_ready() or DEVICE != "cpu":
        pytest.skip("the C++ kernels run on CPU tensors, built here")
    _check(kind, getattr(cpu, CPU[kind]), atol=1e-5)


@pytest.mark.triton
@requires_triton
@pytest.mark.parametrize("kind", list(POOLS))
def test_triton_kernel_runs_shared_slots_in_order(kernel_mode, kind):
    _check(kind, TRITON[kind], atol=2e-5)


@pytest.mark.parametrize("kind", list(POOLS))
def test_rows_that_read_a_shared_slot_once_fail_the_check(kind):
    """The mutation check: the same rows without `slot_runs`, where a reference reads each slot
    once for all its rows, do not give the definition, so the checks above can fail."""
    per_row, rest = _inputs(kind, len(SLOTS))
    pool = torch.randn(POOL_ROWS, *POOLS[kind], generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = _one_row_at_a_time(kind, pool.clone(), per_row, rest)
    got = _call(REFS[kind], kind, pool, torch.tensor(SLOTS, device=DEVICE), per_row, rest).float()
    assert not torch.allclose(got, want, atol=1e-3)


@jit
def _runs_kernel(slots_ptr, out_ptr, rows):
    row = tl.program_id(0)
    slot, end, mask = slot_rows(slots_ptr, row, rows, tl.arange(0, 2) < 2, True)
    tl.store(out_ptr + 3 * row, slot)
    tl.store(out_ptr + 3 * row + 1, end.to(tl.int64))
    tl.store(out_ptr + 3 * row + 2, tl.sum(mask.to(tl.int64), axis=0))  # the state store's lanes


@pytest.mark.triton
@requires_triton
def test_each_run_is_one_program(kernel_mode):
    """What each program of a SLOT_RUNS kernel runs: a run's first row runs to the run's end,
    its other rows nothing. (Under the interpreter programs run one after another, so the
    numbers above would also come out of programs that each ran their own row; on a GPU they
    run at once, and only this split gives them.)"""
    out = torch.full((len(SLOTS), 3), -9, dtype=torch.long, device=DEVICE)
    _runs_kernel[(len(SLOTS),)](torch.tensor(SLOTS, device=DEVICE), out, len(SLOTS))
    assert out[:, 0].tolist() == SLOTS
    assert out[:, 1].tolist() == [3, 1, 2, 4, 8, 5, 6, 7]
    assert out[:, 2].tolist() == [2, 0, 0, 2, 2, 0, 0, 0]  # only a run's first program stores the state


@pytest.mark.triton
@requires_triton
def test_triton_runs_fill_every_output_row(kernel_mode):
    """Outputs start as NaN: each run's first program writes all of its rows."""
    per_row, rest = _inputs("conv", len(SLOTS))
    pool = torch.randn(POOL_ROWS, 24, 4, device=DEVICE)
    out = torch.full((len(SLOTS), 24), NAN, device=DEVICE)
    causal_conv1d_update_triton(pool, torch.tensor(SLOTS, device=DEVICE), *per_row, **rest, out=out, slot_runs=True)
    assert not out.isnan().any()
