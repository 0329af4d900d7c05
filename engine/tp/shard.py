"""shard_model: a fully loaded HybridLM -> this rank's tensor-parallel shard of it, in place.

Each rank loads the whole checkpoint, then keeps its shard: each layer kind shards itself
(its `tp_layer_plan`, `tp_plan` or `tp_partial_plan`, in its own module; the protocol is
engine.tp.parallel's), engine.tp.plan says which heads and channels. The residual stream, norms, routers and
everything else outside the sharded matmuls stay replicated: every collective gives every rank
the same bits, so the replicated parts agree without further communication.

The embedding is vocab-parallel (a masked lookup, all-reduced); the LM head keeps the same
vocab rows and all-gathers the logits (tied embeddings share the embedding's shard).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.models.hybrid import HybridLM, ModelSpec
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, Reduced, VocabParallelEmbedding, check_linear, partial_ffn_plan, vocab_shard
from engine.tp.plan import model_shards


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
    if hasattr(module, "tp_layer_plan"):
        apply, out = _plan_layer(module, group, {}), module
    elif hasattr(module, "tp_plan") and (apply := module.tp_plan(group)) is not None:
        out = module
    else:
        apply, out = partial_ffn_plan(module, group), Reduced(module, group)
    with torch.no_grad():
        apply()
    return out


def _plan_layer(layer: nn.Module, group: TPGroup, memo: dict) -> Apply:
    plan = getattr(layer, "tp_layer_plan", None)
    apply = plan(group, memo) if plan is not None else None
    if apply is None:
        raise ValueError(f"tensor parallelism: layer kind {getattr(layer, 'kind', '?')!r} "
                         f"({type(layer).__name__}) is not supported at TP size {group.size}")
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
