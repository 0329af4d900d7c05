"""The field's chunked gated delta rule on CUDA: fla's kernels (the fla-core package, in the
`[gpu]` extra), where it is installed.

A Gated DeltaNet prefill (a decay per head) goes to `fla.ops.gated_delta_rule.chunk_gated_delta_rule`,
a Kimi Delta Attention prefill (a decay per key channel) to `fla.ops.kda.chunk_kda`: the same rule
as engine.kernels.gdn_scan (q and k L2-normalised in the kernel, q scaled by dk^-1/2, value head
h reading key head h // (Hv / Hk), the state [Hv, dk, dv] in float32), for one sequence from its
initial state. fla's chunked kernels do not run under Triton's interpreter, so CPU CI checks
what this module does around them (shapes, dtypes, layouts, the state in and out) through a
stand-in with their documented semantics; a GPU test holds the kernels themselves to the
reference. Without fla, or with SPLITSERVE_DISABLE_FLA=1, the caller's own paths run.

`chunk_rule_varlen` runs every prefill row of a step in one call (fla's `cu_seqlens`, one initial
state per sequence), so a step's prefill costs one launch sequence per layer, not one per row.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
_kernels = None  # (chunk_gated_delta_rule, chunk_kda) once imported; False when fla is absent
_refused: dict[tuple, str] = {}  # (device, dtype, dk, dv, per channel, varlen) -> why fla turned it down


def _load():
    global _kernels
    if _kernels is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda
            _kernels = (chunk_gated_delta_rule, chunk_kda)
        except ImportError:
            _kernels = False
    return _kernels


def available(v: torch.Tensor) -> bool:
    """Whether fla runs this prefill: a CUDA tensor, fla installed, not switched off."""
    return (v.is_cuda and os.environ.get("SPLITSERVE_DISABLE_FLA", "0") in ("", "0")
            and os.environ.get("SPLITSERVE_DISABLE_TRITON", "0") in ("", "0") and bool(_load()))


def chunk_rule(q, k, v, g, beta, h0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One sequence's prefill. q, k: [L, Hk, dk]; v: [L, Hv, dv]; g: [L, Hv] (per head) or
    [L, Hv, dk] (per key channel), float32 log decays; beta: [L, Hv]; h0: [Hv, dk, dv] (read only).
    Returns o [L, Hv, dv] and the final state [Hv, dk, dv], both float32; None where fla turned
    this shape down (remembered and logged once: the caller's own path serves it)."""
    done = _call(q, k, v, g, beta, h0[None], None)
    return None if done is None else (done[0], done[1][0])


def chunk_rule_varlen(q, k, v, g, beta, h0, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor] | None:
    """N sequences' prefill in one call: q, k, v, g, beta as chunk_rule's, their tokens back to
    back ([T, ...]); h0 [N, Hv, dk, dv]; cu_seqlens [N + 1] int64 on the device. Returns o
    [T, Hv, dv] and the final states [N, Hv, dk, dv], float32; None where fla turned it down."""
    return _call(q, k, v, g, beta, h0, cu_seqlens)


def refused(q, v, g, varlen: bool) -> bool:
    """Whether fla already turned such a call down (asked before packing a step's rows for it)."""
    return _key(q, v, g, varlen) in _refused


def _key(q, v, g, varlen: bool) -> tuple:
    return str(v.device), v.dtype, q.shape[-1], v.shape[-1], g.dim() == 3, varlen


def _call(q, k, v, g, beta, h0, cu_seqlens):
    key = _key(q, v, g, cu_seqlens is not None)
    if key in _refused:
        return None
    gated_delta_rule, kda = _load()
    kernel = kda if g.dim() == 3 else gated_delta_rule
    dtype = v.dtype
    varlen = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    try:
        o, state = kernel(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None],
                          g.float().contiguous()[None], beta.to(dtype).contiguous()[None],
                          scale=q.shape[-1] ** -0.5, initial_state=h0.float().contiguous(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True, **varlen)
    except (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError) as error:
        _refused[key] = f"{type(error).__name__}: {error}"
        log.warning("fla's chunked rule unavailable for %s (%s); the caller's own path serves it", key, error)
        return None
    return o[0].float(), state.float()
