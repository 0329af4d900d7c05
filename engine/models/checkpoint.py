"""Reading HF-format checkpoint folders: config.json and (sharded) safetensors.

Every failure names the file, the key and what was expected, because a serving system that
half-loads a checkpoint produces garbage that looks like a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.models.fp8 import FLOAT8, FP8Weights
from engine.models.fp8_experts import Fp8Experts
from engine.models.fp8_experts_loading import load_stacked
from engine.models.fp8_linear import Fp8Linear

__all__ = ["CheckpointError", "ConfigReader", "WeightFiles", "load_into", "read_config", "read_json"]


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    config = read_json(model_dir / "config.json")
    if "model_type" not in config:
        raise CheckpointError(f"{model_dir / 'config.json'}: missing key 'model_type'")
    return config


class ConfigReader:
    """Typed access to config.json fields with errors that name the file and key."""

    def __init__(self, config: dict[str, Any], path: Path):
        self.config = config
        self.path = path

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, allow_none=False):
        if key not in self.config or (self.config[key] is None and not allow_none):
            if default is ...:
                raise CheckpointError(f"{self.path}: missing key {key!r} (expected {_kind_name(kind)})")
            return default
        value = self.config[key]
        if value is None and allow_none:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and kind is not bool and not (isinstance(kind, tuple) and bool in kind):
            raise CheckpointError(f"{self.path}: key {key!r} is {value!r}, expected {_kind_name(kind)}")
        if not isinstance(value, kind):
            raise CheckpointError(f"{self.path}: key {key!r} is {value!r}, expected {_kind_name(kind)}")
        return value

    def positive_int(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value is not None and value <= 0:
            raise CheckpointError(f"{self.path}: key {key!r} is {value}, expected a positive integer")
        return value

    def float_pair(self, key: str, default: tuple[float, float]) -> tuple[float, float]:
        """A [low, high] pair such as time_step_limit; None means the default. transformers
        writes infinity as {"__float__": "Infinity"}, older files as Infinity or "inf"."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise self.unsupported(key, "expected a [low, high] pair")
        pair = []
        for item in value:
            if isinstance(item, dict) and set(item) == {"__float__"}:
                item = item["__float__"]
            try:
                pair.append(float(item))
            except (TypeError, ValueError):
                raise self.unsupported(key, f"{item!r} is not a number") from None
        if not pair[0] <= pair[1]:
            raise self.unsupported(key, "low is above high")
        return pair[0], pair[1]

    def unsupported(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: key {key!r} = {self.config.get(key)!r}: {message}")


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


class WeightFiles:
    """Name -> tensor access over model.safetensors or a sharded set with its index."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._file_of: dict[str, Path] = {}
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: missing key 'weight_map' (expected an object)")
            for name, shard in weight_map.items():
                shard_path = model_dir / shard
                if not shard_path.exists():
                    raise CheckpointError(f"{index}: tensor {name!r} points to missing shard {shard}")
                self._file_of[name] = shard_path
        elif single.exists():
            with safe_open(single, framework="pt") as f:
                for name in f.keys():
                    self._file_of[name] = single
        else:
            raise CheckpointError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json found"
            )
        self._handles: dict[Path, Any] = {}
        self.used: set[str] = set()
        # An FP8 checkpoint's scheme (engine.models.fp8): its float8 weights are read dequantized.
        quant = read_json(model_dir / "config.json").get("quantization_config") \
            if (model_dir / "config.json").exists() else None
        self.fp8 = FP8Weights(quant, str(model_dir / "config.json")) if quant is not None else None

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        path = self._file_of.get(name)
        if path is None:
            expect = f" of shape {list(shape)}" if shape is not None else ""
            raise CheckpointError(f"{self.model_dir}: missing tensor {name!r}{expect}")
        tensor = self._read(path, name)
        if tensor.dtype in FLOAT8:
            if self.fp8 is None:
                raise CheckpointError(f"{path}: tensor {name!r} is {tensor.dtype} but config.json has no "
                                      "quantization_config")
            scale_name = self.fp8.scale_name(name)
            scale = self._read(self._file_of[scale_name], scale_name) if scale_name in self._file_of else None
            tensor = self.fp8.dequantize(name, tensor, scale)
            self.used.add(scale_name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        self.used.add(name)
        return tensor

    def get_float8(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple | None]:
        """A float8 weight as stored, with its scale, its static input scale (None where the
        checkpoint has none) and the scale's block (None: per tensor or per channel), for a
        linear that keeps FP8 (engine.models.fp8_linear)."""
        names = (name, self.fp8.scale_name(name), self.fp8.input_scale_name(name))
        weight, scale, input_scale = (self._read(self._file_of[n], n) if n in self._file_of else None for n in names)
        self.used.update(n for n in names if n in self._file_of)
        return (weight, self.fp8.checked_scale(name, weight, scale), self.fp8.checked_input_scale(name, input_scale),
                self.fp8.block)

    def stored_dtype(self, name: str) -> str | None:
        """A tensor's dtype as the file's header names it ("F8_E4M3", "BF16"); None if missing."""
        return self._slice(name).get_dtype() if name in self._file_of else None

    def shape_of(self, name: str) -> list[int]:
        """A tensor's shape from the file's header (missing names are an error naming them)."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name!r}")
        return list(self._slice(name).get_shape())

    def numel_of(self, name: str) -> int:
        """A tensor's element count from the file's header; 0 for a missing name."""
        return math.prod(self.shape_of(name)) if name in self._file_of else 0

    def _handle(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        return handle

    def _slice(self, name: str):
        return self._handle(self._file_of[name]).get_slice(name)

    def _read(self, path: Path, name: str) -> torch.Tensor:
        return self._handle(path).get_tensor(name)

    def unused(self) -> list[str]:
        """Tensors not read, less those that exist only for quantization."""
        return [n for n in self._file_of if n not in self.used and not (self.fp8 and self.fp8.is_scale(n))]

    def close(self) -> None:
        self._handles.clear()


def load_into(module: torch.nn.Module, weights: WeightFiles, name_map, ignore=lambda name: False):
    """Fill every parameter of `module` from `weights` through `name_map(our_name) -> source`.

    `source` is an HF tensor name, or a callable (weights -> tensor) for parameters that are
    assembled from several HF tensors (fused MoE experts). Leftover checkpoint tensors that
    `ignore` does not excuse are an error: they mean the architecture was read wrong.
    """
    float8 = {f"{name}.qweight": m for name, m in module.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))}
    with torch.no_grad():
        for our_name, param in module.named_parameters():
            kept = float8.get(our_name)  # a linear or stacked experts keeping the checkpoint's FP8 weights
            if isinstance(kept, Fp8Linear):
                kept.load_float8(*weights.get_float8(name_map(our_name.removesuffix("qweight") + "weight")))
                continue
            if isinstance(kept, Fp8Experts):
                load_stacked(kept, weights, name_map(our_name.removesuffix(".qweight")))
                continue
            source = name_map(our_name)
            if callable(source):
                tensor = source(weights)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{weights.model_dir}: {our_name} assembled to shape {list(tensor.shape)}, "
                        f"expected {list(param.shape)}"
                    )
            else:
                tensor = weights.get(source, tuple(param.shape))
            param.copy_(tensor.to(param.dtype))
    leftover = [n for n in weights.unused() if not ignore(n)]
    if leftover:
        shown = ", ".join(sorted(leftover)[:5])
        raise CheckpointError(
            f"{weights.model_dir}: {len(leftover)} checkpoint tensors not used by the model "
            f"(config and weights disagree?): {shown}"
        )
