"""Fetching a cached prefix from another worker instead of recomputing it.

The router knows, from the workers' cache events (router.prefix_routing), which usable prefixes
each worker holds in its pool and tiers. When the prefill worker chosen for a request holds
less of its prompt than another worker reports holding, by at least `prefix_fetch_tokens`,
the prefill worker fetches the entry from that worker's host tier into its own before queueing
the request (worker_base.prefix_wire: over shared memory on one node, Gloo across nodes):
copying the prefix's KV and checkpoint beats recomputing it once it is long enough
(docs/prefix-caching.md has the measured break-even). A source may be a prefill worker that
saw the same system prompt, or the decode worker that answered a chat's last turn; both ends
need a host tier (--host-cache-bytes), where entries are staged and land. The router names the
source and never holds the bytes.

Fetching must also pay: the entry's bytes (its blocks' KV and its checkpoint, as the target
reports an entry's size) over the link, plus a fixed cost, must take less time than the target
prefilling the tokens it saves at the rate it has measured. A decode-sized hybrid's checkpoint
can outweigh a short prefix's KV many times over, and a GPU prefills a few hundred tokens in
milliseconds, so where the token floor alone would fetch, this often recomputes. Until the
target has prefilled anything (no rate yet), the floor alone decides.

Only what a worker reported is trusted as held (not what the router merely sent it); a stale
report costs one export that finds nothing. A failed, slow or refused fetch costs the
recompute it tried to save, never the request (prefill_worker.PendingPrefix).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.workers import WorkerRef


@dataclass(frozen=True)
class FetchPlan:
    source: WorkerRef
    hashes: list[bytes]  # the block chain to export (the source's longest usable prefix of it)
    tokens: int  # prompt tokens the source reported holding


def fetch_pays(stats: dict, tokens: int, saved: int, block_size: int, link_bytes_per_s: float,
               overhead_s: float) -> bool:
    """Whether moving an entry of `tokens` tokens to the worker whose `stats` these are takes
    less time than that worker prefilling the `saved` tokens it would not have to (True where
    it has not measured its prefill rate yet)."""
    rate = stats.get("prefill_tokens_per_s")
    block, state = stats.get("prefix_entry_block_bytes"), stats.get("prefix_entry_state_bytes")
    if not rate or block is None or state is None:
        return True
    entry_bytes = tokens // block_size * block + state
    return overhead_s + entry_bytes / link_bytes_per_s < saved / rate


def plan_fetch(workers: list[WorkerRef], target: WorkerRef, hashes: list[bytes], target_cached: int,
               block_size: int, min_tokens: int, link_bytes_per_s: float = float("inf"),
               overhead_s: float = 0.0) -> FetchPlan | None:
    """The source to fetch `hashes`' longest cached prefix from for `target` (which holds
    `target_cached` of its tokens), or None: fetching is off (min_tokens 0), `target` has no
    host tier to take an entry, no live worker holds at least `min_tokens` more, or fetching
    the entry would not pay (fetch_pays). Of equal holders: one on the target's node, then a
    prefill worker (a decode worker's export takes time between its decode steps)."""
    if min_tokens <= 0 or not hashes or "tier_host_bytes" not in target.stats:
        return None
    best, best_key = None, None
    for worker in workers:
        if worker is target or not worker.alive or worker.draining or "tier_host_bytes" not in worker.stats:
            continue  # a source stages what it sends in its host tier
        tokens = worker.prefixes.reported_blocks(hashes) * block_size
        if tokens - target_cached < min_tokens or (best_key is not None and tokens < best_key[0]):
            continue
        if not fetch_pays(target.stats, tokens, tokens - target_cached, block_size, link_bytes_per_s, overhead_s):
            continue
        key = (tokens, worker.node_id == target.node_id, worker.kind == "prefill")
        if best_key is None or key > best_key:
            best, best_key = worker, key
    if best is None:
        return None
    return FetchPlan(best, hashes[: best_key[0] // block_size], best_key[0])
