"""CPU linear layers on oneDNN, with each weight packed once into oneDNN's blocked layout.

torch's CPU `F.linear` in float32 goes to MKL's sgemm, which on the AMD EPYC (Zen 4, AVX-512)
of the 2-core box ran at 95-196 GFLOP/s; oneDNN's matmul on the same shapes with prepacked
weights ran 1.5-2.6x faster (64 x 256 x 1536: 213 against 101 GFLOP/s; 1024 x 256 x 768: 400
against 185); vLLM-CPU's linears run on oneDNN too. Below MIN_ROWS rows MKL won (one row:
oneDNN 0.7x), so small calls keep F.linear. On a Zen 3 EPYC (AVX2, no AVX-512) oneDNN's call
cost about 20 us more than MKL's, which decides small weights in decode: at 64 rows MKL took
8.6 / 28.5 / 23.2 / 20.1 us against oneDNN's 31.3 / 52.0 / 37.7 / 43.6 us for a router
(256 -> 4), Mamba's x_proj (512 -> 48) and dt_proj (16 -> 512), and 256 -> 64; at 8192 rows
oneDNN won again (16 -> 512: 1.65 against 2.53 ms). So a weight with a side under SMALL_SIDE
runs packed only from SMALL_WEIGHT_ROWS rows.

The packed copy sits beside the dense weight, which stays the model's parameter (checkpoint
loading, tensor-parallel slicing and tied embeddings read it): linear weights take twice their
memory on a CPU worker. Results differ from F.linear's in the last bits (another summation
order); the transformers judge compares tokens as for any kernel change.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels_enabled as enabled

MIN_ROWS = 8
SMALL_SIDE, SMALL_WEIGHT_ROWS = 128, 256
PACK_HINT_ROWS = 64  # oneDNN picks the packed layout for this batch; any row count runs on it


def supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor):
    """oneDNN's packed copy of a [out, in] weight, or None where it does not apply."""
    if not supported(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def pack_per_expert(*stacks: torch.Tensor) -> list[tuple] | None:
    """For each expert, the packed copies of its [out, in] slice of every stacked weight
    [experts, out, in] given; None where packing does not apply."""
    if any(s.dim() != 3 or not supported(s[0]) for s in stacks):
        return None
    return list(zip(*([pack(w) for w in s] for s in stacks)))


def _runs_packed(x: torch.Tensor, packed) -> bool:
    """A packed weight exists and the call is float32 and big enough for it (MIN_ROWS, or
    SMALL_WEIGHT_ROWS for a weight with a side under SMALL_SIDE)."""
    if packed is None or x.dtype != torch.float32:
        return False
    out_features, in_features = packed.shape
    rows = MIN_ROWS if min(out_features, in_features) >= SMALL_SIDE else SMALL_WEIGHT_ROWS
    return x.numel() >= rows * in_features and enabled()


def _packed_matmul(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """F.linear, on the packed weight when there is one and the call is big enough."""
    if _runs_packed(x, packed):
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
    the call is big enough for packing, else each linear on its own."""
    if fused is not None and _runs_packed(x, fused[0]):
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
