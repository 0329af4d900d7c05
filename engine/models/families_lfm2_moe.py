"""The lfm2_moe family (LFM2-MoE, Liquid AI): LFM2's short-conv and attention layers, whose FFN is
LFM2's SwiGLU MLP in the first `num_dense_layers` layers and sparse experts after them.

The experts are SwiGLU, stacked as SparseMoE stacks them; the routing is its own: sigmoid
scores, the top k chosen by score + expert_bias (a load-balancing offset, where
use_expert_bias) but weighted by the score alone, renormalised where norm_topk_prob (with
transformers' 1e-6), then scaled by routed_scaling_factor.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.checkpoint import ConfigReader
from engine.models.families import _stacked_experts
from engine.models.families_lfm2 import build_lfm2, lfm2_names
from engine.models.layers import GatedMLP, SparseMoE
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply


class SigmoidRoutedMoE(SparseMoE):
    """SparseMoE's experts under LFM2-MoE's routing (above). The router and the expert bias are
    replicated under tensor parallelism; the experts shard as SparseMoE's do."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool,
                 scaling: float, expert_bias: bool):
        super().__init__(hidden, intermediate, num_experts, top_k, "silu", normalize)
        self.scaling = scaling
        self.expert_bias = nn.Parameter(torch.zeros(num_experts)) if expert_bias else None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float().sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        experts = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.normalize_top_k:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-6)
        return experts, weights * self.scaling

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        return self.tp_partial_plan_of_experts(group) if type(self) is SigmoidRoutedMoE else None


def build_lfm2_moe(cfg: ConfigReader):
    dense_layers = cfg.get("num_dense_layers", int, 2)
    layers_n = cfg.positive_int("num_hidden_layers")
    if not 0 <= dense_layers <= layers_n:
        raise cfg.unsupported("num_dense_layers", f"must be in [0, num_hidden_layers={layers_n}]")
    experts, top_k = cfg.positive_int("num_experts", 32), cfg.positive_int("num_experts_per_tok", 4)
    if top_k > experts:
        raise cfg.unsupported("num_experts_per_tok", f"exceeds num_experts={experts}")
    dense_width, expert_width = cfg.positive_int("intermediate_size"), cfg.positive_int("moe_intermediate_size")
    normalize = cfg.get("norm_topk_prob", bool, True)
    scaling = cfg.get("routed_scaling_factor", float, 1.0)
    expert_bias = cfg.get("use_expert_bias", bool, True)

    def ffn_of_layer(index: int, hidden: int) -> nn.Module:
        if index < dense_layers:
            return GatedMLP(hidden, dense_width, "silu")  # transformers reads no hidden_act here either
        return SigmoidRoutedMoE(hidden, expert_width, experts, top_k, normalize, scaling, expert_bias)

    return build_lfm2(cfg, ffn_of_layer)


def lfm2_moe_names(name: str):
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[2] == "ffn" and parts[3] in ("router.weight", "expert_bias", "gate_up", "down"):
        p = f"model.layers.{parts[1]}.feed_forward"
        rest = parts[3]
        if rest == "router.weight":
            return f"{p}.gate.weight"
        if rest == "expert_bias":
            return f"{p}.expert_bias"
        fused = {"gate_up": "gate_up_proj", "down": "down_proj"}[rest]
        halves = ("w1", "w3") if rest == "gate_up" else ("w2",)
        return lambda w: _stacked_experts(w, f"{p}", halves, fused)
    return lfm2_names(name)


FAMILIES = {"lfm2_moe": (build_lfm2_moe, lfm2_moe_names)}
