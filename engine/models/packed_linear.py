"""CPU float32 linears on splitserve's own GEMM (engine/kernels/cpu_gemm.cpp), each weight packed
once into the kernel's panel layout.

Decode multiplies 1-64 rows (32 for an MoE expert) by weights that stream from memory. There
torch's MKL sgemm and oneDNN's matmul on a prepacked weight fall short of the memory-bound rate
(per-call overhead on small weights, no prefetch of the next panel); this kernel streams each
weight's panels with prefetch, in 16-float tiles over two panels where AVX-512 is there, and
keeps up with both in prefill too. `bench roofline` measures it against them (docs/benchmarks.md).

The packed copy sits beside the dense weight, which stays the model's parameter (checkpoint
loading, tensor-parallel slicing and tied embeddings read it): linear weights take twice their
memory on a CPU worker. Without the C++ library (no compiler) nothing is packed and F.linear
runs. Results differ from F.linear's in the last bits (another summation order); the
transformers judge compares tokens as for any kernel change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels_enabled as enabled
from engine.kernels import native

PANEL = 16  # output columns per panel: cpu_gemm.cpp's PANEL


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] weight as cpu_gemm.cpp reads it: [ceil(out / PANEL), in, PANEL], the columns
    past `out_features` zero."""
    panels: torch.Tensor
    out_features: int
    in_features: int


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and native.available())


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The packed copy of a [out, in] weight, or None where it does not apply."""
    if not supported(weight):
        return None
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // PANEL) * PANEL, in_features)
    padded[:out_features] = weight.detach()
    panels = padded.view(-1, PANEL, in_features).transpose(1, 2).contiguous()
    return PackedWeight(panels, out_features, in_features)


def pack_per_expert(*stacks: torch.Tensor) -> list[tuple] | None:
    """For each expert, the packed copies of its [out, in] slice of every stacked weight
    [experts, out, in] given; None where packing does not apply."""
    if any(not isinstance(s, torch.Tensor) or s.dim() != 3 or not supported(s[0]) for s in stacks):
        return None
    return list(zip(*([pack(w) for w in s] for s in stacks)))


def panel_pointers(per_expert: list[tuple]) -> torch.Tensor:
    """The addresses of pack_per_expert's panels, [experts, weights per expert], for a kernel that
    runs every expert in one call (the PackedWeights must outlive it)."""
    return torch.tensor([[w.panels.data_ptr() for w in weights] for weights in per_expert], dtype=torch.int64)


def silu_experts(routed: torch.Tensor, counts: list[int], pointers: torch.Tensor, inter: int) -> torch.Tensor:
    """down_e(silu(gate) * up) with [gate | up] = gate_up_e(x) for each expert e over its counts[e]
    rows of routed [rows, hidden] (grouped by expert, float32, contiguous), in one C++ call;
    pointers: panel_pointers of (gate_up, down) per expert."""
    rows, hidden = routed.shape
    if sum(counts) != rows or len(counts) != pointers.shape[0]:
        raise ValueError(f"silu_experts: {rows} rows, counts {counts}, {pointers.shape[0]} experts")
    out = torch.empty((rows, hidden))
    native.call("moe_silu_experts", x=routed, counts=torch.tensor(counts, dtype=torch.int64), panels=pointers,
                scratch=torch.empty(rows * 3 * inter), out=out, experts=len(counts), hidden=hidden, inter=inter)
    return out


def adapter_gelu_mlp(x: torch.Tensor, gate_up: nn.Linear, lora_down: nn.Linear, lora_up: nn.Linear,
                     down: nn.Linear) -> torch.Tensor:
    """down(gelu(gate) * up), [gate | up] = gate_up(x) + lora_up(lora_down(x)), for contiguous
    float32 x [rows, hidden], in one C++ call; every linear packed (pack_linears)."""
    rows, hidden = x.shape
    inter, rank = down.in_features, lora_down.out_features
    if (gate_up.in_features, lora_down.in_features, lora_up.in_features) != (hidden, hidden, rank) \
            or gate_up.out_features != 2 * inter or lora_up.out_features != 2 * inter or not x.is_contiguous():
        raise ValueError(f"adapter_gelu_mlp: x {tuple(x.shape)} does not fit gate_up {gate_up}, "
                         f"adapter ({lora_down}, {lora_up}), down {down}")
    out = torch.empty((rows, down.out_features))
    native.call("adapter_gelu_mlp", x=x, rows=rows, hidden=hidden, gate_up_panels=gate_up.packed_weight.panels,
                gate_up_bias=gate_up.bias, lora_down_panels=lora_down.packed_weight.panels, rank=rank,
                lora_up_panels=lora_up.packed_weight.panels, inter=inter, down_panels=down.packed_weight.panels,
                down_bias=down.bias, scratch=torch.empty(rows * (5 * inter + rank)), out=out)
    return out


def runs_packed(x: torch.Tensor, packed: PackedWeight | None) -> bool:
    """A packed weight exists, the kernels are on, and x is a float32 input autograd does not track."""
    return packed is not None and x.dtype == torch.float32 and not x.requires_grad and enabled()


def _packed_matmul(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    # The kernel takes a row stride, so a matrix of contiguous rows (a column block) runs as it is.
    rows = x if x.dim() == 2 else x.reshape(-1, packed.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], packed.out_features))
    native.call("packed_linear", x=rows, ldx=rows.stride(0), panels=packed.panels,
                bias=None if bias is None else bias.contiguous(), out=out, ldo=packed.out_features,
                rows=rows.shape[0], out_features=packed.out_features, in_features=packed.in_features)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], packed.out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """F.linear, on the packed weight when there is one and the call can take it."""
    if runs_packed(x, packed):
        return _packed_matmul(x, packed, bias)
    return F.linear(x, weight, bias)


def _packed_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, module.packed_weight)


def pack_fused(*linears: nn.Module):
    """One packed weight for several plain nn.Linear that read the same input (q, k and v; gate and
    up): one GEMM instead of several small ones, the outputs its column blocks. Marks the linears
    so pack_linears does not pack them again. None where it does not apply."""
    if not linears or any(type(m) is not nn.Linear for m in linears):
        return None
    if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
        return None
    packed = pack(torch.cat([m.weight.detach() for m in linears]))
    if packed is None:
        return None
    for module in linears:
        module.fused_elsewhere = True
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return packed, bias, [m.out_features for m in linears]


def fused_linear(x: torch.Tensor, fused, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """The outputs of `linears` on x: column views of one GEMM on their pack_fused weight when
    the call can take it, else each linear on its own."""
    if fused is not None and runs_packed(x, fused[0]):
        packed, bias, sizes = fused
        return _packed_matmul(x, packed, bias).split(sizes, dim=-1)
    return tuple(m(x) for m in linears)


def pack_linears(model: nn.Module) -> int:
    """Give every plain nn.Linear of `model` a packed weight and route its forward through it,
    and let modules that pack weights of their own (stacked experts, fused projections) do so
    first (a `pack_weights()` method that returns how many it packed); returns how many weights
    were packed. Call once the weights are final (loaded, sharded)."""
    count = 0
    for module in model.modules():  # parents come before their children
        if hasattr(module, "pack_weights"):
            count += module.pack_weights()
        elif (type(module) is nn.Linear and not getattr(module, "fused_elsewhere", False)
              and (packed := pack(module.weight)) is not None):
            module.packed_weight = packed
            module.forward = functools.partial(_packed_forward, module)
            count += 1
    return count
