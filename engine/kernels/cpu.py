"""CPU kernels: the torch-facing side of engine.kernels._numba_kernels.

In decode, the Mamba and Mamba2 state updates and attention over paged KV cost more as chains
of torch ops than their arithmetic: each op is a full pass over [B, d_inner, d_state], and
attention first copies every sequence's KV out of the pool. These run each row in one pass,
reading the pool in place. Measured against the torch ops at Jamba/Granite-like decode shapes
(64 rows) on 2 cores: state update 1.2 vs 1.8-3.7 ms, Mamba2 update 2.4 vs 10 ms, attention
(context 129-256) 1.9-3.0 vs 11.5 ms (on a later, slower day: 2.7-3.7 ms against 6.4 for the
gather + SDPA path, and about twice that right after a torch op, whose OpenMP threads are still
spinning when numba's start; end to end the two attention paths measured the same). Not here,
because they measured slower: the conv update (too little work to pay a parallel launch) and
the Mamba prefill scan (bound by its exps, which torch vectorises as well as anything here;
engine.models.ssm.selective_scan).

Same contracts as the `*_ref` functions they stand for (engine.kernels.ssm_update,
mamba2_update, paged_attention); float32 arithmetic.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

import torch

from engine.kernels.mamba2_update import NO_LIMIT, check_state_update, process_dt


@functools.cache
def available() -> bool:
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):
        return False


# numba's "workqueue" threading layer parks idle workers on condition variables; its OpenMP
# layer would be a second OpenMP runtime beside torch's. The same state-update kernel beside torch
# GEMMs took 3-7 ms on workqueue and 10-16 ms on omp, in alternating runs on the (loaded) 2-core
# box. Workqueue must not be entered from two threads at once, so every launch holds this lock
# (one engine thread per process is the usual case).
_LAUNCH = threading.Lock()


@functools.cache
def _kernels():
    import numba

    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    from engine.kernels import _numba_kernels

    return _numba_kernels


def _launch(name: str, *args) -> None:
    kernel = getattr(_kernels(), name)
    import numba

    with _LAUNCH:
        # numba's thread count is per calling thread; follow torch's so the two pools agree.
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        kernel(*args)


def _f32(t: torch.Tensor):
    return t.detach().float().numpy()


def _ids(t: torch.Tensor):
    return t.detach().to(torch.int64).numpy()


def _pool(t: torch.Tensor, name: str):
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"{name}: the CPU kernel updates it in place and needs a contiguous "
                         f"float32 pool, got {t.dtype}")
    return t.detach().numpy()


def selective_state_update_cpu(ssm_state, slots, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False, out=None):
    """See engine.kernels.ssm_update.selective_state_update_ref."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    y = torch.empty(x.shape, dtype=torch.float32)
    if x.shape[0]:
        decay = torch.mul(dt[:, :, None], A.float()).exp_()  # [B, D, N]
        _launch("ssm_state_update", _pool(ssm_state, "ssm_state"), _ids(slots), decay.numpy(),
                _f32(dt * x.float()), _f32(B), _f32(C), y.numpy())
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    if out is None:
        return y
    out.copy_(y)
    return out


def mamba2_state_update_cpu(ssm_state, slots, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                            dt_limit=NO_LIMIT, out=None):
    """See engine.kernels.mamba2_update.mamba2_state_update_ref."""
    check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.empty(x.shape, dtype=torch.float32)
    if x.shape[0]:
        _launch("mamba2_state_update", _pool(ssm_state, "ssm_state"), _ids(slots), _f32(x), _f32(dt),
                _f32(A), _f32(B), _f32(C), y.numpy())
    if D is not None:
        y = y + x.float() * D.float()[None, :, None]
    if out is None:
        return y
    out.copy_(y)
    return out


def paged_attention_decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None, out=None):
    """See engine.kernels.paged_attention.paged_attention_decode_ref."""
    result = torch.empty(q.shape, dtype=torch.float32)
    if q.shape[0]:
        _launch("paged_attention_decode", _f32(q), _f32(k_cache), _f32(v_cache), _ids(block_tables),
                _ids(context_lens), float(scale), int(sliding_window or 0), result.numpy())
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
