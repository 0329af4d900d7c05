"""`splitserve bench transfer --latency`: begin-to-landed of a small hand-off under busy engine loops.

The payload is one 1024-token request of the benchmarks' 11M hybrid (bench/checkpoints.py:
8 layers, attention at layers 2 and 6 with 4 KV heads of 32, a recurrent conv + SSM state
elsewhere with d_inner 512, d_conv 4, d_state 16; float32): 2.3 MB. The receiver lives in this process, the sender in
a spawned one, and each process's main thread runs an engine stand-in: steps of about
--slice-ms, part pure Python (holds the GIL) and part torch matmul (releases it), with the
workers' switch interval. The sender calls send() between two of its steps, as the prefill
worker does after a step; the receiver calls poll() after each of its steps, as the decode loop does.

Per hand-off, from the sender's begin():
- landed: the receiver's result became reportable (what poll() would return from then on);
  taken as expect() time + the result's elapsed_s, so it is the transport's own stamp.
- seen:   the receiver's engine loop got it from poll() (landed plus up to one step).
Both clocks are CLOCK_MONOTONIC, shared by the two processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time

import torch

from bench.transfer import Payload, churned_block_ids
from kvtransfer.config import TransferConfig
from worker_base import WORKER_SWITCH_INTERVAL_S
from kvtransfer.layout import CacheTensors
from kvtransfer.messages import HandoffTarget
from kvtransfer.transport import make_transport

CACHE_SLOTS = 8
PAYLOAD = Payload(block_size=16, num_tokens=1024, d_inner=512, spare=4.0, num_layers=8, attention_period=4,
                  attention_offset=2, kv_heads=4, head_dim=32, kv_dtype=torch.float32, conv_dtype=torch.float32)


def payload_cache(seed: int) -> CacheTensors:
    return PAYLOAD.make_cache(seed, num_slots=CACHE_SLOTS)


class BusyLoop:
    """One engine step: `gil` seconds of pure Python, then about `slice_s - gil` of torch matmuls."""

    def __init__(self, slice_s: float, gil_fraction: float):
        self.python_s = slice_s * gil_fraction
        self.a = torch.randn(96, 96)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            torch.mm(self.a, self.a)
            n += 1
        self.matmuls = max(0, round(slice_s * (1 - gil_fraction) / (0.05 / n)))

    def step(self) -> None:
        end, x = time.perf_counter() + self.python_s, 0
        while time.perf_counter() < end:  # holds the GIL, as the engine's Python does
            for i in range(50):
                x += i * i
        for _ in range(self.matmuls):
            torch.mm(self.a, self.a)


def _sender_main(transport: str, offer, conn, slice_s: float, gil_fraction: float) -> None:
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
    torch.set_num_threads(1)
    cache = payload_cache(seed=1)
    sender = make_transport(transport).sender("bench-prefill", cache, TransferConfig(timeout_s=30))
    sender.connect(offer.receiver, offer)
    busy = BusyLoop(slice_s, gil_fraction)
    conn.send("ready")
    begun: dict[str, float] = {}
    while True:
        busy.step()
        if conn.poll():
            order = conn.recv()
            if order is None:
                break
            target, src_blocks = order
            begun[target.request_id] = time.monotonic()
            sender.send(target, PAYLOAD.num_tokens, src_blocks, 0, first_token=7)
        for result in sender.poll():
            conn.send((result.request_id, begun.pop(result.request_id), result.ok, result.error))
    sender.close()


def _block_patterns(count: int, rng: random.Random) -> list[list[int]]:
    return [churned_block_ids(PAYLOAD.cache_blocks, PAYLOAD.num_blocks, rng) for _ in range(count)]


def run(transport: str, handoffs: int, warmup: int, slice_s: float, gil_fraction: float) -> dict:
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
    torch.set_num_threads(1)
    rng = random.Random(0)
    patterns = _block_patterns(8, rng)
    cache = payload_cache(seed=2)
    receiver = make_transport(transport).receiver("bench-decode", cache, TransferConfig(timeout_s=30))
    offer = receiver.accept("bench-prefill")
    conn, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_sender_main, args=(transport, offer, child, slice_s, gil_fraction), daemon=True)
    process.start()
    if not conn.poll(120) or conn.recv() != "ready":
        raise RuntimeError("bench sender did not connect")
    busy = BusyLoop(slice_s, gil_fraction)
    landed, seen = [], []
    try:
        for i in range(warmup + handoffs):
            rid = f"lat-{i}"
            target = HandoffTarget(rid, "bench-decode", tuple(patterns[i % len(patterns)]), i % CACHE_SLOTS)
            expected_at = time.monotonic()
            receiver.expect(target)
            busy.step()  # the reservation precedes the prefill by at least a step
            conn.send((target, patterns[(i + 3) % len(patterns)]))
            result = seen_at = report = None
            while report is None:
                busy.step()
                if result is None:
                    result = next((r for r in receiver.poll() if r.request_id == rid), None)
                    seen_at = time.monotonic()
                if result is not None and conn.poll():
                    report = conn.recv()
            reported_rid, begun_at, sender_ok, sender_error = report
            assert reported_rid == rid, (reported_rid, rid)
            if not (result.ok and sender_ok):
                raise RuntimeError(f"hand-off {rid} failed: {result.error or sender_error}")
            if i >= warmup:
                landed.append(expected_at + result.elapsed_s - begun_at)
                seen.append(seen_at - begun_at)
    finally:
        conn.send(None)
        process.join(timeout=30)
        receiver.close()
    nbytes = cache.layout.handoff_bytes(PAYLOAD.num_tokens)
    return {"transport": transport, "payload_bytes": nbytes, "handoffs": handoffs, "slice_ms": slice_s * 1e3,
            "gil_fraction": gil_fraction, "landed_ms": _summary(landed), "seen_ms": _summary(seen)}


def _summary(values: list[float]) -> dict:
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 3)  # noqa: E731
    return {"median": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(v[-1] * 1e3, 3), "min": round(v[0] * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench transfer --latency", description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("shm", "gloo"), action="append", help="default: both")
    parser.add_argument("--handoffs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--slice-ms", type=float, default=1.0, help="length of one engine step of the busy loops")
    parser.add_argument("--gil-fraction", type=float, default=0.5, help="share of a step spent in pure Python")
    parser.add_argument("--json", action="store_true", help="print one JSON object per transport only")
    args = parser.parse_args(argv)
    if args.handoffs < 1 or args.warmup < 0 or args.slice_ms <= 0 or not 0 <= args.gil_fraction <= 1:
        parser.error("need --handoffs >= 1, --warmup >= 0, --slice-ms > 0, 0 <= --gil-fraction <= 1")
    results = [run(t, args.handoffs, args.warmup, args.slice_ms / 1e3, args.gil_fraction) for t in args.transport or ("shm", "gloo")]
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        print(f"{r['transport']}: {r['payload_bytes'] / 1e6:.2f} MB x {r['handoffs']}, engine steps of {r['slice_ms']} ms "
              f"({r['gil_fraction']:.0%} holding the GIL) on both sides")
        print(f"  {'ms from begin()':<16} {'median':>7} {'p90':>7} {'p99':>7} {'max':>7}")
        for what in ("landed", "seen"):
            s = r[f"{what}_ms"]
            print(f"  {what:<16} {s['median']:>7.3f} {s['p90']:>7.3f} {s['p99']:>7.3f} {s['max']:>7.3f}")
        print("  json:", json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
