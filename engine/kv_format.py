"""KV blocks stored in FP8 (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2) with a scale per layer and
tensor, or per KV head.

Each attention layer's K and V (an MLA layer's latent rows) are stored as value / scale in
float8, saturated at the format's largest value. The scales come from the checkpoint where it
carries them (`<layer>.k_scale` / `v_scale`, or `k_proj.output_scale` / `v_proj.output_scale`,
as vLLM's and llm-compressor's FP8 checkpoints do): one number, or one per KV head (the
`attn_head` strategy), else 1.0; a checkpoint whose config declares a static
`kv_cache_scheme` must carry them for every attention layer. Scales per head are not taken
with tensor parallelism (each rank would hold its heads' share; refused at load).

As for narrow recurrent state (engine.state_format), on the CPU the attention layers do not
change: around each such layer's forward, NarrowKV dequantizes the blocks the step's rows read into working
rows in the compute dtype (one layer at a time: every layer of the same row shape shares
them), the layer runs on those, and the rows it wrote go back quantized (where Triton runs, one
pass each of engine.kernels.kv_fp8). A step's own tokens therefore attend to each other at
full precision and to earlier ones through the format.

On Triton, a layer that can (its modules say `reads_fp8_in_place`) is handed the pool itself
(engine.models.batch.Fp8Blocks), and its decode rows read the blocks through their scales, each
row's own token at full precision, so they compute what they would over the working rows (the
same values, read where they lie). An all-decode step then loads and stores nothing: the layer
stores its one token per row quantized. A step that prefills loads only its prefill rows'
blocks (its varlen attention reads half-precision blocks) and stores its rows as above.

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
        # a step that prefills, on Triton: the pool for its decode rows, working rows for the rest
        self.beside = {i: dataclasses.replace(blocks, working=self.working[i]) for i, blocks in self.in_place.items()}
        self._batch: ForwardBatch | None = None
        self._blocks: dict[bool, torch.Tensor] = {}

    def place(self, kv: list, state: list) -> None:
        for i, rows in self.working.items():
            kv[i] = rows

    def holds(self, layer: int) -> bool:
        return layer in self.layers

    reads_kind = "kv"  # what a layer's modules must say they take in place (HybridLM.in_place_readers)

    def load(self, layer: int, batch: ForwardBatch, pool_ok: bool):
        """What layer `layer` is handed this step. Where it may be handed its pool (`pool_ok`) and
        Triton runs, an Fp8Blocks: an all-decode step's loads nothing; a step that prefills loads
        its prefill rows' blocks into the working rows beside it. Else the working rows, with
        every block the step's rows read (their whole tables) dequantized into them."""
        in_place = self._reads_pool(layer, pool_ok)
        if in_place and not batch.prefill_rows:
            return self.in_place[layer]
        blocks = self._blocks_of(batch, prefill_only=in_place)
        for working, stored, scale in zip(self.working[layer], self.pool.kv[layer], self.scales[layer]):
            if uses_triton(working):  # one pass (engine.kernels.kv_fp8)
                kv_load_triton(stored, blocks, working, scale)
                continue
            # float8 rows move as bytes: torch's CPU index ops do not take float8 dtypes
            rows = stored.view(torch.uint8).index_select(0, blocks).view(stored.dtype)
            working.index_copy_(0, blocks, dequantize(rows, scale, self.dtype))
        return self.beside[layer] if in_place else self.working[layer]

    def _reads_pool(self, layer: int, pool_ok: bool) -> bool:
        """Whether the layer's decode rows read its pool in place: it may be handed it (`pool_ok`)
        and Triton runs (the paged decode kernel that reads FP8 blocks)."""
        return pool_ok and uses_triton(self.pool.kv[layer][0])

    def _blocks_of(self, batch: ForwardBatch, prefill_only: bool) -> torch.Tensor:
        """The blocks a step loads: every row's table, or its prefill rows' (once per step; a
        replayed static batch keeps its tensors)."""
        if self._batch is not batch:
            self._blocks, self._batch = {}, batch
        if prefill_only not in self._blocks:
            tables = batch.block_tables
            if prefill_only:
                rows = torch.tensor(batch.prefill_rows, dtype=torch.long).to(tables.device)
                tables = tables.index_select(0, rows)
            self._blocks[prefill_only] = tables.reshape(-1)
        return self._blocks[prefill_only]

    def store(self, layer: int, batch: ForwardBatch, pool_ok: bool) -> None:
        """The rows the step wrote (its tokens' K and V), quantized into the pool; nothing after
        an all-decode step whose layer stored them itself (`load` handed it the pool alone)."""
        if self._reads_pool(layer, pool_ok) and not batch.prefill_rows:
            return
        written = batch.kv_write_index
        for working, stored, scale in zip(self.working[layer], self.pool.kv[layer], self.scales[layer]):
            if uses_triton(working):  # one pass (engine.kernels.kv_fp8)
                kv_store_triton(working, written, stored, scale)
                continue
            flat_rows = working.view(-1, *working.shape[2:])
            flat_pool = stored.view(torch.uint8).view(-1, *stored.shape[2:])
            flat_pool.index_copy_(0, written, quantize(flat_rows.index_select(0, written), scale, stored.dtype)
                                  .view(torch.uint8))
