"""The check the one-call layers (engine/kernels/cpu_layers.cpp) share in their tests."""

from __future__ import annotations

import torch


def compare_each_one_call_with_the_chain(monkeypatch, layer_class, record, check: str = "_decodes_in_one_call",
                                         run: str = "_decode_in_one_call", cache_arg: int | None = 2) -> list:
    """Patch layer_class.forward so that each call its `check` accepts also runs `run` (on
    copies of the caches, forward's argument `cache_arg`, where it has them) and asserts that
    its output and the caches it leaves are the bits of forward's chain of kernels (run with
    the check off, on the real caches, whose result the model goes on with). Returns a list
    that gets record(*args) per comparison, so a test can tell that the path ran."""
    chain, compared = layer_class.forward, []

    def both(self, *args):
        if not getattr(self, check)(*args):
            return chain(self, *args)
        copies = args if cache_arg is None else (*args[:cache_arg], tuple(t.clone() for t in args[cache_arg]))
        at_once = getattr(self, run)(*copies)
        with monkeypatch.context() as patched:
            patched.setattr(layer_class, check, lambda *_: False)
            one_by_one = chain(self, *args)
        assert torch.equal(at_once, one_by_one)
        if cache_arg is not None:
            assert all(torch.equal(a, b) for a, b in zip(copies[cache_arg], args[cache_arg]))
        compared.append(record(*args))
        return one_by_one

    monkeypatch.setattr(layer_class, "forward", both)
    return compared
