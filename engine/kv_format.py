"""KV blocks stored in FP8 (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2) with a scale per layer and
tensor, or per KV head.

Each attention layer's K and V (an MLA layer's latent rows) are stored as value / scale in
float8, saturated at the format's largest value. The scales come from the checkpoint where it
carries them (`<layer>.k_scale` / `v_scale`, or `k_proj.output_scale` / `v_proj.output_scale`,
as vLLM's and llm-compressor's FP8 checkpoints do): one number, or one per KV head (the
`attn_head` strategy), else 1.0; a checkpoint whose config declares a static
`kv_cache_scheme` must carry them for every attention layer. Scales per head are not taken
with tensor parallelism (each rank would hold its heads' share; refused at load).

As for narrow recurrent state (engine.state_format), the attention layers do not change: around
each such layer's forward, NarrowKV dequantizes the blocks the step's rows read into working
rows in the compute dtype (one layer at a time: every layer of the same row shape shares
them), the layer runs on those, and the rows it wrote go back quantized (where Triton runs, one
pass each of engine.kernels.kv_fp8). A step's own tokens therefore attend to each other at
full precision and to earlier ones through the format.

An all-decode step on Triton skips both passes where the layer can (`reads_in_place`): the
layer is handed the pool itself (engine.models.batch.Fp8Blocks), stores its one token per row
quantized, and the decode kernel reads the blocks through their scales, with each row's own
token at full precision, so it computes what it would over the working rows (the same values,
read where they lie). A step that prefills keeps the working rows: its varlen attention reads
half-precision blocks.

The scales are part of the cache's layout: each layer's KV kind names them, so the hand-off's
layout handshake refuses a pair whose scales (or formats: the tensors' dtypes) differ, naming
both, and a disk tier entry's fingerprint changes with them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from engine.errors import CheckpointError
from engine.kernels import uses_triton
from engine.kernels.kv_fp8 import kv_load_triton, kv_store_triton
from engine.models import LayerCaches, ModelSpec
from engine.models.batch import ForwardBatch, Fp8Blocks

KV_DTYPES = {"auto": None, "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def is_kv_scale(name: str) -> bool:
    """A checkpoint tensor that is an attention layer's KV scale (read by read_kv_scales, not
    by the model's loader)."""
    return _SCALE_NAME.search(name) is not None


Scale = float | tuple[float, ...]  # one for the layer's tensor, or one per KV head


def read_kv_scales(model_dir: str | Path, spec: ModelSpec) -> dict[int, dict[str, Scale]]:
    """{layer: {"k": scale, "v": scale}} from the checkpoint; a CheckpointError naming the tensor
    where a scale is not one positive finite number or one per KV head, or the layer where a
    static kv_cache_scheme leaves one out."""
    from engine.models.checkpoint import WeightFiles

    model_dir = Path(model_dir)
    weights = WeightFiles(model_dir)
    try:
        scales: dict[int, dict[str, float]] = {}
        for name in weights.names():
            match = _SCALE_NAME.search(name)
            if match is None:
                continue
            layer, which = int(match.group(1)), match.group(2) or match.group(3)
            stored = weights.get(name)
            value = stored.float().reshape(-1)
            kv = spec.layers[layer].kv if layer < len(spec.layers) else None
            heads = kv.num_kv_heads if kv is not None else 1
            if value.numel() not in (1, heads):
                raise CheckpointError(f"{model_dir}: {name}: a KV scale must be one number or one per KV head "
                                      f"({heads}), got shape {tuple(stored.shape)}")
            if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise CheckpointError(f"{model_dir}: {name}: a KV scale must be positive and finite")
            scales.setdefault(layer, {})[which] = float(value) if value.numel() == 1 else tuple(value.tolist())
    finally:
        weights.close()
    config = json.loads((model_dir / "config.json").read_text())
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme and not scheme.get("dynamic", False):
        for layer in spec.attention_layers:
            missing = [w for w in spec.layers[layer].kv.names if w in ("k", "v") and w not in scales.get(layer, {})]
            if missing:
                raise CheckpointError(f"{model_dir}: quantization_config.kv_cache_scheme is static, but layer "
                                      f"{layer} has no {missing[0]}_scale tensor")
    return scales


def narrow_kv_spec(spec: ModelSpec, kv_dtype: str, scales: dict[int, dict[str, Scale]]) -> ModelSpec:
    """`spec` with every attention layer's KV stored as `kv_dtype` (a KV_DTYPES key), its scales
    (1.0 where the checkpoint has none) in the spec and named in the layer's KV kind."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_dtype!r} not in {list(KV_DTYPES)}")
    if KV_DTYPES[kv_dtype] is None:
        return spec
    layers = list(spec.layers)
    for i in spec.attention_layers:
        kv = layers[i].kv
        values = tuple(scales.get(i, {}).get(name, 1.0) for name in kv.names)
        kind = f"{kv.kind} in {KV_DTYPES[kv_dtype]} scaled " + ",".join(f"{n}={scale_text(s)}"
                                                                       for n, s in zip(kv.names, values))
        layers[i] = dataclasses.replace(layers[i], kv=dataclasses.replace(
            kv, stored_dtype=KV_DTYPES[kv_dtype], scales=values, kind=kind))
    return dataclasses.replace(spec, layers=tuple(layers))


def scale_text(scale: Scale) -> str:
    return f"{scale:.9g}" if isinstance(scale, float) else "[" + ",".join(f"{s:.9g}" for s in scale) + "]"


def scale_tensor(scale: Scale, device) -> float | torch.Tensor:
    """A scale as quantize takes it: the number, or [heads, 1] to broadcast over rows of
    [..., heads, head_dim]."""
    return scale if isinstance(scale, float) else torch.tensor(scale, device=device).reshape(-1, 1)


def head_scales(scale: Scale, pool: torch.Tensor) -> torch.Tensor:
    """A scale as the in-place decode reads it: float32 [KV heads] on the pool's device (rows
    [..., heads, head_dim]), a layer's one number repeated."""
    heads = pool.shape[-2]
    values = [scale] * heads if isinstance(scale, float) else list(scale)
    return torch.tensor(values, dtype=torch.float32, device=pool.device)


def quantize(rows: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows / scale in the float8 `dtype`, saturated at its largest value (not inf or nan)."""
    largest = torch.finfo(dtype).max
    values = rows.float() if isinstance(scale, float) and scale == 1.0 else rows.float() / scale
    return values.clamp_(-largest, largest).to(dtype)


def dequantize(rows: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values = rows.float() if isinstance(scale, float) and scale == 1.0 else rows.float() * scale
    return values.to(dtype)


class NarrowKV:
    """The working rows of a cache whose KV blocks are stored in FP8, and the load / store around
    each attention layer's forward."""

    def __init__(self, pool: LayerCaches, spec: ModelSpec, layers: list[int], num_block_rows: int,
                 compute_dtype: torch.dtype):
        self.pool, self.layers, self.dtype = pool, set(layers), compute_dtype
        self.scales = {i: [scale_tensor(s, t.device) for s, t in zip(spec.layers[i].kv.scales, pool.kv[i])]
                       for i in layers}
        self.in_place = {i: Fp8Blocks(tuple(pool.kv[i]), tuple(head_scales(s, t) for s, t in
                                                            zip(spec.layers[i].kv.scales, pool.kv[i])))
                         for i in layers}
        buffers: dict[tuple, list[torch.Tensor]] = {}
        self.working: dict[int, tuple[torch.Tensor, ...]] = {}
        for i in layers:
            rows, used = [], {}
            for t in pool.kv[i]:
                shape = tuple(t.shape[1:])
                j = used[shape] = used.get(shape, -1) + 1
                shared = buffers.setdefault(shape, [])
                if j == len(shared):
                    shared.append(torch.zeros((num_block_rows, *shape), dtype=compute_dtype, device=t.device))
                rows.append(shared[j])
            self.working[i] = tuple(rows)
        self.buffers = [t for shared in buffers.values() for t in shared]
        self._batch: ForwardBatch | None = None
        self._blocks = None

    def place(self, kv: list, state: list) -> None:
        for i, rows in self.working.items():
            kv[i] = rows

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    reads_kind = "kv"  # what a layer's modules must say they take in place (HybridLM.in_place_readers)

    def reads_in_place(self, layer: int, batch: ForwardBatch) -> bool:
        """Whether a layer that can read the pool in place does so this step: every row a
        decode, on Triton (the kernel that reads FP8 blocks)."""
        return not batch.prefill_rows and uses_triton(self.pool.kv[layer][0])

    def load(self, layer: int, batch: ForwardBatch) -> None:
        """Every block the step's rows read (their whole tables), dequantized into the working rows."""
        if self._batch is not batch:  # once per step; a replayed static batch keeps its tensors
            self._blocks, self._batch = batch.block_tables.reshape(-1), batch
        for working, stored, scale in zip(self.working[layer], self.pool.kv[layer], self.scales[layer]):
            if uses_triton(working):  # one pass (engine.kernels.kv_fp8)
                kv_load_triton(stored, self._blocks, working, scale)
                continue
            # float8 rows move as bytes: torch's CPU index ops do not take float8 dtypes
            rows = stored.view(torch.uint8).index_select(0, self._blocks).view(stored.dtype)
            working.index_copy_(0, self._blocks, dequantize(rows, scale, self.dtype))

    def store(self, layer: int, batch: ForwardBatch) -> None:
        """The rows the step wrote (its tokens' K and V), quantized into the pool."""
        written = batch.kv_write_index
        for working, stored, scale in zip(self.working[layer], self.pool.kv[layer], self.scales[layer]):
            if uses_triton(working):  # one pass (engine.kernels.kv_fp8)
                kv_store_triton(working, written, stored, scale)
                continue
            flat_rows = working.view(-1, *working.shape[2:])
            flat_pool = stored.view(torch.uint8).view(-1, *stored.shape[2:])
            flat_pool.index_copy_(0, written, quantize(flat_rows.index_select(0, written), scale, stored.dtype)
                                  .view(torch.uint8))
