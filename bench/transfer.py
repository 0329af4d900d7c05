"""`splitserve bench transfer`: hand-off throughput between two processes against memcpy.

The payload is one request of a large hybrid model (32 layers, attention every 8th, a
recurrent conv + SSM state elsewhere) with as many prompt tokens as make up --size-mb. Its block ids on each side
come from the engine's own BlockManager after a churn of random requests (--block-ids
allocator: what a serving worker hands out), or are drawn at random (--block-ids random:
the worst case, one copy per block). The receiver lives in this process, the sender in a spawned one;
a hand-off is timed from the order to send until the receiver reports it landed. memcpy
is one contiguous copy of the same number of bytes in this process (the physical floor
for a one-copy transport). After a warm-up, hand-offs and memcpys alternate; the JSON
reports medians, and ratio_to_memcpy is the median ratio of back-to-back pairs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.config import TransferConfig
from kvtransfer.layout import CacheTensors
from kvtransfer.messages import HandoffTarget
from kvtransfer.shm import SHM_SENDER_ENV
from kvtransfer.transport import TRANSPORTS, default_cpu_transport, make_transport

NUM_LAYERS, ATTENTION_PERIOD, ATTENTION_OFFSET = 32, 8, 4
KV_HEADS, HEAD_DIM, D_CONV, D_STATE, FULL_D_INNER = 8, 128, 4, 16, 8192


@dataclass(frozen=True)
class Payload:
    """One request's cache rows on a hybrid layout: attention at layers i % attention_period ==
    attention_offset, a recurrent state of kind "recurrent" (conv [d_inner, D_CONV], ssm
    [d_inner, D_STATE]) elsewhere. The transport only moves declared tensors: kind names are data."""

    block_size: int
    num_tokens: int
    d_inner: int
    spare: float = 1.5  # cache rows per request row, so random ids have room
    num_layers: int = NUM_LAYERS
    attention_period: int = ATTENTION_PERIOD
    attention_offset: int = ATTENTION_OFFSET
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    kv_dtype: torch.dtype = torch.bfloat16
    conv_dtype: torch.dtype = torch.bfloat16

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def cache_blocks(self) -> int:
        return int(self.num_blocks * self.spare) + 1

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i % self.attention_period == self.attention_offset]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i % self.attention_period != self.attention_offset]

    def make_cache(self, seed: int, num_slots: int = 4) -> CacheTensors:
        generator = torch.Generator().manual_seed(seed)

        def filled(shape, dtype):  # random bytes: the copy must be exact whatever they encode
            t = torch.empty(shape, dtype=dtype)
            t.view(torch.uint8).random_(0, 256, generator=generator)
            return t

        kv = (self.cache_blocks, self.block_size, self.kv_heads, self.head_dim)
        attention = {i: (filled(kv, self.kv_dtype), filled(kv, self.kv_dtype)) for i in self.attention_layers}
        state = {i: ("recurrent", {"conv": filled((num_slots, self.d_inner, D_CONV), self.conv_dtype),
                                   "ssm": filled((num_slots, self.d_inner, D_STATE), torch.float32)})
                 for i in self.recurrent_layers}
        return CacheTensors.hybrid(self.block_size, attention, state)


def payload_for(size_mb: float, block_size: int = 16) -> Payload:
    """A realistic request of about size_mb: recurrent state scaled down only for tiny payloads."""
    target = int(size_mb * 2**20)
    recurrent_layers = NUM_LAYERS - NUM_LAYERS // ATTENTION_PERIOD
    state_per_d_inner = recurrent_layers * (D_CONV * 2 + D_STATE * 4)
    d_inner = min(FULL_D_INNER, max(64, (target // 4 // state_per_d_inner) // 64 * 64))
    kv_per_token = (NUM_LAYERS // ATTENTION_PERIOD) * 2 * KV_HEADS * HEAD_DIM * 2
    tokens = max(1, (target - d_inner * state_per_d_inner) // kv_per_token)
    return Payload(block_size, tokens, d_inner)


def _sender_main(transport: str, payload: Payload, offer, conn) -> None:
    torch.set_num_threads(1)
    cache = payload.make_cache(seed=1)
    sender = make_transport(transport).sender("bench-prefill", cache, TransferConfig(timeout_s=120))
    sender.connect(offer.receiver, offer)
    conn.send("ready")
    computes, compute_times = {}, []
    while (order := conn.recv()) is not None:
        target, src_blocks, compute_s = order
        handle = sender.begin(target, payload.num_tokens, src_blocks, 0)
        if compute_s is None:
            handle.finish(7)
        else:  # simulated prefill; pipelined if layer_done follows each layer
            pipelined, per_layer = compute_s
            compute = computes.setdefault(per_layer, _Compute(per_layer))
            start = time.perf_counter()
            for layer in range(NUM_LAYERS):
                compute()
                if pipelined:
                    handle.layer_done(layer)
            handle.finish(7)
            compute_times.append(time.perf_counter() - start)
        ok = sender.wait_for([target.request_id], 120)[target.request_id].ok
        conn.send((ok, compute_times[-1] if compute_s is not None else 0.0))
    sender.close()


class _Compute:
    """A stand-in for one layer's prefill: matmuls of a calibrated size, so the GIL is free
    while they run (as in a real forward pass), taking about `seconds` in all."""

    def __init__(self, seconds: float):
        n = 64
        while True:
            a = torch.randn(n, n)
            took = self._time_one(a)
            if took >= seconds / 4 or n >= 2048:
                break
            n *= 2
        self.a, self.repeats = a, max(1, round(seconds / took))

    @staticmethod
    def _time_one(a: torch.Tensor) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, a)
            times.append(time.perf_counter() - start)
        return sorted(times)[2]

    def __call__(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.a)


class _Memcpy:
    """One contiguous copy of n bytes: glibc memcpy (numpy.copyto) or torch's copy_, whichever is faster."""

    def __init__(self, nbytes: int):
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        self._src_t, self._dst_t = torch.from_numpy(self.src), torch.from_numpy(self.dst)

    def seconds(self) -> float:
        best = float("inf")
        for copy in (lambda: np.copyto(self.dst, self.src), lambda: self._dst_t.copy_(self._src_t)):
            start = time.perf_counter()
            copy()
            best = min(best, time.perf_counter() - start)
        return best


@contextlib.contextmanager
def _environment(extra: dict[str, str]):
    """os.environ plus `extra` while a child process is spawned (it inherits the environment)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def churned_block_ids(rows: int, count: int, rng: random.Random = random) -> list[int]:
    """`count` block ids as engine.BlockManager hands them out after serving a while: requests
    of 1..64 blocks come and go at random until the cache has been filled 20 times over."""
    from engine.block_manager import BlockManager

    blocks, held, ids = BlockManager(rows, 1), [], itertools.count()
    for _ in range(20):
        while blocks.num_free_blocks >= (size := rng.randint(1, 64)):  # block_size 1: a block a token
            held.append(f"r{next(ids)}")
            blocks.allocate(held[-1], size)
        rng.shuffle(held)
        for _ in range(len(held) // 2):
            blocks.free(held.pop())
    rng.shuffle(held)
    while blocks.num_free_blocks < count:
        blocks.free(held.pop())
    return list(blocks.allocate("payload", count))


BLOCK_ID_PATTERNS = {
    "allocator": churned_block_ids,
    "random": lambda rows, count: random.sample(range(rows), count),
}


class _Pair:
    """Receiver here, sender in a spawned process."""

    def __init__(self, transport: str, payload: Payload, tuned_copy: bool, block_ids: str = "allocator"):
        self.payload = payload
        self.block_ids = BLOCK_ID_PATTERNS[block_ids]
        self.cache = payload.make_cache(seed=2)
        self.receiver = make_transport(transport).receiver("bench-decode", self.cache, TransferConfig(timeout_s=120))
        offer = self.receiver.accept("bench-prefill")
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=_sender_main, args=(transport, payload, offer, child), daemon=True)
        with _environment(SHM_SENDER_ENV if tuned_copy and transport == "shm" else {}):
            self.process.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("bench sender did not connect")
        self._count = 0

    def handoff(self, compute=None) -> float:
        return self.timed_handoff(compute)[0]

    def timed_handoff(self, compute=None) -> tuple[float, float]:
        """(seconds until landed, seconds the sender spent computing)."""
        self._count += 1
        rows = self.payload.cache_blocks
        dst, src = (self.block_ids(rows, self.payload.num_blocks) for _ in range(2))
        target = HandoffTarget(f"bench-{self._count}", "bench-decode", tuple(dst), 1)
        self.receiver.expect(target)
        start = time.perf_counter()
        self.conn.send((target, src, compute))
        result = self.receiver.wait_for([target.request_id], 120)[target.request_id]
        elapsed = time.perf_counter() - start
        sender_ok, compute_s = self.conn.recv()
        if not result.ok or not sender_ok:
            raise RuntimeError(f"hand-off failed: {result.error}")
        return elapsed, compute_s

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)
        self.receiver.close()


def run(transport: str, size_mb: float, repeats: int, pipeline_check: bool, tuned_copy: bool = True,
        block_ids: str = "allocator") -> dict:
    """Hand-offs and memcpys alternate, so both see the same machine (shared hosts drift by 2x)."""
    torch.set_num_threads(1)
    payload = payload_for(size_mb)
    pair = _Pair(transport, payload, tuned_copy, block_ids)
    nbytes = pair.cache.layout.handoff_bytes(payload.num_tokens)
    memcpy = _Memcpy(nbytes)
    try:
        pair.handoff(), memcpy.seconds()  # warm-up: first touch of pages and buffers
        handoffs, copies = [], []
        for _ in range(repeats):
            handoffs.append(pair.handoff())
            copies.append(memcpy.seconds())
        ratios = sorted(c / h for h, c in zip(handoffs, copies))
        out = {
            "transport": transport, "size_mb": round(nbytes / 2**20, 2), "payload_bytes": nbytes,
            "num_tokens": payload.num_tokens, "block_size": payload.block_size,
            "attention_layers": len(payload.attention_layers), "recurrent_layers": len(payload.recurrent_layers),
            "repeats": repeats, "tuned_copy": tuned_copy and transport == "shm", "block_ids": block_ids,
            "transport_gbps": round(nbytes / _median(handoffs) / 1e9, 3),
            "memcpy_gbps": round(nbytes / _median(copies) / 1e9, 3),
            "ratio_to_memcpy": round(_median(ratios), 3),  # median of back-to-back pairs
            "transport_gbps_best": round(nbytes / min(handoffs) / 1e9, 3),
            "memcpy_gbps_best": round(nbytes / min(copies) / 1e9, 3),
        }
        if pipeline_check:
            out["pipelining"] = _pipeline_check(pair, _median(handoffs))
    finally:
        pair.close()
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _pipeline_check(pair: _Pair, transfer_s: float) -> dict:
    """A simulated prefill whose compute equals the transfer time, spread evenly over the
    layers: layer_done after every layer (pipelined) vs only at the end (sequential)."""
    per_layer = transfer_s / NUM_LAYERS
    pair.timed_handoff((False, per_layer))  # calibrates the compute
    runs = {"sequential": [], "pipelined": []}
    for _ in range(3):
        for mode in runs:
            runs[mode].append(pair.timed_handoff((mode == "pipelined", per_layer)))
    sequential, pipelined = (min(t for t, _ in runs[m]) for m in ("sequential", "pipelined"))
    return {"transfer_s": round(transfer_s, 4),
            "compute_s": round(_median([c for _, c in runs["sequential"]]), 4),
            "compute_s_when_pipelined": round(_median([c for _, c in runs["pipelined"]]), 4),
            "sequential_s": round(sequential, 4), "pipelined_s": round(pipelined, 4),
            "saved_fraction": round(1 - pipelined / sequential, 3)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--latency" in argv:  # small hand-offs under busy engine loops: bench/transfer_latency.py
        from bench.transfer_latency import main as latency_main

        return latency_main([a for a in argv if a != "--latency"])
    parser = argparse.ArgumentParser(prog="splitserve bench transfer", description=__doc__.splitlines()[0],
                                     epilog="--latency: begin-to-landed of a 2.3 MB hand-off instead (--latency --help)")
    parser.add_argument("--transport", choices=TRANSPORTS, default=None,
                        help="default: what the cluster picks for two CPU workers on one node")
    parser.add_argument("--size-mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipeline-check", action="store_true", help="also time a simulated prefill, sequential vs layer-pipelined")
    parser.add_argument("--no-tuned-copy", action="store_true", help="shm: run the sender without SHM_SENDER_ENV")
    parser.add_argument("--block-ids", choices=sorted(BLOCK_ID_PATTERNS), default="allocator",
                        help="allocator: ids from the engine's allocator after churn; random: worst case")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.size_mb <= 0 or args.repeats < 1:
        parser.error("--size-mb must be > 0 and --repeats >= 1")
    transport = args.transport or default_cpu_transport(same_node=True)
    result = run(transport, args.size_mb, args.repeats, args.pipeline_check, not args.no_tuned_copy,
                 args.block_ids)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{transport}: {result['transport_gbps']:.2f} GB/s for {result['size_mb']} MiB "
              f"({result['num_tokens']} tokens); memcpy {result['memcpy_gbps']:.2f} GB/s; "
              f"ratio {result['ratio_to_memcpy']:.2f}")
        if "pipelining" in result:
            print(f"pipelining: {result['pipelining']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
