"""Nemotron-H's FFN layers: a non-gated MLP (squared ReLU by default) and its MoE.

The MoE routes with sigmoid scores plus a per-expert correction bias (used only to choose),
optionally within the best `topk_group` of `n_group` expert groups, normalises the chosen
weights when the config says so and scales them by routed_scaling_factor; experts are
non-gated MLPs, optionally inside a latent projection; a shared expert is always added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.decode_plan import RELU2_MLP, LayerPlan, Needs, pointer
from engine.models.checkpoint import ConfigReader
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows, partial_ffn_plan, set_param, span
from engine.tp.plan import even_split
from engine.models.expert_dispatch import dispatch_experts
from engine.models.layers import ACTIVATIONS, activation
from engine.models.packed_linear import linear, pack_per_expert


class NemotronMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        """Intermediate channels split: up keeps its rows, down is row-parallel."""
        if type(self) is not NemotronMLP:
            return None
        rows = span(even_split(self.up_proj.out_features, group.size, group.rank, "MLP intermediate size"))
        check_linear(self.up_proj, "MLP up_proj")
        check_linear(self.down_proj, "MLP down_proj")

        def apply():
            keep_rows(self.up_proj, rows)
            self.down_proj = RowParallelLinear.of(self.down_proj, rows, group, False, "MLP down_proj")
        return apply

    def plan_as_mixer(self, entry: LayerPlan) -> Needs | None:
        """This squared-ReLU MLP in a mixer's place (Nemotron-H's) in a decode step's one-call plan."""
        fits = (type(self) is NemotronMLP and self.act is ACTIVATIONS["relu2"]
                and all(getattr(m, "packed_weight", None) is not None for m in (self.up_proj, self.down_proj))
                and all(p.dtype == torch.float32 and p.is_contiguous() for p in self.parameters()))
        if not fits:
            return None
        up, down = self.up_proj, self.down_proj
        entry.mixer, entry.mlp_inter = RELU2_MLP, up.out_features
        entry.up_panels, entry.up_bias = up.packed_weight.panels.data_ptr(), pointer(up.bias)
        entry.down_panels, entry.down_bias = down.packed_weight.panels.data_ptr(), pointer(down.bias)
        return Needs(floats=up.out_features)


class NemotronMoE(nn.Module):
    float8_experts = ("up", "down")  # stacked weights an FP8 checkpoint keeps as float8 (engine.models.fp8_experts)

    def __init__(self, hidden: int, intermediate: int, shared_intermediate: int, num_experts: int,
                 top_k: int, n_group: int, topk_group: int, normalize: bool, scaling: float,
                 latent: int | None, act: str, bias: bool):
        super().__init__()
        width = latent or hidden
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.gate_bias = nn.Parameter(torch.zeros(num_experts))  # e_score_correction_bias
        self.up = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.down = nn.Parameter(torch.empty(num_experts, width, intermediate))
        self.shared = NemotronMLP(hidden, shared_intermediate, act, bias)
        self.fc1_latent = nn.Linear(hidden, latent, bias=bias) if latent else None
        self.fc2_latent = nn.Linear(latent, hidden, bias=bias) if latent else None
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.normalize, self.scaling = normalize, scaling
        self.act = activation(act)
        self.packed = None

    @classmethod
    def from_config(cls, cfg: ConfigReader, hidden: int) -> NemotronMoE:
        experts = cfg.positive_int("n_routed_experts")
        top_k = cfg.positive_int("num_experts_per_tok")
        n_group, topk_group = cfg.positive_int("n_group", 1), cfg.positive_int("topk_group", 1)
        if experts % n_group or topk_group > n_group or (n_group > 1 and experts // n_group < 2):
            raise cfg.unsupported("n_group", f"{experts} experts cannot form {n_group} groups of two or "
                                  f"more with topk_group={topk_group}")
        if top_k > experts:
            raise cfg.unsupported("num_experts_per_tok", f"exceeds n_routed_experts={experts}")
        if cfg.get("n_shared_experts", int, 1) != 1:
            raise cfg.unsupported("n_shared_experts", "only one shared expert is supported")
        return cls(hidden, cfg.positive_int("moe_intermediate_size"),
                   cfg.positive_int("moe_shared_expert_intermediate_size"), experts, top_k, n_group,
                   topk_group, cfg.get("norm_topk_prob", bool, True),
                   cfg.get("routed_scaling_factor", float, 1.0), cfg.get("moe_latent_size", int, None),
                   cfg.get("mlp_hidden_act", str, "relu2"), cfg.get("mlp_bias", bool, False))

    @staticmethod
    def checkpoint_name(p: str, ours: str):
        """Our parameter name inside the mixer -> the HF tensor name (or assembling callable)."""
        if ours.startswith(("up_proj", "down_proj")):  # a dense MLP layer
            return f"{p}.{ours}"
        fixed = {"gate_weight": f"{p}.gate.weight", "gate_bias": f"{p}.gate.e_score_correction_bias",
                 "fc1_latent.weight": f"{p}.fc1_latent_proj.weight", "fc1_latent.bias": f"{p}.fc1_latent_proj.bias",
                 "fc2_latent.weight": f"{p}.fc2_latent_proj.weight", "fc2_latent.bias": f"{p}.fc2_latent_proj.bias"}
        if ours in fixed:
            return fixed[ours]
        if ours.startswith("shared."):
            return f"{p}.shared_experts.{ours.removeprefix('shared.')}"
        part = {"up": "up_proj", "down": "down_proj"}[ours]
        return lambda w: _experts(w, f"{p}.experts", part)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_route(F.linear(x.float(), self.gate_weight.float()), self.gate_bias, self.n_group,
                                     self.topk_group, self.top_k, self.normalize, self.scaling)

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        """Each expert's intermediate channels split; the shared expert as its own kind; the
        latent projection back (fc2_latent) row-parallel, its bias on rank 0 only."""
        if type(self) is not NemotronMoE:
            return None
        rows = span(even_split(self.up.shape[1], group.size, group.rank, "MoE expert intermediate size"))
        shared = partial_ffn_plan(self.shared, group)
        if self.fc2_latent is not None:
            check_linear(self.fc2_latent, "MoE fc2_latent")

        def apply():
            set_param(self, "up", self.up, 1, rows)
            set_param(self, "down", self.down, 2, rows)
            if self.fc2_latent is not None:  # linear in the routed partial sums
                self.fc2_latent = RowParallelLinear.of(self.fc2_latent, range(self.fc2_latent.in_features),
                                                       group, False, "MoE fc2_latent")
            shared()
        return apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        inner = self.fc1_latent(x) if self.fc1_latent is not None else x
        routed = dispatch_experts(inner, experts, weights.to(inner.dtype), self.num_experts, self._expert,
                                  (self.up, self.down, self.act))
        if self.fc2_latent is not None:
            routed = self.fc2_latent(routed)
        return routed + self.shared(x)

    def pack_weights(self) -> int:
        """Packed expert weights on CPU (engine.models.packed_linear)."""
        self.packed = pack_per_expert(self.up, self.down)
        return 2 * self.num_experts if self.packed else 0

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        up, down = self.packed[expert] if self.packed else (None, None)
        return linear(self.act(linear(x, self.up[expert], None, up)), self.down[expert], None, down)


def grouped_sigmoid_route(logits: torch.Tensor, correction_bias: torch.Tensor, n_group: int, topk_group: int,
                          top_k: int, normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (Nemotron-H's and Kimi Linear's MoE): float32 router logits [T, E]
    -> (experts [T, k], weights [T, k]). Sigmoid scores; experts chosen by score + correction
    bias within the best `topk_group` of `n_group` groups (a group scored by its two best);
    weighted by the score alone, renormalised where `normalize`, scaled by `scaling`."""
    scores = logits.float().sigmoid()
    choice = scores + correction_bias.float()
    experts_n = scores.shape[-1]
    if n_group > 1:
        grouped = choice.view(-1, n_group, experts_n // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1)
        mask = keep[:, :, None].expand_as(grouped).reshape(-1, experts_n).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    experts = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return experts, weights * scaling


def _experts(weights, p: str, part: str) -> torch.Tensor:
    if f"{p}.{part}" in weights:  # stacked, as newer transformers save them
        return weights.get(f"{p}.{part}")
    stacked, e = [], 0
    while f"{p}.{e}.{part}.weight" in weights:
        stacked.append(weights.get(f"{p}.{e}.{part}.weight"))
        e += 1
    if not stacked:
        from engine.models.checkpoint import CheckpointError

        raise CheckpointError(f"{weights.model_dir}: missing tensor {p}.0.{part}.weight")
    return torch.stack(stacked)
