"""`splitserve bench prefix --fetch`: fetching a cached prefix from another worker against
recomputing it, by prefix length (what router.prefix_fetch's `prefix_fetch_tokens` trades).

Two colocated engines alike but for what they hold: the source has prefilled a prompt; the
importer (with a host tier) has not. Per prefix length: the entry's bytes; the fetch's parts,
each timed: the source's export (its pool's rows copied out), the entry's serialization
round trip (what Ray does to move it between processes; the network between nodes is not
measured here: add bytes / bandwidth), the importer's import; and the importer's time to first
token of a prompt that extends the prefix by 16 tokens, with the entry against without it.
Greedy; the run checks both first tokens agree. Medians of `rounds`."""

from __future__ import annotations

import pickle
import random
import statistics
import time


def run_fetch(model: str, lengths: tuple[int, ...] = (32, 128, 512, 1984), rounds: int = 3,
              block_size: int = 16, seed: int = 0) -> list[dict]:
    from engine import LLM, SamplingParams
    from engine.prefix_cache import block_hashes

    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(seed)
    options = dict(block_size=block_size, enable_prefix_caching=True, max_num_batched_tokens=8192)
    source = LLM(model, **options)
    vocab = source.engine.spec.vocab_size
    rows = []
    for length in lengths:
        times = {k: [] for k in ("export", "serialize", "import", "ttft_fetched", "ttft_computed")}
        nbytes = 0
        for _ in range(rounds):
            importer = LLM(model, host_cache_bytes=1 << 26, **options)  # room for the longest entry
            importer.generate([[5] * 16], first_token)  # warm
            prefix = [rng.randrange(3, vocab) for _ in range(length)]
            prompt = prefix + [rng.randrange(3, vocab) for _ in range(16)]
            source.generate([prefix + [7]], first_token)  # its last boundary short of the end: `length`
            start = time.perf_counter()
            exported = source.engine.export_prefix(block_hashes(prefix, block_size, []))
            times["export"].append(time.perf_counter() - start)
            if exported is None or exported.entry.end != length:
                raise AssertionError(f"the source holds no {length}-token prefix to export")
            start = time.perf_counter()
            exported = pickle.loads(pickle.dumps(exported, protocol=5))
            times["serialize"].append(time.perf_counter() - start)
            nbytes = exported.entry.nbytes
            start = time.perf_counter()
            assert importer.engine.import_prefix(exported) == length
            times["import"].append(time.perf_counter() - start)
            fetched = importer.generate([prompt], first_token)[0]
            times["ttft_fetched"].append(fetched.first_token_time - fetched.arrival_time)
            computed = LLM(model, **options).generate([prompt], first_token)[0]
            times["ttft_computed"].append(computed.first_token_time - computed.arrival_time)
            if fetched.num_cached_tokens != length or fetched.token_ids != computed.token_ids:
                raise AssertionError(f"{length}: fetched {fetched.num_cached_tokens} tokens, "
                                     f"tokens {fetched.token_ids} vs {computed.token_ids}")
        row = {"prefix_tokens": length, "entry_bytes": nbytes}
        row.update({f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()})
        row["fetch_ms"] = row["export_ms"] + row["serialize_ms"] + row["import_ms"] + row["ttft_fetched_ms"]
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'prefix':>7} {'entry MB':>9} {'export':>7} {'serial.':>7} {'import':>7} {'TTFT':>7} "
             f"{'fetch total':>11} {'recompute TTFT':>14} {'speedup':>7}   (ms)"]
    for r in rows:
        lines.append(f"{r['prefix_tokens']:>7} {r['entry_bytes'] / 1e6:>9.2f} {r['export_ms']:>7.1f} "
                     f"{r['serialize_ms']:>7.1f} {r['import_ms']:>7.1f} {r['ttft_fetched_ms']:>7.1f} "
                     f"{r['fetch_ms']:>11.1f} {r['ttft_computed_ms']:>14.1f} "
                     f"{r['ttft_computed_ms'] / r['fetch_ms']:>6.2f}x")
    return "\n".join(lines)
