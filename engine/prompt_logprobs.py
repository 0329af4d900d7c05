"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the
tokens before it, its rank, and the top n there, computed during the prefill that runs the
prompt anyway (lm-eval's loglikelihood, echo with logprobs).

Position p's logits score prompt token p + 1, so a prefill chunk over positions [begin, end)
gives the entries of tokens begin + 1 .. end (within the prompt). A request keeps its entries
in order; a chunk computes only those it lacks, so a preempted request that runs its prompt
again adds nothing twice. The model computes them in slices of rows, so the logits of a long
chunk never exist whole ([rows, vocab] float32 for a 2k chunk of a 150k vocabulary: 1.2 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.phase import Phase

SLICE_ROWS = 256


@dataclass
class PromptLogprobPlan:
    """What one step computes: flat token indices into the batch, the token each scores, the
    largest top n asked for; `owners` says whose entries they are, in order."""

    index: torch.Tensor  # [n] int64
    targets: torch.Tensor  # [n] int64
    top: int
    owners: list[tuple[object, int, int]]  # (request, how many entries, its top n)

    def to(self, device) -> PromptLogprobPlan:
        return PromptLogprobPlan(self.index.to(device), self.targets.to(device), self.top, self.owners)


def plan(seqs) -> PromptLogprobPlan | None:
    """The step's prompt-logprob rows, or None (the usual case: one attribute read per row)."""
    index, targets, owners, top, offset = [], [], [], 0, 0
    for seq in seqs:
        request = seq.request
        entries = request.prompt_logprobs
        if entries is not None and seq.phase is not Phase.DECODE:
            begin = request.num_computed_tokens
            first = max(begin, len(entries) - 1)  # the position that scores the first missing entry
            last = min(begin + seq.num_new_tokens, request.num_prompt_tokens - 1)
            if last > first:
                index.append(torch.arange(offset + first - begin, offset + last - begin))
                targets.append(torch.tensor(request.prompt_token_ids[first + 1:last + 1], dtype=torch.long))
                n = request.sampling_params.prompt_logprobs
                owners.append((request, last - first, n))
                top = max(top, n)
        offset += seq.num_new_tokens
    if not owners:
        return None
    return PromptLogprobPlan(torch.cat(index), torch.cat(targets), top, owners)


def compute(head, hidden: torch.Tensor, step: PromptLogprobPlan) -> tuple[torch.Tensor, ...]:
    """(logprob [n], rank [n], top values [n, top], top ids [n, top]) of the planned rows of
    `hidden` (the last layer's output, before the final norm); `head` maps such rows to logits."""
    chosen, ranks, values, ids = [], [], [], []
    for start in range(0, step.index.shape[0], SLICE_ROWS):
        rows = step.index[start:start + SLICE_ROWS]
        logprobs = torch.log_softmax(head(hidden.index_select(0, rows)).float(), dim=-1)
        target = logprobs.gather(1, step.targets[start:start + SLICE_ROWS, None])
        chosen.append(target[:, 0])
        ranks.append((logprobs > target).sum(dim=-1) + 1)
        if step.top:
            top = logprobs.topk(step.top, dim=-1)
            values.append(top.values)
            ids.append(top.indices)
    empty = torch.empty(0, 0)
    return (torch.cat(chosen), torch.cat(ranks), torch.cat(values) if values else empty,
            torch.cat(ids) if ids else empty)


def record(step: PromptLogprobPlan, result: tuple[torch.Tensor, ...]) -> None:
    """Append each owner's entries: {"token": logprob, "rank": r, "top": [(id, logprob), ...]}."""
    chosen, ranks, values, ids = (t.cpu().tolist() for t in result)
    at = 0
    for request, count, n in step.owners:
        for i in range(at, at + count):
            top = list(zip(ids[i][:n], values[i][:n])) if n else []
            request.prompt_logprobs.append({"token": chosen[i], "rank": ranks[i], "top": top})
        at += count
