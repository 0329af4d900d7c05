"""Tiny Qwen3-Next checkpoints that carry an MTP head (`mtp.*`), and the head run by
transformers' own modules as the oracle for its drafts.

transformers loads Qwen3-Next without its MTP head, so the reference assembles one from
transformers' Qwen3-Next modules in the order vLLM's Qwen3NextMultiTokenPredictor runs them:
the embedding of token p + 1 and the model's final hidden state at p, each RMS-normed,
concatenated (embedding first) and projected by `fc`; a full-attention decoder layer (whose
FFN follows layer 0's rule); the head's `norm`; the model's LM head.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.oracle import CONFIGS, TIE_TOLERANCE, tiny_hf_model


class ReferenceMTPHead(nn.Module):
    def __init__(self, config):
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        super().__init__()
        config = copy.deepcopy(config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config._attn_implementation = "eager"
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = m.Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = m.Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([m.Qwen3NextDecoderLayer(config, 0)])
        self.norm = m.Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = m.Qwen3NextRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """g at every position of one sequence ([1, n, hidden] inputs), causal."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)), -1))
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=mask,
                             position_ids=positions)
        return self.norm(out[0] if isinstance(out, tuple) else out)


def save_mtp_model(path: Path, name: str = "qwen3_next"):
    """A tiny Qwen3-Next checkpoint with a random MTP head: (transformers model, reference head)."""
    model_type, kwargs = CONFIGS[name]
    hf = tiny_hf_model(model_type, kwargs, seed=sum(map(ord, name)))
    hf.save_pretrained(path)
    torch.manual_seed(7)
    head = ReferenceMTPHead(hf.config).eval()
    with torch.no_grad():
        for param_name, param in head.named_parameters():
            if param.dim() == 1 and "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
            else:
                param.normal_(0.0, 0.1)
    tensors = load_file(path / "model.safetensors")
    tensors.update({f"mtp.{n}": t.contiguous() for n, t in head.state_dict().items() if not n.startswith("rotary")})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return hf, head


def assert_drafts_are_the_heads(hf, head, tokens: list[int], drafts: list[int]) -> None:
    """Each draft is the reference head's argmax (within the tie tolerance) after `tokens` (the
    last one the pending token) and the drafts before it."""
    for j in range(len(drafts)):
        row = _logits_after(hf, head, tokens, drafts[:j])
        assert row[drafts[j]] >= row.max() - TIE_TOLERANCE, (
            f"draft {j} after {len(tokens)} tokens: ours {drafts[j]} "
            f"(logit {row[drafts[j]]:.5f}), the head run by transformers {int(row.argmax())} ({row.max():.5f})")


@torch.no_grad()
def _logits_after(hf, head, tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The reference head's logits for the draft after `drafts` (ours, fed in order), the
    whole sequence recomputed, no cache: g at each draft's position stands in for the model's
    hidden state at the next."""
    ids = torch.tensor([tokens])
    hidden = hf.model(ids).last_hidden_state
    embed = hf.model.embed_tokens
    inputs, states = list(tokens[1:]), hidden[:, :-1]
    g = head(embed(torch.tensor([inputs])), states)
    for draft in drafts:
        inputs.append(draft)
        states = torch.cat((states, g[:, -1:]), 1)
        g = head(embed(torch.tensor([inputs])), states)
    return hf.lm_head(g[:, -1]).float()[0]
