"""One decoder stack for every family: per layer a mixer (attention or Mamba) and an optional FFN.

Jamba interleaves both mixer kinds; Llama-family models are all attention; Mamba is all Mamba
with no FFN. The families differ only in how config.json and tensor names map onto this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.batch import ForwardBatch, LayerCaches


@dataclass
class ModelSpec:
    """What the engine needs to know about a model to size, place and move its caches."""

    model_type: str
    layer_kinds: list[str]  # "attention" or "mamba", per layer
    vocab_size: int
    hidden_size: int
    num_kv_heads: int = 0
    head_dim: int = 0
    d_inner: int = 0
    d_conv: int = 0
    d_state: int = 0
    max_position: int | None = None  # None: no positional limit (pure Mamba)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self):
        for kind in self.layer_kinds:
            if kind not in ("attention", "mamba"):
                raise ValueError(f"unknown layer kind {kind!r}")

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "attention"]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mamba"]


class DecoderLayer(nn.Module):
    def __init__(self, kind: str, input_norm: nn.Module, mixer: nn.Module,
                 ffn_norm: nn.Module | None = None, ffn: nn.Module | None = None,
                 residual_fp32: bool = False):
        super().__init__()
        self.kind = kind
        self.input_norm = input_norm
        self.mixer = mixer
        self.ffn_norm = ffn_norm
        self.ffn = ffn
        self.residual_fp32 = residual_fp32

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, index: int):
        cache = caches.kv[index] if self.kind == "attention" else caches.state[index]
        residual = h.float() if self.residual_fp32 else h
        h = residual + self.mixer(self.input_norm(h.to(self.input_norm.weight.dtype)), batch, cache)
        if self.ffn is not None:
            h = h + self.ffn(self.ffn_norm(h))
        return h


class HybridLM(nn.Module):
    def __init__(self, spec: ModelSpec, layers: list[DecoderLayer], final_norm: nn.Module,
                 tie_embeddings: bool):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.tie_embeddings = tie_embeddings
        if not tie_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """Logits (float32) of each sequence's last scheduled token: [num_seqs, vocab]."""
        h = self.embed(batch.input_ids)
        for index, layer in enumerate(self.layers):
            h = layer(h, batch, caches, index)
        h = self.final_norm(h.index_select(0, batch.logits_indices))
        weight = self.embed.weight if self.tie_embeddings else self.lm_head.weight
        return (h.to(weight.dtype) @ weight.t()).float()
