"""Hot-loop kernels: Triton on CUDA tensors, the torch reference everywhere else.

Each operation has a `*_ref` (plain torch, the definition) and a `*_triton` beside it in its
module; the functions here pick one per call:
- SPLITSERVE_DISABLE_TRITON=1: always the reference (debugging a GPU run);
- SPLITSERVE_FORCE_TRITON=1: always Triton, CPU tensors included (with TRITON_INTERPRET=1
  this is how CPU-only CI exercises the kernels);
- otherwise Triton when it is installed and the tensors are on CUDA;
- on CPU, for the operations engine.kernels.cpu covers (the Mamba, Mamba2 and Gated DeltaNet
  decode steps, the conv update, decode attention, the Mamba2 and Gated DeltaNet prefill
  recurrences; Mamba's prefill scan, the prefill conv and attention and the elementwise
  epilogues, which the model code calls directly), its C++ kernels for float32
  tensors, unless SPLITSERVE_DISABLE_CPU_KERNELS=1 (or no C++ compiler can build them here:
  engine.kernels.native).
Triton stays optional: without it every CUDA call takes the reference path.
"""

from __future__ import annotations

import os

import torch

from engine.kernels import _triton, cpu, fla_rule, state_round
from engine.kernels.conv_update import causal_conv1d_update_ref, causal_conv1d_update_triton
from engine.kernels.gdn_scan import chunk_gated_delta_rule_ref, gated_delta_step_ref
from engine.kernels.gdn_triton import chunk_gated_delta_rule_triton, gated_delta_scan_triton, gated_delta_step_triton
from engine.kernels.mamba2_update import NO_LIMIT, mamba2_state_update_ref, mamba2_state_update_triton
from engine.kernels.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton
from engine.kernels.row_copy import (copy_rows_ref, copy_rows_triton, gather_rows_ref, gather_rows_triton,
                                     scatter_rows_ref, scatter_rows_triton)
from engine.kernels.ssd_scan import ssd_chunk_scan_ref, ssd_chunk_scan_triton, ssd_chunk_scan_varlen_ref
from engine.kernels.ssm_scan import selective_scan_varlen_ref, selective_scan_varlen_triton
from engine.kernels.ssm_update import selective_state_update_ref, selective_state_update_triton

__all__ = ["causal_conv1d_update", "chunk_gated_delta_rule", "chunk_gated_delta_rule_varlen", "copy_rows",
           "gated_delta_varlen_available", "gather_rows", "gated_delta_step",
           "mamba2_state_update", "paged_attention_decode", "scatter_rows", "selective_scan_varlen",
           "selective_state_update", "ssd_chunk_scan", "ssd_chunk_scan_varlen",
           "ssd_varlen_available", "triton_available", "cpu_kernels_enabled", "cpu_kernels_ready", "uses_cpu_kernel",
           "uses_triton"]


def triton_available() -> bool:
    return _triton.available()


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether an operation on `tensor` runs the Triton kernel under the current settings."""
    if os.environ.get("SPLITSERVE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    if os.environ.get("SPLITSERVE_FORCE_TRITON", "0") not in ("", "0"):
        if not _triton.available():
            raise RuntimeError("SPLITSERVE_FORCE_TRITON is set but Triton is not installed")
        return True
    return tensor.is_cuda and _triton.available()


def cpu_kernels_enabled() -> bool:
    """SPLITSERVE_DISABLE_CPU_KERNELS unset or 0; read per call, so a benchmark can switch the
    C++ kernels and the packed linears (engine.models.packed_linear) off between runs."""
    return os.environ.get("SPLITSERVE_DISABLE_CPU_KERNELS", "0") in ("", "0")


def cpu_kernels_ready() -> bool:
    """The C++ kernels are switched on and built here; callers whose kernels take strided
    inputs check the layout themselves (engine.kernels.cpu.rows_of_heads, rows_with_stride)."""
    return cpu_kernels_enabled() and cpu.available()


def uses_cpu_kernel(tensor: torch.Tensor) -> bool:
    """Whether an operation engine.kernels.cpu covers runs its C++ kernel on `tensor`."""
    return (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()
            and cpu_kernels_ready())


def _narrow(state: torch.Tensor, positions) -> dict:
    """The positions argument for a half-width state pool updated in place (engine.state_format:
    an all-decode step on Triton); none for a float32 pool, whose CPU kernels take none."""
    return {"positions": positions} if state.dtype in state_round.HALF else {}


def _pick(tensor: torch.Tensor, triton_impl, cpu_impl, ref_impl):
    if uses_triton(tensor):
        return triton_impl
    return cpu_impl if uses_cpu_kernel(tensor) else ref_impl


def selective_state_update(ssm_state, slots, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, out=None, positions=None, slot_runs=False):
    """Mamba decode step, in place at ssm_state[slots]; returns y [B, D] (float32 unless `out`).
    `positions` (each row's sequence length after the step) where the pool is half width;
    `slot_runs` where adjacent rows may share a slot (engine.kernels.slot_runs). See
    engine.kernels.ssm_update."""
    impl = _pick(ssm_state, selective_state_update_triton, cpu.selective_state_update_cpu,
                 selective_state_update_ref)
    return impl(ssm_state, slots, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                dt_softplus=dt_softplus, out=out, slot_runs=slot_runs, **_narrow(ssm_state, positions))


def mamba2_state_update(ssm_state, slots, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                        dt_limit=NO_LIMIT, out=None, positions=None, slot_runs=False):
    """Mamba2 decode step, in place at ssm_state[slots]; returns y [b, H, P] (float32 unless
    `out`). `positions` where the pool is half width; `slot_runs` where adjacent rows may share
    a slot. See engine.kernels.mamba2_update."""
    impl = _pick(ssm_state, mamba2_state_update_triton, cpu.mamba2_state_update_cpu, mamba2_state_update_ref)
    return impl(ssm_state, slots, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                dt_limit=dt_limit, out=out, slot_runs=slot_runs, **_narrow(ssm_state, positions))


def selective_scan_varlen(x, dt, A, B, C, cu_seqlens, h0, rows=None, state=None, slots=None, out=None):
    """Mamba prefill scan of every sequence cu_seqlens (or its `rows`) delimits, in one call;
    returns (y [T, D] float32 unless `out`, h_final [S, D, N], or None when the final states
    go to state[slots]). See engine.kernels.ssm_scan."""
    impl = selective_scan_varlen_triton if uses_triton(x) else selective_scan_varlen_ref
    return impl(x, dt, A, B, C, cu_seqlens, h0, rows=rows, state=state, slots=slots, out=out)


def _prefill_scan_on_triton(tensor: torch.Tensor) -> bool:
    """Our Triton SSD and Gated DeltaNet prefill kernels are slower than the chunked torch
    references on a GPU (docs/gpu.md), so CUDA runs the references until the field's kernels
    replace both; SPLITSERVE_FORCE_TRITON=1 still picks ours (the A/B)."""
    return uses_triton(tensor) and os.environ.get("SPLITSERVE_FORCE_TRITON", "0") not in ("", "0")


def ssd_chunk_scan(x, dt, A, B, C, h0, chunk_size):
    """Mamba2 prefill scan of one sequence from state h0; returns (y [L, H, P], h_L [H, P, N]).
    See engine.kernels.ssd_scan."""
    if _prefill_scan_on_triton(x):
        return ssd_chunk_scan_triton(x, dt, A, B, C, h0, chunk_size)
    # x is often a view into the projection's output; the state says whether this is float32 on CPU.
    if uses_cpu_kernel(h0):  # the recurrence itself: on a CPU it is cheaper than the chunked form
        return cpu.ssd_scan_cpu(x, dt, A, B, C, h0)
    return ssd_chunk_scan_ref(x, dt, A, B, C, h0, chunk_size)


def ssd_chunk_scan_varlen(x, dt, A, B, C, h0, bounds, chunk_size):
    """Every prefill row of a step in one pass, their tokens back to back (`bounds`: host
    offsets), h0 [N, H, P, N]; (y [T, H, P], S [N, H, P, N]) float32. Asked only where
    ssd_varlen_available(the state pool): per row is better on a CPU (the C++ recurrence) and
    when our Triton kernel is forced (the A/B)."""
    return ssd_chunk_scan_varlen_ref(x, dt, A, B, C, h0, bounds, chunk_size)


def ssd_varlen_available(pool: torch.Tensor) -> bool:
    return not _prefill_scan_on_triton(pool) and not uses_cpu_kernel(pool)


def gated_delta_step(state, slots, q, k, v, g, beta, positions=None, slot_runs=False):
    """Gated DeltaNet decode step, in place at state[slots]; returns o [b, Hv, dv] float32.
    `positions` where the pool is half width; `slot_runs` where adjacent rows may share a slot.
    See engine.kernels.gdn_scan."""
    impl = _pick(state, gated_delta_step_triton, cpu.gated_delta_step_cpu, gated_delta_step_ref)
    return impl(state, slots, q, k, v, g, beta, slot_runs=slot_runs, **_narrow(state, positions))


def chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk_size):
    """Gated DeltaNet prefill of one sequence from state h0; returns (o [L, Hv, dv], S_L [Hv, dk, dv]).
    See engine.kernels.gdn_scan. On CUDA, fla's chunked kernels where fla is installed
    (engine.kernels.fla_rule); SPLITSERVE_FORCE_TRITON=1 picks ours instead (the A/B), where a
    decay per key channel (g [L, Hv, dk]) takes the token-by-token scan (our chunked kernel is
    per head only)."""
    if _prefill_scan_on_triton(v):
        if g.dim() == 3:
            return gated_delta_scan_triton(q, k, v, g, beta, h0)
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, h0, chunk_size)
    if fla_rule.available(v) and (done := fla_rule.chunk_rule(q, k, v, g, beta, h0)) is not None:
        return done
    if uses_cpu_kernel(h0):  # the rule token by token: on a CPU, cheaper than the chunked form
        return cpu.gated_delta_rule_cpu(q, k, v, g, beta, h0)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, h0, chunk_size)


def chunk_gated_delta_rule_varlen(q, k, v, g, beta, h0, cu_seqlens):
    """Every prefill row of a step in one call, their tokens back to back: h0 [N, Hv, dk, dv],
    cu_seqlens [N + 1] int64 on the device; (o [T, Hv, dv], S [N, Hv, dk, dv]) float32. Asked
    only where gated_delta_varlen_available; None where fla turns the call down (the caller then
    runs chunk_gated_delta_rule per row)."""
    return fla_rule.chunk_rule_varlen(q, k, v, g, beta, h0, cu_seqlens)


def gated_delta_varlen_available(q, v, g) -> bool:
    """Whether a one-call kernel may serve tensors like these (asked before packing a step's rows):
    fla installed, on CUDA, not the Triton A/B, and not already refused for such tensors."""
    return not _prefill_scan_on_triton(v) and fla_rule.available(v) and not fla_rule.refused(q, v, g, varlen=True)


def causal_conv1d_update(conv_state, slots, x, weight, bias=None, activation=None, out=None, positions=None,
                         slot_runs=False):
    """Conv decode step, in place at conv_state[slots]; returns [B, D] in x's dtype.
    `positions` where the pool is half width; `slot_runs` where adjacent rows may share a slot.
    See engine.kernels.conv_update."""
    impl = _pick(conv_state, causal_conv1d_update_triton, cpu.causal_conv1d_update_cpu, causal_conv1d_update_ref)
    return impl(conv_state, slots, x, weight, bias=bias, activation=activation, out=out, slot_runs=slot_runs,
                **_narrow(conv_state, positions))


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                           sliding_window=None, out=None, kv_scales=None, last_kv=None):
    """One query per sequence over its paged KV; returns [B, H, Dh] in q's dtype. An FP8 cache
    read in place takes kv_scales and last_kv (the C++ kernel does not: the reference there).
    See engine.kernels.paged_attention."""
    impl = _pick(k_cache, paged_attention_decode_triton, cpu.paged_attention_decode_cpu,
                 paged_attention_decode_ref)
    if kv_scales is None and last_kv is None:
        return impl(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=sliding_window, out=out)
    if impl is cpu.paged_attention_decode_cpu:
        impl = paged_attention_decode_ref
    return impl(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=sliding_window, out=out,
                kv_scales=kv_scales, last_kv=last_kv)


def copy_rows(src, src_ids, dst, dst_ids, last_row_elems=None):
    """dst[dst_ids[i]] = src[src_ids[i]] (ids None: 0..n-1); see engine.kernels.row_copy."""
    impl = copy_rows_triton if uses_triton(dst) else copy_rows_ref
    return impl(src, src_ids, dst, dst_ids, last_row_elems=last_row_elems)


def gather_rows(src, ids, out=None, last_row_elems=None):
    """packed[i] = src[ids[i]]; see engine.kernels.row_copy."""
    impl = gather_rows_triton if uses_triton(src) else gather_rows_ref
    return impl(src, ids, out=out, last_row_elems=last_row_elems)


def scatter_rows(packed, ids, dst, last_row_elems=None):
    """dst[ids[i]] = packed[i]; see engine.kernels.row_copy."""
    impl = scatter_rows_triton if uses_triton(dst) else scatter_rows_ref
    return impl(packed, ids, dst, last_row_elems=last_row_elems)
