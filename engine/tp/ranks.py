"""The ranks of one tensor-parallel engine.

Rank 0 is the engine (scheduler, sampler, hand-offs); ranks 1..N-1 are follower processes that
hold their shard of the model and of the cache and do exactly what rank 0 tells them, in the
order it tells them: ("forward", HostBatch), ("static_step", HostBatch) (a decode step on their
static buffers or CUDA graph of its size, engine.cuda_graphs), ("copy_state", pairs), ("poison",
slot), a hand-off's ("gather", blocks, slot) and ("scatter", shapes, blocks, slot)
(engine.tp.staging; with a last argument True, a prefix-cache entry's, whose slot is a
checkpoint row: engine.entry_rows), an MTP head's ("mtp_head",) and ("mtp", step, ...)
(engine.mtp.HeadSteps), ("stop",); and the kinds they answer: ("xfer", op, ...), their own transport
endpoint's calls for rank-to-rank hand-offs (engine.tp.rank_handoffs), ("profile", tokens), the
profile step of gpu_memory_utilization (engine.memory_profile), and ("static_decode", capture),
their static decode buffers and CUDA graphs, both run with rank 0's.
Their forwards meet rank 0's at every collective of the sharded layers (a process group of
their own, gloo on CPU and NCCL on GPUs, so several engines can live in one process), and their
caches only ever change by these commands, so rank r's cache is always rank 0's cache, sharded.

Commands go over a local socket per follower (multiprocessing.connection, with a key): a follower
whose engine died sees it close and exits, instead of waiting in a collective that will never
come. Followers are processes rank 0 starts, or Ray actors a worker places (engine.tp.ray_ranks). Commands are pickled by hand
(plain pickle copies tensor bytes; multiprocessing's pickler would move every step's tensors
into new shared-memory files).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import secrets
import threading
import weakref
from multiprocessing.connection import Client, Listener

import torch

from engine.tp.group import TPGroup

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0
WATCH_INTERVAL_S = 0.2
ANSWERED = ("xfer", "profile", "static_decode")  # the commands a follower answers (TPLeader.ask)


class StoreGroup(TPGroup):
    """The ranks' process group, built on a TCPStore outside torch.distributed's default world
    (several engines per process): gloo for CPU ranks, NCCL for GPU ranks (one device each)."""

    def __init__(self, store, rank: int, size: int, device: str = "cpu", timeout_s: float = COLLECTIVE_TIMEOUT_S):
        import torch.distributed as dist

        self.rank, self.size, self._store = rank, size, store
        self.backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        timeout, prefixed = datetime.timedelta(seconds=timeout_s), dist.PrefixStore("tp", store)
        if self.backend == "nccl":
            if not dist.is_nccl_available():
                raise RuntimeError("tensor-parallel GPU ranks need torch built with NCCL")
            torch.cuda.set_device(torch.device(device))
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        self.on_error = None  # called with the exception when a collective fails (a rank is gone)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:
            if self.on_error is not None:
                self.on_error(e)
            raise

    @staticmethod
    def open_store(size: int):
        """Rank 0's store on a free local port: (store, port)."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        return store, store.port

    @classmethod
    def join(cls, port: int, rank: int, size: int, device: str = "cpu") -> StoreGroup:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        return cls(store, rank, size, device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._wait(self._pg.allreduce([t]))
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self._pg.allgather([parts], [t]))
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (one shape on all) on rank 0, in rank order; None on the others."""
        import torch.distributed as dist

        t, dtype = _as_bytes(t.contiguous())
        outputs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._wait(self._pg.gather(outputs, [t], options))
        return [o.view(dtype) for o in outputs[0]] if self.rank == 0 else None

    def scatter_from_first(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's parts[r] into rank r's `out` (one shape on all); the others pass None."""
        import torch.distributed as dist

        inputs = [[_as_bytes(p.contiguous())[0] for p in parts]] if self.rank == 0 else []
        options = dist.ScatterOptions()
        options.rootRank = 0
        self._wait(self._pg.scatter([_as_bytes(out)[0]], inputs, options))
        return out


def rank_device(device: str, rank: int) -> str:
    """Where rank `rank` runs. CPU ranks share the host. A GPU rank takes cuda:rank when this
    process sees a device per rank (local ranks), else the one device it sees (a Ray rank's own)."""
    if torch.device(device).type != "cuda":
        return device
    if torch.device(device).index not in (None, 0):
        raise ValueError(f"device {device!r}: tensor-parallel ranks are placed from cuda:0 on; pass 'cuda'")
    count = torch.cuda.device_count()
    if count == 1:
        return "cuda:0"
    if count > rank:
        return f"cuda:{rank}"
    raise ValueError(f"tensor-parallel rank {rank} needs its own GPU; this process sees {count}")


class LocalRanks:
    """Ranks 1..N-1 as processes of this machine (the default; a worker passes Ray actors).

    They fork from this process's multiprocessing forkserver, which imports torch and this
    module once (a spawned rank imported them again: about 2 s a rank on 2 cores, against 0.1 s
    forked). The forkserver only imports: no op runs there, so torch's OpenMP pool and the
    engine's threads do not exist when it forks, as they do in the engine's process. Its
    environment is the one it started with: each rank takes rank 0's current one first
    (`with_environment`)."""

    def start(self, rank: int, args: tuple):
        proc = rank_context().Process(target=with_environment, name=f"splitserve-tp-rank{rank}",
                                      args=(dict(os.environ), follower_main, *args), daemon=True)
        proc.start()
        return proc  # is_alive(), exitcode, pid, join(timeout), kill()


def rank_context():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])  # read when the forkserver starts
    return context


def with_environment(environment: dict, target, *args) -> None:
    """target(*args) under `environment`: a forked process has its forkserver's."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


def _as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """A float8 tensor as its bytes (gloo moves no float8 dtype: FP8 KV rows, engine.kv_format),
    and the dtype to view the result back as; other tensors as they are."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8), t.dtype
    return t, t.dtype


class TPLeader:
    """Rank 0's end: starts the other ranks of an engine (through `launcher`, LocalRanks by
    default) and sends them its commands over a local socket each."""

    def __init__(self, model: str, dtype: str, device: str, block_size: int, size: int, launcher=None):
        store, port = StoreGroup.open_store(size)
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        launcher = launcher or LocalRanks()
        self._procs = [launcher.start(rank, (model, dtype, device, block_size, rank, size, port,
                                             listener.address, authkey, torch.get_num_threads()))
                       for rank in range(1, size)]
        self.group = StoreGroup(store, 0, size, rank_device(device, 0))  # gloo: returns once all joined
        by_rank = {}
        with listener:  # each rank connects once it is in the group, and says which it is
            for _ in range(size - 1):
                conn = listener.accept()
                by_rank[conn.recv()] = conn
        self._conns = [by_rank[rank] for rank in range(1, size)]
        self._closing = threading.Event()
        self._closer = weakref.finalize(self, _stop, self._conns, self._procs, self._closing)
        # Called (rank or None, why) when a rank dies: by the watchdog, or by whichever of a
        # collective or a send notices first (the engine thread must not carry on and fail the
        # requests as if they were at fault).
        self.on_rank_lost = None
        me = weakref.ref(self)  # no cycle through the group: collection still stops the ranks
        self.group.on_error = lambda e: me() is not None and me()._lost(None, e)
        threading.Thread(target=_watch, args=(weakref.ref(self), self._procs, self._closing),
                         name="tp-rank-watchdog", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        """The processes of ranks 1..N-1."""
        return [proc.pid for proc in self._procs]

    def send(self, *command) -> None:
        """Every forward goes through here: no liveness probe per call (a Ray rank's costs a
        round trip); the watchdog watches the ranks, and a dead rank's socket refuses the send."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, len(self._conns) + 1):
            self._send_to(rank, data)

    def ask(self, *command, each: list | None = None) -> list[tuple[bool, object]]:
        """Send a command every follower answers; their (ok, value or error text) in rank order
        (1..N-1). `each`: one more argument per follower (e.g. that rank's offer). Like send(),
        only from the thread that drives the engine: commands and answers share each socket."""
        return self.ask_while(None, *command, each=each)[1]

    def ask_while(self, mine, *command, each: list | None = None):
        """ask(), with rank 0's own part `mine()` run between sending and reading the answers
        (a command whose work meets in collectives); returns (what mine returned, answers)."""
        for rank in range(1, len(self._conns) + 1):
            full = command if each is None else (*command, each[rank - 1])
            self._send_to(rank, pickle.dumps(full, protocol=pickle.HIGHEST_PROTOCOL))
        own = mine() if mine is not None else None
        answers = []
        for rank, conn in enumerate(self._conns, start=1):  # every answer is read: the sockets stay in step
            try:
                answers.append(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError) as e:
                self._lost(rank, e)
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e})") from e
        return own, answers

    def _send_to(self, rank: int, data: bytes) -> None:
        try:
            self._conns[rank - 1].send_bytes(data)
        except OSError as e:
            self._lost(rank, e)
            raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e})") from e

    def _lost(self, rank: int | None, why) -> None:
        if not self._closing.is_set() and self.on_rank_lost is not None:
            self.on_rank_lost(rank, why)

    def close(self) -> None:
        self._closer()


def _watch(leader_ref, procs, closing: threading.Event) -> None:
    """A follower that dies leaves rank 0 waiting in (or failing) its next collective: say so at
    once. A worker exits then, so that Ray restarts all its ranks and the router resumes its
    requests elsewhere (decode_worker, prefill_worker); an in-process engine's next step fails."""
    while not closing.wait(WATCH_INTERVAL_S):
        for rank, proc in enumerate(procs, start=1):
            if not proc.is_alive() and not closing.is_set():
                leader = leader_ref()
                log.error("tensor-parallel rank %d died (exit code %s)", rank, proc.exitcode)
                if leader is not None:
                    leader._lost(rank, f"exit code {proc.exitcode}")
                return


def _stop(conns, procs, closing: threading.Event) -> None:
    closing.set()
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def follower_main(model_path: str, dtype: str, device: str, block_size: int, rank: int, size: int,
                  port: int, address, authkey: bytes, threads: int) -> None:
    """A follower: build the shard, then obey rank 0 until it says stop or goes away."""
    from engine.models import load_model
    from engine.tp.shard import shard_model

    torch.set_num_threads(threads)
    torch_dtype, device = getattr(torch, dtype), rank_device(device, rank)
    group = StoreGroup.join(port, rank, size, device)
    conn = Client(address, authkey=authkey)
    conn.send(rank)
    follower = Follower(group, shard_model(load_model(model_path, torch_dtype, device), group),
                        block_size, torch_dtype, device, model_path)
    try:
        while True:
            try:
                command = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                return
            if command[0] == "stop":
                return
            answer = follower.obey(command)
            if command[0] in ANSWERED:  # answered, even when it fails: rank 0 reads one answer per ask
                conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        follower.endpoint.close()


class Follower:
    """What a follower rank holds: its shard of the model and of the cache, and its hand-off
    endpoint (engine.tp.rank_handoffs)."""

    def __init__(self, group, model, block_size: int, torch_dtype, device: str, model_path: str = ""):
        from engine.tp.rank_handoffs import RankEndpoint

        self.group, self.model, self.block_size = group, model, block_size
        self.torch_dtype, self.device, self.model_path = torch_dtype, device, model_path
        self.cache = self.runner = self.index = None
        self.full_spec = model.full_spec  # un-sharded, with an MTP head's layer once there is one
        self.head = self.head_steps = None  # an MTP head (engine.mtp), where rank 0 has one
        self.endpoint = RankEndpoint(group.rank, group.size, block_size)

    def obey(self, command: tuple):
        from engine.cache import ModelCache
        from engine.model_runner import ModelRunner
        from engine.state_slots import StateSlotAllocator

        kind = command[0]
        # As on rank 0, only compute runs in inference mode: the cache, and whatever a transport
        # allocates, must stay normal tensors that the transport's own threads may write in place.
        if kind == "xfer":
            return self.endpoint.handle(self.cache, *command[1:])
        if kind == "profile":  # gpu_memory_utilization: the profile step, with rank 0's (its collectives)
            from engine import memory_profile

            try:
                return True, memory_profile.measure(self.model, self.model.spec, self.torch_dtype, self.block_size,
                                                    command[1], torch.device(self.device),
                                                    stats=memory_profile.device_stats)
            except Exception as error:  # noqa: BLE001 - reported to rank 0, which refuses to start
                return False, f"{type(error).__name__}: {error}"
        if kind == "static_decode":  # with rank 0's own: captures meet in the same collectives
            try:
                with torch.inference_mode():
                    self.runner.use_static_decode(capture=command[1], verify_rows=command[2])
                return True, self.runner.static.eager_reason
            except Exception as error:  # noqa: BLE001 - reported to rank 0, which refuses to start
                return False, f"{type(error).__name__}: {error}"
        if kind == "mtp_head":  # before "cache": the head's layer is one more of the cache's
            from engine.mtp import load_head

            self.head, full = load_head(self.model_path, self.torch_dtype, self.device, self.group)
            self.full_spec = self.full_spec.with_layer(full)
            return None
        if kind == "cache":  # the sizes rank 0 planned: same shard shapes, same rows, same formats
            from engine.mtp import HeadSteps

            sizes, max_model_len, cache_format = command[1:]  # engine.cache_formats.CacheFormat
            spec = cache_format.for_rank(self.model.full_spec, self.group.size, self.group.rank).apply(self.model.spec)
            spec = spec.with_layer(self.head.cache_spec(self.torch_dtype) if self.head is not None else None)
            self.cache = ModelCache(spec, sizes, self.block_size, self.torch_dtype, self.device)
            self.runner = ModelRunner(self.model, self.cache, StateSlotAllocator(sizes.num_slots), self.device,
                                      debug=False, enforce_eager=True, max_model_len=max_model_len,
                                      keep_hidden=self.head is not None)
            if self.head is not None:
                self.head_steps = HeadSteps(self.head, self.model, self.cache, self.runner, len(self.model.layers))
            return None
        with torch.inference_mode():
            return self._compute(kind, command[1:])

    def _compute(self, kind: str, args: tuple) -> None:
        from engine.tp.staging import gather_rows, scatter_rows, shard_indices

        cache = self.cache
        if kind == "forward":
            batch = self.runner.device_batch(args[0])
            batch.keep_hidden = self.runner.keep_hidden
            self.model(batch, cache.layers)
            self.runner.last_hidden = batch.hidden  # what an MTP head's next observation reads
        elif kind == "static_step":
            self.runner.static.run(args[0])
            self.runner.last_hidden = self.runner.static.last_hidden
        elif kind == "mtp":  # one of the head's steps, as rank 0 takes it (engine.mtp.HeadSteps)
            getattr(self.head_steps, args[0])(*args[1:])
        elif kind == "copy_state":
            cache.copy_state(args[0])
        elif kind == "poison":
            cache.poison_slot(args[0])
        elif kind == "gather":
            gather_rows(self.group, cache, *args)
        elif kind == "scatter":
            self.index = self.index or shard_indices(self.full_spec, self.group.size, cache.device)
            scatter_rows(self.group, cache, self.index, None, *args)
        else:
            raise RuntimeError(f"tensor-parallel rank {self.group.rank}: unknown command {kind!r}")
