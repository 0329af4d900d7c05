"""Tensor-parallel process groups: who this rank is, and the two collectives sharded layers use.

`all_reduce` sums and `all_gather` concatenates in rank order, and every rank gets the same
bits: replicated computations after a collective (norms, MoE routing) then agree on every rank
without further communication. Both may work in place on their argument: callers use the
returned tensor and never read the argument again.

- SingleRank: size 1, collectives are the identity.
- DistGroup: a torch.distributed process group (gloo on CPU, nccl on GPU: the same code).
- ThreadGroup: N ranks as N threads of one process (tests), meeting at a barrier.
"""

from __future__ import annotations

import threading

import torch


class TPGroup:
    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class SingleRank(TPGroup):
    rank, size = 0, 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t


class DistGroup(TPGroup):
    """A torch.distributed process group (None: the default world group)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)


class _Meeting:
    """Where the threads of one ThreadGroup exchange tensors: each posts its tensor, all wait,
    each combines all posts itself (same order, same bits), all wait again before the next post."""

    def __init__(self, size: int, timeout: float):
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.posts: list = [None] * size

    def exchange(self, rank: int, t: torch.Tensor, combine):
        self.posts[rank] = t
        self.barrier.wait()
        out = combine(self.posts)
        self.barrier.wait()
        return out


class ThreadGroup(TPGroup):
    def __init__(self, meeting: _Meeting, rank: int, size: int):
        self._meeting, self.rank, self.size = meeting, rank, size

    @classmethod
    def create(cls, size: int, timeout: float = 120.0) -> list[ThreadGroup]:
        """One group object per rank; a collective some rank never joins fails after `timeout`
        seconds (threading.BrokenBarrierError) instead of hanging."""
        meeting = _Meeting(size, timeout)
        return [cls(meeting, rank, size) for rank in range(size)]

    def abort(self) -> None:
        """Break the barrier: every rank waiting in (or later entering) a collective raises."""
        self._meeting.barrier.abort()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        def total(posts):
            out = posts[0].clone()
            for p in posts[1:]:
                out += p
            return out
        return self._meeting.exchange(self.rank, t, total)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._meeting.exchange(self.rank, t, lambda posts: torch.cat(posts, dim=dim))


def run_in_threads(size: int, fn, timeout: float = 120.0) -> list:
    """fn(group) on `size` ThreadGroup ranks, one thread each; results in rank order. The first
    rank to raise breaks the barrier (so the others stop too) and its exception is re-raised."""
    groups = ThreadGroup.create(size, timeout)
    results: list = [None] * size
    errors: list = [None] * size

    def body(rank: int):
        try:
            results[rank] = fn(groups[rank])
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[rank] = e
            groups[rank].abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A rank's own failure first: BrokenBarrierError on the others is only its echo.
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results
