"""Helpers for tests of the hand-off (importable by spawned processes): small random caches,
a byte-exact landing check, and a sender process body."""

from __future__ import annotations

import random

import torch

from kvtransfer.config import TransferConfig
from kvtransfer.layout import BLOCK, CacheTensors
from kvtransfer.messages import HandoffTarget
from kvtransfer.transport import make_transport

LAYOUT_KINDS = ("hybrid", "attention", "mamba", "novel", "deep")


def make_cache(kind: str, block_size: int, num_blocks: int, num_slots: int, seed: int, device: str = "cpu",
               heads: int = 2, head_dim: int = 8, d_inner: int = 24) -> CacheTensors:
    """Random bytes in every row (NaN patterns included): a copy must be exact, not merely close."""
    generator = torch.Generator().manual_seed(seed)

    def filled(shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        t.view(torch.uint8).random_(0, 256, generator=generator)
        return t.to(device)

    kv = (num_blocks, block_size, heads, head_dim)
    attention, state = {}, {}
    if kind == "hybrid":
        state = {0: ("mamba", {"conv": filled((num_slots, d_inner, 4), torch.bfloat16),
                               "ssm": filled((num_slots, d_inner, 8), torch.float32)}),
                 2: ("mamba2", {"conv": filled((num_slots, d_inner, 4), torch.bfloat16),
                                "ssm": filled((num_slots, 3, d_inner, 8), torch.float32)})}
        attention = {1: (filled(kv, torch.bfloat16), filled(kv, torch.bfloat16)),
                     3: (filled(kv, torch.bfloat16), filled(kv, torch.bfloat16))}
    elif kind == "attention":
        attention = {i: (filled(kv, torch.float16), filled(kv, torch.float16)) for i in range(3)}
    elif kind == "mamba":
        state = {i: ("mamba", {"conv": filled((num_slots, d_inner, 4), torch.float32),
                               "ssm": filled((num_slots, d_inner, 8), torch.float32)}) for i in range(3)}
    elif kind == "novel":  # a state kind nothing in kvtransfer has heard of: 3 tensors, 3 dtypes, odd shapes
        state = {0: ("some_future_kind", {"conv": filled((num_slots, d_inner, 3), torch.bfloat16),
                                          "recurrent": filled((num_slots, 3, 7, 5), torch.float32),
                                          "step": filled((num_slots, 1), torch.int32)})}
        attention = {1: (filled(kv, torch.bfloat16), filled(kv, torch.bfloat16))}
    elif kind == "deep":  # 48 layers: 96 tensors, more storages than fit the old 64-descriptor message
        attention = {i: (filled(kv, torch.bfloat16), filled(kv, torch.bfloat16)) for i in range(0, 48, 4)}
        state = {i: ("mamba", {"conv": filled((num_slots, d_inner, 4), torch.bfloat16),
                               "ssm": filled((num_slots, d_inner, 8), torch.float32)})
                 for i in range(48) if i % 4}
    else:
        raise ValueError(f"unknown layout kind {kind!r}; one of {LAYOUT_KINDS}")
    return CacheTensors.hybrid(block_size, attention, state)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def landed_exactly(src: CacheTensors, src_blocks: list[int], src_slot: int | None,
                   dst: CacheTensors, dst_blocks: list[int], dst_slot: int | None, num_tokens: int) -> list[str]:
    """Names of tensors whose prompt tokens (block tensors) or slot rows differ between the
    sender's and the receiver's copy (empty: exact); the two block sizes may differ."""
    bad = []
    for spec in src.layout.specs:
        s, d = src.tensors[spec.name].cpu(), dst.tensors[spec.name].cpu()
        if spec.role == BLOCK:
            ok = same_bytes(token_rows(s, src_blocks, num_tokens), token_rows(d, dst_blocks, num_tokens))
        else:
            ok = same_bytes(s[src_slot], d[dst_slot])
        if not ok:
            bad.append(spec.name)
    return bad


def token_rows(blocks: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Tokens 0..num_tokens-1 of a request from a [num_blocks, block_size, ...] tensor."""
    size = blocks.shape[1]
    tokens = torch.arange(num_tokens)
    ids = torch.tensor(list(block_ids), dtype=torch.long)[tokens // size] * size + tokens % size
    return blocks.reshape(-1, *blocks.shape[2:])[ids]


def random_request(rng: random.Random, layout, num_blocks: int, num_slots: int, max_tokens: int,
                   taken_blocks: set[int], taken_slots: set[int]) -> tuple[int, list[int], int | None]:
    """(num_tokens, block ids, slot) not overlapping earlier picks on the same cache."""
    num_tokens = rng.randint(1, max_tokens)
    needed = layout.num_blocks_for(num_tokens)
    blocks = rng.sample(sorted(set(range(num_blocks)) - taken_blocks), needed)
    slot = rng.choice(sorted(set(range(num_slots)) - taken_slots)) if layout.has_slots else None
    taken_blocks.update(blocks)
    if slot is not None:
        taken_slots.add(slot)
    return num_tokens, blocks, slot


def sender_process(transport: str, name: str, cache_args: dict, offers: list, jobs: list, conn, pipelined_layers: bool = True) -> None:
    """A prefill worker in a child process: connect, send every job at once, report results."""
    torch.set_num_threads(1)
    cache = make_cache(**cache_args)
    sender = make_transport(transport).sender(name, cache, TransferConfig(timeout_s=30))
    try:
        for offer in offers:
            sender.connect(offer.receiver, offer)
        handles = [sender.begin(HandoffTarget(*target), num_tokens, src_blocks, src_slot)
                   for target, num_tokens, src_blocks, src_slot, _ in jobs]
        if pipelined_layers:
            for layer in cache.layout.layers:
                for handle in handles:
                    handle.layer_done(layer)
        for handle, job in zip(handles, jobs):
            handle.finish(job[-1])
        results = sender.wait_for([h.request_id for h in handles], 30)
        conn.send({rid: (r.ok, r.error) for rid, r in results.items()})
    except Exception as error:  # reported to the parent, which fails the test with it
        conn.send({"error": f"{type(error).__name__}: {error}"})
    finally:
        sender.close()
