"""FP8 checkpoints as published, dequantized once at load to the serving dtype.

Two formats, named by config.json's `quantization_config`:
- compressed-tensors (`quant_method: "compressed-tensors"`, the float-quantized format): a
  quantized Linear's `weight` is float8 with a `weight_scale` beside it, one per tensor
  (`strategy: "tensor"`) or one per output channel (`"channel"`); activations may carry an
  `input_scale` (static) or none (dynamic). W = weight * weight_scale.
- transformers' fine-grained FP8 (`quant_method: "fp8"`): `weight` float8 with
  `weight_scale_inv`, one per `weight_block_size` block of it. W = weight * the block's scale.

A weight without a float8 dtype is loaded as it is (the formats' `ignore` lists: norms,
embeddings, LM heads, routers). Each float8 weight is dequantized in float32 as the name
source reads it (engine.models.checkpoint.WeightFiles), so every family's loader, fused MoE
experts included, sees plain weights. Activation scales have no use once the weights are
dequantized: the forward runs in the serving dtype. On a GPU with FP8 units the linears'
weights of both formats stay FP8 instead (engine.models.fp8_linear, through
WeightFiles.get_float8), and so do stacked MoE experts (engine.models.fp8_experts).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import CheckpointError

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """One scale per `block` of a weight of `shape` ([..., ceil(out / rows), ceil(in / cols)];
    stacked experts lead with their own dimension) as one per element: W = weight *
    expand_blocks(scale, ...)."""
    rows, cols = block
    return scale.repeat_interleave(rows, -2)[..., : shape[-2], :].repeat_interleave(cols, -1)[..., : shape[-1]]


class FP8Weights:
    """The checkpoint's FP8 scheme: which scale goes with a weight, and the dequantization."""

    def __init__(self, quant: dict[str, Any], where: str):
        self.where = f"{where}: quantization_config"
        method = quant.get("quant_method")
        if method == "compressed-tensors":
            self.scale_suffix, self.block = "weight_scale", None
            self.dynamic_activations = None  # per weight: an `input_scale` beside it is static
            self._check_compressed_tensors(quant)
        elif method == "fp8":
            self.scale_suffix = "weight_scale_inv"
            block = quant.get("weight_block_size", [128, 128])
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise CheckpointError(f"{self.where}.weight_block_size = {block!r}: expected two positive integers")
            self.block = tuple(block)
            scheme = quant.get("activation_scheme", "dynamic")
            if scheme not in ("dynamic", "static"):
                raise CheckpointError(f"{self.where}.activation_scheme = {scheme!r}: expected 'dynamic' or 'static'")
            # dynamic: a scale per token and block of input columns (what the kept FP8 GEMM computes)
            self.dynamic_activations = scheme == "dynamic"
        else:
            raise CheckpointError(f"{self.where}.quant_method = {method!r}: not supported (supported: "
                                  "'compressed-tensors' FP8, 'fp8')")

    def _check_compressed_tensors(self, quant: dict) -> None:
        fmt = quant.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise CheckpointError(f"{self.where}.format = {fmt!r}: not supported (supported: 'float-quantized')")
        kv = quant.get("kv_cache_scheme")
        if kv is not None:  # the KV scales themselves are read by engine.kv_format
            field = f"{self.where}.kv_cache_scheme"
            if kv.get("num_bits") != 8 or kv.get("type") != "float":
                raise CheckpointError(f"{field}: num_bits {kv.get('num_bits')!r}, type {kv.get('type')!r}: "
                                      "only 8-bit float (FP8) KV caches are supported")
            if kv.get("strategy", "tensor") not in ("tensor", "attn_head"):
                raise CheckpointError(f"{field}.strategy = {kv.get('strategy')!r}: only 'tensor' (a scale per "
                                      "layer for K and for V) and 'attn_head' (one per KV head) are supported")
        groups = quant.get("config_groups")
        if kv is not None and not groups:
            return  # the KV cache alone is quantized: every weight is as it is
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{self.where}.config_groups: missing (expected the quantization groups)")
        for group, spec in groups.items():
            for part in ("weights", "input_activations"):
                args = (spec or {}).get(part)
                if args is None:
                    if part == "weights":
                        raise CheckpointError(f"{self.where}.config_groups.{group}.weights: missing")
                    continue
                field = f"{self.where}.config_groups.{group}.{part}"
                if args.get("num_bits") != 8:
                    raise CheckpointError(f"{field}.num_bits = {args.get('num_bits')!r}: only 8-bit FP8 is supported")
                if args.get("type") != "float":
                    raise CheckpointError(f"{field}.type = {args.get('type')!r}: only 'float' (FP8) is supported")
                strategies = ("tensor", "channel") if part == "weights" else ("tensor", "token")
                if args.get("strategy") not in strategies:
                    raise CheckpointError(f"{field}.strategy = {args.get('strategy')!r}: supported {list(strategies)}")

    def scale_name(self, name: str) -> str | None:
        """The scale tensor's name for weight `name`; None for a tensor that is not a weight."""
        return name.removesuffix("weight") + self.scale_suffix if name.endswith(".weight") else None

    def input_scale_name(self, name: str) -> str:
        """A weight's static activation scale (compressed-tensors' `input_scale`)."""
        return name.removesuffix("weight") + "input_scale"

    def is_scale(self, name: str) -> bool:
        """Tensors that exist only for quantization (used with their weight, or unneeded)."""
        return name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale"))

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """`weight` (float8) times its scale, in float32; errors name the tensor."""
        scale = self.checked_scale(name, weight, scale).float()
        if self.block is None:
            return weight.float() * scale
        return weight.float() * expand_blocks(scale, self.block, weight.shape)

    def checked_scale(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """`weight`'s scale, checked: compressed-tensors' shaped to multiply it ([] or [out, 1]);
        a fine-grained one as stored, one per block ([ceil(out / rows), ceil(in / cols)])."""
        scale = self._present(name, weight, scale)
        if self.block is not None:
            rows, cols = self.block
            if weight.dim() != 2 or tuple(scale.shape) != (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols)):
                raise CheckpointError(f"{self.where}: {self.scale_name(name)!r} has shape {list(scale.shape)}; "
                                      f"expected one per {rows}x{cols} block of {list(weight.shape)}")
            return scale
        out = weight.shape[0]
        if scale.numel() == 1:
            return scale.reshape(())
        if scale.numel() == out and weight.dim() == 2:
            return scale.reshape(out, 1)
        raise CheckpointError(f"{self.where}: {self.scale_name(name)!r} has shape {list(scale.shape)}; "
                              f"expected one scale or one per output channel ({out})")

    def checked_input_scale(self, name: str, input_scale: torch.Tensor | None) -> torch.Tensor | None:
        """Weight `name`'s static activation scale (None: the checkpoint has none), one number."""
        if input_scale is not None and input_scale.numel() != 1:
            raise CheckpointError(f"{self.where}: {self.input_scale_name(name)!r} has shape "
                                  f"{list(input_scale.shape)}; expected one scale")
        return input_scale

    def _present(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            raise CheckpointError(f"{self.where}: tensor {name!r} is {weight.dtype} but the checkpoint has no "
                                  f"{self.scale_name(name)!r}")
        return scale
