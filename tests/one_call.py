"""The check the one-call decode layers (engine/kernels/cpu_layers.cpp) share in their tests."""

from __future__ import annotations

import torch


def compare_each_one_call_with_the_chain(monkeypatch, layer_class, record) -> list:
    """Patch layer_class.forward so that each call its `_decodes_in_one_call` accepts also runs
    `_decode_in_one_call` on copies of the caches and asserts that its output and the caches
    it leaves are the bits of forward's chain of kernels (run with the check off, on the real
    caches, whose result the model goes on with). Returns a list that gets record(x, batch)
    per comparison, so a test can tell that the path ran."""
    chain, compared = layer_class.forward, []

    def both(self, x, batch, cache):
        if not self._decodes_in_one_call(x, batch, cache):
            return chain(self, x, batch, cache)
        copies = tuple(t.clone() for t in cache)
        at_once = self._decode_in_one_call(x, batch, copies)
        with monkeypatch.context() as patched:
            patched.setattr(layer_class, "_decodes_in_one_call", lambda *args: False)
            one_by_one = chain(self, x, batch, cache)
        assert torch.equal(at_once, one_by_one)
        assert all(torch.equal(a, b) for a, b in zip(copies, cache))
        compared.append(record(x, batch))
        return one_by_one

    monkeypatch.setattr(layer_class, "forward", both)
    return compared
