"""Building blocks shared by the model families."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu, cpu_kernels_ready, native, uses_cpu_kernel
from engine.kernels.decode_plan import MOE, SWIGLU_MLP, LayerPlan, Needs, plan_shared_mlp
from engine.models.expert_dispatch import dispatch_experts
from engine.tp.group import TPGroup
from engine.tp.parallel import (Apply, ShardedGatedRMSNorm, all_of, check_linear, keep_rows, partial_ffn_plan,
                                RowParallelLinear, set_param, span, take)
from engine.tp.plan import even_split
from engine.models.packed_linear import (fused_linear, linear, pack_fused, pack_per_expert, panel_pointers,
                                         silu_experts)

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "relu2": lambda x: torch.square(F.relu(x))}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    offset = 0.0  # what a subclass adds to the weight before scaling (Qwen3-Next's OffsetRMSNorm); 0 here

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._runs_kernel(x):
            return cpu.rms_norm_cpu(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm). On the CPU kernel path one pass does both and the sum is
        written into x, so x must be the caller's own (a mixer's fresh output)."""
        if (x.shape == residual.shape and self.weight.dtype == torch.float32 and uses_cpu_kernel(x)
                and uses_cpu_kernel(residual)):
            return x, cpu.rms_norm_cpu(x, self.weight, self.eps, add=residual)
        h = residual + x
        return h, self(h)

    def fits_decode_plan(self) -> bool:
        """Runs as the one-call decode plan's RMSNorm (this forward, a float32 contiguous weight)."""
        return type(self) is RMSNorm and self.weight.dtype == torch.float32 and self.weight.is_contiguous()

    def _runs_kernel(self, x: torch.Tensor) -> bool:
        return self.weight.dtype == torch.float32 and (
            uses_cpu_kernel(x) or (cpu.rows_with_stride(x) and cpu_kernels_ready()))


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: RMS-normalise y * silu(z) within groups of `group_size` channels
    (mamba_ssm's norm_before_gate=False, what Mamba2, Bamba, Granite 4.0-H, Nemotron-H and
    Zamba2 use); with norm_before_gate=True (a Falcon-H1 option) normalise y, then gate."""

    def __init__(self, size: int, group_size: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        if group_size <= 0 or size % group_size:
            raise ValueError(f"gated norm: group size {group_size} does not divide {size}")
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y.float()
        if not self.norm_before_gate:
            y = y * F.silu(z.float())
        y = self.weight * self._group_rms(y).to(dtype)
        if self.norm_before_gate:
            y = y * F.silu(z.to(y.dtype))
        return y

    def normalise_gated(self, gated: torch.Tensor) -> torch.Tensor:
        """The norm alone, for a float32 y * silu(z) computed elsewhere (norm_before_gate=False);
        one C++ pass on CPU (the kernel Mamba2's one-call decode runs too, so both give the same
        bits). (ShardedGatedRMSNorm has its own.)"""
        if uses_cpu_kernel(gated) and gated.dim() == 2 and gated.is_contiguous() and self.weight.dtype == torch.float32:
            return cpu.group_rms_norm_cpu(gated, self.weight, self.group_size, self.eps)
        return self.weight * self._group_rms(gated)

    def _group_rms(self, y: torch.Tensor) -> torch.Tensor:
        groups = y.view(*y.shape[:-1], -1, self.group_size)
        return (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(y.shape)

    def tp_slice(self, channels: tuple[int, int], group: TPGroup) -> nn.Module:
        """The norm for channels [c0, c1) of one tensor-parallel rank: the same norm on the slice
        when they are whole groups (no communication), else a ShardedGatedRMSNorm."""
        if type(self) is not GatedRMSNorm:
            raise ValueError(f"tensor parallelism: Mamba2 norm is a {type(self).__name__}, not a GatedRMSNorm")
        c0, c1 = channels
        if c0 % self.group_size == 0 and (c1 - c0) % self.group_size == 0:
            out = GatedRMSNorm(c1 - c0, self.group_size, self.eps, self.norm_before_gate)
            out.weight = take(self.weight, 0, range(c0, c1))
            return out
        return ShardedGatedRMSNorm(self, channels, group)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.gate_up_fused = None
        self._panel_pointers = (None, None)  # (down_proj's packed weight, the pointers made with it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._runs_in_one_call(x):
            return self._in_one_call(x)
        gate, up = fused_linear(x, self.gate_up_fused, self.gate_proj, self.up_proj)
        if self.act is F.silu and uses_cpu_kernel(x) and gate.dtype == torch.float32 and gate.stride() == up.stride():
            return self.down_proj(cpu.silu_mul_cpu(gate, up))
        return self.down_proj(self.act(gate) * up)

    def pack_weights(self) -> int:
        """gate and up as one packed GEMM on CPU (engine.models.packed_linear.pack_fused)."""
        if not self.packs_fused():
            return 0
        self.gate_up_fused = pack_fused(self.gate_proj, self.up_proj)
        return int(self.gate_up_fused is not None)

    def _runs_in_one_call(self, x: torch.Tensor) -> bool:
        return self.fits_one_call() and uses_cpu_kernel(x) and x.dim() == 2 and not x.requires_grad

    def fits_one_call(self) -> bool:
        """SiLU, no biases, gate-up and down packed: then, on float32 rows, forward's three kernels
        run as one call (packed_linear.silu_experts with one expert)."""
        return (self.gate_up_fused is not None and self.gate_up_fused[1] is None and self.down_proj.bias is None
                and getattr(self.down_proj, "packed_weight", None) is not None and self.act is F.silu)

    def one_call_pointers(self) -> torch.Tensor:
        """panel_pointers of (gate_up, down) as the one expert, for the one-call kernels."""
        down = self.down_proj.packed_weight
        if self._panel_pointers[0] is not down:  # down_proj is packed after this module (parents first)
            self._panel_pointers = (down, panel_pointers([(self.gate_up_fused[0], down)]))
        return self._panel_pointers[1]

    def _in_one_call(self, x: torch.Tensor) -> torch.Tensor:
        return silu_experts(x, [x.shape[0]], self.one_call_pointers(), self.down_proj.in_features)

    def packs_fused(self) -> bool:
        """Whether forward runs as defined here (a subclass that changes it says when it does)."""
        return type(self).forward is GatedMLP.forward

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        """Intermediate channels split: gate and up keep their rows, down is row-parallel."""
        return self.tp_partial_plan_of_mlp(group) if type(self) is GatedMLP else None

    def tp_partial_plan_of_mlp(self, group: TPGroup) -> Apply:
        rows = span(even_split(self.gate_proj.out_features, group.size, group.rank, "MLP intermediate size"))
        check_linear(self.gate_proj, "MLP gate_proj")
        check_linear(self.up_proj, "MLP up_proj")
        check_linear(self.down_proj, "MLP down_proj")

        def apply():
            keep_rows(self.gate_proj, rows)
            keep_rows(self.up_proj, rows)
            self.down_proj = RowParallelLinear.of(self.down_proj, rows, group, False, "MLP down_proj")
        return apply

    def plans_as_mlp(self) -> bool:
        """Runs as the one-call decode plan's SwiGLU MLP (a subclass whose forward is this one's
        counts: Falcon-H1's, its multipliers folded)."""
        return self.packs_fused() and self.fits_one_call()

    def plan_ffn(self, entry: LayerPlan, hidden: int) -> Needs | None:
        """This MLP as a layer's FFN in a decode step's one-call plan (engine.kernels.decode_plan)."""
        if not self.plans_as_mlp():
            return None
        inter = self.down_proj.in_features
        entry.ffn, entry.inter, entry.expert_panels = SWIGLU_MLP, inter, self.one_call_pointers().data_ptr()
        return Needs(floats=3 * inter, fixed_ints=1)


class SummedFFN(nn.Module):
    """Several FFNs over the same input, outputs added (routed experts + a shared expert)."""

    def __init__(self, *ffns: nn.Module):
        super().__init__()
        self.parts = nn.ModuleList(ffns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parts[0](x)
        for part in self.parts[1:]:
            out = out + part(x)
        return out

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        return all_of([partial_ffn_plan(part, group) for part in self.parts]) if type(self) is SummedFFN else None

    def plan_ffn(self, entry: LayerPlan, hidden: int) -> Needs | None:
        """One part as it plans itself, or routed experts plus a shared MLP (Granite 4.0-H's)."""
        parts = list(self.parts)
        if len(parts) == 1:
            return parts[0].plan_ffn(entry, hidden) if hasattr(parts[0], "plan_ffn") else None
        routed, shared = parts if len(parts) == 2 else (None, None)
        if not (getattr(routed, "plans_as_moe", lambda: False)() and getattr(shared, "plans_as_mlp", lambda: False)()):
            return None
        return plan_shared_mlp(entry, shared, None, routed.plan_ffn(entry, hidden))


class SparseMoE(nn.Module):
    """Top-k routed experts with full capacity (no dropped tokens).

    Expert weights are stacked ([experts, 2*inter, hidden] gate+up, [experts, hidden, inter]
    down) so each hit expert is one pair of matmuls over exactly the tokens routed to it.
    """

    float8_experts = ("gate_up", "down")  # stacked weights an FP8 checkpoint keeps as float8 (engine.models.fp8_experts)

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str,
                 normalize_top_k: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:  # the routing kernels rely on it
            raise ValueError(f"MoE: top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.act = activation(act)
        self.packed = self.panel_pointers = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._runs_in_one_call(x):
            return self._in_one_call(x)
        experts, weights = self.route(self.router(x))
        return dispatch_experts(x, experts, weights.to(x.dtype), self.num_experts, self._expert,
                                (self.gate_up, self.down, self._between))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, experts] -> (experts [T, k], weights [T, k]): softmax top-k, the
        weights renormalised where normalize_top_k. A family that routes otherwise overrides this
        (and then runs neither the one-call layer nor this class's TP plan, which route this way)."""
        if uses_cpu_kernel(logits):
            return cpu.moe_route_cpu(logits, self.top_k, self.normalize_top_k)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights

    def _runs_in_one_call(self, x: torch.Tensor) -> bool:
        return self.fits_one_call() and uses_cpu_kernel(x) and x.dim() == 2 and not x.requires_grad

    def fits_one_call(self) -> bool:
        """Packed SwiGLU experts and router: then, on float32 rows with the kernels on, forward's
        kernels run as one C++ call (engine/kernels/cpu_layers.cpp)."""
        return (self.panel_pointers is not None and getattr(self.router, "packed_weight", None) is not None
                and self.router.bias is None and self.act is F.silu and type(self)._expert is SparseMoE._expert
                and type(self).route is SparseMoE.route)

    def tp_partial_plan(self, group: TPGroup) -> Apply | None:
        """Each expert's intermediate channels split (gate_up stacks [gate; up] per expert: the
        same rows of each half)."""
        return self.tp_partial_plan_of_experts(group) if type(self) is SparseMoE else None

    def tp_partial_plan_of_experts(self, group: TPGroup) -> Apply:
        inter = self.down.shape[2]
        rows = span(even_split(inter, group.size, group.rank, "MoE expert intermediate size"))

        def apply():
            set_param(self, "gate_up", self.gate_up, 1, rows + [inter + r for r in rows])
            set_param(self, "down", self.down, 2, rows)
        return apply

    def plans_as_moe(self) -> bool:
        return type(self) is SparseMoE and self.fits_one_call()

    def plan_ffn(self, entry: LayerPlan, hidden: int) -> Needs | None:
        """These experts as a layer's FFN in a decode step's one-call plan (engine.kernels.decode_plan)."""
        if not self.plans_as_moe():
            return None
        inter, k = self.down.shape[2], self.top_k
        entry.ffn, entry.experts, entry.top_k, entry.normalize, entry.inter = (
            MOE, self.num_experts, k, int(self.normalize_top_k), inter)
        entry.router_panels, entry.expert_panels = self.router.packed_weight.panels.data_ptr(), self.panel_pointers.data_ptr()
        # moe_layer's scratch: router logits, then per pick its weight, routed row, expert output, experts' work
        return Needs(floats=self.num_experts + k * (1 + 2 * hidden + 3 * inter), ints=3 * k, fixed_ints=self.num_experts)

    def _in_one_call(self, x: torch.Tensor) -> torch.Tensor:
        rows, hidden = x.shape
        picks, inter = rows * self.top_k, self.down.shape[2]
        out = torch.empty(rows, hidden)
        native.call("moe_layer", x=x, rows=rows, hidden=hidden, router_panels=self.router.packed_weight.panels,
                    experts=self.num_experts, top_k=self.top_k, normalize=int(self.normalize_top_k),
                    expert_panels=self.panel_pointers, inter=inter,
                    ids=torch.empty(3 * picks + self.num_experts, dtype=torch.long),
                    scratch=torch.empty(rows * self.num_experts + picks * (1 + 2 * hidden + 3 * inter)),
                    out=out)
        return out

    def pack_weights(self) -> int:
        """Packed expert weights on CPU (engine.models.packed_linear)."""
        self.packed = pack_per_expert(self.gate_up, self.down)
        self.panel_pointers = panel_pointers(self.packed) if self.packed else None
        return 2 * self.num_experts if self.packed else 0

    def _between(self, projected: torch.Tensor) -> torch.Tensor:
        gate, up = projected.chunk(2, dim=-1)
        return self.act(gate) * up

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packed[expert] if self.packed else (None, None)
        projected = linear(x, self.gate_up[expert], None, gate_up)
        gate, up = projected.chunk(2, dim=-1)
        if self.act is F.silu and uses_cpu_kernel(projected):
            return linear(cpu.silu_mul_cpu(gate, up), self.down[expert], None, down)
        return linear(self.act(gate) * up, self.down[expert], None, down)


class RotaryEmbedding(nn.Module):
    """RoPE with the scaling kinds HF configs carry: default, linear, dynamic, llama3, yarn.

    'dynamic' NTK only rescales beyond the original context, and the engine caps max_model_len
    at that context, so within what we serve it equals default RoPE (a per-batch rescale would
    make one request's output depend on its batch neighbours).
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, scaling: dict | None,
                 max_position: int):
        super().__init__()
        scaling = dict(scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        # Plain CPU tensors, not buffers: models are built on the meta device before loading.
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        inv_freq = 1.0 / (theta ** exponents)
        self.attention_scaling = 1.0
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(theta, rotary_dim, scaling, max_position)
        elif kind not in ("default", "dynamic"):
            raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, "
                             "dynamic, llama3, yarn)")
        self.rotary_dim = 2 * inv_freq.shape[0]  # as transformers: an odd rotary_dim rounds up
        self.inv_freq = inv_freq
        self._cpu_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> (cos, sin) of 0..n-1

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] -> rotated. On the CPU kernel
        path q and k are rotated in place (callers pass their fresh projections)."""
        cos, sin = self._tables(positions, q.dtype)
        if uses_cpu_kernel(cos) and cpu.rows_of_heads(q) and cpu.rows_of_heads(k):
            return cpu.rotary_cpu(q, cos, sin), cpu.rotary_cpu(k, cos, sin)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, rotary_dim] of these positions. On the CPU, rows of tables computed
        once for positions 0..n-1 (n doubling as positions grow): a position's values do not
        depend on the batch it is in, and a decode step pays two row selections instead of
        a dozen torch calls, each slow on the caches the step has flushed.
        Not on GPUs, where a CUDA graph capture must record the computation itself."""
        if positions.device.type != "cpu":
            return self._compute(positions, dtype)
        known = self._cpu_tables.get(dtype)
        if known is not None:
            try:
                return known[0].index_select(0, positions), known[1].index_select(0, positions)
            except IndexError:  # a position past the tables: grow them
                pass
        need = int(positions.max()) + 1 if positions.numel() else 1
        rows = max(256, need, 2 * (0 if known is None else known[0].shape[0]))
        cos, sin = self._cpu_tables[dtype] = self._compute(torch.arange(rows), dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate(x, cos, sin, rotary_dim):
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def _llama3_inv_freq(inv_freq, s):
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(theta, dim, s, max_position):
    original = s.get("original_max_position_embeddings") or max_position
    factor = s.get("factor") or max_position / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)
