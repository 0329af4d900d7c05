"""Batched sampling over one step's logits: one set of tensor ops for all requests.

Order: penalties -> (greedy rows: argmax) -> temperature -> top-k -> top-p -> min-p -> draw.
A draw is argmax(probs / E) with E ~ Exp(1) noise (the Gumbel-max trick in exponential form);
a seeded request draws its noise from its own generator, so its tokens do not depend on
which other requests share the batch. Logprobs are of the model's raw distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": lp, "top": [(id, lp), ...]} or None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                 prompt_ids: list[list[int]], output_ids: list[list[int]]) -> SampleResult:
        logits = logits.float()
        rows = logits.shape[0]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if any(p.uses_penalties for p in params):
            logits = self._apply_penalties(logits, params, prompt_ids, output_ids)

        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                       device=logits.device)
            scaled = logits / temperature[:, None]
            scaled = self._apply_top_k(scaled, params)
            scaled = self._apply_top_p_min_p(scaled, params)
            probs = torch.softmax(scaled, dim=-1)
            noise = self._exponential_noise(rows, params, request_ids, greedy)
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

    def _exponential_noise(self, rows, params, request_ids, greedy):
        noise = torch.empty(rows, self.vocab_size, device=self.device).exponential_()
        for row, p in enumerate(params):
            if p.seed is None or p.greedy:
                continue
            gen = self._generators.get(request_ids[row])
            if gen is None:
                gen = torch.Generator(device=self.device).manual_seed(p.seed)
                self._generators[request_ids[row]] = gen
            noise[row] = torch.empty(self.vocab_size, device=self.device).exponential_(generator=gen)
        return noise
