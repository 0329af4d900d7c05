"""`splitserve bench prefix --fetch`: fetching a cached prefix from another worker against
recomputing it, by prefix length (what router.prefix_fetch's `prefix_fetch_tokens` trades).

Two colocated engines alike but for what they hold, both with a host tier: the source has
prefilled a prompt; the importer has not. Per transport (shared memory, as between workers on
one node; Gloo over loopback, as across nodes less the network: add bytes / bandwidth) and
prefix length: the entry's bytes; the fetch's parts, each timed: the source staging the entry
in rows of its host tier (its pool's rows copied out), the rows' move into rows the importer
reserved, the importer adopting them; and the importer's time to first token of a prompt that
extends the prefix by 16 tokens, with the entry against without it. The actors' calls that
order these steps in a cluster (worker_base.prefix_wire) are not in the times. Greedy; the run
checks both first tokens agree. Medians of `rounds`."""

from __future__ import annotations

import random
import statistics
import time

from engine.host_tier import ROW_BYTES


def run_fetch(model: str, lengths: tuple[int, ...] = (32, 128, 512, 1984), rounds: int = 3,
              block_size: int = 16, seed: int = 0, transports: tuple[str, ...] = ("shm", "gloo")) -> list[dict]:
    from engine import LLM, SamplingParams
    from engine.prefix_cache import block_hashes
    from kvtransfer.config import TransferConfig
    from kvtransfer.messages import HandoffTarget
    from worker_base.prefix_wire import PrefixWire

    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(seed)
    options = dict(block_size=block_size, enable_prefix_caching=True, max_num_batched_tokens=8192,
                   host_cache_bytes=1 << 26)  # room for the longest entry
    source = LLM(model, **options)
    vocab = source.engine.spec.vocab_size
    config = TransferConfig(timeout_s=30)
    sending = PrefixWire("source", source.engine.tiers.host.rows(), config)
    rows = []
    try:
        for kind in transports:
            for length in lengths:
                times = {k: [] for k in ("stage", "move", "adopt", "ttft_fetched", "ttft_computed")}
                nbytes = 0
                for n in range(rounds):
                    importer = LLM(model, **options)
                    importer.generate([[5] * 16], first_token)  # warm
                    receiving = PrefixWire("importer", importer.engine.tiers.host.rows(), config)
                    _, receiver = receiving.receiver(kind)
                    sending.sender(kind).connect(receiving.name, receiver.accept(sending.name))
                    prefix = [rng.randrange(3, vocab) for _ in range(length)]
                    prompt = prefix + [rng.randrange(3, vocab) for _ in range(16)]
                    source.generate([prefix + [7]], first_token)  # its last boundary short of the end: `length`
                    fetch_id = f"{kind}-{length}-{n}"
                    start = time.perf_counter()
                    staged = source.engine.exchange.stage(block_hashes(prefix, block_size, []), fetch_id)
                    times["stage"].append(time.perf_counter() - start)
                    if staged is None or staged.end != length:
                        raise AssertionError(f"the source holds no {length}-token prefix to stage")
                    nbytes = staged.nbytes
                    offset = importer.engine.exchange.make_room(staged)
                    dst = list(range(offset // ROW_BYTES, offset // ROW_BYTES + len(staged.rows)))
                    start = time.perf_counter()
                    receiver.expect(HandoffTarget(fetch_id, receiving.name, tuple(dst), None))
                    sending.send(fetch_id, receiving.name, kind, staged.rows, dst)
                    if not receiver.wait_for([fetch_id], 30)[fetch_id].ok:
                        raise AssertionError(f"{kind}: the rows of {fetch_id} did not land")
                    times["move"].append(time.perf_counter() - start)
                    source.engine.exchange.unstage(fetch_id)
                    start = time.perf_counter()
                    assert importer.engine.exchange.adopt(staged, offset) == length
                    times["adopt"].append(time.perf_counter() - start)
                    fetched = importer.generate([prompt], first_token)[0]
                    times["ttft_fetched"].append(fetched.first_token_time - fetched.arrival_time)
                    computed = LLM(model, **options).generate([prompt], first_token)[0]
                    times["ttft_computed"].append(computed.first_token_time - computed.arrival_time)
                    sending.sender(kind).disconnect(receiving.name)
                    receiving.close()
                    if fetched.num_cached_tokens != length or fetched.token_ids != computed.token_ids:
                        raise AssertionError(f"{length}: fetched {fetched.num_cached_tokens} tokens, "
                                             f"tokens {fetched.token_ids} vs {computed.token_ids}")
                row = {"transport": kind, "prefix_tokens": length, "entry_bytes": nbytes}
                row.update({f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()})
                row["fetch_ms"] = row["stage_ms"] + row["move_ms"] + row["adopt_ms"] + row["ttft_fetched_ms"]
                rows.append(row)
    finally:
        sending.close()
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'wire':>5} {'prefix':>7} {'entry MB':>9} {'stage':>7} {'move':>7} {'adopt':>7} {'TTFT':>7} "
             f"{'fetch total':>11} {'recompute TTFT':>14} {'speedup':>7}   (ms)"]
    for r in rows:
        lines.append(f"{r['transport']:>5} {r['prefix_tokens']:>7} {r['entry_bytes'] / 1e6:>9.2f} "
                     f"{r['stage_ms']:>7.1f} {r['move_ms']:>7.1f} {r['adopt_ms']:>7.2f} {r['ttft_fetched_ms']:>7.1f} "
                     f"{r['fetch_ms']:>11.1f} {r['ttft_computed_ms']:>14.1f} "
                     f"{r['ttft_computed_ms'] / r['fetch_ms']:>6.2f}x")
    return "\n".join(lines)
