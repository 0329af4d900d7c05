"""Static-shape decode: persistent, padded input tensors per batch size and, on CUDA, one
captured CUDA graph of the model's decode step per size.

A decode-only step is padded up to the next size in `padded_sizes`. Its inputs are written
into tensors that live as long as the engine, and the ForwardBatch over them is built once
per size, so the forward pass of that step reads no per-step Python data: what a graph
captured is what every replay computes, with new data in the same tensors.

Padded rows are the danger: they run every layer like real decodes. Each one decodes token 0
at position 0 from the cache's scratch state slot and scratch KV block (engine.cache: rows
the allocators never hand out and a hand-off never moves), its whole block-table row is the
scratch block, and its logits (and, for an MTP head, its hidden states) are dropped. All
padded rows share the scratch rows, so what they leave there is garbage, read only by other
padded rows; every layer computes each row on its own, so nothing of it reaches a real row.

A speculating engine's verify steps (engine.model_runner.verify_host_batch: each VERIFY row's
tokens as decode rows of its slot) have static buffers and graphs of their own, their rows
counted in tokens, up to `verify_rows`: their batches tell the state kernels that adjacent rows
may share a slot (engine.kernels.slot_runs). There the padded rows, adjacent on the scratch
slot, run as one run, one after another, which is why plain decode steps keep graphs without it.

Capture is refused with a reason, and the step stays eager, when the decode step would
synchronise with the host (`capture_blockers`); any other capture failure is logged and
falls back to eager too. On CPU only the eager static path runs (tests/test_static_decode.py);
scripts/gpu_check.py captures and replays on a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.kernels import uses_triton
from engine.models import ForwardBatch, HybridLM
from engine.phase import Phase

if TYPE_CHECKING:
    from engine.cache import ModelCache
    from engine.model_runner import HostBatch

log = logging.getLogger(__name__)

def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with static buffers (and graphs): 1, 2, 4, then every multiple of 8, and
    max_num_seqs itself; a step pads to the smallest size that holds it."""
    return sorted({s for s in (1, 2, 4, *range(8, max_num_seqs, 8)) if s < max_num_seqs} | {max_num_seqs})


def capture_blockers(model: HybridLM, device: torch.device) -> list[str]:
    """Why the decode step of `model` on `device` cannot be captured; empty when it can. MoE
    layers capture: on CUDA they dispatch without reading counts on the host
    (engine.models.expert_dispatch); tests/test_decode_host_reads.py holds every family to it."""
    reasons = []
    if model.spec.attention_layers and not uses_triton(torch.empty(0, device=device)):
        reasons.append("decode attention without Triton reads context_lens.max() on the host")
    return reasons


# The most rows a verify step's graphs take (the rest run eagerly): vLLM's default largest
# CUDA graph size too. Such steps are large batches, where drafting rarely pays anyway.
MAX_VERIFY_GRAPH_ROWS = 512


class StaticDecode:
    def __init__(self, model: HybridLM, cache: ModelCache, max_num_seqs: int, max_blocks: int,
                 device: torch.device, keep_hidden: bool = False, verify_rows: int = 0):
        """`keep_hidden`: each step also gives its rows' final hidden states (an MTP head's
        input, engine.mtp), as one more output of the graphs. `verify_rows`: the most rows of a
        verify step with static buffers and graphs (0: none)."""
        self.model, self.cache, self.device = model, cache, device
        self.keep_hidden = keep_hidden
        self.sizes = padded_sizes(max_num_seqs)
        self.verify_sizes = padded_sizes(verify_rows) if verify_rows else []
        self.max_blocks = max_blocks
        self.scratch_block = cache.scratch_block
        most = max(self.sizes + self.verify_sizes)
        # Rows: input id, position, KV write index, state slot, context length.
        pad = torch.tensor([0, 0, cache.scratch_block * cache.block_size, cache.scratch_slot, 1])
        self.pad_rows = pad[:, None].expand(5, most).contiguous()
        self.inputs = self.pad_rows.to(device, copy=True)
        self.block_tables = torch.full((most, max_blocks), cache.scratch_block, dtype=torch.long, device=device)
        rows = torch.arange(most, device=device)
        # Keyed by (slot_runs, padded size): plain decode steps' and verify steps'.
        self.batches = {(runs, size): self._batch(size, rows[:size], runs)
                        for runs, sizes in ((False, self.sizes), (True, self.verify_sizes)) for size in sizes}
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        self.graph_logits: dict[tuple[bool, int], torch.Tensor] = {}
        self.graph_hidden: dict[tuple[bool, int], torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None  # the real rows' of the last run, with keep_hidden
        self.eager_reason: str | None = "not captured"

    def _batch(self, size: int, rows: torch.Tensor, slot_runs: bool) -> ForwardBatch:
        ids, positions, write_index, slots, context_lens = self.inputs[:, :size]
        tables = self.block_tables[:size]
        return ForwardBatch(
            input_ids=ids, positions=positions, query_starts=list(range(size + 1)), context_lens=[],
            phases=[Phase.DECODE] * size, state_slots=[], block_tables=tables,
            kv_write_index=write_index, block_size=self.cache.block_size, logits_indices=rows,
            decode_token_index=rows, decode_slots=slots, decode_context_lens=context_lens,
            decode_block_tables=tables, decode_slot_runs=slot_runs, keep_hidden=self.keep_hidden)

    def fits(self, host: HostBatch) -> bool:
        sizes = self.verify_sizes if host.slot_runs else self.sizes
        return (bool(sizes) and len(host.phases) <= sizes[-1] and host.block_tables.shape[1] <= self.max_blocks
                and all(p is Phase.DECODE for p in host.phases))

    def load(self, host: HostBatch) -> tuple[bool, int]:
        """Write a decode-only (or verify) step's inputs into the static tensors; returns its
        key: (slot_runs, padded size)."""
        n = len(host.phases)
        size = next(s for s in (self.verify_sizes if host.slot_runs else self.sizes) if s >= n)
        rows = self.pad_rows[:, :size].clone()
        rows[:, :n] = torch.stack((host.input_ids, host.positions, host.kv_write_index, host.slots,
                                   host.context_lens))
        self.inputs[:, :size].copy_(rows, non_blocking=True)
        self.block_tables[:size].fill_(self.scratch_block)  # no stale block id of any earlier step
        width = host.block_tables.shape[1]
        used = torch.arange(width) < host.block_counts[:, None]  # the rest: scratch, not block 0
        tables = torch.where(used, host.block_tables, self.scratch_block)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        return host.slot_runs, size

    def run(self, host: HostBatch) -> torch.Tensor:
        """Logits of the real rows, [n, vocab]: a view valid until the next step."""
        key, n = self.load(host), len(host.phases)
        if key in self.graphs:
            self.graphs[key].replay()
            logits, hidden = self.graph_logits[key], self.graph_hidden.get(key)
        else:
            batch = self.batches[key]
            logits = self.model(batch, self.cache.layers)
            hidden = batch.hidden
        self.last_hidden = hidden[:n] if self.keep_hidden else None
        return logits[:n]

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture one graph per padded size, largest first (smaller ones reuse its memory
        pool). On any refusal or failure no graph is kept and every step runs eagerly."""
        blockers = capture_blockers(self.model, self.device) if self.device.type == "cuda" else ["not on CUDA"]
        if blockers:
            self.eager_reason = "; ".join(blockers)
            log.warning("decode step not captured as CUDA graphs, running eagerly: %s", self.eager_reason)
            return False
        self.inputs.copy_(self.pad_rows)  # every row a padded row: capture touches only scratch
        self.block_tables.fill_(self.scratch_block)
        try:
            pool = torch.cuda.graph_pool_handle()
            warm = torch.cuda.Stream(self.device)
            for key in sorted(self.batches, key=lambda key: -key[1]):
                batch = self.batches[key]
                warm.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(warm):  # compiles Triton kernels, moves lazy buffers
                    for _ in range(2):
                        self.model(batch, self.cache.layers)
                torch.cuda.current_stream(self.device).wait_stream(warm)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a hand-off thread's CUDA calls during capture are not ours to fail
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self.model(batch, self.cache.layers)
                self.graphs[key], self.graph_logits[key] = graph, logits
                if self.keep_hidden:
                    self.graph_hidden[key] = batch.hidden
            torch.cuda.synchronize(self.device)
        except Exception as e:  # a capture failure must leave a working (eager) engine
            self.graphs.clear()
            self.graph_logits.clear()
            self.graph_hidden.clear()
            self.eager_reason = f"capture failed: {type(e).__name__}: {e}"
            log.warning("decode step not captured as CUDA graphs, running eagerly: %s", self.eager_reason)
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                log.exception("CUDA synchronize after a failed capture")
            return False
        self.eager_reason = None
        log.info("decode step captured as CUDA graphs for batch sizes %s%s", self.sizes,
                 f", verify steps of up to {self.verify_sizes[-1]} rows" if self.verify_sizes else "")
        return True
