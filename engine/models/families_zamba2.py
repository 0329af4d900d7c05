"""The zamba2 family: config.json -> HybridLM, and our parameter names -> HF tensor names.

Zamba2 is a Mamba2 stack; at its "hybrid" layers a shared transformer block first reads
concat(h, the original embeddings) and its output, through that layer's own linear, is added to
the Mamba2 block's input (not to its residual). Hybrid use j (j-th hybrid layer) runs shared
block j % num_mem_blocks with its own LoRA-style adapters (index j) and its own KV cache.

As transformers computes it, the blocks are only shared when tie_word_embeddings is set (the
same switch ties lm_head); untied, every hybrid layer keeps an independent block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.decode_plan import NO_FFN, ZAMBA2_HYBRID, LayerPlan, Needs, all_cpu, norm_fits, pointer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, RowParallelLinear, check_linear, keep_rows
from engine.tp.plan import attention_layout, even_split, scaled
from engine.models.attention import PagedAttention
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.checkpoint import CheckpointError, ConfigReader
from engine.models.families import _eos_ids, rotary_of
from engine.models.families_mamba2 import mamba2_names
from engine.models.hybrid import DecoderLayer, HybridLM, LayerCacheSpec, ModelSpec
from engine.models.layers import GatedRMSNorm, RMSNorm, activation
from engine.models.mamba2 import Mamba2Mixer
from engine.models.packed_linear import adapter_gelu_mlp, pack_fused, runs_packed

MAMBA, HYBRID = ("mamba", "linear_attention"), "hybrid"


def _lora(d_in: int, rank: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))


class SharedBlock(nn.Module):
    """One shared transformer block, with the adapters of every hybrid use it may serve
    (keyed by use index, as transformers builds and saves them)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
                 act: str, bias: bool, eps: float, uses: list[int], rank: int, attn_adapters: bool):
        super().__init__()
        wide = 2 * hidden  # the block reads concat(h, embeddings)
        self.input_norm = RMSNorm(wide, eps)
        self.q_proj = nn.Linear(wide, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(wide, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(wide, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.pre_ff_norm = RMSNorm(hidden, eps)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)
        self.gate_up_adapters = nn.ModuleDict({str(j): _lora(hidden, rank, 2 * inter) for j in uses})
        for name in ("q_adapters", "k_adapters", "v_adapters") if attn_adapters else ():
            setattr(self, name, nn.ModuleDict({str(j): _lora(wide, rank, wide) for j in uses}))

    def adapter(self, name: str, use: int) -> nn.Module | None:
        table = getattr(self, name, None)
        return None if table is None else table[str(use)]

    def mlp(self, x: torch.Tensor, use: int) -> torch.Tensor:
        adapter = self.gate_up_adapters[str(use)]
        if self._mlp_in_one_call(x, adapter):
            return adapter_gelu_mlp(x, self.gate_up_proj, adapter[0], adapter[1], self.down_proj)
        gate, up = (self.gate_up_proj(x) + adapter(x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def tp_plan(self, heads: int, kv_heads: int, head_dim: int, group: TPGroup) -> Apply:
        """Attention heads split as in any attention, the MLP's intermediate channels split; a
        LoRA adapter adds to a projection's output, so its second linear keeps the same rows."""
        lay = attention_layout(heads, kv_heads, group.size, group.rank)
        q_rows = list(range(*scaled(lay.q_heads, head_dim)))
        kv_rows = list(range(*scaled(lay.kv_heads, head_dim)))
        inter = self.down_proj.in_features
        ffn_rows = list(range(*even_split(inter, group.size, group.rank, "shared block MLP intermediate size")))
        gate_up_rows = ffn_rows + [inter + r for r in ffn_rows]  # gate_up stacks [gate; up]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"):
            check_linear(getattr(self, name), f"shared block {name}")
        adapters = {"q_adapters": q_rows, "k_adapters": kv_rows, "v_adapters": kv_rows,
                    "gate_up_adapters": gate_up_rows}
        for name in adapters:
            for lora in getattr(self, name, {}).values():
                check_linear(lora[1], f"shared block {name}")

        def apply():
            keep_rows(self.q_proj, q_rows)
            keep_rows(self.k_proj, kv_rows)
            keep_rows(self.v_proj, kv_rows)
            for name, rows in adapters.items():
                for lora in getattr(self, name, {}).values():
                    keep_rows(lora[1], rows)
            self.o_proj = RowParallelLinear.of(self.o_proj, range(*scaled(lay.q_heads, head_dim)), group,
                                               True, "shared block o_proj")
            keep_rows(self.gate_up_proj, gate_up_rows)
            self.down_proj = RowParallelLinear.of(self.down_proj, ffn_rows, group, True, "shared block down_proj")
        return apply

    def mlp_fits_one_call(self, adapter: nn.Sequential) -> bool:
        """The exact GELU and every linear packed (with the use's adapter)."""
        return self.act is F.gelu and all(getattr(m, "packed_weight", None) is not None
                                          for m in (self.gate_up_proj, adapter[0], adapter[1], self.down_proj))

    def _mlp_in_one_call(self, x: torch.Tensor, adapter: nn.Sequential) -> bool:
        """mlp_fits_one_call, and x a contiguous float32 matrix the kernels take."""
        return (self.mlp_fits_one_call(adapter) and x.dim() == 2 and x.is_contiguous()
                and runs_packed(x, self.gate_up_proj.packed_weight))


class _Plus(nn.Module):
    """A shared linear plus one use's adapter. Both are held by reference, not registered: each
    parameter lives once in the module tree, under its SharedBlock."""

    def __init__(self, base: nn.Linear, adapter: nn.Module | None):
        super().__init__()
        self._parts = (base, adapter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, adapter = self._parts
        return base(x) if adapter is None else base(x) + adapter(x)

    # Without an adapter this is the base linear, and a one-call decode may read its packed weight.
    @property
    def packed_weight(self):
        base, adapter = self._parts
        return getattr(base, "packed_weight", None) if adapter is None else None

    @property
    def bias(self) -> torch.Tensor | None:
        return self._parts[0].bias


class SharedAttention(PagedAttention):
    """Paged attention of one hybrid use: the block's projections plus this use's adapters."""

    def __init__(self, block: SharedBlock, use: int, heads: int, kv_heads: int, head_dim: int,
                 rotary):
        # transformers scales scores by (head_dim / 2) ** -0.5: head_dim counts both halves of
        # the concatenated input.
        super().__init__(2 * block.o_proj.out_features, heads, kv_heads, head_dim, False, False,
                         rotary, scale=(head_dim / 2) ** -0.5)
        for name in ("q", "k", "v"):  # replace PagedAttention's own projections
            setattr(self, f"{name}_proj", _Plus(getattr(block, f"{name}_proj"),
                                                block.adapter(f"{name}_adapters", use)))
        self.o_proj = _Plus(block.o_proj, None)
        self._shared = (block,)  # by reference, as in _Plus

    def pack_weights(self) -> int:
        """Without q/k/v adapters, the block's q, k and v as one packed GEMM, packed once for all
        the block's uses: decode then takes PagedAttention's one call."""
        block = self._shared[0]
        if any(getattr(self, f"{name}_proj")._parts[1] is not None for name in ("q", "k", "v")):
            return 0
        packed_here = "qkv_fused" not in vars(block)
        if packed_here:
            block.qkv_fused = pack_fused(block.q_proj, block.k_proj, block.v_proj)
        self.qkv_fused = block.qkv_fused
        return int(packed_here and self.qkv_fused is not None)


class HybridLayer(nn.Module):
    """h + mamba2(norm(h + linear(shared_block(h, embeddings)))); the block's KV and the Mamba2
    state are both this layer's own."""

    def __init__(self, block: SharedBlock, use: int, attention: SharedAttention, hidden: int,
                 eps: float, mixer: Mamba2Mixer):
        super().__init__()
        self._block = (block,)  # by reference: registered once, in Zamba2LM.shared
        self.use = use
        self.attention = attention
        self.linear = nn.Linear(hidden, hidden, bias=False)
        self.mamba_norm = RMSNorm(hidden, eps)
        self.mamba = mixer

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec("attention+mamba2", kv=self.attention.kv_spec(),
                              state_kind=self.mamba.state_kind, state=tuple(self.mamba.state_spec()))

    def tp_layer_plan(self, group: TPGroup, memo: dict) -> Apply | None:
        """Its shared block (sharded once, by the first layer that uses it: `memo`), this use's
        attention view of it, and its own Mamba2 mixer."""
        block, attn = self._block[0], self.attention
        if type(self) is not HybridLayer or type(block) is not SharedBlock or type(attn) is not SharedAttention:
            return None
        lay = attention_layout(attn.num_heads, attn.num_kv_heads, group.size, group.rank)
        if id(block) in memo:  # sharded by the layer that used it first
            block_apply = lambda: None  # noqa: E731
        else:
            block_apply = memo[id(block)] = block.tp_plan(attn.num_heads, attn.num_kv_heads, attn.head_dim, group)
        mamba_apply = self.mamba.tp_plan(group)
        if mamba_apply is None:
            return None

        def apply():
            block_apply()
            # q/k/v views hold the block's linears, sliced in place; o_proj is a new module.
            attn.o_proj = _Plus(block.o_proj, None)
            attn.num_heads = lay.q_heads[1] - lay.q_heads[0]
            attn.num_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
            mamba_apply()
        return apply

    def plan_decode(self, caches: LayerCaches, index: int):
        """This layer in a decode step's one-call plan (engine.kernels.decode_plan), where its
        shared attention (no q/k/v adapters), its shared MLP (the exact GELU), its linear and
        its Mamba2 mixer each run as one call; None otherwise."""
        block, attention, mixer = self._block[0], self.attention, self.mamba
        adapter, state, kv = block.gate_up_adapters[str(self.use)], caches.state[index], caches.kv[index]
        norms = (block.input_norm, block.pre_ff_norm, self.mamba_norm)
        if not (attention.fits_one_call() and mixer.fits_one_call() and block.mlp_fits_one_call(adapter)
                and getattr(self.linear, "packed_weight", None) is not None and all_cpu(kv) and all_cpu(state)
                and all(norm_fits(norm) for norm in norms)):
            return None
        entry, keep, rotary = LayerPlan(), [], []
        mamba_needs = mixer.fill_decode_plan(entry, state, keep)
        attention_needs = attention.fill_decode_plan(entry, kv, rotary)
        entry.mixer, entry.ffn = ZAMBA2_HYBRID, NO_FFN
        (entry.block_norm, entry.block_eps), (entry.pre_ff_norm, entry.pre_ff_eps), \
            (entry.mamba_norm, entry.mamba_norm_eps) = ((norm.weight.data_ptr(), norm.eps) for norm in norms)
        inter, rank = block.down_proj.in_features, adapter[0].out_features
        entry.mlp_inter, entry.lora_rank = inter, rank
        entry.up_panels = block.gate_up_proj.packed_weight.panels.data_ptr()
        entry.up_bias = pointer(block.gate_up_proj.bias)
        entry.lora_down_panels = adapter[0].packed_weight.panels.data_ptr()
        entry.lora_up_panels = adapter[1].packed_weight.panels.data_ptr()
        entry.down_panels = block.down_proj.packed_weight.panels.data_ptr()
        entry.down_bias = pointer(block.down_proj.bias)
        entry.linear_panels = self.linear.packed_weight.panels.data_ptr()
        # cpu_decode.cpp zamba2_hybrid: [h | embeddings] and its norm, three rows of hidden, then the parts' own
        own = max(attention_needs.floats, 5 * inter + rank, mamba_needs.floats)
        return entry, keep, rotary, Needs(floats=7 * self.linear.in_features + own)

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, batch: ForwardBatch,
                caches: LayerCaches, index: int) -> torch.Tensor:
        block = self._block[0]
        x = block.input_norm(torch.cat([h, embeddings], dim=-1))
        x = block.pre_ff_norm(self.attention(x, batch, caches.kv[index]))
        shared = self.linear(block.mlp(x, self.use))
        return h + self.mamba(self.mamba_norm(h + shared), batch, caches.state[index])


class Zamba2LM(HybridLM):
    def __init__(self, spec: ModelSpec, layers: list[nn.Module], final_norm: nn.Module,
                 tie_embeddings: bool, shared: dict[str, SharedBlock]):
        super().__init__(spec, layers, final_norm, tie_embeddings)
        # Keyed by the checkpoint layers that hold (a copy of) the block, e.g. "1_4": the names
        # map (zamba2_names) sees only our parameter names, and this is what it needs.
        self.shared = nn.ModuleDict(shared)

    def forward(self, batch: ForwardBatch, caches: LayerCaches, plan=None) -> torch.Tensor:
        h = embeddings = self.embed_tokens(batch)

        def run_layer(index: int, x: torch.Tensor) -> torch.Tensor:
            layer = self.layers[index]
            if isinstance(layer, HybridLayer):
                return self.run_layer(index, x, batch, caches, lambda c: layer(x, embeddings, batch, c, index))
            return self.run_layer(index, x, batch, caches)

        if plan is not None:  # runs of layers as one call each (engine.decode_stack)
            h = plan.run(h, batch, run_layer, embeddings)
        else:
            for index in range(len(self.layers)):
                h = run_layer(index, h)
        return self.finish(h, batch)


def _mixer(cfg: ConfigReader, hidden: int) -> Mamba2Mixer:
    heads = cfg.positive_int("n_mamba_heads", 8)
    d_inner = cfg.positive_int("mamba_expand", 2) * hidden
    if d_inner % heads:
        raise cfg.unsupported("n_mamba_heads", f"does not divide mamba_expand * hidden_size = {d_inner}")
    groups = cfg.positive_int("mamba_ngroups", 1)
    if heads % groups:
        raise cfg.unsupported("mamba_ngroups", f"does not divide n_mamba_heads={heads}")
    # transformers' Zamba2 mixer: conv bias always on, SiLU always, dt clamped only from below,
    # gated-norm eps fixed at 1e-5 (not rms_norm_eps); use_conv_bias and hidden_act do not apply.
    return Mamba2Mixer(hidden, heads, d_inner // heads, groups, cfg.positive_int("mamba_d_state", 64),
                       cfg.positive_int("mamba_d_conv", 4), cfg.positive_int("chunk_size", 256), True,
                       cfg.get("add_bias_linear", bool, False), "silu",
                       (cfg.get("time_step_min", float, 0.001), math.inf),
                       GatedRMSNorm(d_inner, d_inner // groups, 1e-5))


def _layer_types(cfg: ConfigReader) -> list[str]:
    types = cfg.get("layers_block_type", list, None) or cfg.get("layer_types", list, None)
    if types is None:
        raise cfg.unsupported("layers_block_type", "missing (transformers' 54-layer default is not assumed)")
    if len(types) != cfg.positive_int("num_hidden_layers") or any(t not in (*MAMBA, HYBRID) for t in types):
        raise cfg.unsupported("layers_block_type", f"expected num_hidden_layers="
                              f"{cfg.config.get('num_hidden_layers')} entries from {[*MAMBA, HYBRID]}")
    return types


def _rotary(cfg: ConfigReader, head_dim: int, max_position: int):
    if not cfg.get("use_mem_rope", bool, False):
        return None
    if cfg.get("use_long_context", bool, False):  # older transformers rescaled rope_theta for it
        raise cfg.unsupported("use_long_context", "its RoPE differs across transformers versions")
    rope = cfg.get("rope_parameters", dict, None) or {}
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", float, 1.0))) != 1.0:
        raise cfg.unsupported("partial_rotary_factor", "Zamba2 rotates the whole head")
    return rotary_of(cfg, head_dim, max_position)


def build_zamba2(cfg: ConfigReader) -> Zamba2LM:
    hidden = cfg.positive_int("hidden_size")
    eps = cfg.get("rms_norm_eps", float, 1e-5)
    types = _layer_types(cfg)
    hybrid_ids = [i for i, t in enumerate(types) if t == HYBRID]
    heads = cfg.positive_int("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", int, None) or heads
    # transformers derives 2 * hidden_size // num_attention_heads unless the config sets it
    # (saved as attention_head_dim; head_dim is its alias)
    head_dim = (cfg.get("attention_head_dim", int, None) or cfg.get("head_dim", int, None)
                or 2 * hidden // heads)
    if heads % kv_heads:
        raise cfg.unsupported("num_key_value_heads", f"does not divide num_attention_heads={heads}")
    attn_adapters = cfg.get("use_shared_attention_adapter", bool, False)
    if attn_adapters and not (kv_heads == heads and heads * head_dim == 2 * hidden):
        raise cfg.unsupported("use_shared_attention_adapter", "adapters project to 2 * hidden_size, so "
                              "they need num_key_value_heads = num_attention_heads, dividing it")
    if not cfg.get("use_shared_mlp_adapter", bool, True):
        raise cfg.unsupported("use_shared_mlp_adapter", "transformers always applies the MLP adapters")
    act = cfg.get("hidden_act", str, "gelu")
    try:
        activation(act)
    except ValueError as e:
        raise cfg.unsupported("hidden_act", str(e)) from None
    long_context = cfg.get("use_long_context", bool, False)
    max_position = 16384 if long_context else cfg.positive_int("max_position_embeddings", 4096)
    rotary = _rotary(cfg, head_dim, max_position)
    tied = cfg.get("tie_word_embeddings", bool, True)
    mem_blocks = cfg.positive_int("num_mem_blocks", 1)
    # Use j runs block j % num_mem_blocks (tied) or its own block (untied); either way the block
    # carries adapters for every use k = j mod num_mem_blocks, as the checkpoint does.
    block_of = [j % mem_blocks if tied else j for j in range(len(hybrid_ids))]
    shared: dict[str, SharedBlock] = {}
    layers = []
    for i, kind in enumerate(types):
        if kind != HYBRID:
            layers.append(DecoderLayer("mamba2", RMSNorm(hidden, eps), _mixer(cfg, hidden)))
            continue
        j = hybrid_ids.index(i)
        holders = "_".join(str(hybrid_ids[k]) for k, b in enumerate(block_of) if b == block_of[j])
        if holders not in shared:
            uses = [k for k in range(len(hybrid_ids)) if k % mem_blocks == j % mem_blocks]
            shared[holders] = SharedBlock(
                hidden, heads, kv_heads, head_dim, cfg.positive_int("intermediate_size", 4 * hidden), act,
                cfg.get("add_bias_linear", bool, False), eps, uses, cfg.positive_int("adapter_rank", 128),
                attn_adapters)
        block = shared[holders]
        attention = SharedAttention(block, j, heads, kv_heads, head_dim, rotary)
        layers.append(HybridLayer(block, j, attention, hidden, eps, _mixer(cfg, hidden)))
    spec = ModelSpec("zamba2", cfg.positive_int("vocab_size"), hidden, max_position, _eos_ids(cfg),
                     cfg.get("bos_token_id", int, None))
    return Zamba2LM(spec, layers, RMSNorm(hidden, eps), tied, shared)


_BLOCK_PARTS = {"input_norm": "input_layernorm", "pre_ff_norm": "pre_ff_layernorm",
                "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
                "q_adapters": "self_attn.linear_q_adapter_list",
                "k_adapters": "self_attn.linear_k_adapter_list",
                "v_adapters": "self_attn.linear_v_adapter_list",
                "gate_up_proj": "feed_forward.gate_up_proj", "down_proj": "feed_forward.down_proj",
                "gate_up_adapters": "feed_forward.gate_up_proj_adapter_list"}


def zamba2_names(name: str):
    top = {"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
           "final_norm.weight": "model.final_layernorm.weight"}
    if name in top:
        return top[name]
    if name.startswith("shared."):
        _, holders, part, rest = name.split(".", 3)
        return _one_copy([f"model.layers.{i}.shared_transformer.{_BLOCK_PARTS[part]}.{rest}"
                          for i in holders.split("_")])
    _, i, part, rest = name.split(".", 3)
    p = f"model.layers.{i}"
    if part == "input_norm":  # a Mamba2-only layer
        return f"{p}.input_layernorm.{rest}"
    if part == "mixer":
        return mamba2_names(f"{p}.mamba", rest)
    if part == "mamba_norm":  # a hybrid layer
        return f"{p}.mamba_decoder.input_layernorm.{rest}"
    if part == "mamba":
        return mamba2_names(f"{p}.mamba_decoder.mamba", rest)
    return f"{p}.{part}.{rest}"  # the hybrid layer's linear


def _one_copy(names: list[str]):
    """A shared block's tensor: checkpoints may hold a copy under every layer using the block
    (transformers saves the first); all copies present are read and must agree."""
    if len(names) == 1:
        return names[0]

    def read(weights) -> torch.Tensor:
        present = [n for n in names if n in weights] or names[:1]
        first = weights.get(present[0])
        for other in present[1:]:
            if not torch.equal(weights.get(other), first):
                raise CheckpointError(f"{weights.model_dir}: {other} differs from {present[0]}, "
                                      "but num_mem_blocks and tie_word_embeddings share them")
        return first
    return read


FAMILIES = {"zamba2": (build_zamba2, zamba2_names)}
