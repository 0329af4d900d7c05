"""The NCCL binding: CPU-side calls run anywhere the wheel is installed; transfers need 2 GPUs."""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path

import pytest
import torch

from kvtransfer import nccl
from kvtransfer.nccl import NcclCommunicator, NcclError, check_p2p, nccl_dtype


@pytest.fixture(scope="module")
def lib():
    try:
        return nccl.load_library()
    except OSError as error:
        pytest.skip(f"libnccl.so.2 not loadable (pip install nvidia-nccl-cu12): {error}")


def test_library_comes_from_the_wheel_when_installed(lib):
    path = nccl.find_library()
    if Path(path).is_absolute():
        assert path.endswith("nvidia/nccl/lib/libnccl.so.2") or "KVTRANSFER_NCCL_LIBRARY" in __import__("os").environ
    assert lib.path == path


def test_version_is_a_tuple(lib):
    version = nccl.nccl_version()
    assert version == lib.version()
    assert len(version) == 3 and version[0] == 2 and version >= (2, 9, 0)


def test_unique_ids_are_fresh_128_byte_blobs(lib):
    a, b = lib.unique_id(), lib.unique_id()
    assert isinstance(a, bytes) and len(a) == nccl.UNIQUE_ID_BYTES == 128
    assert a != b


def test_error_strings(lib):
    assert lib.error_string(0) == "no error"
    assert "invalid argument" in lib.error_string(4)
    assert "remote process exited" in lib.error_string(6)


def test_dtype_mapping():
    assert nccl_dtype(torch.bfloat16) == 9 and nccl_dtype(torch.float32) == 7 and nccl_dtype(torch.uint8) == 1
    assert nccl_dtype(torch.float16) == 6 and nccl_dtype(torch.int64) == 4
    with pytest.raises(TypeError, match="NCCL cannot send torch.complex64"):
        nccl_dtype(torch.complex64)


def test_communicator_arguments_are_checked_before_nccl(lib):
    uid = lib.unique_id()
    with pytest.raises(ValueError, match="128 bytes"):
        NcclCommunicator(b"short", 0, 2, 0, lib)
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        NcclCommunicator(uid, 2, 2, 0, lib)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        NcclCommunicator(uid, 0, 0, 0, lib)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        NcclCommunicator(uid, 0, 2, "cpu", lib)


def test_send_recv_arguments_are_checked():
    cuda0 = torch.device("cuda", 0)
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="peer 0 must be another rank"):
        check_p2p(t, 0, 0, 2, cuda0, "send")
    with pytest.raises(ValueError, match="peer 5 must be another rank"):
        check_p2p(t, 5, 0, 2, cuda0, "recv")
    with pytest.raises(ValueError, match="NCCL moves CUDA tensors"):
        check_p2p(t, 1, 0, 2, cuda0, "send")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path without a GPU")
def test_init_without_gpu_fails_with_a_clear_error(lib):
    with pytest.raises(NcclError, match="ncclCommInitRank failed: NCCL error"):
        NcclCommunicator(lib.unique_id(), 0, 1, torch.device("cuda", 0), lib)


# ---- on a box with two GPUs ----

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _gpu_sender(offer, jobs, conn, pipelined):
    from kvtransfer.testing import sender_process

    sender_process("nccl", "P", dict(kind="hybrid", block_size=16, num_blocks=64, num_slots=4, seed=1, device="cuda:1"),
                   [offer], jobs, conn, pipelined)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("pipelined", [True, False])
def test_nccl_round_trip_between_two_gpus(pipelined):
    from kvtransfer import HandoffTarget, TransferConfig, make_transport
    from kvtransfer.testing import landed_exactly, make_cache, random_request

    receiver_cache = make_cache("hybrid", 16, 64, 4, seed=2, device="cuda:0")
    receiver = make_transport("nccl").receiver("D", receiver_cache, TransferConfig(timeout_s=60))
    offer = receiver.accept("P")
    rng = random.Random(0)
    taken_src, taken_dst, slots_src, slots_dst, jobs = set(), set(), set(), set(), []
    for i in range(3):
        tokens, src_blocks, src_slot = random_request(rng, receiver_cache.layout, 64, 4, 150, taken_src, slots_src)
        dst_blocks = rng.sample(sorted(set(range(64)) - taken_dst), len(src_blocks))
        taken_dst.update(dst_blocks)
        dst_slot = rng.choice(sorted(set(range(4)) - slots_dst))
        slots_dst.add(dst_slot)
        target = HandoffTarget(f"g{i}", "D", tuple(dst_blocks), dst_slot)
        receiver.expect(target)
        jobs.append(((target.request_id, "D", target.dst_block_ids, dst_slot), tokens, src_blocks, src_slot, 100 + i))
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_gpu_sender, args=(offer, jobs, child, pipelined))
    process.start()
    results = receiver.wait_for([f"g{i}" for i in range(3)], 120)
    sent = parent.recv()
    process.join(60)
    receiver.close()
    assert all(ok for ok, _ in sent.values()), sent
    sender_cache = make_cache("hybrid", 16, 64, 4, seed=1, device="cuda:1")
    for i, (target, tokens, src_blocks, src_slot, first) in enumerate(jobs):
        assert results[f"g{i}"].ok and results[f"g{i}"].first_token == first
        assert landed_exactly(sender_cache, src_blocks, src_slot, receiver_cache, list(target[2]), target[3], tokens) == []


def test_an_idle_nccl_receiver_waits_on_the_doorbell_not_in_a_receive(monkeypatch):
    """The receiver learns of a hand-off from the header rung on the pair's doorbell and posts no
    NCCL call while it waits; abort() on either side wakes it. Fake communicators record every
    call, so this runs on CPU."""
    import queue
    import threading
    import time

    from kvtransfer.doorbell import Doorbell, StoreHost
    from kvtransfer.messages import WireHeader
    from kvtransfer.nccl_wire import RECEIVER_RANK, SENDER_RANK, NcclWire

    calls = []

    class RecordingComm:
        device = torch.device("cpu")

        def __getattr__(self, name):  # send, recv, group, abort, ...
            return lambda *args, **kwargs: calls.append(name)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)  # the wire's streams are not used here
    stores = StoreHost("127.0.0.1", 5.0)
    prefix = stores.new_prefix("D", "P")
    receiver = NcclWire(RecordingComm(), RECEIVER_RANK, stores.doorbell(prefix))
    sender = NcclWire(RecordingComm(), SENDER_RANK, Doorbell(stores.client(prefix)))
    headers: queue.Queue = queue.Queue()
    waiter = threading.Thread(target=lambda: [headers.put(receiver.await_announcement()) for _ in range(3)], daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert headers.empty() and calls == []  # idle: asleep on the doorbell, nothing posted

    sent = [WireHeader("r1", 7, 2, 3, 99, False), WireHeader("r2", 40, 3, None, 5, True)]
    for header in sent:
        sender.announce(header.encode())
    assert [WireHeader.decode(headers.get(timeout=5)) for _ in sent] == sent
    assert calls == []  # the header is not an NCCL message either

    sender.abort()  # the sender goes: the receiver wakes with no header
    assert headers.get(timeout=5) is None
    waiter.join(timeout=5)
    assert calls == ["abort"]
    receiver.abort()
    assert receiver.await_announcement() is None  # a closed wire announces nothing, at once


def test_implicit_launch_order_is_refused_for_tensor_parallel_workers():
    from kvtransfer.nccl import check_launch_order

    for value in ("", "0"):
        check_launch_order(4, {"NCCL_LAUNCH_ORDER_IMPLICIT": value})
    check_launch_order(1, {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"})  # one rank: one communicator per device
    with pytest.raises(ValueError, match="NCCL_LAUNCH_ORDER_IMPLICIT=1: a tensor-parallel worker .*=2"):
        check_launch_order(2, {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"})
