"""A multi-token-prediction head (Qwen3-Next's `mtp.*` weights): one more decoder layer that
predicts the token after next from the target's final hidden state and the next token.

At position p it takes the target's hidden state h_p (after the final norm) and the
embedding of token p + 1, each RMS-normed, concatenated and projected back to the hidden
size (`fc`); runs its layer (attention with a paged KV cache of its own, and an FFN); and its
`norm` gives g_p, whose logits through the target's LM head predict token p + 2. Drafting
feeds g_p back in place of the target's hidden state for the next position.

The head shares the target's embedding and LM head. Its cache is one more layer of the
target's cache (index = the target's layer count): KV rows at the target's block ids, and per
state slot `hidden`, the g of the last position the head ran, which the next drafts start
from. So a hand-off carries both under the target's own tables (engine.mtp).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.batch import ForwardBatch, LayerCaches
from engine.models.hybrid import DecoderLayer, LayerCacheSpec, StateTensorSpec

HIDDEN_STATE_KIND = "mtp_hidden"


class MTPHead(nn.Module):
    def __init__(self, hidden: int, layer: DecoderLayer, norm):
        """`norm()`: a new RMSNorm of the family's kind over `hidden`."""
        super().__init__()
        self.hidden_size = hidden
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.norm = norm()

    def cache_spec(self, dtype: torch.dtype) -> LayerCacheSpec:
        """The layer's KV, and the last g per slot (in the model's dtype, as the head makes it)."""
        hidden = StateTensorSpec("hidden", (self.hidden_size,), str(dtype).removeprefix("torch."))
        return LayerCacheSpec("mtp", self.layer.cache_spec().kv, HIDDEN_STATE_KIND, (hidden,))

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches: LayerCaches,
                index: int) -> torch.Tensor:
        """g for each token of `batch`: `embedded` its tokens' embeddings, `hidden` the hidden
        state each one comes after; `index` the head's layer in `caches`."""
        x = torch.cat((self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden.to(embedded.dtype))), -1)
        return self.norm(self.layer(self.fc(x), batch, caches, index))
