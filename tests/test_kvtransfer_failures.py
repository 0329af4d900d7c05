"""Hand-off failures: each fails its request alone, both sides free every block and slot (through
the engine's allocators, driven by on_done), freed rows are never written late, and a layout
mismatch is refused at the handshake."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from engine.block_manager import BlockManager
from engine.state_slots import StateSlotAllocator
from kvtransfer import ChannelClosedError, HandoffTarget, LayoutMismatchError, TransferConfig, make_transport
from kvtransfer.testing import landed_exactly, make_cache

CPU_TRANSPORTS = ["gloo", "shm"]


class Worker:
    """A cache plus the engine's allocators; on_done frees the request like a worker would."""

    def __init__(self, cache):
        self.cache = cache
        self.blocks = BlockManager(cache.num_blocks, cache.layout.block_size)
        self.slots = StateSlotAllocator(cache.num_slots)
        self.results = {}
        self._lock = threading.Lock()

    def reserve(self, rid: str, num_tokens: int):
        with self._lock:
            return list(self.blocks.allocate(rid, num_tokens)), self.slots.allocate(rid)

    def on_done(self, result) -> None:
        with self._lock:
            self.results[result.request_id] = result
            self.blocks.free(result.request_id)
            self.slots.free(result.request_id)

    def all_free(self) -> bool:
        with self._lock:
            self.blocks.check_integrity()
            self.slots.check_integrity()
            return self.blocks.num_free_blocks == self.blocks.num_blocks and self.slots.num_free_slots == self.slots.num_slots

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.cache.tensors.items()}

    def unchanged_since(self, snapshot) -> bool:
        return all(torch.equal(snapshot[n].view(torch.uint8), t.view(torch.uint8)) for n, t in self.cache.tensors.items())


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@contextlib.contextmanager
def connected(transport_name: str):
    """(prefill worker, decode worker, sender, receiver), the sender connected to the receiver."""
    transport = make_transport(transport_name)
    prefill, decode = Worker(make_cache("hybrid", 4, 32, 4, seed=1)), Worker(make_cache("hybrid", 4, 32, 4, seed=2))
    config = TransferConfig(timeout_s=10)
    with transport.receiver("D", decode.cache, config, on_done=decode.on_done) as receiver, \
            transport.sender("P", prefill.cache, config, on_done=prefill.on_done) as sender:
        sender.connect("D", receiver.accept("P"))
        yield prefill, decode, sender, receiver


@pytest.fixture(params=CPU_TRANSPORTS)
def pair(request):
    """(transport, prefill worker, decode worker, sender, receiver) over the transport under test."""
    with connected(request.param) as workers:
        yield request.param, *workers


def announcing_threads(monkeypatch) -> list[str]:
    """The names of the threads that announce each Gloo hand-off, in order."""
    from kvtransfer.gloo import GlooWire

    threads, announce = [], GlooWire.announce
    monkeypatch.setattr(
        GlooWire,
        "announce",
        lambda self, header: threads.append(threading.current_thread().name) or announce(self, header),
    )
    return threads


def start(prefill, decode, receiver, rid, num_tokens=10, receiver_timeout=None, target_blocks=None):
    """Reserve on both sides and register the reservation; returns (target, src_blocks, src_slot)."""
    src_blocks, src_slot = prefill.reserve(rid, num_tokens)
    dst_blocks, dst_slot = decode.reserve(rid, num_tokens)
    receiver.expect(HandoffTarget(rid, "D", tuple(dst_blocks), dst_slot), timeout_s=receiver_timeout)
    target = HandoffTarget(rid, "D", tuple(target_blocks or dst_blocks), dst_slot)
    return target, src_blocks, src_slot


def send_ok(prefill, decode, sender, receiver, rid):
    """A normal hand-off on the same channel (the failure before it failed alone); returns its rows."""
    target, src_blocks, src_slot = start(prefill, decode, receiver, rid, num_tokens=7)
    sender.send(target, 7, src_blocks, src_slot, first_token=3)
    wait_until(lambda: rid in decode.results and rid in prefill.results)
    assert decode.results[rid].ok and decode.results[rid].first_token == 3, decode.results[rid]
    assert landed_exactly(prefill.cache, src_blocks, src_slot, decode.cache, list(target.dst_block_ids), target.dst_slot, 7) == []
    return list(target.dst_block_ids), target.dst_slot


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("theirs, expected", [
    (dict(kind="hybrid", block_size=8, head_dim=16), "layer1.k: token shape (2, 16) vs (2, 8)"),
    (dict(kind="attention", block_size=4), "layer 0: attention vs mamba"),
    (dict(kind="hybrid", block_size=4, d_inner=32), "layer0.conv: row_shape (32, 4) vs (24, 4)"),
])
def test_layout_mismatch_is_refused_at_handshake(transport, theirs, expected):
    t = make_transport(transport)
    receiver = t.receiver("D", make_cache("hybrid", 4, 8, 2, seed=0))
    sender = t.sender("P", make_cache(num_blocks=8, num_slots=2, seed=0, **theirs))
    with pytest.raises(LayoutMismatchError, match="between sender P and receiver D") as info:
        sender.connect("D", receiver.accept("P"))
    assert expected in str(info.value)
    wait_until(lambda: "P" in receiver.channel_errors)
    assert "mismatch" in receiver.channel_errors["P"]
    slot = 0 if sender.layout.has_slots else None
    with pytest.raises(ChannelClosedError, match="no channel to receiver 'D'"):
        sender.begin(HandoffTarget("r", "D", (0,), slot), 3, [0], slot)
    sender.close()
    receiver.close()


def test_receiver_timeout_with_nothing_sent_fails_that_request_alone(pair):
    _, prefill, decode, sender, receiver = pair
    start(prefill, decode, receiver, "never", receiver_timeout=0.2)
    send_ok(prefill, decode, sender, receiver, "fine")
    wait_until(lambda: "never" in decode.results)
    assert not decode.results["never"].ok and "timed out after 0.2s while waiting" in decode.results["never"].error
    prefill.on_done(decode.results["never"])  # the prefill never ran it: its caller frees it
    assert prefill.all_free() and decode.all_free()
    assert receiver.pending() == [] and sender.pending() == []


def test_a_waiting_reservation_kept_alive_outlives_its_timeout_then_expires(pair):
    """The router renews a reservation whose hand-off has not begun while the prefill worker
    works through its queue; renewals stop, the timeout applies again. A hand-off that has
    begun is not renewable."""
    _, prefill, decode, sender, receiver = pair
    start(prefill, decode, receiver, "queued", receiver_timeout=0.3)
    began = time.monotonic()
    while time.monotonic() - began < 0.9:  # three timeouts long
        assert receiver.keep_waiting("queued")
        time.sleep(0.05)
    assert "queued" not in decode.results and receiver.pending() == ["queued"]
    wait_until(lambda: "queued" in decode.results)
    assert "timed out after 0.3s while waiting" in decode.results["queued"].error
    assert not receiver.keep_waiting("queued") and not receiver.keep_waiting("never-reserved")
    prefill.on_done(decode.results["queued"])
    target, src_blocks, src_slot = start(prefill, decode, receiver, "landing", receiver_timeout=0.5)
    sender.begin(target, 10, src_blocks, src_slot, timeout_s=0.4).layer_done(1)  # then it stalls
    wait_until(lambda: not receiver.keep_waiting("landing"))  # refused once the sender announced it
    wait_until(lambda: "landing" in decode.results and "landing" in prefill.results)
    assert not decode.results["landing"].ok and "timed out" in prefill.results["landing"].error
    assert prefill.all_free() and decode.all_free()


def test_stalled_prefill_times_out_on_both_sides(pair):
    _, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "stalled", receiver_timeout=0.5)
    handle = sender.begin(target, 10, src_blocks, src_slot, timeout_s=0.4)
    handle.layer_done(1)  # the prefill stops after layer 1 and never finishes
    wait_until(lambda: "stalled" in decode.results and "stalled" in prefill.results)
    assert not decode.results["stalled"].ok and not prefill.results["stalled"].ok
    assert "timed out" in prefill.results["stalled"].error and "stalled" in decode.results["stalled"].error
    assert prefill.all_free() and decode.all_free()
    send_ok(prefill, decode, sender, receiver, "next")


def test_late_arrival_after_timeout_never_writes_the_freed_rows(pair):
    transport, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "late", receiver_timeout=0.1)
    wait_until(lambda: "late" in decode.results)
    assert decode.all_free()  # its blocks and slot could now belong to anyone
    before = decode.snapshot()
    sender.send(target, 10, src_blocks, src_slot, first_token=1)
    wait_until(lambda: "late" in prefill.results)
    # shm refuses before writing; gloo has no back channel: the bytes left, the receiver drained them
    assert prefill.results["late"].ok == (transport == "gloo")
    blocks, slot = send_ok(prefill, decode, sender, receiver, "after")  # lands after the drain: same stream
    for spec in decode.cache.layout.specs:
        written = set(blocks) if spec.role == "block" else {slot}
        now, then = decode.cache.tensors[spec.name], before[spec.name]
        untouched = [r for r in range(now.shape[0]) if r not in written]
        assert torch.equal(now[untouched].view(torch.uint8), then[untouched].view(torch.uint8)), spec.name
    assert prefill.all_free() and decode.all_free()


def test_sender_abort_mid_transfer_fails_both_sides(pair):
    _, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "aborted")
    handle = sender.begin(target, 10, src_blocks, src_slot)
    handle.layer_done(0)
    wait_until(lambda: receiver._incoming["aborted"].state == "landing")
    handle.abort("prefill hit an error")
    wait_until(lambda: "aborted" in decode.results and "aborted" in prefill.results)
    assert not decode.results["aborted"].ok and not prefill.results["aborted"].ok
    assert "prefill hit an error" in prefill.results["aborted"].error
    assert prefill.all_free() and decode.all_free()
    send_ok(prefill, decode, sender, receiver, "next")


def test_receiver_abort_while_landing_stops_writes_before_reporting(pair):
    transport, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "cancelled")
    handle = sender.begin(target, 10, src_blocks, src_slot)
    handle.layer_done(0)
    wait_until(lambda: receiver._incoming["cancelled"].state == "landing")
    receiver.abort("cancelled", "client went away")
    wait_until(lambda: "cancelled" in decode.results)
    assert "client went away" in decode.results["cancelled"].error
    after_failure = decode.snapshot()
    handle.finish(5)  # the rest of the prefill completes anyway
    wait_until(lambda: "cancelled" in prefill.results)
    # shm: the receiver revoked the grant; gloo: the rest was sent and drained
    assert prefill.results["cancelled"].ok == (transport == "gloo")
    assert decode.unchanged_since(after_failure), "rows were written after the failure was reported"
    assert prefill.all_free() and decode.all_free()
    send_ok(prefill, decode, sender, receiver, "next")


def test_sender_disconnect_fails_its_landing_requests(pair):
    _, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "orphan")
    handle = sender.begin(target, 10, src_blocks, src_slot)
    handle.layer_done(0)
    wait_until(lambda: receiver._incoming["orphan"].state == "landing")
    sender.close()
    wait_until(lambda: "orphan" in decode.results and "orphan" in prefill.results)
    assert not decode.results["orphan"].ok and not prefill.results["orphan"].ok
    assert prefill.all_free() and decode.all_free()


def test_sender_aiming_at_other_rows_is_refused(pair):
    transport, prefill, decode, sender, receiver = pair
    target, src_blocks, src_slot = start(prefill, decode, receiver, "misrouted", target_blocks=[30, 31, 29])
    before = decode.snapshot()
    sender.send(target, 10, src_blocks, src_slot, first_token=1)
    wait_until(lambda: "misrouted" in decode.results and "misrouted" in prefill.results)
    assert "differ from the reservation" in decode.results["misrouted"].error
    assert prefill.results["misrouted"].ok == (transport == "gloo")
    assert decode.unchanged_since(before)
    assert prefill.all_free() and decode.all_free()
    send_ok(prefill, decode, sender, receiver, "next")


def test_bad_arguments_are_refused_before_any_byte_moves(pair):
    _, prefill, decode, sender, receiver = pair
    with pytest.raises(ChannelClosedError, match="no channel to receiver 'X'"):
        sender.begin(HandoffTarget("r", "X", (0, 1, 2), 0), 10, [0, 1, 2], 0)
    with pytest.raises(ValueError, match="10 tokens need 3 source and 3 destination blocks; got 2 source, 3 destination"):
        sender.begin(HandoffTarget("r", "D", (0, 1, 2), 0), 10, [0, 1], 0)
    with pytest.raises(ValueError, match="got 3 source, 2 destination ids"):
        sender.begin(HandoffTarget("r", "D", (0, 1), 0), 10, [0, 1, 2], 0)
    with pytest.raises(ValueError, match=r"request r \(sender\): block ids \[99\] outside"):
        sender.begin(HandoffTarget("r", "D", (0, 1, 2), 0), 10, [0, 1, 99], 0)
    with pytest.raises(ValueError, match="state slot 9 outside"):
        receiver.expect(HandoffTarget("r", "D", (0, 1, 2), 9))
    with pytest.raises(ValueError, match="names receiver 'E'"):
        receiver.expect(HandoffTarget("r", "E", (0, 1, 2), 0))
    receiver.expect(HandoffTarget("dup", "D", (0,), 0))
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect(HandoffTarget("dup", "D", (1,), 1))
    receiver.abort("dup")
    wait_until(lambda: "dup" in decode.results)


def test_a_finished_prefill_on_an_idle_gloo_channel_is_posted_by_the_caller(monkeypatch):
    """send() on an idle channel announces and posts on the caller's thread; a job sent while
    another is on the wire queues behind it (one packing buffer per channel), and both land."""
    threads = announcing_threads(monkeypatch)
    with connected("gloo") as (prefill, decode, sender, receiver):
        jobs = {rid: start(prefill, decode, receiver, rid, num_tokens=9) for rid in ("idle", "running", "behind")}

        def args(rid):
            target, src_blocks, src_slot = jobs[rid]
            return target, 9, src_blocks, src_slot

        sender.send(*args("idle"), first_token=1)
        wait_until(lambda: "idle" in decode.results and "idle" in prefill.results)
        running = sender.begin(*args("running"))  # still prefilling: the channel thread waits for its layers
        sender.send(*args("behind"), first_token=3)
        running.finish(2)
        wait_until(lambda: all(rid in decode.results and rid in prefill.results for rid in jobs))
    assert threads[0] == threading.current_thread().name and all(t.startswith("kvtransfer-send") for t in threads[1:]), threads
    for rid, (target, src_blocks, src_slot) in jobs.items():
        assert decode.results[rid].ok and prefill.results[rid].ok, (decode.results[rid], prefill.results[rid])
        assert landed_exactly(prefill.cache, src_blocks, src_slot, decode.cache, list(target.dst_block_ids), target.dst_slot, 9) == []


def test_a_caller_posting_into_a_broken_wire_fails_the_request_and_the_channel():
    with connected("gloo") as (prefill, decode, sender, receiver):
        target, src_blocks, src_slot = start(prefill, decode, receiver, "doomed", num_tokens=9)
        wire = sender._channels["D"].wire
        wire.send = lambda tensors: (_ for _ in ()).throw(RuntimeError("gloo: connection reset"))
        sender.send(target, 9, src_blocks, src_slot, first_token=1)  # the caller is not the one told
        wait_until(lambda: "doomed" in prefill.results)
        assert not prefill.results["doomed"].ok and "connection reset" in prefill.results["doomed"].error
        wait_until(lambda: "doomed" in decode.results)  # the receiver's wire is gone with the sender's
        assert not decode.results["doomed"].ok
        assert "connection reset" in sender.channel_errors["D"]
        with pytest.raises(ChannelClosedError, match="no channel to receiver 'D'"):
            sender.begin(HandoffTarget("later", "D", (0, 1, 2), 0), 9, [0, 1, 2], 0)
    assert prefill.all_free() and decode.all_free()


def test_a_big_hand_off_is_posted_by_the_channel_thread(monkeypatch):
    """Above INLINE_MAX_BYTES the caller does not pay the packing and the write itself."""
    from kvtransfer import stream_channel

    threads = announcing_threads(monkeypatch)
    with connected("gloo") as (prefill, decode, sender, receiver):
        monkeypatch.setattr(stream_channel, "INLINE_MAX_BYTES", prefill.cache.layout.handoff_bytes(9) - 1)
        small_target, small_blocks, small_slot = start(prefill, decode, receiver, "small", num_tokens=4)
        big_target, big_blocks, big_slot = start(prefill, decode, receiver, "big", num_tokens=9)
        sender.send(small_target, 4, small_blocks, small_slot, first_token=1)
        wait_until(lambda: "small" in decode.results and "small" in prefill.results)
        sender.send(big_target, 9, big_blocks, big_slot, first_token=2)
        wait_until(lambda: "big" in decode.results and "big" in prefill.results)
    assert threads[0] == threading.current_thread().name and threads[1].startswith("kvtransfer-send"), threads
    assert decode.results["big"].ok and landed_exactly(prefill.cache, big_blocks, big_slot, decode.cache,
                                                       list(big_target.dst_block_ids), big_target.dst_slot, 9) == []


def test_a_channel_closed_while_the_caller_posts_still_reports_the_request():
    """disconnect() lands while the caller is inside its own posting: the channel thread is
    gone by the time the posting ends, so the caller reports the request failed itself."""
    with connected("gloo") as (prefill, decode, sender, receiver):
        target, src_blocks, src_slot = start(prefill, decode, receiver, "cut", num_tokens=9)
        channel = sender._channels["D"]
        entered, release, send = threading.Event(), threading.Event(), channel.wire.send

        def held_send(tensors):
            entered.set()
            release.wait(5)
            return send(tensors)

        channel.wire.send = held_send
        poster = threading.Thread(target=sender.send, args=(target, 9, src_blocks, src_slot), kwargs={"first_token": 1})
        poster.start()
        assert entered.wait(5)
        closer = threading.Thread(target=sender.disconnect, args=("D",))
        closer.start()
        wait_until(lambda: channel._closing)
        release.set()
        poster.join(5)
        closer.join(15)
        wait_until(lambda: "cut" in prefill.results)
        assert not prefill.results["cut"].ok and "closed" in prefill.results["cut"].error, prefill.results["cut"]
        receiver.abort("cut")
        wait_until(lambda: "cut" in decode.results)
    assert prefill.all_free() and decode.all_free()
