"""Turns a scheduler decision into tensors, runs the model, samples. Owns model and cache."""

from __future__ import annotations

import dataclasses
import logging
from array import array
from dataclasses import dataclass

import torch

from engine import prompt_logprobs
from engine.cache import ModelCache
from engine.cpu_malloc import keep_freed_memory
from engine.cuda_graphs import MAX_VERIFY_GRAPH_ROWS, StaticDecode
from engine.decode_stack import DecodeStack
from engine.models import ForwardBatch, HybridLM
from engine.phase import Phase
from engine.prompt_logprobs import PromptLogprobPlan
from engine.request import Request
from engine.sampler import SampleResult, Sampler
from engine.scheduler import ScheduledSeq
from engine.state_slots import StateSlotAllocator

log = logging.getLogger(__name__)


@dataclass
class HostBatch:
    """A step's inputs as int64 CPU tensors, built with whole-tensor ops: the Python work per
    step is one pass over the rows, none over the tokens."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    kv_write_index: torch.Tensor  # [T]
    query_starts: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B]
    slots: torch.Tensor  # [B]
    block_counts: torch.Tensor  # [B] blocks in each row's table
    block_tables: torch.Tensor  # [B, widest table] (padding: 0)
    phases: list[Phase]
    # query_starts, context_lens and slots as Python lists where the builder had them (decode
    # steps), so the ForwardBatch's lists need no conversion back.
    row_lists: tuple[list[int], list[int], list[int]] | None = None
    prompt_logprobs: PromptLogprobPlan | None = None  # rows whose prompt logprobs this step scores
    # The flat indices whose logits the step returns, where a VERIFY row wants more than its
    # last token's (its last token's and each draft's, in order); None: each row's last token.
    logits_indices: torch.Tensor | None = None
    # ForwardBatch.state_captures: (row, tokens into the row, state row)
    state_captures: tuple[tuple[int, int, int], ...] = ()
    # ForwardBatch.decode_slot_runs: a VERIFY row's tokens are decode rows of its slot
    slot_runs: bool = False

    def for_followers(self) -> HostBatch:
        """What the other tensor-parallel ranks run: the same batch, its prompt-logprob rows
        without their owners (the ranks meet in the LM head's gathers; rank 0 keeps the entries)."""
        if self.prompt_logprobs is None:
            return self
        return dataclasses.replace(self, prompt_logprobs=dataclasses.replace(self.prompt_logprobs, owners=[]))


class SlotBlockTables:
    """Each state slot's block table as a row of one int64 tensor, kept in step with the
    BlockManager's lists, so a step indexes rows instead of converting every table again.

    A row remembers the list object it mirrors (holding it, so identity cannot be reused): a
    live list only ever grows at the end, so for the same list only the new blocks are
    copied; any other list (a new owner, a preempted request restarted) rewrites the row."""

    def __init__(self, num_rows: int, width: int):
        self.rows = torch.zeros(num_rows, width, dtype=torch.long)
        self.lens = [0] * num_rows
        self.lists: list[list[int] | None] = [None] * num_rows

    def update(self, slot: int, table: list[int]) -> None:
        have = self.lens[slot]
        if self.lists[slot] is not table or len(table) < have:
            self.rows[slot].zero_()
            self.lists[slot], have = table, 0
        if len(table) > have:
            if len(table) > self.rows.shape[1]:
                wider = torch.zeros(self.rows.shape[0], 2 * len(table), dtype=torch.long)
                wider[:, : self.rows.shape[1]] = self.rows
                self.rows = wider
            self.rows[slot, have:len(table)] = int64(table[have:])
            self.lens[slot] = len(table)


def int64(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`, through array('q') (torch.tensor(list) boxes every int)."""
    return torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)


def token_slice(request: Request, begin: int, end: int) -> list[int]:
    """request.all_token_ids[begin:end] without building the whole list; past the request's
    tokens, its drafts (a VERIFY step's)."""
    if end > request.num_tokens:
        return token_slice(request, begin, request.num_tokens) + request.draft_token_ids[:end - request.num_tokens]
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    if end <= len(prompt):
        return prompt[begin:end]
    if begin >= len(prompt):
        return outputs[begin - len(prompt):end - len(prompt)]
    return prompt[begin:] + outputs[:end - len(prompt)]


def host_batch(seqs: list[ScheduledSeq], block_size: int, tables: SlotBlockTables) -> HostBatch:
    if all(seq.phase is Phase.DECODE for seq in seqs):
        return decode_host_batch(seqs, block_size, tables)
    return general_host_batch(seqs, block_size, tables)


def general_host_batch(seqs: list[ScheduledSeq], block_size: int, tables: SlotBlockTables) -> HostBatch:
    """Any mix of rows: prefill chunks expand to one position per token."""
    token_ids, rows = [], []
    for seq in seqs:
        begin = seq.request.num_computed_tokens
        token_ids += token_slice(seq.request, begin, begin + seq.num_new_tokens)
        tables.update(seq.slot, seq.block_table)
        rows += (begin, seq.num_new_tokens, len(seq.block_table), seq.slot)
    begins, lens, counts, slots = int64(rows).view(-1, 4).unbind(1)
    ends = torch.cumsum(lens, 0)
    table = tables.rows[:, : int(counts.max())].index_select(0, slots)  # contiguous: kernels take it as is
    num_tokens = len(token_ids)
    if num_tokens == len(seqs):  # one token per row (decodes): no row expansion needed
        positions = begins
        write_index = table.gather(1, (positions // block_size)[:, None])[:, 0]
    else:
        row = torch.repeat_interleave(torch.arange(len(seqs)), lens, output_size=num_tokens)
        positions = begins[row] + torch.arange(num_tokens) - (ends - lens)[row]
        write_index = table[row, positions // block_size]
    return HostBatch(int64(token_ids), positions, write_index * block_size + positions % block_size,
                     torch.cat((torch.zeros(1, dtype=torch.long), ends)), begins + lens, slots, counts,
                     table, [s.phase for s in seqs], logits_indices=scored_indices(seqs, ends))


def scored_indices(seqs: list[ScheduledSeq], ends: torch.Tensor) -> torch.Tensor | None:
    """HostBatch.logits_indices: a VERIFY row's last 1 + len(drafts) tokens, every other row's
    last token; None when no row verifies."""
    if not any(seq.phase is Phase.VERIFY for seq in seqs):
        return None
    scored = int64([1 + len(s.request.draft_token_ids) if s.phase is Phase.VERIFY else 1 for s in seqs])
    total = int(scored.sum())
    row = torch.repeat_interleave(torch.arange(len(seqs)), scored, output_size=total)
    first = torch.cumsum(scored, 0) - scored
    return ends[row] - scored[row] + torch.arange(total) - first[row]


def decode_host_batch(seqs: list[ScheduledSeq], block_size: int, tables: SlotBlockTables) -> HostBatch:
    """host_batch where every row decodes one token: each row's values are Python ints put into
    one int64 buffer, with no per-token expansion and no gather of the block table. The decode
    step's Python runs on caches the layers just flushed, where each torch call is slow, so
    this makes four."""
    token_ids, begins, write_index, lens, slots, counts = [], [], [], [], [], []
    mirrored, mirrored_lens = tables.lists, tables.lens
    for seq in seqs:
        request, table, slot = seq.request, seq.block_table, seq.slot
        begin, blocks = request.num_computed_tokens, len(table)
        # A decode runs the request's last token (Phase.DECODE: begin == num_tokens - 1), or
        # its last draft where a draft model feeds its own (engine.draft_model).
        drafts = request.draft_token_ids
        token_ids.append(drafts[-1] if drafts else (request.output_token_ids or request.prompt_token_ids)[-1])
        if mirrored[slot] is not table or mirrored_lens[slot] != blocks:
            tables.update(slot, table)
        begins.append(begin)
        write_index.append(table[begin // block_size] * block_size + begin % block_size)
        lens.append(begin + 1)
        slots.append(slot)
        counts.append(blocks)
    rows = len(seqs)
    starts = list(range(rows + 1))
    columns = int64(token_ids + begins + write_index + lens + slots + counts + starts).split(
        [rows, rows, rows, rows, rows, rows, rows + 1])
    ids, positions, write, context_lens, slot_rows, block_counts, query_starts = columns
    return HostBatch(ids, positions, write, query_starts, context_lens, slot_rows, block_counts,
                     tables.rows[:, : max(counts)].index_select(0, slot_rows), [Phase.DECODE] * rows,
                     (starts, lens, slots))


def verify_host_batch(seqs: list[ScheduledSeq], block_size: int, tables: SlotBlockTables
                      ) -> tuple[HostBatch, torch.Tensor]:
    """A step of DECODE and VERIFY rows as decode rows, each VERIFY row's tokens one decode
    row apiece on its slot (ModelRunner.execute), built as decode_host_batch
    builds its rows; and the rows whose logits the step returns (each row's last token, and a
    VERIFY row's drafts')."""
    token_ids, begins, write_index, slots, counts, scored = [], [], [], [], [], []
    for seq in seqs:
        request, table, slot = seq.request, seq.block_table, seq.slot
        begin, blocks = request.num_computed_tokens, len(table)
        if tables.lists[slot] is not table or tables.lens[slot] != blocks:
            tables.update(slot, table)
        token_ids += token_slice(request, begin, begin + seq.num_new_tokens)
        for position in range(begin, begin + seq.num_new_tokens):
            begins.append(position)
            write_index.append(table[position // block_size] * block_size + position % block_size)
        slots += [slot] * seq.num_new_tokens
        counts += [blocks] * seq.num_new_tokens
        width = 1 + len(request.draft_token_ids) if seq.phase is Phase.VERIFY else 1
        scored += range(len(begins) - width, len(begins))
    rows = len(begins)
    lens = [begin + 1 for begin in begins]
    columns = int64(token_ids + begins + write_index + lens + slots + counts + list(range(rows + 1)) + scored).split(
        [rows, rows, rows, rows, rows, rows, rows + 1, len(scored)])
    ids, positions, write, context_lens, slot_rows, block_counts, query_starts, scored_rows = columns
    host = HostBatch(ids, positions, write, query_starts, context_lens, slot_rows, block_counts,
                     tables.rows[:, : max(counts)].index_select(0, slot_rows), [Phase.DECODE] * rows,
                     (list(range(rows + 1)), lens, slots), slot_runs=True)
    return host, scored_rows


class ModelRunner:
    def __init__(self, model: HybridLM, cache: ModelCache, slots: StateSlotAllocator,
                 device: torch.device | str, debug: bool, enforce_eager: bool = True,
                 max_model_len: int | None = None, tp=None, keep_hidden: bool = False, verify_width: int = 1):
        """`verify_width`: 1 + the drafts a step may verify per request where the engine
        speculates (engine.verify), else 1."""
        self.model = model
        model.pack_for_cpu()  # weights are final here (loaded, sharded); a no-op off the CPU
        # a CPU decode step's layers as one C++ call where they fit (built after the packing)
        self.decode_stack = DecodeStack(model) if torch.device(device).type == "cpu" else None
        if torch.device(device).type == "cpu":
            keep_freed_memory()  # engine.cpu_malloc: no page faults for each step's big activations
        self.tp = tp  # engine.tp.ranks.TPLeader: the other ranks repeat every forward and cache copy
        self.cache = cache
        self.slots = slots
        self.device = torch.device(device)
        self.debug = debug
        self.sampler = Sampler(model.spec.vocab_size, self.device)
        self.static: StaticDecode | None = None
        self.verify_width = verify_width
        # An MTP head reads every token's final hidden state (engine.mtp): each step leaves
        # them in last_hidden (a decode graph's outputs are then its logits and its hidden states).
        self.keep_hidden = keep_hidden
        self.last_hidden: torch.Tensor | None = None
        width = self.cache.sizes.num_blocks
        if max_model_len is not None:
            width = min(width, -(-max_model_len // self.cache.block_size))
        self.block_tables = SlotBlockTables(self.cache.sizes.num_slots, width)
        if self.device.type == "cuda" and not enforce_eager:
            self.use_static_decode(capture=True)

    @property
    def verifies(self) -> bool:
        """The engine speculates: some steps may hold VERIFY rows."""
        return self.verify_width > 1

    def use_static_decode(self, capture: bool, verify_rows: int | None = None) -> None:
        """Route decode-only steps, and a speculating engine's verify steps of up to
        `verify_rows` rows (by default its slots times verify_width, at most
        MAX_VERIFY_GRAPH_ROWS), through persistent padded buffers (engine.cuda_graphs), and on
        CUDA capture a graph per padded size (any failure: logged, eager replays instead).
        Tensor-parallel ranks all do the same at once: a step's collectives are in every rank's
        warm-up and capture alike, and a rank that falls back to eager still runs them in the
        same order as the graphs of the others."""
        if verify_rows is None:
            verify_rows = min(self.slots.num_slots * self.verify_width, MAX_VERIFY_GRAPH_ROWS) if self.verifies else 0

        def mine():
            self.static = StaticDecode(self.model, self.cache, self.slots.num_slots, self.block_tables.rows.shape[1],
                                       self.device, self.keep_hidden, verify_rows)
            if capture:
                self.static.capture()

        if self.tp is None:
            mine()
            return
        _, answers = self.tp.ask_while(mine, "static_decode", capture, verify_rows)
        failed = [f"rank {rank}: {why}" for rank, (ok, why) in enumerate(answers, start=1) if not ok]
        if failed:
            raise RuntimeError(f"static decode buffers on tensor-parallel ranks: {'; '.join(failed)}")

    def build_batch(self, seqs: list[ScheduledSeq]) -> ForwardBatch:
        return self.device_batch(self.host_batch(seqs))

    def host_batch(self, seqs: list[ScheduledSeq]) -> HostBatch:
        host = host_batch(seqs, self.cache.block_size, self.block_tables)
        if host.row_lists is None:  # a step with prefill rows: some may want their prompt's logprobs
            host.prompt_logprobs = prompt_logprobs.plan(seqs)
            host.state_captures = tuple((i, offset, self.cache.checkpoint_row(row))
                                        for i, seq in enumerate(seqs) for offset, row in seq.captures)
        return host

    def device_batch(self, host: HostBatch) -> ForwardBatch:
        starts = host.query_starts[:-1]
        if host.phases.count(Phase.DECODE) == len(host.phases):
            extra = (starts, host.slots, host.context_lens, host.block_tables)
            last_tokens = starts  # one token a row: the row's token is its last
        else:
            rows = torch.tensor([i for i, p in enumerate(host.phases) if p is Phase.DECODE], dtype=torch.long)
            extra = (starts[rows], host.slots[rows], host.context_lens[rows], host.block_tables[rows])
            last_tokens = host.query_starts[1:] - 1 if host.logits_indices is None else host.logits_indices
        tensors = [host.input_ids, host.positions, host.kv_write_index, host.block_tables, last_tokens, *extra]
        if self.device.type != "cpu":  # one host-to-device copy for the whole step
            flat = torch.cat([t.reshape(-1) for t in tensors]).to(self.device, non_blocking=True)
            tensors = [part.view(t.shape) for part, t in
                       zip(flat.split([t.numel() for t in tensors]), tensors)]
        input_ids, positions, write_index, tables, logits_indices, d_index, d_slots, d_lens, d_tables = tensors
        lists = host.row_lists or (host.query_starts.tolist(), host.context_lens.tolist(), host.slots.tolist())
        return ForwardBatch(
            input_ids=input_ids, positions=positions, query_starts=lists[0],
            context_lens=lists[1], phases=host.phases, state_slots=lists[2],
            block_tables=tables, kv_write_index=write_index, block_size=self.cache.block_size,
            logits_indices=logits_indices, decode_token_index=d_index, decode_slots=d_slots,
            decode_context_lens=d_lens, decode_block_tables=d_tables,
            prompt_logprobs=host.prompt_logprobs.to(self.device) if host.prompt_logprobs is not None else None,
            state_captures=host.state_captures, decode_slot_runs=host.slot_runs,
        )

    def check_state_reads(self, seqs: list[ScheduledSeq]) -> None:
        """The guard: a sequence that reads its slot must find state written for itself."""
        if not self.model.spec.state_layers:
            return
        for seq in seqs:
            if seq.phase.reads_state:
                self.slots.check_readable(seq.request.request_id, seq.slot)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Logits [len(seqs), vocab]; on the static path a view valid until the next step."""
        self.check_state_reads(seqs)
        # A step of decodes and verifies runs as a decode step (verify_host_batch): each VERIFY
        # row's tokens are consecutive decode rows of its slot, each attending over the KV up to
        # its own position (every row's K and V are stored before any row attends), and the state
        # kernels run a slot's rows in row order (engine.kernels.slot_runs): the plain decode's
        # kernels, a token at a time, with the step's GEMMs over all the tokens at once; from a
        # graph where one fits, else on the CPU's one-call stack where the layers fit it, else on
        # each layer's own decode path. (Not with narrow state: its store rounds each row's
        # slot, and a verify's rows share one.)
        verify = self.verifies and self.cache.layers.narrow is None \
            and any(s.phase is Phase.VERIFY for s in seqs) \
            and all(s.phase in (Phase.DECODE, Phase.VERIFY) for s in seqs)
        host = scored = logits = None
        if verify:
            host, scored = verify_host_batch(seqs, self.cache.block_size, self.block_tables)
        elif self.static is not None and all(s.phase is Phase.DECODE for s in seqs):
            host = host_batch(seqs, self.cache.block_size, self.block_tables)
        if host is not None and self.static is not None and self.static.fits(host):
            if self.tp is not None:  # every rank replays its own graph of this size
                self.tp.send("static_step", host)
            logits = self.static.run(host)
            self.last_hidden = self.static.last_hidden
        if logits is None:
            if host is None and self.tp is None:
                batch = self.build_batch(seqs)
            else:
                host = self.host_batch(seqs) if host is None else host
                if self.tp is not None:  # the other ranks build the same batch from the same host tensors
                    self.tp.send("forward", host.for_followers())
                batch = self.device_batch(host)
            batch.keep_hidden = self.keep_hidden
            plan = None if self.decode_stack is None else self.decode_stack.plan(batch, self.cache.layers)
            logits = self.model(batch, self.cache.layers, plan)
            self.last_hidden = batch.hidden
            if batch.prompt_logprobs is not None:
                prompt_logprobs.record(batch.prompt_logprobs, batch.prompt_logprobs_result)
        if scored is not None:  # a verify's rows are tokens: the scored ones, as execute returns them
            # (non_blocking: a pageable copy is staged at once, and the stream need not drain)
            logits = logits.index_select(0, scored.to(logits.device, non_blocking=True))
        for seq in seqs:
            self.slots.mark_written(seq.request.request_id)
        return logits

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> SampleResult:
        requests = [s.request for s in seqs]
        if all(r.argmax_only and r.grammar is None for r in requests):  # one pass, not the sampler's ten
            return self.sampler.greedy(logits)
        return self.sampler(logits, [r.sampling_params for r in requests],
                            [r.prompt_token_ids for r in requests],
                            [r.output_token_ids for r in requests],
                            [r.grammar for r in requests])  # structured outputs (engine/structured.py)

    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent-state rows (src, dst) on every rank."""
        if self.tp is not None and pairs:
            self.tp.send("copy_state", pairs)
        self.cache.copy_state(pairs)

    def on_slot_freed(self, slot: int) -> None:
        if self.debug:
            if self.tp is not None:
                self.tp.send("poison", slot)
            self.cache.poison_slot(slot)
