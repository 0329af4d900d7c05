"""Engine options: one dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.hub import resolve_model
from engine.speculative import SpeculativeConfig
from engine.host_tier import TierConfig
from engine.kv_format import KV_DTYPES
from engine.state_format import STATE_DTYPES

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ENGINE_MODES = ("colocated", "prefill", "decode")
OUTPUT_KINDS = ("cumulative", "delta")


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (recurrent state: mamba_state_dtype)
    # What the cache stores recurrent state in: float32, or half width (bfloat16, float16) with
    # stochastic rounding on each write; the layers compute it in float32 either way
    # (engine.state_format).
    mamba_state_dtype: str = "float32"
    # What the cache stores attention KV in: "auto" (the model's dtype) or FP8 ("fp8_e4m3",
    # "fp8_e5m2"), scaled per layer by the checkpoint's KV scales or 1.0 (engine.kv_format).
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 64  # running sequences at once = Mamba state slots
    max_num_batched_tokens: int = 2048  # per-step token budget; small values force chunked prefill
    max_model_len: int | None = None  # default: the model's max positions, capped at 8192
    num_kv_blocks: int | None = None  # overrides the count derived from cache_memory_bytes
    cache_memory_bytes: int = 1 << 30  # KV blocks + state slots are carved from this at start
    # CUDA: size the cache from this share of the device's memory instead, after the weights
    # and the largest step (engine.memory_profile; on every rank, the smallest budget sizing
    # all); ignored on CPU, where cache_memory_bytes is.
    gpu_memory_utilization: float | None = None
    mode: str = "colocated"  # "prefill" / "decode": one half of a disaggregated pair
    seed: int = 0
    # False: on CUDA, decode-only steps replay a CUDA graph per padded batch size, captured at
    # start (engine.cuda_graphs; a model that cannot be captured decodes eagerly). No effect on CPU.
    enforce_eager: bool = False
    # Debug mode also poisons freed state slots with NaN so an unguarded read shows up at once.
    debug: bool = os.environ.get("SPLITSERVE_DEBUG", "") not in ("", "0")
    # Hub ids (engine/hub.py): the branch, tag or commit to serve; after __post_init__ the
    # commit resolved, and `model` the snapshot folder. None for a local folder.
    revision: str | None = None
    # Reuse the KV blocks and recurrent state of prefixes seen before (engine.prefix_cache).
    enable_prefix_caching: bool = False
    # Recurrent-state checkpoint rows the prefix cache may fill (None: max_num_seqs). Carved
    # from cache_memory_bytes before the KV blocks; unused by models without recurrent layers.
    prefix_checkpoints: int | None = None
    # Tiers below the prefix cache's pool (engine.tiered_cache): what the pool evicts moves to
    # host memory (host_cache_bytes), then to a directory (disk_cache_dir, disk_cache_bytes).
    # 0 / None: no such tier. They need enable_prefix_caching.
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    # Ranks the model is sharded over (engine.tp): this process is rank 0 and starts the others
    # as processes of this machine, joined by a gloo group. CPU only, for now.
    tensor_parallel_size: int = 1
    # "cumulative": every output carries the prompt and the tokens, text and logprobs so far.
    # "delta": only what is new since the request's previous output (RequestOutput.delta()), for
    # a consumer that rebuilds the rest (the decode worker's router): no per-step copy that grows
    # with the output.
    output_kind: str = "cumulative"
    # vLLM's speculative_config: a dict such as {"method": "ngram", "num_speculative_tokens": 4}
    # (engine.speculative), made a SpeculativeConfig here; None: no speculation.
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.model, self.revision = resolve_model(str(self.model), self.revision)  # Hub id -> folder
        if not Path(self.model).is_dir():
            raise ValueError(f"model: {self.model!r} is not a directory")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} not in {['auto', *sorted(_DTYPES)]}")
        if self.mamba_state_dtype not in STATE_DTYPES:
            raise ValueError(f"mamba_state_dtype: {self.mamba_state_dtype!r} not in {list(STATE_DTYPES)}")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} not in {list(KV_DTYPES)}")
        if KV_DTYPES[self.kv_cache_dtype] is not None and not hasattr(torch, KV_DTYPES[self.kv_cache_dtype]):
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r}: this torch ({torch.__version__}) has no "
                             f"{KV_DTYPES[self.kv_cache_dtype]} to store it in")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, (int, float))
                                        or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cache_memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: must be a positive integer or None, got {value!r}")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.prefix_checkpoints is not None and (isinstance(self.prefix_checkpoints, bool) or not
                                                    isinstance(self.prefix_checkpoints, int) or self.prefix_checkpoints <= 0):
            raise ValueError(f"prefix_checkpoints: must be a positive integer or None, got {self.prefix_checkpoints!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise ValueError(f"tensor_parallel_size: must be a positive integer, got {tp!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device: {self.device!r} is not a torch device ({e})") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r}: only 'cpu' and 'cuda' devices are supported")
        if tp > 1 and device.index not in (None, 0):
            raise ValueError(f"tensor_parallel_size {tp} on {self.device}: ranks are placed from cuda:0 on; "
                             "pass device='cuda'")
        tiers = self.tier_config  # validates the three fields
        if tiers.enabled and not self.enable_prefix_caching:
            raise ValueError("host_cache_bytes / disk_cache_dir: the tiers hold what the prefix cache evicts; "
                             "they need enable_prefix_caching")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind: {self.output_kind!r} not in {OUTPUT_KINDS}")
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode: {self.mode!r} not in {ENGINE_MODES}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r} requested but CUDA is not available")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if device.type == "cuda" else "float32"
        if device.type == "cuda" and self.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype: bfloat16 is not supported on {torch.cuda.get_device_name(device)}; "
                             "use float16 or float32")

    @property
    def tier_config(self) -> TierConfig:
        return TierConfig(self.host_cache_bytes, self.disk_cache_dir, self.disk_cache_bytes)

    @property
    def num_prefix_checkpoints(self) -> int:
        if not self.enable_prefix_caching:
            return 0
        return self.prefix_checkpoints if self.prefix_checkpoints is not None else self.max_num_seqs

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
