"""The router's view of its workers: start, connect, watch, choose, abort."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
from dataclasses import dataclass, field

from decode_worker.outbox import connect_outputs
from kvtransfer.transport import choose_transport
from router.backend import Unavailable
from router.placement import check_capacity, place_workers, remove_groups, resolve_auto_resources
from router.prefix_routing import PrefixIndex

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.25


@dataclass
class WorkerRef:
    name: str
    kind: str  # "prefill" or "decode"
    handle: object  # Ray actor handle
    node_id: str = ""
    alive: bool = True
    stats: dict = field(default_factory=dict)
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet handed off
    reserved_since_stats: int = 0  # decode: reservations the last stats do not show yet
    incarnation: str = ""  # the actor's current life; a new one after Ray restarts it
    prefixes: PrefixIndex = field(default_factory=lambda: PrefixIndex(1 << 16))  # what it likely caches
    draining: bool = False  # being removed: gets no new work (router/scaling.py)
    group: object = None  # its placement group (shared with its pair when packed)
    poll_task: object = None  # decode: the task following its outputs
    outputs_over_ray: bool = False  # decode: the router cannot reach its output_address


class WorkerSet:
    def __init__(self, config, on_lost=None, on_room=None):
        self.config = config
        self.prefill: list[WorkerRef] = []
        self.decode: list[WorkerRef] = []
        # worker-side request id -> (decode worker holding it, that worker's incarnation then)
        self.owner: dict[str, tuple[WorkerRef, str]] = {}
        self._on_lost = on_lost or (lambda worker, incarnation: None)  # a decode incarnation died
        self._on_room = on_room or (lambda: None)  # fresh stats: capacity may have freed
        self.model_facts: dict = {}
        self._groups = []
        self._tasks: list[asyncio.Task] = []
        self._started_ray = False
        self.transport = config.transport
        self._indices = {"prefill": itertools.count(), "decode": itertools.count()}
        self._route = None
        self._repairing: asyncio.Lock | None = None  # made on the router's loop, on first use

    # ---- lifecycle ----

    async def start(self, route) -> None:
        import ray

        config, placement = self.config, self.config.placement
        if not ray.is_initialized():
            options = dict(config.ray_init_options)
            if config.address is None:
                p_most, d_most = (config.autoscale.prefill[1], config.autoscale.decode[1]) \
                    if config.autoscale is not None else (0, 0)  # room on our own Ray for the most it may start
                workers = (max(config.prefill, p_most) * placement.prefill_tp
                           + max(config.decode, d_most) * placement.decode_tp)
                options.setdefault("num_cpus", max(os.cpu_count() or 1,
                                                   int(workers * placement.cpus_per_worker + 0.999)))
                options.setdefault("include_dashboard", False)
            # "local": a fresh Ray of our own even if another one runs on this machine.
            ray.init(address=config.address or "local", **options)
            self._started_ray = True
        self._route = route
        await self.grow(config.prefill, config.decode, placement.pack_pairs)
        self._tasks.append(asyncio.ensure_future(self._watch()))

    async def grow(self, num_prefill: int, num_decode: int, pack_pairs: bool = False) -> list[WorkerRef]:
        """Start workers and pair each with every live worker of the other kind before it gets
        work; at start, or on a running cluster (router/scaling.py)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from decode_worker.worker import DecodeWorker
        from kvtransfer.layout import CacheLayout
        from kvtransfer.shm import SHM_SENDER_ENV
        from prefill_worker.worker import PrefillWorker

        config = self.config
        placement = dataclasses.replace(config.placement, pack_pairs=pack_pairs)
        if self._started_ray:  # a Ray of fixed size: what does not fit now never will
            resolve_auto_resources(placement, ray.cluster_resources())
            running = len(self.prefill) * placement.prefill_tp + len(self.decode) * placement.decode_tp
            check_capacity(placement, num_prefill, num_decode, ray.available_resources(),
                           running + num_prefill * placement.prefill_tp + num_decode * placement.decode_tp)
        groups, p_slots, d_slots = await asyncio.to_thread(place_workers, placement, num_prefill, num_decode)
        self._groups += groups

        def spawn(cls, kind, slot, env):
            group, bundles = slot
            name = f"{kind}-{next(self._indices[kind])}"
            # Ranks 1..N-1 go to the worker's other bundles (engine.tp.ray_ranks).
            ranks = (group, bundles[1:], placement.cpus_per_worker, placement.gpus_per_worker) \
                if len(bundles) > 1 else None
            handle = ray.remote(cls).options(
                name=None, num_cpus=placement.cpus_per_worker, num_gpus=placement.gpus_per_worker,
                max_concurrency=1000, max_restarts=config.max_restarts, max_task_retries=0, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundles[0]),
            ).remote(name, config.model, engine_options(config, kind), self.transport, config.transfer_timeout_s, ranks)
            return WorkerRef(name, kind, handle, group=group)

        nodes = set().union(*(_group_nodes(g) for g in groups))
        if self.transport == "auto":
            self.transport = choose_transport("auto", placement.gpus_per_worker, same_node=len(nodes) == 1)
        elif self.transport == "shm" and self.prefill and nodes - {w.node_id for w in self.prefill + self.decode}:
            remove_groups(groups)
            self._groups = [g for g in self._groups if g not in groups]
            raise RuntimeError("the shm transport needs every worker on one node, and Ray placed new "
                               "ones elsewhere; serve with --transport gloo to grow across nodes")
        env = SHM_SENDER_ENV if self.transport == "shm" else None
        new_prefill = [spawn(PrefillWorker, "prefill", s, env) for s in p_slots]
        new_decode = [spawn(DecodeWorker, "decode", s, None) for s in d_slots]
        new = new_prefill + new_decode
        known = [w for w in self.prefill + self.decode if w.alive]
        layouts = await asyncio.gather(*(w.handle.layout.remote() for w in known[:1] + new))
        first = CacheLayout.from_dict(layouts[0])
        for worker, layout in zip(new, layouts[len(known[:1]):]):  # block sizes may differ: hand-offs re-block
            CacheLayout.from_dict(layout).check_compatible(first, f"worker {worker.name}", f"worker {(known[:1] + new)[0].name}")
        nodes = await asyncio.gather(*(w.handle.node_id.remote() for w in new))
        for worker, node in zip(new, nodes):
            worker.node_id = node
        if new_decode:  # the newest worker's: a rolling restart may have changed the block size
            self.model_facts = await new_decode[-1].handle.facts.remote()
        for worker in new:  # roughly what each worker's cache can keep
            worker.prefixes = PrefixIndex(self.model_facts["num_kv_blocks"])
        live_prefill = [w for w in self.prefill if w.alive and not w.draining] + new_prefill
        live_decode = [w for w in self.decode if w.alive and not w.draining] + new_decode
        for p in live_prefill:
            for d in live_decode:
                if p in new_prefill or d in new_decode:
                    await self._connect(p, d)
        self.prefill += new_prefill
        self.decode += new_decode
        await self.refresh_stats()
        for d in new_decode:
            d.poll_task = asyncio.ensure_future(self._follow_outputs(d, self._route))
            self._tasks.append(d.poll_task)
        return new

    async def stop(self) -> None:
        import ray

        for task in self._tasks:
            task.cancel()
        # Awaited, so that none is still pending when the router's loop stops.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for worker in self.prefill + self.decode:
            try:
                await asyncio.wait_for(worker.handle.shutdown.remote(), 10)
            except Exception:
                pass
            ray.kill(worker.handle, no_restart=True)
        remove_groups(self._groups)
        if self._started_ray:
            ray.shutdown()

    # ---- watching ----

    async def _follow_outputs(self, worker: WorkerRef, route) -> None:
        """Route the decode worker's outputs as its engine delivers them, pushed, no poll
        between steps: over a direct connection to the worker (decode_worker.outbox), or its
        Ray `outputs` stream where that connection cannot be made; opened again when it breaks.
        A break may have lost outputs in flight, so it is handled as the worker's loss: its
        requests fail over and resume from what their callers have."""
        while True:
            life = worker.incarnation
            try:
                async for batch in await self._outputs_of(worker):
                    await route(batch)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._lost(worker, e, life)
            await asyncio.sleep(0.5)  # a dead worker: Ray restarts it meanwhile

    @staticmethod
    async def _outputs_of(worker: WorkerRef):
        if not worker.outputs_over_ray:
            host, port, token = await worker.handle.output_address.remote()
            try:
                return await connect_outputs(host, port, token)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("%s: no direct connection to %s:%s (%s); its outputs come over Ray",
                            worker.name, host, port, e)
                worker.outputs_over_ray = True
        return _resolved(worker.handle.outputs.remote())

    def lost_if_dead(self, worker: WorkerRef, error: BaseException, incarnation: str) -> None:
        """`error` came from a call made to `incarnation` of the worker."""
        from ray.exceptions import RayActorError

        if isinstance(error, RayActorError):
            self._lost(worker, error, incarnation)

    def _lost(self, worker: WorkerRef, error, incarnation: str) -> None:
        """The worker stopped answering: nothing is placed on it until it answers as a (new)
        incarnation and is reconnected; what its old incarnation held is failed over.
        A failure of a call made to an earlier incarnation says nothing of the current one
        (Ray fails calls sent during a restart later, after the new life has been seen)."""
        if incarnation != worker.incarnation:
            return
        if worker.alive:
            log.warning("%s %s lost: %s", worker.kind, worker.name, error)
        worker.alive = False
        if worker.kind == "decode":
            self._on_lost(worker, worker.incarnation)

    async def _connect(self, prefill: WorkerRef, decode: WorkerRef) -> None:
        # Workers of one TP size pair rank to rank (engine.tp.rank_handoffs): the offer says so.
        ranks = await prefill.handle.handoff_ranks.remote()
        offer = await decode.handle.accept.remote(prefill.name, ranks)
        await prefill.handle.connect.remote(decode.name, offer)

    async def repair_channels(self) -> int:
        """Reconnect every prefill -> decode channel that broke; returns how many were broken.
        One repair at a time: two would pair the same workers twice, and the second connect
        closes the channel the first just opened (failing whatever it carries)."""
        if self._repairing is None:
            self._repairing = asyncio.Lock()
        async with self._repairing:
            return await self._repair_channels()

    async def _repair_channels(self) -> int:
        by_name = {d.name: d for d in self.decode}
        broken = 0
        for p in [w for w in self.prefill if w.alive]:
            try:
                peers = await asyncio.wait_for(p.handle.disconnected_peers.remote(), 5)
            except Exception:
                continue
            for name in peers:
                broken += 1
                if by_name.get(name) is not None and by_name[name].alive:
                    try:
                        await self._connect(p, by_name[name])
                        log.info("reconnected %s -> %s", p.name, name)
                    except Exception as e:
                        log.warning("reconnecting %s -> %s failed: %s", p.name, name, e)
        return broken

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self.refresh_stats()
            await self.repair_channels()

    async def refresh_stats(self) -> None:
        workers = self.prefill + self.decode
        lives = [w.incarnation for w in workers]
        results = await asyncio.gather(*(asyncio.wait_for(w.handle.stats.remote(), 5) for w in workers),
                                       return_exceptions=True)
        for worker, life, stats in zip(workers, lives, results):
            if isinstance(stats, BaseException):
                self._lost(worker, stats, life)
                continue
            if worker.incarnation and stats["incarnation"] != worker.incarnation:
                self._lost(worker, "restarted", worker.incarnation)
                worker.prefixes.clear()  # a new life starts with an empty cache
                await self._rejoin(worker)
            worker.incarnation = stats["incarnation"]
            events = stats.pop("cache_events", None)
            if events is not None:
                worker.prefixes.apply(events)
            worker.stats = stats
            worker.reserved_since_stats = 0
            worker.alive = True
        self._on_room()

    async def _rejoin(self, worker: WorkerRef) -> None:
        """A restarted worker: pair it again with every live worker of the other kind."""
        pairs = ([(worker, d) for d in self.decode if d.alive] if worker.kind == "prefill"
                 else [(p, worker) for p in self.prefill if p.alive])
        for p, d in pairs:
            try:
                await self._connect(p, d)
            except Exception as e:
                log.warning("reconnecting %s -> %s failed: %s", p.name, d.name, e)
        log.info("%s %s rejoined after a restart", worker.kind, worker.name)

    def all_alive(self) -> bool:
        return any(w.alive for w in self.prefill) and any(w.alive for w in self.decode)

    # ---- choosing ----

    def pick_decode(self, num_tokens: int, hashes: list[bytes] = (), local_limit: int = 0
                    ) -> tuple[WorkerRef, int]:
        """A decode worker with room, and how many of the request's tokens it likely has cached.
        One that can prefill the request itself (at most `local_limit` tokens not cached, e.g.
        the next turn of a chat it answered) goes before the others."""
        alive = [w for w in self.decode if w.alive and not w.draining]
        if not alive:
            raise Unavailable("no decode worker is alive")
        size = self.model_facts.get("block_size", 1)

        def cached(w: WorkerRef) -> int:
            return min(w.prefixes.matched_blocks(hashes) * size, num_tokens - 1)

        def room(w: WorkerRef):
            s = w.stats
            has_slot = s.get("state_slots_free", 0) - w.reserved_since_stats > 0
            return (has_slot, has_slot and num_tokens - cached(w) <= local_limit,
                    s.get("kv_blocks_free", 0), -(s.get("running", 0) + w.reserved_since_stats))

        best = max(alive, key=room)
        best.reserved_since_stats += 1
        return best, cached(best)

    def pick_prefill(self, num_tokens: int, hashes: list[bytes] = ()) -> tuple[WorkerRef, int]:
        """The prefill worker with the least work ahead once this request is queued there: its
        queued prompt tokens plus this prompt's part it likely has not cached (Dynamo's
        KV-aware routing). Returns the worker and the tokens charged to it."""
        alive = [w for w in self.prefill if w.alive and not w.draining]
        if not alive:
            raise Unavailable("no prefill worker is alive")
        size = self.model_facts.get("block_size", 1)

        def uncached(w: WorkerRef) -> int:
            return num_tokens - min(w.prefixes.matched_blocks(hashes) * size, num_tokens - 1)

        best = min(alive, key=lambda w: (w.queued_tokens + uncached(w), w.queued_tokens))
        charge = uncached(best)
        best.queued_tokens += charge  # counted from the choice on, so a burst spreads out
        best.prefixes.add(hashes)
        return best, charge

    async def abort_everywhere(self, request_id: str) -> None:
        """Abort on every worker. One taken for lost gets it too, unawaited: a stats call that
        timed out on a busy machine marks a worker lost that may still be running the request
        (it answers again as the same incarnation), and skipping it let the request run on to
        max_tokens; a worker that really died fails the call, or its new life finds nothing."""
        workers = self.prefill + self.decode
        calls = [asyncio.ensure_future(asyncio.wait_for(w.handle.abort.remote(request_id), 10)) for w in workers]
        for call in calls:
            call.add_done_callback(_ignore_failure)
        await asyncio.gather(*(c for c, w in zip(calls, workers) if w.alive), return_exceptions=True)
        self.owner.pop(request_id, None)

    def status(self) -> dict:
        return {"transport": self.transport, "workers": [
            {"id": w.name, "kind": w.kind, "node": w.node_id, "alive": w.alive, **w.stats}
            for w in self.prefill + self.decode]}


def _ignore_failure(future: asyncio.Future) -> None:
    """Retrieve a best-effort call's outcome, so a failure is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _group_nodes(group) -> set[str]:
    from ray.util.placement_group import placement_group_table

    return set(placement_group_table(group).get("bundles_to_node_id", {}).values())


def engine_options(config, kind: str) -> dict:
    """A worker's engine options: the cluster's, with its kind's tensor-parallel size and block size."""
    options = dict(config.engine_options)
    tp, block_size = config.placement.ranks(kind), getattr(config, f"{kind}_block_size")
    if tp > 1:
        options["tensor_parallel_size"] = tp
    if block_size is not None:
        options["block_size"] = block_size
    return options


async def _resolved(stream):
    """The values of a Ray streaming generator's items."""
    async for ref in stream:
        yield await ref
