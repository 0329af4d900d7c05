"""The host tier's memory: one buffer of its whole budget, taken when the engine starts.

Entries live in byte ranges of it, each tensor a view at an aligned offset. Allocating a
tensor per entry instead page-faults every spill into fresh memory until the tier is full
(the heap grows with it), which costs a CPU worker more than the copy itself
(docs/benchmarks.md, "Tiers below the pool"). Taking the budget up front is what the field's
host caches do (vLLM's CPU offloading, LMCache's local CPU backend), and on a GPU it is what
lets the tier be page-locked once: device -> host spills and host -> device loads then run
asynchronously on the engine's stream instead of blocking the step.

Ranges are handed out first fit and merged with their free neighbours on release; a request
that finds no run long enough gets None, and the tier evicts until one is.
"""

from __future__ import annotations

import bisect
import logging
import math
import weakref

import torch

log = logging.getLogger(__name__)
ALIGNMENT = 64  # every tensor starts on a cache line (and on any element size)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # tensor name -> (shape, dtype)


def specs_of(tensors: dict[str, torch.Tensor]) -> Specs:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def footprint(specs: Specs) -> int:
    """Bytes tensors of `specs` take in an arena, packed one after another."""
    return sum(aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in specs.values())


class HostArena:
    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer.zero_()  # the pages faulted in now, not on the spills that first reach them
        self.pinned = pin and pin_memory(self.buffer)
        if self.pinned:  # unregistered before the buffer's memory goes back (the callback keeps no self)
            weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, self.buffer.data_ptr())
        self._starts: list[int] = [0]  # free runs, sorted by start
        self._lengths: dict[int, int] = {0: nbytes}

    def allocate(self, nbytes: int, align: int = ALIGNMENT) -> int | None:
        """The offset (a multiple of `align`, itself one of ALIGNMENT) of `nbytes` (aligned)
        free bytes, now taken; None where no run holds them."""
        nbytes = aligned(nbytes)
        for i, start in enumerate(self._starts):
            end = start + self._lengths[start]
            first = -(-start // align) * align
            if first + nbytes > end:
                continue
            del self._lengths[start]
            # what is left of the run on either side stays free, in order
            left = [(s, e - s) for s, e in ((start, first), (first + nbytes, end)) if e > s]
            self._starts[i:i + 1] = [s for s, _ in left]
            self._lengths.update(left)
            return first
        return None

    def release(self, offset: int, nbytes: int) -> None:
        """Give back what `allocate(nbytes)` returned at `offset`."""
        nbytes = aligned(nbytes)
        i = bisect.bisect(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + nbytes or i and self._ends_at(i - 1) > offset:
            raise ValueError(f"range {offset}+{nbytes} overlaps a free run: released twice")
        if i < len(self._starts) and self._starts[i] == offset + nbytes:  # merge with the run after
            nbytes += self._lengths.pop(self._starts.pop(i))
        if i and self._ends_at(i - 1) == offset:  # and with the run before
            self._lengths[self._starts[i - 1]] += nbytes
        else:
            self._starts.insert(i, offset)
            self._lengths[offset] = nbytes

    def views(self, offset: int, specs: Specs) -> dict[str, torch.Tensor]:
        """Tensors of `specs`, packed from `offset` in their order."""
        out = {}
        for name, (shape, dtype) in specs.items():
            size = math.prod(shape) * dtype.itemsize
            out[name] = self.buffer[offset: offset + size].view(dtype).view(shape)
            offset += aligned(size)
        return out

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths.values())

    def _ends_at(self, i: int) -> int:
        return self._starts[i] + self._lengths[self._starts[i]]


def page_lock(ptr: int, nbytes: int) -> int:
    """cudaHostRegister `nbytes` of host memory at `ptr` in place (not torch's pinned allocator,
    which rounds a request up to a power of two): its error code, 0 where it worked."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def pin_memory(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer`; False, logged, where that fails: copies then still run, from
    pageable memory, synchronously."""
    if not torch.cuda.is_available() or not buffer.numel():
        return False
    code = page_lock(buffer.data_ptr(), buffer.numel() * buffer.element_size())
    if code != 0:
        log.warning("host cache tier stays pageable (cudaHostRegister: error %d): its copies block the step", code)
    return code == 0
