"""Hand-offs land bit-exact: every CPU transport, hybrid and degenerate layouts, several block
sizes, random block ids on both sides, many-to-one and one-to-many, in one process and across
processes."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest

from kvtransfer import BLOCK, HandoffTarget, TransferConfig, make_transport
from kvtransfer.testing import landed_exactly, make_cache, random_request, same_bytes, sender_process

CPU_TRANSPORTS = ["gloo", "shm"]
NUM_BLOCKS, NUM_SLOTS = 40, 8


def plan_requests(rng, layout, count, prefix, receiver, sender_taken, receiver_taken, max_tokens):
    """Random requests: (target, num_tokens, src_blocks, src_slot, first_token)."""
    out = []
    for i in range(count):
        tokens, src_blocks, src_slot = random_request(rng, layout, NUM_BLOCKS, NUM_SLOTS, max_tokens, *sender_taken)
        dst_blocks = rng.sample(sorted(set(range(NUM_BLOCKS)) - receiver_taken[0]), len(src_blocks))
        receiver_taken[0].update(dst_blocks)
        dst_slot = None
        if layout.has_slots:
            dst_slot = rng.choice(sorted(set(range(NUM_SLOTS)) - receiver_taken[1]))
            receiver_taken[1].add(dst_slot)
        target = HandoffTarget(f"{prefix}{i}", receiver, tuple(dst_blocks), dst_slot)
        out.append((target, tokens, src_blocks, src_slot, rng.randrange(1000)))
    return out


def hand_off_layer_by_layer(sender, receiver, layout, jobs):
    """Every job expected, begun, and its layers marked done as a prefill would (layer by layer,
    all requests of the batch), then finished; returns (sender's, receiver's) results."""
    for target, *_ in jobs:
        receiver.expect(target)
    handles = [sender.begin(target, tokens, blocks, slot) for target, tokens, blocks, slot, _ in jobs]
    for layer in layout.layers:
        for handle in handles:
            handle.layer_done(layer)
    for handle, job in zip(handles, jobs):
        handle.finish(job[-1])
    rids = [t.request_id for t, *_ in jobs]
    return sender.wait_for(rids, 20), receiver.wait_for(rids, 20)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("kind, block_size, pipelined", [
    ("hybrid", 1, True), ("hybrid", 5, False), ("hybrid", 16, True),
    ("attention", 4, True), ("attention", 16, False), ("mamba", 16, True), ("novel", 3, True),
    ("deep", 4, True),
])
def test_round_trip_is_bit_exact(transport, kind, block_size, pipelined):
    rng = random.Random(f"{transport}{kind}{block_size}")
    src = make_cache(kind, block_size, NUM_BLOCKS, NUM_SLOTS, seed=1)
    dst = make_cache(kind, block_size, NUM_BLOCKS, NUM_SLOTS, seed=2)
    config = TransferConfig(timeout_s=20, pipeline_layers=pipelined)
    with make_transport(transport).receiver("D", dst, config) as receiver, make_transport(transport).sender("P", src, config) as sender:
        sender.connect("D", receiver.accept("P"))
        max_tokens = min(5 * block_size, NUM_BLOCKS * block_size // 5)
        jobs = plan_requests(rng, src.layout, 4, "r", "D", (set(), set()), (set(), set()), max_tokens)
        sent, landed = hand_off_layer_by_layer(sender, receiver, src.layout, jobs)
    for target, tokens, blocks, slot, first in jobs:
        rid = target.request_id
        assert sent[rid].ok and landed[rid].ok, (sent[rid], landed[rid])
        assert landed[rid].first_token == first and landed[rid].num_tokens == tokens
        assert landed_exactly(src, blocks, slot, dst, list(target.dst_block_ids), target.dst_slot, tokens) == []


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("sizes, pipelined", [((16, 4), True), ((4, 16), False), ((6, 4), True), ((1, 8), False)])
def test_block_sizes_may_differ_between_the_two_sides(transport, sizes, pipelined):
    """Prompt tokens land at the receiver's own block boundaries, token for token, and no row
    outside the reservation changes (a prefill and a decode configured apart, or a rolling
    restart that changes the block size)."""
    p_size, d_size = sizes
    rng = random.Random(f"{transport}{sizes}")
    src = make_cache("hybrid", p_size, NUM_BLOCKS, NUM_SLOTS, seed=1)
    dst = make_cache("hybrid", d_size, NUM_BLOCKS, NUM_SLOTS, seed=2)
    before = {name: t.clone() for name, t in dst.tensors.items()}
    config = TransferConfig(timeout_s=20, pipeline_layers=pipelined)
    free = {side: rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) + rng.sample(range(NUM_SLOTS), NUM_SLOTS) for side in "PD"}
    jobs = []
    for i, tokens in enumerate([1, d_size, p_size + 1, 3 * max(sizes) - 1]):
        blocks, dst_blocks = ([free[side].pop(0) for _ in range(-(-tokens // size))] for side, size in zip("PD", sizes))
        target = HandoffTarget(f"r{i}", "D", tuple(dst_blocks), free["D"].pop())
        jobs.append((target, tokens, blocks, free["P"].pop(), rng.randrange(1000)))
    with make_transport(transport).receiver("D", dst, config) as receiver, make_transport(transport).sender("P", src, config) as sender:
        sender.connect("D", receiver.accept("P"))
        sent, landed = hand_off_layer_by_layer(sender, receiver, src.layout, jobs)
    reserved = {b for t, *_ in jobs for b in t.dst_block_ids}
    slots = {t.dst_slot for t, *_ in jobs}
    for target, tokens, blocks, slot, first in jobs:
        rid = target.request_id
        assert sent[rid].ok and landed[rid].ok and landed[rid].first_token == first, (sent[rid], landed[rid])
        assert landed_exactly(src, blocks, slot, dst, list(target.dst_block_ids), target.dst_slot, tokens) == []
    for spec in dst.layout.specs:
        untouched = [i for i in range(dst.tensors[spec.name].shape[0]) if i not in (reserved if spec.role == BLOCK else slots)]
        assert same_bytes(dst.tensors[spec.name][untouched], before[spec.name][untouched]), spec.name


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_two_senders_one_receiver_and_one_sender_two_receivers_in_process(transport):
    rng = random.Random(transport)
    caches = {name: make_cache("hybrid", 4, NUM_BLOCKS, NUM_SLOTS, seed=i) for i, name in enumerate(["P1", "P2", "D1", "D2"])}
    config = TransferConfig(timeout_s=20)
    t = make_transport(transport)
    receivers = {d: t.receiver(d, caches[d], config) for d in ("D1", "D2")}
    senders = {p: t.sender(p, caches[p], config) for p in ("P1", "P2")}
    links = [("P1", "D1"), ("P2", "D1"), ("P1", "D2")]
    taken = {name: (set(), set()) for name in caches}
    jobs = []
    for p, d in links:
        senders[p].connect(d, receivers[d].accept(p))
        jobs += [(p, d, job) for job in plan_requests(rng, caches[p].layout, 3, f"{p}{d}-", d, taken[p], taken[d], 20)]
    for _, d, (target, *_rest) in jobs:
        receivers[d].expect(target)
    for p, _, (target, tokens, blocks, slot, first) in jobs:
        senders[p].send(target, tokens, blocks, slot, first)
    for d, receiver in receivers.items():
        landed = receiver.wait_for([j[2][0].request_id for j in jobs if j[1] == d], 20)
        assert all(r.ok for r in landed.values()), landed
    for p, d, (target, tokens, blocks, slot, _) in jobs:
        assert landed_exactly(caches[p], blocks, slot, caches[d], list(target.dst_block_ids), target.dst_slot, tokens) == []
    for endpoint in [*senders.values(), *receivers.values()]:
        endpoint.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_across_processes_two_senders_one_receiver_one_sender_two_receivers(transport):
    """P1 (a process) sends to D1 and D2 while P2 (another process) also sends to D1."""
    rng = random.Random(f"mp-{transport}")
    cache_args = {p: dict(kind="hybrid", block_size=4, num_blocks=NUM_BLOCKS, num_slots=NUM_SLOTS, seed=seed)
                  for p, seed in (("P1", 11), ("P2", 12))}
    receivers_caches = {d: make_cache("hybrid", 4, NUM_BLOCKS, NUM_SLOTS, seed=seed) for d, seed in (("D1", 21), ("D2", 22))}
    t = make_transport(transport)
    receivers = {d: t.receiver(d, cache, TransferConfig(timeout_s=60)) for d, cache in receivers_caches.items()}
    layout = receivers_caches["D1"].layout
    taken = {name: (set(), set()) for name in ("P1", "P2", "D1", "D2")}
    plans = {"P1": [("D1", 3), ("D2", 3)], "P2": [("D1", 3)]}
    children, jobs_of = [], {}
    ctx = mp.get_context("spawn")
    for p, links in plans.items():
        jobs = [job for d, n in links for job in plan_requests(rng, layout, n, f"{p}{d}-", d, taken[p], taken[d], 24)]
        for target, *_ in jobs:
            receivers[target.receiver].expect(target)
        offers = [receivers[d].accept(p) for d, _ in links]
        wire_jobs = [((t_.request_id, t_.receiver, t_.dst_block_ids, t_.dst_slot), n, b, s, f) for t_, n, b, s, f in jobs]
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(target=sender_process, args=(transport, p, cache_args[p], offers, wire_jobs, child_end))
        process.start()
        children.append((p, process, parent_end))
        jobs_of[p] = jobs
    try:
        for d, receiver in receivers.items():
            expected = [j[0].request_id for jobs in jobs_of.values() for j in jobs if j[0].receiver == d]
            landed = receiver.wait_for(expected, 60)
            assert all(r.ok for r in landed.values()), landed
        for p, process, conn in children:
            assert conn.poll(60), f"{p} did not report"
            sent = conn.recv()
            assert "error" not in sent and all(ok for ok, _ in sent.values()), sent
            process.join(30)
            assert process.exitcode == 0
    finally:
        for _, process, _ in children:
            if process.is_alive():
                process.kill()
        for receiver in receivers.values():
            receiver.close()
    for p, jobs in jobs_of.items():
        src = make_cache(**cache_args[p])
        for target, tokens, blocks, slot, _ in jobs:
            dst = receivers_caches[target.receiver]
            assert landed_exactly(src, blocks, slot, dst, list(target.dst_block_ids), target.dst_slot, tokens) == []
