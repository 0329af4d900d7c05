"""Batched sampling over one step's logits: one set of tensor ops for all requests.

Order: grammar masks -> penalties -> (greedy rows: argmax) -> temperature -> top-k -> top-p -> min-p -> draw.
A draw is argmax(probs / E) with E ~ Exp(1) noise (the Gumbel-max trick in exponential form);
a seeded request's noise for its i-th output token comes from a generator seeded with
(seed, i), so its tokens depend neither on which requests share the batch nor on which
worker draws them (a prefill worker draws token 0, a decode worker the rest; a resumed
request continues the same sequence). Logprobs are of the model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu, uses_cpu_kernel
from engine.sampling_params import SamplingParams
from engine.structured import GrammarState, apply_grammar_masks


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": lp, "top": [(id, lp), ...]} or None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = device
        self._generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 prompt_ids: list[list[int]], output_ids: list[list[int]],
                 grammars: list[GrammarState | None] | None = None) -> SampleResult:
        logits = logits.float()
        rows = logits.shape[0]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if grammars is not None:
            logits = apply_grammar_masks(logits, grammars)
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, params, prompt_ids, output_ids)

        tokens = self._argmax(logits)
        if not all(p.greedy for p in params):
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                       device=logits.device)
            scaled = logits / temperature[:, None]
            scaled = self._apply_top_k(scaled, params)
            scaled = self._apply_top_p_min_p(scaled, params)
            probs = torch.softmax(scaled, dim=-1)
            noise = self._exponential_noise(rows, params, output_ids)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)

        token_list = tokens.tolist()
        logprobs: list[dict | None] = [None] * rows
        if raw_logprobs is not None:
            for row, p in enumerate(params):
                if p.logprobs is None:
                    continue
                entry = {"token": float(raw_logprobs[row, token_list[row]]), "top": []}
                if p.logprobs > 0:
                    values, ids = raw_logprobs[row].topk(p.logprobs)
                    entry["top"] = list(zip(ids.tolist(), values.tolist()))
                logprobs[row] = entry
        return SampleResult(token_list, logprobs)

    def greedy(self, logits: torch.Tensor) -> SampleResult:
        """__call__'s result where every row is greedy without logprobs, penalties or grammar."""
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return SampleResult(self._argmax(logits).tolist(), [None] * logits.shape[0])

    @staticmethod
    def _argmax(logits: torch.Tensor) -> torch.Tensor:
        return cpu.row_argmax_cpu(logits) if uses_cpu_kernel(logits) else logits.argmax(dim=-1)

    def _apply_penalties(self, logits, params, prompt_ids, output_ids):
        rows, vocab = logits.shape
        device = logits.device
        counts = torch.zeros(rows, vocab, device=device)
        seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        for row in range(rows):
            if output_ids[row]:
                out = torch.tensor(output_ids[row], device=device)
                counts[row].index_add_(0, out, torch.ones(len(out), device=device))
            seen[row, torch.tensor(prompt_ids[row] + output_ids[row], dtype=torch.long, device=device)] = True
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        return logits - freq * counts - presence * (counts > 0).float()

    def _apply_top_k(self, logits, params):
        ks = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        if all(k >= logits.shape[1] for k in ks):
            return logits
        k = torch.tensor(ks, device=logits.device).clamp(max=logits.shape[1])
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))

    def _apply_top_p_min_p(self, logits, params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        if bool((top_p < 1.0).any()):
            probs_sorted, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            drop_sorted = mass_before >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if bool((min_p > 0).any()):
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _exponential_noise(self, rows, params, output_ids):
        noise = torch.empty(rows, self.vocab_size, device=self.device).exponential_()
        for row, p in enumerate(params):
            if p.seed is None or p.greedy:
                continue
            self._generator.manual_seed(_token_seed(p.seed, len(output_ids[row])))
            noise[row] = torch.empty(self.vocab_size, device=self.device).exponential_(generator=self._generator)
        return noise


def _token_seed(seed: int, index: int) -> int:
    """One 63-bit seed per (request seed, output index); splitmix64 keeps neighbours unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1
