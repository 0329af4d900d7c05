"""Tensor parallelism: Megatron-style sharding of every layer kind of the model zoo.

engine.tp.group: the TPGroup interface and its single-rank, torch.distributed and in-thread
implementations. engine.tp.plan (no torch): which heads and channels each rank owns, and the
routes of a cache hand-off between two TP sizes. engine.tp.parallel: the sharded building
blocks and the plan protocol each layer kind implements in its own module. engine.tp.shard:
shard_model, which turns a loaded HybridLM into one rank's shard (imported from there: it
imports the models, which import this package's building blocks).
"""

from engine.tp.group import DistGroup, SingleRank, ThreadGroup, TPGroup, run_in_threads
from engine.tp.plan import LayerShard, Piece, TensorShard, layer_routes, layer_shards, model_shards, routes

__all__ = ["DistGroup", "LayerShard", "Piece", "SingleRank", "TPGroup", "TensorShard", "ThreadGroup",
           "layer_routes", "layer_shards", "model_shards", "routes", "run_in_threads"]
