"""Linears that keep a checkpoint's FP8 weights and run through torch's scaled matmul (or,
block-wise, a Triton kernel where that does not take them).

An FP8 weight stays float8_e4m3fn on a GPU with FP8 units: half a bfloat16 weight's memory
and the FP8 tensor cores' rate. Each call quantizes its input to float8_e4m3fn and
`torch._scaled_mm` multiplies, accumulating in float32 and writing the serving dtype. Two
scalings:
- compressed-tensors' (a weight scale per tensor or per output channel): the input with the
  checkpoint's static `input_scale` where it has one, else a scale per token (row):

      y[m, n] = (sum_k xq[m, k] * wq[n, k]) * scale_x[m] * scale_w[n] + bias[n]

- the fine-grained format's (a weight scale per 128x128 block, dynamic activations): the
  input with a scale per token and 128 columns (engine.models.fp8_blocks, which also checks
  on the device that torch's scaled matmul computes it, once per weight shape). Where torch's
  call does not take the blocks (a tensor-parallel shard's, a GPU of compute capability 8.9,
  a float16 output), one launch of the block-wise Triton kernel computes the same sum
  (`fused`), checked on the device the same way.

Which linears keep FP8 is decided on the meta model, before any storage exists (an FP8 model
that fits a GPU only as FP8 must never be materialized dense): a plain nn.Linear whose weight
is one float8_e4m3fn checkpoint tensor, both dimensions multiples of 16 (the GPU kernels'
rule), that no module folds constants into after load (fold_scales) and that no module reads
as a weight instead of calling it (`reads_weights`: MLA's absorbed kv_b_proj). Stacked MoE
experts keep FP8 through engine.models.fp8_experts; every other FP8 weight is dequantized at
load (engine.models.fp8).

`keeps_float8` is the policy: CUDA devices of compute capability 8.9 and above (torch's scales
per row need 9.0 and a bfloat16 output; block-wise weights run there or on the Triton kernel).
On a CPU the weights are dequantized: the engine's own float32 kernels beat a float8 matmul
there. Tests run this same module on a CPU by setting the policy: torch's CPU scaled matmul
takes the per-tensor and per-row scalings, and block-wise products run as
engine.models.fp8_blocks.reference_product, or on the Triton kernel under its interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.float_bits import FP8_CAPABILITY
from engine.kernels.fp8_moe import block_fp8_linear_triton
from engine.models import fp8_blocks
from engine.models.fp8 import expand_blocks
from engine.models.fp8_blocks import GEMM_MULTIPLE

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def keeps_float8(device: torch.device) -> bool:
    """Whether a linear on `device` keeps FP8 weights (else: dequantized at load)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def runs_scaled(device: torch.device, dtype: torch.dtype, rowwise: bool, block: tuple | None = None) -> bool:
    """Whether torch's scaled matmul takes this scaling (per tensor, per row, or `block`-wise
    weights with inputs scaled per token and block of columns) on `device` with `dtype` output."""
    if device.type != "cuda":
        return True
    if block is not None and tuple(block) != fp8_blocks.GEMM_BLOCK:
        return False
    return not (rowwise or block) or (torch.cuda.get_device_capability(device) >= (9, 0) and dtype == torch.bfloat16)


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W kept as float8_e4m3fn and its scale (one, one per output row, or
    one per block).

    `qweight` is the checkpoint's float8 tensor, loaded as it is (engine.models.checkpoint.
    load_into calls load_float8). `weight` gives the dequantized weight in the serving dtype
    (computed on each read) for tests and tools; modules that multiply a weight in themselves
    name it in `reads_weights` and keep it dense."""

    joins_decode_plan = False  # the CPU decode stack packs dense panels and would skip the input's rounding

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.serving_dtype = in_features, out_features, dtype
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                    requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.weight_scale: torch.Tensor | None = None  # float32: [] (per tensor), [1, out] or [out blocks, in blocks]
        self.input_scale: torch.Tensor | None = None  # float32 [] where the checkpoint's is static
        self.block: tuple[int, int] | None = None  # the weight scale's block (rows, cols); None: not block-wise
        self.gemm_scale: torch.Tensor | None = None  # a block-wise weight scale as the GPU's scaled matmul takes it
        self.fused = False  # block-wise through the Triton kernel (engine.kernels.fp8_moe), not torch's matmul
        # The dequantized weight, where no GPU kernel would take this linear (a tensor-parallel
        # shard off the GEMM_MULTIPLE rule, a block-wise product neither computes): the same
        # rounded input times it, in the serving dtype.
        self.dense: torch.Tensor | None = None

    @classmethod
    def replacing(cls, linear: nn.Linear, dtype: torch.dtype) -> Fp8Linear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, linear.weight.device)

    def load_float8(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None,
                    block: tuple[int, int] | None = None) -> None:
        """The checkpoint's float8 weight, its scale (1, one per output row, or one per `block`
        of it) and its static input scale (None: computed on each call, per token, or per token
        and block of columns)."""
        device = self.qweight.device
        with torch.no_grad():
            self.qweight.copy_(weight)
        scale = scale.float().to(device)
        self.input_scale = None if input_scale is None else input_scale.float().to(device).reshape(())
        if block is not None:
            self.block, self.weight_scale = tuple(block), scale.contiguous()
            self._fit()
            return
        self.weight_scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, self.out_features)
        if self.rowwise and self.weight_scale.dim() == 0:  # both scalings per row, or both per tensor
            self.weight_scale = self.weight_scale.expand(1, self.out_features).contiguous()

    @property
    def rowwise(self) -> bool:
        return self.input_scale is None or (self.weight_scale is not None and self.weight_scale.dim() > 0)

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        if self.block is not None:
            scale = expand_blocks(self.weight_scale, self.block, self.qweight.shape)
        else:
            scale = self.weight_scale if self.weight_scale.dim() == 0 else self.weight_scale.reshape(-1, 1)
        return (self.qweight.float() * scale).to(self.serving_dtype)

    def quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [M, in] -> (float8 rows, their scale: [] static, [M, 1] per row, or [M, groups]
        per row and block of columns)."""
        if self.input_scale is None:  # per token, or per token and block of columns
            return fp8_blocks.quantize_groups(rows, self.in_features if self.block is None else self.block[1])
        scale = self.input_scale
        quantized = fp8_blocks.quantize_scaled(rows, scale)
        if self.rowwise:
            scale = scale.expand(rows.shape[0], 1).contiguous()
        return quantized, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale = self.quantize_input(rows)
        if self.dense is not None:
            unscaled = (fp8_blocks.dequantize_groups(quantized, scale, self.block[1]) if self.block is not None
                        else quantized.float() * scale)
            out = F.linear(unscaled.to(self.dense.dtype), self.dense).to(x.dtype)
        elif self.block is None:
            out = torch._scaled_mm(quantized, self.qweight.t(), scale_a=scale, scale_b=self.weight_scale,
                                   out_dtype=x.dtype)
        elif self.gemm_scale is not None:
            out = fp8_blocks.scaled_product(quantized, scale, self.qweight, self.gemm_scale, x.dtype)
        elif self.fused:
            out = block_fp8_linear_triton(quantized, scale, self.qweight, self.weight_scale, self.block, x.dtype)
        else:  # block-wise off the GPU
            out = fp8_blocks.reference_product(quantized, scale, self.qweight, self.weight_scale,
                                               self.block).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    # ------------------------------------------------------------ tensor parallelism (engine.tp.parallel)

    def tp_keep_rows(self, rows: list[int]) -> None:
        """Column parallelism in place: output features `rows`, with their scales and bias. A
        block-wise weight keeps its blocks' scales where `rows` are whole blocks of it; rows that
        cut blocks keep a scale per row (each its block's), which the Triton kernel takes."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.qweight.device)
        with torch.no_grad():
            self.qweight = nn.Parameter(self.qweight.index_select(0, index).clone(), requires_grad=False)
            if self.dense is not None:
                self.dense = self.dense.index_select(0, index)
            if self.block is None:
                if self.weight_scale.dim() > 0:
                    self.weight_scale = self.weight_scale.index_select(1, index).contiguous()
            elif self.dense is None:
                self.block, scale = fp8_blocks.shard_rows(self.weight_scale, self.block, rows, self.out_features)
                self.weight_scale = scale.contiguous()
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.index_select(0, index).clone(), requires_grad=False)
        self.out_features = len(rows)
        self._fit()

    def tp_columns(self, cols: list[int], keep_bias: bool) -> Fp8Linear:
        """Row parallelism: this linear over input features `cols` (a rank's shard of the input),
        the output a partial sum; the bias where `keep_bias` (one rank adds it). The weight
        scales are per output row, so they stay whole; a static input scale stays the
        checkpoint's, and a scale per token is then the shard's own, as row-parallel FP8
        linears in the field compute it (no collective to agree on one). A block-wise weight
        keeps its blocks' scales where `cols` are whole blocks (its input groups are then the
        un-sharded linear's); columns that cut blocks keep FP8 in the widest narrower groups they
        are whole groups of (fp8_blocks.narrower_groups), each group's scale its block's, the
        shard's input then rounded per narrower group (finer than the un-sharded linear's, as a
        shard's own per-token scales are); where there are none, the shard is dequantized."""
        index = torch.as_tensor(cols, dtype=torch.long, device=self.qweight.device)
        out = Fp8Linear(len(cols), self.out_features, False, self.serving_dtype, device="meta")
        with torch.no_grad():
            out.qweight = nn.Parameter(self.qweight.index_select(1, index).clone(), requires_grad=False)
            if keep_bias and self.bias is not None:
                out.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        out.weight_scale, out.input_scale, out.block = self.weight_scale, self.input_scale, self.block
        if self.dense is not None:
            out.dense = self.dense.index_select(1, index)
        elif self.block is not None:
            taken = fp8_blocks.shard_columns(self.weight_scale, self.block, cols, self.in_features)
            if taken is None:  # its input rounded in groups of its own columns, as wide as the blocks
                out.dense = self.weight.index_select(1, index)
            else:
                out.block, out.weight_scale = taken[0], taken[1].contiguous()
        out._fit()
        return out

    def _fit(self) -> None:
        """Pick how the product runs on the weight's device: torch's scaled matmul where it takes
        this linear, else (block-wise) the Triton kernel where it computes it, else dequantized
        (dimensions off the GEMM_MULTIPLE rule too). Off a GPU, tests, block-wise products run as
        fp8_blocks.reference_product unless the Triton kernel is said to run."""
        if self.dense is None and (self.in_features % GEMM_MULTIPLE or self.out_features % GEMM_MULTIPLE):
            self.dense = self.weight
        self.gemm_scale, self.fused = None, False
        if self.block is None or self.dense is not None:
            return
        device = self.qweight.device
        if device.type == "cuda" and runs_scaled(device, self.serving_dtype, True, self.block):
            layout = fp8_blocks.gemm_layout(device, self.serving_dtype, self.out_features, self.in_features)
            if layout is not None:
                self.gemm_scale = fp8_blocks.gemm_scale(self.weight_scale, layout)
                return
        triton = fp8_blocks.fused_runs(device, self.block)
        self.fused = triton and fp8_blocks.fused_fits(device, self.serving_dtype, self.out_features,
                                                      self.in_features, self.block)
        if not self.fused and (device.type == "cuda" or triton):  # no kernel computes it
            self.dense = self.weight

    def extra_repr(self) -> str:
        kind = ("per {}x{} block".format(*self.block) if self.block is not None
                else "per row" if self.rowwise else "per tensor")
        way = ", dequantized" if self.dense is not None else ", Triton kernel" if self.fused else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn, scaled {kind}{way}"


def use_float8_linears(model: nn.Module, name_map, weights, device: torch.device, dtype: torch.dtype) -> int:
    """On the meta `model`, before storage: replace each plain nn.Linear that can keep its
    checkpoint's FP8 weight (module docstring) by an Fp8Linear; returns how many."""
    if weights.fp8 is None or not keeps_float8(device):
        return 0
    block = weights.fp8.block
    if block is not None and not weights.fp8.dynamic_activations:
        return 0  # a static input scale beside block-wise weights
    if block is not None and not (runs_scaled(device, dtype, True, block) or fp8_blocks.fused_runs(device, block)):
        return 0  # blocks neither torch's scaled matmul nor the Triton kernel takes on this device
    folding = [f"{name}." if name else "" for name, m in model.named_modules() if hasattr(m, "fold_scales")]
    read = {f"{name}.{attr}" for name, m in model.named_modules() for attr in getattr(m, "reads_weights", ())}
    count = 0
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or name in read or any(name.startswith(prefix) for prefix in folding):
            continue
        if linear.in_features % GEMM_MULTIPLE or linear.out_features % GEMM_MULTIPLE:
            continue
        source = name_map(f"{name}.weight")
        if not isinstance(source, str) or weights.stored_dtype(source) != "F8_E4M3":
            continue
        per_tensor = weights.numel_of(weights.fp8.scale_name(source)) == 1
        static = weights.fp8.input_scale_name(source) in weights
        if block is None and not runs_scaled(device, dtype, rowwise=not (per_tensor and static)):
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Fp8Linear.replacing(linear, dtype))
        count += 1
    return count
