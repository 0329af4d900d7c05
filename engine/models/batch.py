"""What one forward step sees: a flattened varlen batch plus where each sequence's memory lives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.kv_fp8 import kv_store_rows_triton
from engine.phase import Phase


@dataclass
class ForwardBatch:
    """Tensors carry the data; the Python lists are per-row metadata that the mixers read only
    for prefill rows (a prefill row's slice, context and slot). Decode rows are reached only
    through the `decode_*` tensors, so a decode-only batch can be replayed with new data
    written into the same tensors (engine.cuda_graphs leaves context_lens and state_slots
    empty there: a read of them for a decode row fails instead of reading a stale value)."""

    input_ids: torch.Tensor  # [T] all scheduled tokens, sequence after sequence
    positions: torch.Tensor  # [T]
    query_starts: list[int]  # [B + 1] offsets of each sequence's tokens in the flat batch
    context_lens: list[int]  # [B] tokens in the KV cache once this step has written its own
    phases: list[Phase]  # [B]
    state_slots: list[int]  # [B] Mamba state slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] paged KV block ids (padding: 0)
    kv_write_index: torch.Tensor  # [T] flat cache row (block * block_size + offset) per token
    block_size: int
    logits_indices: torch.Tensor  # [B] flat index of each sequence's last token (a VERIFY row: its drafts' too)
    # Over the decode rows only, in row order; derived from the lists above when not given.
    decode_token_index: torch.Tensor | None = None  # [D] flat index of the row's one token
    decode_slots: torch.Tensor | None = None  # [D]
    decode_context_lens: torch.Tensor | None = None  # [D]
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks]
    # Adjacent decode rows may share a state slot and run in row order: a VERIFY row's tokens as
    # decode rows of its slot (engine.kernels.slot_runs; the state kernels take it as slot_runs).
    decode_slot_runs: bool = False
    # engine.prompt_logprobs: the rows to score (a PromptLogprobPlan on this device), and what
    # the model's forward leaves here for them.
    prompt_logprobs: object | None = None
    prompt_logprobs_result: tuple | None = field(default=None, init=False)
    # An MTP head (engine.mtp) reads every token's final hidden state: with keep_hidden set,
    # the model's forward leaves them in `hidden` [T, hidden_size], after the final norm.
    keep_hidden: bool = False
    hidden: torch.Tensor | None = field(default=None, init=False, repr=False)
    decode_rows: list[int] = field(init=False)
    prefill_rows: list[int] = field(init=False)
    # Where the decode rows' tokens sit: decode_token_index, or on CPU, when every token is a
    # decode row's, slice(None) (views and copies instead of a gather and a scatter per use).
    decode_tokens: torch.Tensor | slice = field(init=False)
    # The prefill rows as one varlen attention call takes them (engine.kernels.varlen_attention),
    # built by the first attention layer that asks and shared by the others.
    varlen_rows: object | None = field(default=None, init=False, repr=False)
    # (row, tokens into the row, state row): prefill rows whose recurrent state after that many
    # of their tokens this pass also leaves in that state row (a prefix-cache checkpoint,
    # engine.LLMEngine), so a chunk that crosses a save point still runs as one pass.
    state_captures: tuple[tuple[int, int, int], ...] = ()
    _state_spans: StateSpans | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.decode_rows = [i for i, p in enumerate(self.phases) if p is Phase.DECODE]
        self.prefill_rows = [i for i, p in enumerate(self.phases) if p is not Phase.DECODE]
        if self.decode_token_index is None:
            device = self.input_ids.device
            rows = torch.tensor(self.decode_rows, dtype=torch.long)
            self.decode_token_index = torch.tensor(self.query_starts[:-1], dtype=torch.long)[rows].to(device)
            self.decode_slots = torch.tensor(self.state_slots, dtype=torch.long)[rows].to(device)
            self.decode_context_lens = torch.tensor(self.context_lens, dtype=torch.long)[rows].to(device)
            self.decode_block_tables = self.block_tables.index_select(0, rows.to(self.block_tables.device))
        only_decodes = not self.prefill_rows and len(self.decode_rows) == self.input_ids.shape[0]
        on_cpu = self.input_ids.device.type == "cpu"
        self.decode_tokens = slice(None) if only_decodes and on_cpu else self.decode_token_index

    @property
    def state_spans(self) -> StateSpans:
        """How the prefill rows run through a recurrent layer (built once per batch)."""
        if self._state_spans is None:
            self._state_spans = StateSpans(self)
        return self._state_spans

    @property
    def num_seqs(self) -> int:
        return len(self.phases)

    def query_len(self, row: int) -> int:
        return self.query_starts[row + 1] - self.query_starts[row]


@dataclass(frozen=True)
class StateSegment:
    """Tokens [start, end) of one prefill row, run by a recurrent layer from the state in row
    `src` of its pools (zeros when `fresh`) to a final state written to row `dst`."""

    index: int  # the span's position in StateSpans.bounds: [bounds[index], bounds[index + 1])
    start: int
    end: int
    src: int
    dst: int
    fresh: bool

    def prepare(self, pool: torch.Tensor) -> None:
        """`dst` made to hold the state this segment starts from, so a layer runs it in place
        at `dst` as it runs any prefill row at its slot."""
        if not self.fresh and self.src != self.dst:
            pool[self.dst].copy_(pool[self.src])


class StateSpans:
    """The prefill rows of a step as a recurrent layer runs them. Without captures, one
    segment per row, from and to its slot. A row captured after p tokens into state row c runs
    as two: its first p tokens from its slot (or zeros) into c, then the rest from c into its
    slot. The second reads what the first wrote, so segments come in rounds: a layer runs each
    round whole (one varlen call) before preparing the next; a layer that runs segment by
    segment takes them in round order (`segments`).

    bounds: the batch's query_starts with the capture points added, so every segment, and
    every decode row, is one span between consecutive bounds (what a varlen kernel's
    cu_seqlens with row indices takes)."""

    def __init__(self, batch: ForwardBatch):
        cuts: dict[int, list[tuple[int, int]]] = {}
        for row, offset, state_row in batch.state_captures:
            if batch.phases[row] not in (Phase.FRESH_PREFILL, Phase.CONTINUED_PREFILL) \
                    or not 0 < offset < batch.query_len(row):
                raise ValueError(f"state capture after {offset} tokens of row {row} "
                                 f"({batch.phases[row].name}, {batch.query_len(row)} tokens)")
            cuts.setdefault(row, []).append((batch.query_starts[row] + offset, state_row))
        self.bounds = sorted({*batch.query_starts, *(at for row in cuts.values() for at, _ in row)})
        where = {at: i for i, at in enumerate(self.bounds)}
        self.rounds: list[list[StateSegment]] = [[]]
        for row in batch.prefill_rows:
            start, end, slot = batch.query_starts[row], batch.query_starts[row + 1], batch.state_slots[row]
            src, fresh = slot, batch.phases[row] is Phase.FRESH_PREFILL
            for k, (at, state_row) in enumerate([*sorted(cuts.get(row, ())), (end, slot)]):
                if len(self.rounds) <= k:
                    self.rounds.append([])
                self.rounds[k].append(StateSegment(where[start], start, at, src, state_row, fresh))
                start, src, fresh = at, state_row, False

    def segments(self, pool: torch.Tensor):
        """Every segment in round order, `pool` prepared for each just before it is yielded."""
        for segments in self.rounds:
            for segment in segments:
                segment.prepare(pool)
                yield segment

    def prepared_rounds(self, pool: torch.Tensor):
        """Each round's segments, `pool` prepared for all of them before the round is yielded."""
        for segments in self.rounds:
            for segment in segments:
                segment.prepare(pool)
            yield segments


@dataclass
class LayerCaches:
    """Per model layer: (k, v) where the layer has attention; its state tensors, in the order its
    mixer declared them (engine.models.hybrid), where it has recurrent state; else None."""

    kv: list[tuple[torch.Tensor, torch.Tensor] | None]
    state: list[tuple[torch.Tensor, ...] | None]
    # Where some layers' state is stored narrower than they compute it: the float32 working
    # buffers they run on (engine.state_format.NarrowState); None: every layer runs on `state`.
    narrow: object | None = field(default=None, repr=False)

    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor: each layer's K and V, then each layer's state tensors."""
        return [t for per_layer in (*self.kv, *self.state) if per_layer for t in per_layer]


@dataclass(frozen=True)
class Fp8Blocks:
    """An attention layer's KV blocks stored in FP8 (engine.kv_format), as a step on Triton hands
    them to the layer: its decode rows read the blocks through their scales
    (engine.kernels.paged_attention), so no decode row's context is dequantized anywhere. In an
    all-decode step (`working` None) the layer also stores its tokens' rows quantized (`store`);
    in a step that prefills, `working` holds the prefill rows' blocks dequantized, the layer
    writes the step's rows there as into any cache, and the cache stores them after it. Handed
    only to a layer whose attention modules all say `reads_fp8_in_place` (HybridLM.run_layer)."""

    tensors: tuple[torch.Tensor, ...]  # the pool's K and V; an MLA layer's one latent tensor
    scales: tuple[torch.Tensor, ...]  # float32 [KV heads] per tensor (a layer's one scale, repeated)
    working: tuple[torch.Tensor, ...] | None = None  # a step that prefills: its working rows

    def store(self, rows: tuple[torch.Tensor, ...], written: torch.Tensor) -> None:
        """The step's rows ([T, KV heads, head_dim] per tensor) into the blocks' token rows `written`."""
        for pool, own, scale in zip(self.tensors, rows, self.scales):
            kv_store_rows_triton(own, written, pool, scale)
