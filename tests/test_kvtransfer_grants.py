"""The shm grant protocol (kvtransfer/grant_table.py): the grant exists from expect(), a
send lands with no message and no transport thread, a completion waits in shared memory
until someone looks, and a revoked or orphaned grant is reported only once no write of it
can still run."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from kvtransfer import HandoffTarget, TransferConfig, make_transport
from kvtransfer.grant_table import CLAIM, GEN, request_key
from kvtransfer.testing import landed_exactly, make_cache

SRC_BLOCKS, DST_BLOCKS, TOKENS = [4, 5, 6], [10, 11, 12], 10


def pair(watchdog_interval_s: float = 0.01):
    config = TransferConfig(timeout_s=10, watchdog_interval_s=watchdog_interval_s)
    shm = make_transport("shm")
    receiver = shm.receiver("D", make_cache("hybrid", 4, 32, 4, seed=2), config)
    sender = shm.sender("P", make_cache("hybrid", 4, 32, 4, seed=1), config)
    sender.connect("D", receiver.accept("P"))
    return sender, receiver


def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
    return value


def test_grant_is_in_shared_memory_before_begin_and_send_lands_inline():
    sender, receiver = pair(watchdog_interval_s=1.0)  # no watchdog sweep during the test
    try:
        target = HandoffTarget("r1", "D", tuple(DST_BLOCKS), 3)
        receiver.expect(target)
        row = receiver._incoming["r1"].row
        assert receiver._table.find(request_key("r1")) == (row, receiver._incoming["r1"].gen)
        handle = sender.send(target, TOKENS, SRC_BLOCKS, 1, first_token=42)
        # Written and marked done on this thread: the sender's result is already there, and
        # the receiver's poll() finds the landing without any thread having run.
        assert [r.ok for r in sender.poll()] == [True] and handle.state == "done"
        landed = receiver.poll()
        assert [(r.request_id, r.ok, r.first_token, r.num_tokens) for r in landed] == [("r1", True, 42, TOKENS)]
        assert 0 < landed[0].elapsed_s < 5
        assert landed_exactly(sender.cache, SRC_BLOCKS, 1, receiver.cache, DST_BLOCKS, 3, TOKENS) == []
        assert receiver.pending() == [] and receiver._table.rows[row, GEN] == 0  # row given back
    finally:
        sender.close()
        receiver.close()


def test_completion_waits_in_shared_memory_until_polled_and_is_reported_once():
    sender, receiver = pair(watchdog_interval_s=1.0)
    try:
        targets = [HandoffTarget(f"q{i}", "D", (10 + 3 * i, 11 + 3 * i, 12 + 3 * i), i) for i in range(3)]
        for t in targets:
            receiver.expect(t)
        for i, t in enumerate(targets):
            sender.send(t, TOKENS, SRC_BLOCKS, 1, first_token=i)
        assert receiver._results == []  # nobody looked yet: nothing was pushed anywhere
        assert sorted((r.request_id, r.first_token) for r in receiver.poll()) == [("q0", 0), ("q1", 1), ("q2", 2)]
        assert receiver.poll() == [] and receiver.pending() == []
    finally:
        sender.close()
        receiver.close()


def test_cancellation_after_grant_is_reported_at_once_and_refuses_the_late_sender():
    sender, receiver = pair()
    try:
        target = HandoffTarget("c1", "D", tuple(DST_BLOCKS), 3)
        receiver.expect(target)
        receiver.abort("c1", "client went away")
        failed = receiver.poll()  # reported by abort() itself: nobody was writing
        assert [(r.ok, "client went away" in r.error) for r in failed] == [(False, True)]
        before = {n: t.clone() for n, t in receiver.cache.tensors.items()}
        sender.send(target, TOKENS, SRC_BLOCKS, 1, first_token=1)
        result = wait_until(lambda: sender.poll())
        assert not result[0].ok and "not expected" in result[0].error
        assert all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8)) for n, t in receiver.cache.tensors.items())
    finally:
        sender.close()
        receiver.close()


def test_cancellation_while_claimed_waits_for_the_sender_to_let_go():
    sender, receiver = pair()
    try:
        target = HandoffTarget("c2", "D", tuple(DST_BLOCKS), 3)
        receiver.expect(target)
        handle = sender.begin(target, TOKENS, SRC_BLOCKS, 1)
        handle.layer_done(0)
        receiver.abort("c2")
        # The sender's watchdog sees the revoked grant, stops and unlocks; only then the receiver reports.
        assert not wait_until(lambda: receiver.poll())[0].ok
        assert not wait_until(lambda: sender.poll())[0].ok
        after = {n: t.clone() for n, t in receiver.cache.tensors.items()}
        handle.finish(5)  # the prefill completes anyway: no write
        assert all(torch.equal(after[n].view(torch.uint8), t.view(torch.uint8)) for n, t in receiver.cache.tensors.items())
    finally:
        sender.close()
        receiver.close()


def _claim_then_die(offer, conn) -> None:
    sender = make_transport("shm").sender("P", make_cache("hybrid", 4, 32, 4, seed=1), TransferConfig(timeout_s=10))
    sender.connect("D", offer)
    handle = sender.begin(HandoffTarget("dead", "D", tuple(DST_BLOCKS), 3), TOKENS, SRC_BLOCKS, 1)
    handle.layer_done(0)  # claimed, row locked, one layer written
    conn.send("claimed")
    conn.recv()
    os._exit(3)  # dies holding the row's lock


def test_sender_death_after_claim_fails_the_request_and_frees_the_row():
    receiver = make_transport("shm").receiver("D", make_cache("hybrid", 4, 32, 4, seed=2), TransferConfig(timeout_s=30))
    try:
        receiver.expect(HandoffTarget("dead", "D", tuple(DST_BLOCKS), 3))
        row = receiver._incoming["dead"].row
        # spawn, not fork: a child forked from this many-threaded process (torch, numba's
        # workqueue) can abort before it runs a line of the test (seen once in CI).
        here, there = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_claim_then_die, args=(receiver.accept("P"), there))
        child.start()
        there.close()  # the child's end: if the child dies early, recv() ends instead of hanging
        assert here.poll(60) and here.recv() == "claimed"
        assert receiver._table.rows[row, CLAIM] == receiver._incoming["dead"].gen
        here.send("die")
        child.join(10)
        result = wait_until(lambda: receiver.poll(), timeout_s=5)  # well before the 30 s timeout
        assert not result[0].ok and "broke" in result[0].error
        assert receiver.pending() == [] and receiver._table.rows[row, GEN] == 0
        sender = make_transport("shm").sender("P2", make_cache("hybrid", 4, 32, 4, seed=1), TransferConfig(timeout_s=10))
        sender.connect("D", receiver.accept("P2"))
        target = HandoffTarget("after", "D", tuple(DST_BLOCKS), 3)
        receiver.expect(target)
        sender.send(target, TOKENS, SRC_BLOCKS, 1, first_token=9)
        assert wait_until(lambda: receiver.poll())[0].ok
        assert landed_exactly(sender.cache, SRC_BLOCKS, 1, receiver.cache, DST_BLOCKS, 3, TOKENS) == []
        sender.close()
    finally:
        receiver.close()
