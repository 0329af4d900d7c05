"""Model zoo: plain-torch serving forwards for HF-format checkpoints (no transformers import)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.checkpoint import CheckpointError, ConfigReader, WeightFiles, load_into, read_config, read_json
from engine.models.families import FAMILIES as _BASE_FAMILIES
from engine.models.families_falcon_h1 import FAMILIES as _FALCON_H1_FAMILIES
from engine.models.families_kimi_linear import FAMILIES as _KIMI_LINEAR_FAMILIES
from engine.models.families_lfm2 import FAMILIES as _LFM2_FAMILIES
from engine.models.families_lfm2_moe import FAMILIES as _LFM2_MOE_FAMILIES
from engine.models.families_mamba2 import FAMILIES as _MAMBA2_FAMILIES
from engine.models.families_olmo_hybrid import FAMILIES as _OLMO_HYBRID_FAMILIES
from engine.models.families_qwen3_next import FAMILIES as _QWEN3_NEXT_FAMILIES
from engine.models.families_qwen3_next import MTP_HEADS
from engine.models.families_zamba2 import FAMILIES as _ZAMBA2_FAMILIES
from engine.models.fp8 import FLOAT8
from engine.models.fp8_experts_loading import use_float8_experts
from engine.models.fp8_linear import use_float8_linears
from engine.models.hybrid import HybridLM, LayerCacheSpec, ModelSpec, StateTensorSpec
from engine.models.mtp_head import MTPHead

__all__ = ["CheckpointError", "ForwardBatch", "HybridLM", "LayerCacheSpec", "LayerCaches", "ModelSpec",
           "MTPHead", "StateTensorSpec", "load_model", "load_mtp_head"]

FAMILIES = {**_BASE_FAMILIES, **_MAMBA2_FAMILIES, **_FALCON_H1_FAMILIES, **_ZAMBA2_FAMILIES,
            **_QWEN3_NEXT_FAMILIES, **_LFM2_FAMILIES, **_LFM2_MOE_FAMILIES,
            **_OLMO_HYBRID_FAMILIES, **_KIMI_LINEAR_FAMILIES}
logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model's forward does not use: cached rotary tables,
# multi-token-prediction heads (loaded on their own for speculation: load_mtp_head), and the
# KV cache's scales (read by the cache's format: engine.kv_format.read_kv_scales).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")
_IGNORED_PREFIXES = ("mtp.",)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> HybridLM:
    """The checkpoint's model in `dtype` on `device`; its FP8 linears stay FP8 where the device
    runs them (engine.models.fp8_linear), a tensor-parallel shard's too."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    config = read_config(model_dir)
    model_type = config["model_type"]
    if model_type not in FAMILIES:
        raise CheckpointError(f"{model_dir / 'config.json'}: model_type {model_type!r} is not "
                              f"supported (supported: {', '.join(sorted(FAMILIES))})")
    build, names = FAMILIES[model_type]
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = read_json(generation).get("eos_token_id")
        if eos is not None:
            config = {**config, "eos_token_id": eos}
    return _build_and_load(
        lambda: build(ConfigReader(config, model_dir / "config.json")), model_dir, names, dtype, device,
        ignore=lambda model, n: n.endswith(_IGNORED_SUFFIXES) or n.startswith(_IGNORED_PREFIXES)
        or (model.tie_embeddings and n == "lm_head.weight"))


def load_mtp_head(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> MTPHead:
    """The multi-token-prediction head a checkpoint carries (engine.models.mtp_head); a
    ValueError naming what is missing where the family has none or the checkpoint lacks it."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    model_type = config["model_type"]
    where = f"speculative_config.method 'mtp' on {model_dir}"
    if model_type not in MTP_HEADS:
        raise ValueError(f"{where}: model_type {model_type!r} has no MTP head here "
                         f"(supported: {', '.join(sorted(MTP_HEADS))})")
    weights = WeightFiles(model_dir)
    try:
        if not any(name.startswith("mtp.") for name in weights.names()):
            raise ValueError(f"{where}: the checkpoint carries no mtp.* weights")
    finally:
        weights.close()
    build, names = MTP_HEADS[model_type]
    return _build_and_load(lambda: build(ConfigReader(config, model_dir / "config.json")), model_dir, names,
                           dtype, device, ignore=lambda head, n: not n.startswith("mtp."))


def _build_and_load(build, model_dir: Path, names, dtype: torch.dtype, device, ignore):
    """build() on the meta device, storage in `dtype` on `device`, the weights loaded through
    `names`; `ignore(module, name)`: checkpoint tensors it does not use."""
    weights = WeightFiles(model_dir)
    try:
        with torch.device("meta"):
            module = build()
            # chosen before any storage exists: an FP8 model is never materialized dense
            kept = use_float8_linears(module, names, weights, torch.device(device), dtype)
            experts = use_float8_experts(module, names, weights, torch.device(device), dtype)
            if kept or experts:
                logger.info("%s: %d linears and %d stacked expert weights keep the checkpoint's FP8 weights",
                            model_dir, kept, experts)
        # Storage for the meta tensors, floating ones in `dtype` (FP8 weights stay float8):
        # to_empty().to(dtype) through the same Module._apply to_empty uses, but with torch.empty
        # (to_empty's empty_like of a meta tensor imports sympy: 0.5 s of every start).
        module = module._apply(lambda t: torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() and t.dtype not in FLOAT8 else t.dtype, device=device))
        load_into(module, weights, names, ignore=lambda n: ignore(module, n))
    finally:
        weights.close()
    for part in list(module.modules()):  # constant multipliers into the loaded weights (Falcon-H1's muP)
        if hasattr(part, "fold_scales"):
            part.fold_scales()
    return module.eval()

