"""A guard that fails on any host read of a tensor's values: what a CUDA graph cannot capture
and what stalls a GPU step until the device catches up. It runs on CPU tensors, so CI checks the
CUDA path's code for them (the Triton interpreter's own reads are its business, not ours)."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero,
              torch.nonzero, torch.Tensor.unique, torch.unique, torch.Tensor.bincount, torch.bincount,
              torch.masked_select, torch.Tensor.masked_select, torch.Tensor.__format__, torch.Tensor.__repr__}
# Reads only with some arguments: repeat_interleave sizes its output from tensor repeats.
SOMETIMES = {torch.Tensor.repeat_interleave, torch.repeat_interleave}


def _reads(func, args, kwargs) -> bool:
    if func in HOST_READS:
        return True
    if func in SOMETIMES:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


class HostReadError(AssertionError):
    pass


class _Guard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _reads(func, args, kwargs or {}) and not _from_triton():
            raise HostReadError(f"host read of a tensor value: {getattr(func, '__qualname__', func)}")
        return func(*args, **(kwargs or {}))


def _from_triton() -> bool:
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if "/triton/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def no_host_reads():
    with _Guard():
        yield
