"""Hand-offs streamed while the prompt prefills in chunks: KV rows go as each chunk finishes
them, the rest and the recurrent state at finish(). Exact whatever the chunking and block
sizes, never a row before its chunk wrote it, other requests' hand-offs are not held behind a
long prefill, and a failure mid-stream fails only its request."""

from __future__ import annotations

import random
import time

import pytest

import kvtransfer.stream_channel
from kvtransfer import BLOCK, HandoffTarget, TransferConfig, make_transport
from kvtransfer.messages import WireHeader
from kvtransfer.testing import landed_exactly, make_cache
from tests.test_kvtransfer_failures import CPU_TRANSPORTS, connected, send_ok, start, wait_until

NUM_BLOCKS, NUM_SLOTS = 96, 6


@pytest.fixture(autouse=True)
def one_row_parts(monkeypatch):
    """Tiny test caches: every chunk's rows make a part of their own (the default waits for 256 KiB)."""
    monkeypatch.setattr(kvtransfer.stream_channel, "MIN_PART_BYTES", 1)


def write_tokens(dst, final, block_ids: list[int], first: int, end: int) -> None:
    """What a prefill chunk does to the cache: tokens [first, end) of every block tensor take
    their final bytes (the rest of a partly written block is left as it is)."""
    for spec in dst.layout.specs:
        if spec.role != BLOCK:
            continue
        size = dst.tensors[spec.name].shape[1]
        for t in range(first, end):
            block, offset = block_ids[t // size], t % size
            dst.tensors[spec.name][block, offset] = final.tensors[spec.name][block, offset]


def write_state(dst, final, slot: int) -> None:
    for spec in dst.layout.specs:
        if spec.role != BLOCK:
            dst.tensors[spec.name][slot] = final.tensors[spec.name][slot]


def chunks(rng: random.Random, num_tokens: int, cached: int) -> list[int]:
    """Ends of random chunks after a cached prefix, the last one ending at num_tokens."""
    ends, at = [], cached
    while at < num_tokens:
        at = min(num_tokens, at + rng.randint(1, 9))
        ends.append(at)
    return ends


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("kind, sizes", [("hybrid", (4, 4)), ("hybrid", (6, 4)), ("hybrid", (1, 8)),
                                         ("attention", (16, 16)), ("mamba", (4, 4)), ("deep", (4, 8))])
def test_streamed_hand_offs_land_exactly_and_never_send_a_row_before_its_chunk(transport, kind, sizes):
    """The sender's cache holds stale bytes until each chunk writes its tokens (a partial block
    row is written by two chunks), so a row sent before its chunk finished lands stale."""
    p_size, d_size = sizes
    rng = random.Random(f"{transport}{kind}{sizes}")
    src = make_cache(kind, p_size, NUM_BLOCKS, NUM_SLOTS, seed=1)  # stale until written
    final = make_cache(kind, p_size, NUM_BLOCKS, NUM_SLOTS, seed=3)
    dst = make_cache(kind, d_size, NUM_BLOCKS, NUM_SLOTS, seed=2)
    free = {side: rng.sample(range(NUM_BLOCKS), NUM_BLOCKS) for side in "PD"}
    jobs = []
    for i, tokens in enumerate([1, 13, 40, 3 * max(sizes) + 1]):
        blocks = [free["P"].pop() for _ in range(-(-tokens // p_size))] if src.layout.has_blocks else []
        dst_blocks = [free["D"].pop() for _ in range(-(-tokens // d_size))] if src.layout.has_blocks else []
        slot = i if src.layout.has_slots else None
        cached = rng.choice([0, 0, tokens // 2])
        jobs.append((HandoffTarget(f"r{i}", "D", tuple(dst_blocks), slot), tokens, blocks, slot, cached, chunks(rng, tokens, cached)))
    config = TransferConfig(timeout_s=20)
    with make_transport(transport).receiver("D", dst, config) as receiver, make_transport(transport).sender("P", src, config) as sender:
        sender.connect("D", receiver.accept("P"))
        handles = []
        for target, tokens, blocks, slot, cached, _ in jobs:
            receiver.expect(target)
            write_tokens(src, final, blocks, 0, cached)  # a prefix-cache hit: computed before it began
            handles.append(sender.begin(target, tokens, blocks, slot, computed_tokens=cached))
        steps = max(len(c) for *_, c in jobs)
        for step in range(steps):  # one engine step: every request runs its next chunk
            for handle, (target, _, blocks, slot, cached, ends) in zip(handles, jobs):
                if step < len(ends):
                    write_tokens(src, final, blocks, cached if step == 0 else ends[step - 1], ends[step])
                    if step + 1 < len(ends):
                        handle.tokens_done(ends[step])
                    else:  # its last chunk: the state is final and the first token sampled
                        if slot is not None:
                            write_state(src, final, slot)
                        handle.finish(100 + int(target.request_id[1:]))
        rids = [t.request_id for t, *_ in jobs]
        sent, landed = sender.wait_for(rids, 20), receiver.wait_for(rids, 20)
    for target, tokens, blocks, slot, *_ in jobs:
        rid = target.request_id
        assert sent[rid].ok and landed[rid].ok, (sent[rid], landed[rid])
        assert landed[rid].first_token == 100 + int(rid[1:]) and landed[rid].num_tokens == tokens
        assert landed_exactly(src, blocks, slot, dst, list(target.dst_block_ids), slot, tokens) == []


def test_a_short_hand_off_is_not_held_behind_a_long_streaming_prefill():
    """Gloo keeps one ordered stream per pair: a request sent whole while a long prompt is
    still prefilling lands at once, between that prompt's parts."""
    with connected("gloo") as (prefill, decode, sender, receiver):
        long_target, long_blocks, long_slot = start(prefill, decode, receiver, "long", num_tokens=24)
        streaming = sender.begin(long_target, 24, long_blocks, long_slot, computed_tokens=0)
        streaming.tokens_done(8)
        wait_until(lambda: receiver._incoming["long"].rows_landed == 2)  # its first part landed
        send_ok(prefill, decode, sender, receiver, "short")  # lands while "long" still prefills
        assert "long" not in decode.results and receiver.pending() == ["long"]
        streaming.tokens_done(16)
        streaming.finish(7)
        wait_until(lambda: "long" in decode.results and "long" in prefill.results)
        assert decode.results["long"].ok and decode.results["long"].first_token == 7
        assert landed_exactly(prefill.cache, long_blocks, long_slot, decode.cache, list(long_target.dst_block_ids),
                              long_target.dst_slot, 24) == []


def landing_stream(prefill, decode, sender, receiver, rid: str):
    """A 24-token hand-off streamed through its first 8 tokens, landing on the receiver."""
    target, blocks, slot = start(prefill, decode, receiver, rid, num_tokens=24)
    handle = sender.begin(target, 24, blocks, slot, computed_tokens=4)
    handle.tokens_done(8)
    wait_until(lambda: receiver._incoming[rid].state == "landing")
    return handle


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_sender_abort_mid_stream_fails_both_sides_and_the_channel_goes_on(transport):
    with connected(transport) as (prefill, decode, sender, receiver):
        handle = landing_stream(prefill, decode, sender, receiver, "cut")
        handle.abort("prefill hit an error")
        wait_until(lambda: "cut" in decode.results and "cut" in prefill.results)
        assert not decode.results["cut"].ok and "prefill hit an error" in prefill.results["cut"].error
        assert prefill.all_free() and decode.all_free()
        send_ok(prefill, decode, sender, receiver, "next")


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_receiver_abort_mid_stream_stops_writes_before_reporting(transport):
    with connected(transport) as (prefill, decode, sender, receiver):
        handle = landing_stream(prefill, decode, sender, receiver, "gone")
        receiver.abort("gone", "client went away")
        wait_until(lambda: "gone" in decode.results)
        after_failure = decode.snapshot()
        handle.tokens_done(16)  # the prefill goes on: its later parts must not land
        handle.finish(3)
        wait_until(lambda: "gone" in prefill.results)
        assert prefill.results["gone"].ok == (transport == "gloo")  # gloo: sent and drained; shm: revoked
        assert decode.unchanged_since(after_failure), "rows were written after the failure was reported"
        assert prefill.all_free() and decode.all_free()
        send_ok(prefill, decode, sender, receiver, "next")


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_streaming_hand_off_times_out_from_its_latest_progress(transport):
    """A long prefill outlives the sender's timeout while it makes progress; a stalled one does not."""
    with connected(transport) as (prefill, decode, sender, receiver):
        target, blocks, slot = start(prefill, decode, receiver, "slow", num_tokens=24)
        handle = sender.begin(target, 24, blocks, slot, timeout_s=0.3, computed_tokens=0)
        for done in (4, 8, 12, 16, 20):  # 0.5 s of progress, past the 0.3 s timeout
            time.sleep(0.1)
            handle.tokens_done(done)
        handle.finish(9)
        wait_until(lambda: "slow" in decode.results and "slow" in prefill.results)
        assert decode.results["slow"].ok and prefill.results["slow"].ok, (decode.results["slow"], prefill.results["slow"])
        target, blocks, slot = start(prefill, decode, receiver, "stalled", num_tokens=24)
        sender.begin(target, 24, blocks, slot, timeout_s=0.3, computed_tokens=0).tokens_done(8)
        wait_until(lambda: "stalled" in prefill.results)
        assert "timed out" in prefill.results["stalled"].error
        wait_until(lambda: prefill.all_free())


def test_tokens_done_needs_a_streaming_hand_off_and_part_headers_round_trip():
    with connected("shm") as (prefill, decode, sender, receiver):
        target, blocks, slot = start(prefill, decode, receiver, "whole")
        handle = sender.begin(target, 10, blocks, slot)
        with pytest.raises(ValueError, match="not begun with computed_tokens"):
            handle.tokens_done(4)
        handle.finish(1)
    part = WireHeader("r", 40, 10, 2, 77, False, 3, 7, final=False)
    assert WireHeader.decode(part.encode()) == part and not part.final
    assert WireHeader("r", 40, 10, None, 77, True).end_row == 10
    with pytest.raises(ValueError, match="outside"):
        WireHeader("r", 40, 10, None, 77, False, 4, 11)


def landed(receiver, rid: str) -> int:
    """Block rows of a streamed hand-off landed so far, once the receiver sees it landing."""
    incoming = receiver._incoming[rid]
    return receiver._rows_landed(incoming) if incoming.state == "landing" else -1


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_streaming_reservation_is_renewed_only_while_rows_keep_landing(transport):
    """The router renews reservations while the prefill worker steps (keep_waiting): a hand-off
    streamed through a prefill longer than the receiver's timeout lands, because each renewal
    finds more rows landed; one whose rows stop coming is refused renewal and times out."""
    with connected(transport) as (prefill, decode, sender, receiver):
        target, blocks, slot = start(prefill, decode, receiver, "long", num_tokens=40, receiver_timeout=0.5)
        handle = sender.begin(target, 40, blocks, slot, computed_tokens=0)
        for done in range(4, 40, 4):  # 1.4 s of prefill, nearly three receiver timeouts long
            handle.tokens_done(done)
            wait_until(lambda done=done: landed(receiver, "long") == done // 4, timeout_s=0.4)
            assert receiver.keep_waiting("long")
            time.sleep(0.15)
        assert not receiver.keep_waiting("long")  # nothing landed since the last renewal
        handle.finish(6)
        wait_until(lambda: "long" in decode.results and "long" in prefill.results)
        assert decode.results["long"].ok, decode.results["long"]
        target, blocks, slot = start(prefill, decode, receiver, "stuck", num_tokens=40, receiver_timeout=0.5)
        handle = sender.begin(target, 40, blocks, slot, computed_tokens=0)
        handle.tokens_done(8)
        wait_until(lambda: landed(receiver, "stuck") == 2, timeout_s=0.4)
        assert receiver.keep_waiting("stuck")  # its first part landed
        deadline = time.monotonic() + 5
        while "stuck" not in decode.results:  # the router goes on asking; nothing more lands
            assert time.monotonic() < deadline
            assert not receiver.keep_waiting("stuck") or "stuck" in decode.results
            time.sleep(0.05)
        assert "timed out" in decode.results["stuck"].error
        handle.abort("the test is over")
        wait_until(lambda: prefill.all_free() and decode.all_free())
