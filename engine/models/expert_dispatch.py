"""Running each token through its top-k experts: sum_k weights[t, k] * expert(experts[t, k], x[t]).

Three ways, one result (full capacity: no token dropped):
- `by_expert_loop`: each hit expert once over exactly its tokens. The loop's bounds are the
  per-expert token counts, read on the host: right for CPU and for eager prefill steps, but a
  CUDA graph cannot capture it;
- `grouped`: picks sorted by expert on the device, both projections as one grouped GEMM each
  (torch._grouped_mm, offsets on the device): exact work, no host read. Hopper and newer in
  bf16, and CPU tensors (where tests run it), with rows aligned to 16 bytes;
- `dense`: every token through every expert, batched (a few experts per matmul), each output
  weighted by the token's routing weight for that expert (0 where not picked). No host read,
  any device and dtype; E/k times the work, which a decode step at memory-bound batch sizes
  hides and a long prefill would not, so it serves decode-sized steps only.
A module passes its stacked weights (first projection [E, out, in], second [E, out2, out or
out/2], the function between them); `dispatch_experts` picks the way by device, dtype and size.
Stacked weights that keep a checkpoint's FP8 (engine.models.fp8_experts) always run `grouped`,
through their own product (torch's grouped scaled GEMM, or the fused block-wise Triton kernel):
they are kept only where the device computes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from engine.kernels import cpu, uses_cpu_kernel
from engine.models.fp8_experts import Fp8Experts

STATIC_ENV = "SPLITSERVE_STATIC_MOE"  # 1: the host-read-free ways on CPU tensors too (tests)
DENSE_MAX_TOKENS = 512  # beyond, dense work costs more than the host read it saves
DENSE_CHUNK_ELEMENTS = 1 << 24  # per matmul output: bounds the dense way's memory
log = logging.getLogger(__name__)
_refused: set[tuple] = set()  # (device type, dtype, weight shapes) torch._grouped_mm raised on


def dispatch_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     expert_fn, stacked: tuple[torch.Tensor, torch.Tensor, Callable] | None = None) -> torch.Tensor:
    """x [T, in], experts and weights [T, k] (weights in x's dtype) -> [T, out2]."""
    if stacked is not None:
        first, second, between = _dense_or_kept(stacked[0]), _dense_or_kept(stacked[1]), stacked[2]
        if isinstance(first, Fp8Experts) or isinstance(second, Fp8Experts):  # kept only where grouped runs
            return grouped(x, experts, weights, first, second, between)
    if uses_cpu_kernel(x) and uses_cpu_kernel(weights):
        return _cpu_grouped(x, experts, weights, num_experts, expert_fn)
    if stacked is not None and (x.is_cuda or os.environ.get(STATIC_ENV, "") not in ("", "0")):
        if grouped_supported(x, first, second):
            try:
                return grouped(x, experts, weights, first, second, between)
            except RuntimeError as error:  # a shape or build this torch's grouped GEMM refuses
                _refused.add(_grouped_key(x, first, second))
                log.warning("grouped expert GEMM refused (%s); experts run batched instead", error)
        if x.shape[0] <= DENSE_MAX_TOKENS:
            return dense(x, experts, weights, first, second, between)
    return by_expert_loop(x, experts, weights, num_experts, expert_fn)


def _grouped_key(x, first, second) -> tuple:
    return x.device.type, x.dtype, tuple(first.shape), tuple(second.shape)


def grouped_supported(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype != first.dtype or _grouped_key(x, first, second) in _refused:
        return False
    widths = (first.shape[1], first.shape[2], second.shape[1], second.shape[2])
    if any(w * x.element_size() % 16 for w in widths):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def grouped(x, experts, weights, first, second, between) -> torch.Tensor:
    tokens, top_k = experts.shape
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    ids = torch.arange(first.shape[0], device=x.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat.index_select(0, order), ids, right=True).to(torch.int32)
    routed = x.index_select(0, order // top_k)
    y = _project(between(_project(routed, first, ends)), second, ends)
    picks = torch.empty_like(y).index_copy_(0, order, y * weights.flatten().index_select(0, order)[:, None])
    return picks.view(tokens, top_k, -1).sum(dim=1)


def _project(rows: torch.Tensor, stacked, ends: torch.Tensor) -> torch.Tensor:
    if isinstance(stacked, Fp8Experts):
        return stacked.grouped_product(rows, ends)
    return torch._grouped_mm(rows, stacked.transpose(1, 2), offs=ends)


def _dense_or_kept(stacked):
    """A stacked weight as the ways take it: an Fp8Experts the device runs, or a tensor."""
    return stacked.dense if isinstance(stacked, Fp8Experts) and not stacked.kept else stacked


def dense(x, experts, weights, first, second, between) -> torch.Tensor:
    tokens, num_experts = x.shape[0], first.shape[0]
    mix = torch.zeros(tokens, num_experts, dtype=weights.dtype, device=x.device).scatter_add_(1, experts, weights)
    out = torch.zeros(tokens, second.shape[1], dtype=x.dtype, device=x.device)
    chunk = max(1, DENSE_CHUNK_ELEMENTS // max(1, tokens * max(first.shape[1], second.shape[1])))
    for start in range(0, num_experts, chunk):
        end = min(num_experts, start + chunk)
        h = between(torch.matmul(x, first[start:end].transpose(1, 2)))  # [c, T, out]
        y = torch.matmul(h, second[start:end].transpose(1, 2))  # [c, T, out2]
        out += (y * mix[:, start:end].t()[:, :, None]).sum(dim=0)
    return out


def by_expert_loop(x, experts, weights, num_experts: int, expert_fn) -> torch.Tensor:
    """Each (token, k) pick's weighted output is copied to its own row of a [T, k, out] buffer
    and the k rows summed: copies, not index_add_, whose CPU kernel is several times slower at
    these sizes. For top_k <= 2 the sum equals the sequential one bit for bit."""
    tokens, top_k = experts.shape
    flat_experts = experts.flatten()
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=num_experts).tolist()
    routed = x.index_select(0, order // top_k)  # inputs grouped by expert
    flat_weights = weights.flatten().index_select(0, order)
    picks = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for expert, start, end in expert_ranges(counts):
        y = expert_fn(expert, routed[start:end])
        picks.index_copy_(0, order[start:end], (y * flat_weights[start:end, None]).to(x.dtype))
    return picks.view(tokens, top_k, -1).sum(dim=1)


def _cpu_grouped(x, experts, weights, num_experts: int, expert_fn) -> torch.Tensor:
    """Float32 on CPU: one C++ pass groups the picks, the outputs stay grouped by expert and
    one C++ pass weights, gathers and sums them."""
    tokens, top_k = experts.shape
    counts, token_of_row, position = cpu.moe_group_cpu(experts, num_experts)
    routed = x.index_select(0, token_of_row)
    grouped_out = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype)
    for expert, start, end in expert_ranges(counts):
        grouped_out[start:end] = expert_fn(expert, routed[start:end])
    return cpu.moe_combine_cpu(grouped_out, position, weights)


def expert_ranges(counts: list[int]):
    """(expert, start, end) of each hit expert's rows in the expert-grouped order."""
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, start, start + count
            start += count
