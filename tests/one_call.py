"""The check the one-call layers (engine/kernels/cpu_layers.cpp) share in their tests."""

from __future__ import annotations

import torch

from engine.decode_stack import DecodeStack


def compare_each_one_call_with_the_chain(monkeypatch, layer_class, record, check: str = "_decodes_in_one_call",
                                         run: str = "_decode_in_one_call", cache_arg: int | None = 2) -> list:
    """Patch layer_class.forward so that each call its `check` accepts also runs `run` (on
    copies of the caches, forward's argument `cache_arg`, where it has them) and asserts that
    its output and the caches it leaves are the bits of forward's chain of kernels (run with
    the check off, on the real caches, whose result the model goes on with). Returns a list
    that gets record(*args) per comparison, so a test can tell that the path ran. The whole
    stack's one call (engine.decode_stack) is off, so decode steps reach the layers;
    compare_decoder_layers_with_the_layer_path checks it against them."""
    chain, compared = layer_class.forward, []
    monkeypatch.setattr(DecodeStack, "plan", lambda *args: None)

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


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bits, so that equal NaNs (poisoned slots) compare equal."""
    return t.view(torch.int32)


def compare_decoder_layers_with_the_layer_path(monkeypatch) -> list:
    """Make every decode step the model runs through the plan of engine.decode_stack
    (runs of layers as one call each, the layer path between them) also run layer by layer from
    the same caches, and assert that the hidden states and every cache tensor left behind are the
    same bits; the model goes on with the layer path's. Returns a list that gets the batch size
    of each comparison."""
    plan_of, compared = DecodeStack.plan, []

    class Both:
        def __init__(self, model, caches, plan):
            self.model, self.caches, self.plan = model, caches, plan

        def run(self, h, batch, run_layer, embeddings=None):
            tensors = self.caches.tensors()
            before = [t.clone() for t in tensors]
            at_once = self.plan.run(h, batch, run_layer, embeddings)
            left = [t.clone() for t in tensors]
            for t, saved in zip(tensors, before):
                t.copy_(saved)
            one_by_one = h
            for index in range(len(self.model.layers)):
                one_by_one = run_layer(index, one_by_one)
            assert torch.equal(bits(at_once), bits(one_by_one))
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(left, tensors))
            compared.append(h.shape[0])
            return one_by_one

    def both(stack, batch, caches):
        plan = plan_of(stack, batch, caches)
        return None if plan is None else Both(stack.model, caches, plan)

    monkeypatch.setattr(DecodeStack, "plan", both)
    return compared
