"""shard_model: a fully loaded HybridLM -> this rank's tensor-parallel shard of it, in place.

Each rank loads the whole checkpoint, then keeps its shard (engine.tp.layers for the mixers
and FFNs, engine.tp.plan for which heads and channels). The residual stream, norms, routers and
everything else outside the sharded matmuls stay replicated: every collective gives every rank
the same bits, so the replicated parts agree without further communication.

The embedding is vocab-parallel (a masked lookup, all-reduced); the LM head keeps the same
vocab rows and all-gathers the logits (tied embeddings share the embedding's shard).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.models.families_falcon_h1 import FalconH1Layer
from engine.models.families_zamba2 import HybridLayer, SharedAttention, SharedBlock, _Plus
from engine.models.hybrid import DecoderLayer, FFNMixer, HybridLM, ModelSpec
from engine.tp.group import TPGroup
from engine.tp.layers import MIXERS, Apply, check_linear, plan_attention, plan_mamba2, plan_partial_ffn
from engine.tp.parallel import Reduced, RowParallelLinear, VocabParallelEmbedding, keep_rows, vocab_shard
from engine.tp.plan import attention_layout, even_split, model_shards, scaled


class TensorParallelLM:
    """Mixed into a sharded model's class: logits of the rank's vocab rows, all-gathered."""

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_gather(self.vocab_logits(h), -1)[..., : self.spec.vocab_size]


_TP_CLASSES: dict[type, type] = {}


def _tp_class(cls: type) -> type:
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelLM, cls),
                                {"__module__": __name__})
    return _TP_CLASSES[cls]


def shard_model(model: HybridLM, group: TPGroup) -> HybridLM:
    """Keep this rank's shard of `model` (in place; returns it). Everything is validated before
    anything changes: on ValueError (a layer kind not supported, sizes that do not divide) the
    model is untouched. Afterwards `model.spec` describes the rank's caches, `model.full_spec`
    the un-sharded ones (engine.tp.plan maps one onto the other), `model.tp_group` the group."""
    if not isinstance(model, HybridLM):
        raise TypeError(f"shard_model expects a HybridLM, got {type(model).__name__}")
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("model is already sharded")
    full_spec = model.spec
    if group.size == 1:
        model.full_spec, model.tp_group = full_spec, group
        return model
    applies, memo = [], {}
    for i, layer in enumerate(model.layers):
        try:
            applies.append(_plan_layer(layer, group, memo))
        except ValueError as e:
            raise ValueError(f"layer {i} ({getattr(layer, 'kind', type(layer).__name__)}): {e}") from None
    applies.append(_plan_vocab(model, group))
    planned = model_shards(full_spec, group.size)[group.rank]
    with torch.no_grad():
        for apply in applies:
            apply()
    model.spec = dataclasses.replace(full_spec, layers=tuple(layer.cache_spec() for layer in model.layers))
    _check_against_plan(model.spec, planned)
    model.full_spec, model.tp_group = full_spec, group
    model.__class__ = _tp_class(type(model))
    return model


def shard_module(module: nn.Module, group: TPGroup) -> nn.Module:
    """Shard one layer, mixer or FFN in place; returns the module to run in its place (an FFN
    comes back wrapped in the all-reduce of its partial sums)."""
    if type(module) in MIXERS:
        apply, out = MIXERS[type(module)](module, group), module
    elif type(module) in (DecoderLayer, FalconH1Layer, HybridLayer):
        apply, out = _plan_layer(module, group, {}), module
    else:
        apply, out = plan_partial_ffn(module, group), Reduced(module, group)
    with torch.no_grad():
        apply()
    return out


def _plan_layer(layer: nn.Module, group: TPGroup, memo: dict) -> Apply:
    size = group.size
    if type(layer) is DecoderLayer:
        mixer = layer.mixer
        if type(mixer) is FFNMixer:
            mixer_apply = _reduced(mixer, "ffn", group)
        elif type(mixer) in MIXERS:
            mixer_apply = MIXERS[type(mixer)](mixer, group)
        else:
            raise ValueError(f"tensor parallelism: layer kind {layer.kind!r} (mixer "
                             f"{type(mixer).__name__}) is not supported at TP size {size}")
        ffn_apply = _reduced(layer, "ffn", group) if layer.ffn is not None else (lambda: None)
        return _seq(mixer_apply, ffn_apply)
    if type(layer) is FalconH1Layer:
        return _seq(plan_mamba2(layer.mamba, group), plan_attention(layer.self_attn, group),
                    _reduced(layer, "feed_forward", group))
    if type(layer) is HybridLayer:
        return _plan_zamba2_hybrid(layer, group, memo)
    raise ValueError(f"tensor parallelism: layer kind {getattr(layer, 'kind', '?')!r} "
                     f"({type(layer).__name__}) is not supported at TP size {size}")


def _reduced(owner: nn.Module, name: str, group: TPGroup) -> Apply:
    """Shard owner.<name> (an FFN) into partial sums and wrap it in one all-reduce."""
    inner = plan_partial_ffn(getattr(owner, name), group)

    def apply():
        inner()
        setattr(owner, name, Reduced(getattr(owner, name), group))
    return apply


def _seq(*applies: Apply) -> Apply:
    def apply():
        for a in applies:
            a()
    return apply


def _plan_zamba2_hybrid(layer: HybridLayer, group: TPGroup, memo: dict) -> Apply:
    """Zamba2's hybrid layer: its shared block (sharded once, whichever layers use it), this
    use's attention view of it, and its own Mamba2 mixer."""
    block, attn = layer._block[0], layer.attention
    if type(block) is not SharedBlock or type(attn) is not SharedAttention:
        raise ValueError(f"tensor parallelism: zamba2 layer parts {type(block).__name__}/"
                         f"{type(attn).__name__} are not supported at TP size {group.size}")
    lay = attention_layout(attn.num_heads, attn.num_kv_heads, group.size, group.rank)
    if id(block) in memo:  # sharded by the layer that used it first
        block_apply = lambda: None  # noqa: E731
    else:
        block_apply = memo[id(block)] = _plan_shared_block(block, attn, group)
    mamba_apply = plan_mamba2(layer.mamba, group)

    def apply():
        block_apply()
        # q/k/v views hold the block's linears, sliced in place; o_proj is a new module.
        attn.o_proj = _Plus(block.o_proj, None)
        attn.num_heads = lay.q_heads[1] - lay.q_heads[0]
        attn.num_kv_heads = lay.kv_heads[1] - lay.kv_heads[0]
        mamba_apply()
    return apply


def _plan_shared_block(block: SharedBlock, attn: SharedAttention, group: TPGroup) -> Apply:
    lay = attention_layout(attn.num_heads, attn.num_kv_heads, group.size, group.rank)
    head_dim = attn.head_dim
    q_rows = list(range(*scaled(lay.q_heads, head_dim)))
    kv_rows = list(range(*scaled(lay.kv_heads, head_dim)))
    inter = block.down_proj.in_features
    ffn_rows = list(range(*even_split(inter, group.size, group.rank, "shared block MLP intermediate size")))
    gate_up_rows = ffn_rows + [inter + r for r in ffn_rows]  # gate_up stacks [gate; up]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"):
        check_linear(getattr(block, name), f"shared block {name}")
    # LoRA adapters add to a projection's output: their second linear keeps the same rows.
    adapters = {"q_adapters": q_rows, "k_adapters": kv_rows, "v_adapters": kv_rows,
                "gate_up_adapters": gate_up_rows}
    for name in adapters:
        for lora in getattr(block, name, {}).values():
            check_linear(lora[1], f"shared block {name}")

    def apply():
        keep_rows(block.q_proj, q_rows)
        keep_rows(block.k_proj, kv_rows)
        keep_rows(block.v_proj, kv_rows)
        for name, rows in adapters.items():
            for lora in getattr(block, name, {}).values():
                keep_rows(lora[1], rows)
        block.o_proj = RowParallelLinear.of(block.o_proj, range(*scaled(lay.q_heads, head_dim)), group,
                                            True, "shared block o_proj")
        keep_rows(block.gate_up_proj, gate_up_rows)
        block.down_proj = RowParallelLinear.of(block.down_proj, ffn_rows, group, True, "shared block down_proj")
    return apply


def _plan_vocab(model: HybridLM, group: TPGroup) -> Apply:
    if type(model.embed) is not nn.Embedding:
        raise ValueError(f"tensor parallelism: embedding is a {type(model.embed).__name__}, not nn.Embedding")
    if not model.tie_embeddings:
        check_linear(model.lm_head, "LM head")
        if model.lm_head.bias is not None:
            raise ValueError("tensor parallelism: an LM head with a bias is not supported")

    def apply():
        model.embed = VocabParallelEmbedding(model.embed.weight, group)
        if not model.tie_embeddings:
            model.lm_head.weight = vocab_shard(model.lm_head.weight, group)[0]
            model.lm_head.out_features = model.lm_head.weight.shape[0]
    return apply


def _check_against_plan(spec: ModelSpec, planned) -> None:
    """The sharded layers must declare exactly the caches the shard map says this rank holds."""
    for i, (layer, shard) in enumerate(zip(spec.layers, planned)):
        kv = None if layer.kv is None else (layer.kv.num_kv_heads, layer.kv.head_dim)
        want_kv = None if shard.kv is None else shard.kv.shape
        state = [tuple(t.shape) for t in layer.state]
        want_state = [t.shape for t in shard.state]
        if kv != want_kv or state != want_state:
            raise RuntimeError(f"layer {i}: sharded caches {kv} {state} differ from the shard map "
                               f"{want_kv} {want_state}")
