"""Turns a scheduler decision into tensors, runs the model, samples. Owns model and cache."""

from __future__ import annotations

import torch

from engine.cache import ModelCache
from engine.models import ForwardBatch, HybridLM
from engine.sampler import SampleResult, Sampler
from engine.scheduler import ScheduledSeq
from engine.state_slots import StateSlotAllocator


class ModelRunner:
    def __init__(self, model: HybridLM, cache: ModelCache, slots: StateSlotAllocator,
                 device: torch.device | str, debug: bool):
        self.model = model
        self.cache = cache
        self.slots = slots
        self.device = torch.device(device)
        self.debug = debug
        self.sampler = Sampler(model.spec.vocab_size, self.device)

    def build_batch(self, seqs: list[ScheduledSeq]) -> ForwardBatch:
        block_size = self.cache.block_size
        input_ids, positions, write_index, starts, context_lens = [], [], [], [0], []
        for seq in seqs:
            request = seq.request
            begin = request.num_computed_tokens
            end = begin + seq.num_new_tokens
            input_ids += request.all_token_ids[begin:end]
            positions += range(begin, end)
            table = seq.block_table
            write_index += [table[p // block_size] * block_size + p % block_size for p in range(begin, end)]
            starts.append(starts[-1] + seq.num_new_tokens)
            context_lens.append(end)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            query_starts=starts, context_lens=context_lens,
            phases=[s.phase for s in seqs], state_slots=[s.slot for s in seqs],
            block_tables=tables.to(dev),
            kv_write_index=torch.tensor(write_index, dtype=torch.long, device=dev),
            block_size=block_size,
            logits_indices=torch.tensor(starts[1:], dtype=torch.long, device=dev) - 1,
        )

    def check_state_reads(self, seqs: list[ScheduledSeq]) -> None:
        """The guard: a sequence that reads its slot must find state written for itself."""
        for seq in seqs:
            if seq.phase.reads_state and self.model.spec.state_layers:
                self.slots.check_readable(seq.request.request_id, seq.slot)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        self.check_state_reads(seqs)
        logits = self.model(self.build_batch(seqs), self.cache.layers)
        for seq in seqs:
            self.slots.mark_written(seq.request.request_id)
        return logits

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> SampleResult:
        requests = [s.request for s in seqs]
        return self.sampler(logits, [r.sampling_params for r in requests],
                            [r.prompt_token_ids for r in requests],
                            [r.output_token_ids for r in requests])

    def on_slot_freed(self, slot: int) -> None:
        if self.debug:
            self.cache.poison_slot(slot)

