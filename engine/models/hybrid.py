"""One decoder stack for every family: per layer a mixer and an optional FFN.

Jamba interleaves attention and Mamba mixers; Llama-family models are all attention; Mamba is
all Mamba with no FFN; Nemotron-H has FFN-only layers. The families differ only in how
config.json and tensor names map onto this.

What a layer keeps per sequence is declared by its mixer, never known here: an attention
mixer declares its KV shape (`kv_spec()`), a recurrent mixer its state kind and tensors
(`state_kind`, `state_spec()`). The cache, the slot pool and the hand-off move what the
layers declare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.kernels.decode_plan import plan_layer
from engine.tp.group import TPGroup
from engine.tp.parallel import Apply, all_of, reduced_ffn_plan
from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.packed_linear import linear, pack, pack_linears


@dataclass(frozen=True)
class StateTensorSpec:
    """One tensor a recurrent layer keeps per sequence: name, per-sequence shape, the dtype
    the layer computes it in, and the dtype the cache stores it in where that is narrower
    (engine.state_format: mamba_state_dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # state accumulates over the whole sequence: float32 by default
    stored_dtype: str | None = None  # None: stored as computed

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.name.isidentifier() or any(d <= 0 for d in self.shape):
            raise ValueError(f"bad state tensor spec {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.stored_dtype or self.dtype)


@dataclass(frozen=True)
class KVSpec:
    """What an attention layer keeps per token in its paged blocks: one [num_kv_heads, head_dim]
    row in each of the tensors `names`. Multi-head attention keeps K and V; a latent attention
    (engine.models.mla) one compressed row per token that serves as both. `kind` names the rows'
    semantics: the hand-off's layout handshake compares it, so two layouts that merely happen
    to have equal shapes never exchange blocks."""

    num_kv_heads: int
    head_dim: int
    names: tuple[str, ...] = ("k", "v")
    kind: str = "attention"
    # Where the cache stores the rows in another dtype than the model's (engine.kv_format:
    # kv_cache_dtype), that dtype's name and the scale of each of `names`; None: as computed.
    stored_dtype: str | None = None
    scales: tuple = ()  # per name: one float, or a tuple of one per KV head

    def __post_init__(self):
        if (self.num_kv_heads <= 0 or self.head_dim <= 0 or not self.names
                or len(set(self.names)) != len(self.names) or not all(n.isidentifier() for n in self.names)):
            raise ValueError(f"bad KV spec {self}")


@dataclass(frozen=True)
class LayerCacheSpec:
    """What one model layer keeps per sequence: KV rows, recurrent state, both, or nothing."""

    kind: str  # what the layer is, e.g. "attention", "mamba2", "attention+mamba2", "mlp"
    kv: KVSpec | None = None
    state_kind: str | None = None  # "mamba", "mamba2", ...: names the state's semantics
    state: tuple[StateTensorSpec, ...] = ()

    def __post_init__(self):
        if bool(self.state) != (self.state_kind is not None):
            raise ValueError(f"layer {self.kind!r}: state tensors and state_kind go together")


@dataclass
class ModelSpec:
    """What the engine needs to know about a model to size, place and move its caches."""

    model_type: str
    vocab_size: int
    hidden_size: int
    max_position: int | None = None  # None: no positional limit (pure recurrent stacks)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    layers: tuple[LayerCacheSpec, ...] = ()  # filled by HybridLM from its layers' mixers

    @property
    def layer_kinds(self) -> list[str]:
        return [layer.kind for layer in self.layers]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kv is not None]

    @property
    def state_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.state]

    def with_layer(self, layer: LayerCacheSpec | None) -> ModelSpec:
        """This spec with one more cache layer after the model's own (an MTP head's); itself
        where `layer` is None."""
        return self if layer is None else dataclasses.replace(self, layers=self.layers + (layer,))


class FFNMixer(nn.Module):
    """An FFN in a mixer's place (Nemotron-H's MLP and MoE layers): no cache, no state."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        self.ffn = ffn

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        return self.ffn(x)

    def plan_decode(self, entry, state, kv, keep: list, rotary: list):
        """The FFN's own plan as a mixer (engine.kernels.decode_plan), where it has one."""
        plan = getattr(self.ffn, "plan_as_mixer", None)
        return None if plan is None else plan(entry)


def mixer_cache_spec(kind: str, mixer: nn.Module) -> LayerCacheSpec:
    kv = mixer.kv_spec() if hasattr(mixer, "kv_spec") else None
    if hasattr(mixer, "state_spec"):
        return LayerCacheSpec(kind, kv, mixer.state_kind, tuple(mixer.state_spec()))
    return LayerCacheSpec(kind, kv)


class DecoderLayer(nn.Module):
    """h + mixer(norm(h)), then h + ffn(norm(h)) when the layer has an FFN.

    `residual_scale` is Granite's residual_multiplier; `residual_fp32` keeps the residual
    stream in float32 (Mamba, Mamba2).
    """

    def __init__(self, kind: str, input_norm: nn.Module, mixer: nn.Module,
                 ffn_norm: nn.Module | None = None, ffn: nn.Module | None = None,
                 residual_fp32: bool = False, residual_scale: float = 1.0):
        super().__init__()
        self.kind = kind
        self.input_norm = input_norm
        self.mixer = mixer
        self.ffn_norm = ffn_norm
        self.ffn = ffn
        self.residual_fp32 = residual_fp32
        self.residual_scale = residual_scale
        self.uses_kv = hasattr(mixer, "kv_spec")

    def cache_spec(self) -> LayerCacheSpec:
        return mixer_cache_spec(self.kind, self.mixer)

    def tp_layer_plan(self, group: TPGroup, memo: dict) -> Apply | None:
        """The mixer as its kind shards (an FFN in a mixer's place: partial sums, all-reduced),
        then the FFN, all-reduced once; None where the mixer's kind does not shard."""
        if type(self) is not DecoderLayer:
            return None
        if isinstance(self.mixer, FFNMixer):
            mixer = reduced_ffn_plan(self.mixer, "ffn", group)
        else:
            plan = getattr(self.mixer, "tp_plan", None)
            mixer = plan(group) if plan is not None else None
            if mixer is None:
                raise ValueError(f"tensor parallelism: layer kind {self.kind!r} (mixer "
                                 f"{type(self.mixer).__name__}) is not supported at TP size {group.size}")
        ffn = reduced_ffn_plan(self, "ffn", group) if self.ffn is not None else (lambda: None)
        return all_of([mixer, ffn])

    def plan_decode(self, caches: LayerCaches, index: int):
        """This layer's entry in a decode step's one-call plan, composed from what its norms,
        mixer and FFN offer (engine.kernels.decode_plan.plan_layer), or None."""
        if type(self).forward is not DecoderLayer.forward:
            return None
        return plan_layer((self.input_norm, self.mixer, None, self.ffn_norm, self.ffn, self.residual_scale),
                          caches, index)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, index: int):
        cache = caches.kv[index] if self.uses_kv else caches.state[index]
        residual = h.float() if self.residual_fp32 else h
        mixed = self.mixer(self.input_norm(h.to(self.input_norm.weight.dtype)), batch, cache)
        if self.residual_scale != 1.0:
            mixed = mixed * self.residual_scale
        if self.ffn is None:
            return residual + mixed
        if hasattr(self.ffn_norm, "add_and_norm"):  # the add and the norm in one pass (a CPU kernel)
            h, normed = self.ffn_norm.add_and_norm(mixed, residual)
        else:
            h = residual + mixed
            normed = self.ffn_norm(h)
        out = self.ffn(normed)
        return h + (out if self.residual_scale == 1.0 else out * self.residual_scale)


class HybridLM(nn.Module):
    """Embedding, the layers, final norm, LM head. `embedding_scale` and `logits_divisor`
    (Granite's embedding_multiplier and logits_scaling) default to 1."""

    def __init__(self, spec: ModelSpec, layers: list[nn.Module], final_norm: nn.Module,
                 tie_embeddings: bool, embedding_scale: float = 1.0, logits_divisor: float = 1.0):
        super().__init__()
        self.spec = dataclasses.replace(spec, layers=tuple(layer.cache_spec() for layer in layers))
        # Built on the meta device and then loaded: given a weight, Embedding skips its normal_
        # init, whose meta kernel imports torch._dynamo (over 1 s of every worker's start).
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                  _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.tie_embeddings = tie_embeddings
        self.embedding_scale = embedding_scale
        self.logits_divisor = logits_divisor
        if not tie_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.packed_lm_head = None
        self._in_place_readers: list[frozenset[str]] | None = None

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed(batch.input_ids)
        return h if self.embedding_scale == 1.0 else h * self.embedding_scale

    def forward(self, batch: ForwardBatch, caches: LayerCaches, plan=None) -> torch.Tensor:
        """Logits (float32) of each sequence's last scheduled token: [num_seqs, vocab]. `plan`:
        the model runner's one-call decode stack for this step (engine.decode_stack), or None
        for the layer path."""
        h = self.embed_tokens(batch)
        if plan is not None:
            h = plan.run(h, batch, lambda index, x: self.run_layer(index, x, batch, caches))
        else:
            h = self.run_layers(h, batch, caches)
        return self.finish(h, batch)

    def finish(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The last layer's output -> each sequence's logits; the prompt rows' logprobs too
        where the batch asks (engine.prompt_logprobs)."""
        if batch.prompt_logprobs is not None:
            from engine import prompt_logprobs

            batch.prompt_logprobs_result = prompt_logprobs.compute(self.head, h, batch.prompt_logprobs)
        # All decodes on the CPU (decode_tokens a slice): each row is its sequence's last token.
        last = h if isinstance(batch.decode_tokens, slice) else h.index_select(0, batch.logits_indices)
        if batch.keep_hidden:
            batch.hidden = self.final_norm(h)
        return self.head(last)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Rows of the last layer's output -> their float32 logits."""
        logits = self.lm_logits(self.final_norm(h))
        return logits if self.logits_divisor == 1.0 else logits / self.logits_divisor

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """The layer-by-layer path: hidden states after the last layer. A layer whose state is
        stored narrow runs on float32 copies of its slots (engine.state_format)."""
        if caches.narrow is None:
            for index, layer in enumerate(self.layers):
                h = layer(h, batch, caches, index)
            return h
        for index in range(len(self.layers)):
            h = self.run_layer(index, h, batch, caches)
        return h

    def run_layer(self, index: int, h: torch.Tensor, batch: ForwardBatch, caches: LayerCaches,
                  call=None) -> torch.Tensor:
        """Layer `index` on the layer path; `call(caches)` runs it where a family calls its layers
        its own way (Zamba2's hybrid layers take the embeddings too)."""
        if call is None:
            call = lambda layer_caches: self.layers[index](h, batch, layer_caches, index)  # noqa: E731
        narrow = caches.narrow
        if narrow is None or not narrow.holds(index):
            return call(caches)
        readers = self.in_place_readers(index)
        h = call(narrow.load(index, batch, readers))
        narrow.store(index, batch, readers)
        return h

    def in_place_readers(self, index: int) -> frozenset[str]:
        """What layer `index` can be handed in place of working rows (engine.cache_formats):
        "kv" where every attention module (those with kv_spec) says reads_fp8_in_place, "state"
        where every recurrent mixer (those with state_spec) says reads_narrow_state_in_place;
        decided at the first ask."""
        if self._in_place_readers is None:
            self._in_place_readers = [frozenset(
                kind for kind, keeps, says in (("kv", "kv_spec", "reads_fp8_in_place"),
                                               ("state", "state_spec", "reads_narrow_state_in_place"))
                if (modules := [m for m in layer.modules() if hasattr(m, keeps)])
                and all(getattr(m, says, False) for m in modules)) for layer in self.layers]
        return self._in_place_readers[index]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [num_seqs, hidden] -> float32 logits [num_seqs, vocab] (a
        tensor-parallel model gathers its vocab shards here: engine.tp)."""
        return self.vocab_logits(h)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of this model's vocab rows (all of them unless sharded)."""
        weight = self._vocab_weight()
        if h.dtype != weight.dtype:  # a decode step skips the call where it can
            h = h.to(weight.dtype)
        logits = linear(h, weight, None, self.packed_lm_head)
        return logits if logits.dtype == torch.float32 else logits.float()

    def _vocab_weight(self) -> torch.Tensor:
        return self.embed.weight if self.tie_embeddings else self.lm_head.weight

    def pack_for_cpu(self) -> int:
        """Packed weights for the linears and the LM head (engine.models.packed_linear);
        once the weights are final. Returns how many weights were packed."""
        self.packed_lm_head = pack(self._vocab_weight())
        return pack_linears(self) + (self.packed_lm_head is not None)
