"""The engine loop: schedule, run, postprocess. Shared by engine.LLM and both worker kinds."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.cache_events import CacheEvents
from engine.cache import ModelCache, plan_cache, wasted_formats
from engine.cache_formats import CacheFormat
from engine.kv_format import KV_DTYPES, read_kv_scales
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, token_slice
from engine.mtp import MTPProposer, load_head
from engine.models import load_model
from engine.output import OutputTracker, RequestOutput
from engine.phase import Phase
from engine.prefix_cache import PrefixCache, block_hashes
from engine.prompts import check_prompt_length, prompt_token_ids
from engine.request import Request, RequestStatus, Resume
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.scheduler import Scheduler, ScheduledSeq
from engine.verify import Speculation, split_verify_rows
from engine.state_slots import StateOwnershipError, StateSlotAllocator
from engine.structured import GrammarCompiler
from engine.disk_tier import PREFETCH_LIMIT
from engine.entry_rows import entry_rows
from engine.prefix_exchange import PrefixExchange
from engine.tiered_cache import TieredCache, cache_fingerprint
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192
PREFILL_RATE_DECAY = 0.9  # per step that prefills: the rate stats() reports follows the last few dozen
DECODING = RequestStatus.DECODING


@dataclass
class Handoff:
    """Prefill side: a request whose prompt is computed and whose first token is sampled.

    Its blocks and slot stay held until `finish_handoff`, so nothing overwrites them while
    they are being sent.
    """

    request_id: str
    num_tokens: int  # tokens whose KV and state are computed: the prompt (+ resumed outputs)
    first_token: int
    first_logprob: dict | None
    block_ids: list[int]
    slot: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: the wire carries none


@dataclass
class PrefillProgress:
    """Prefill side: a request still prefilling, its whole prompt's blocks and its slot held
    (a prefill-only scheduler takes them at admission), so its hand-off may begin: KV rows of
    its first num_computed_tokens tokens are final in every layer."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    block_ids: list[int]
    slot: int


@dataclass
class Reservation:
    """Decode side: where an incoming request's KV blocks and Mamba state must be written."""

    request_id: str
    block_ids: list[int]
    slot: int


class LLMEngine:
    def __init__(self, config: EngineConfig, tp_launcher=None):
        """`tp_launcher` starts ranks 1..N-1 (engine.tp: local processes by default)."""
        self.config = config
        self._hands_off = config.mode == "prefill"  # a prefill worker's requests leave after their first token
        self.model = load_model(config.model, config.torch_dtype, config.device)
        # FP8 KV's scales, checked against the un-sharded model's KV heads (engine.kv_format)
        scales = read_kv_scales(config.model, self.model.spec) if KV_DTYPES[config.kv_cache_dtype] is not None else {}
        self.tp = None  # engine.tp.ranks.TPLeader when the model is sharded over several ranks
        if config.tensor_parallel_size > 1:
            import torch

            from engine.tp.ranks import TPLeader
            from engine.tp.shard import shard_model

            if tp_launcher is None and config.device.startswith("cuda") and \
                    torch.cuda.device_count() < config.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} on GPUs needs a GPU per "
                                 f"rank; this process sees {torch.cuda.device_count()}")
            self.tp = TPLeader(config.model, config.dtype, config.device, config.block_size,
                               config.tensor_parallel_size, tp_launcher)
            try:
                self.model = shard_model(self.model, self.tp.group)
            except BaseException:
                self.tp.close()
                raise
        self.spec = self.model.spec
        # An MTP head (engine.mtp) runs on every worker, a prefill worker's too: its cache is
        # one more layer of the target's, which a hand-off carries with the rest.
        self.mtp_head = self._load_mtp_head(config)
        # The cache's formats (engine.cache_formats): half-width state, FP8 KV with its scales.
        # (Un-sharded: each rank stores its shard in its share of it, CacheFormat.for_rank.)
        self.cache_format = CacheFormat(config.mamba_state_dtype, config.kv_cache_dtype, scales)
        cache_spec = self.cache_format.for_rank(self.model.full_spec, self.tp.group.size, 0).apply(self.spec) \
            if self.tp is not None else self.cache_format.apply(self.spec)
        for reason in wasted_formats(self.spec, cache_spec, config.torch_dtype, config.block_size):
            log.warning("%s (docs/cache-formats.md)", reason)
        if self.mtp_head is not None:
            cache_spec = cache_spec.with_layer(self.mtp_head.cache_spec(config.torch_dtype))
        # The cache un-sharded, as hand-offs and prefix-cache entries carry it: this one, or under
        # tensor parallelism the whole model's (and head's) in the same formats.
        self.full_cache_spec = cache_spec if self.tp is None else \
            self.cache_format.apply(self.model.full_spec).with_layer(self.mtp_full_spec)
        limit = self.spec.max_position or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = min(config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN), limit)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(config.model)
        except FileNotFoundError:
            self.tokenizer = None
        self.eos_token_ids = list(self.spec.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        profiled = config.gpu_memory_utilization is not None and config.device.startswith("cuda")
        cache_bytes = self._profiled_cache_bytes() if profiled else config.cache_memory_bytes
        try:
            sizes = plan_cache(cache_spec, config.torch_dtype, config.block_size, config.max_num_seqs,
                               self.max_model_len, cache_bytes, config.num_kv_blocks, config.num_prefix_checkpoints)
        except ValueError as e:
            if not profiled:
                raise
            raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization}: {e}") from None
        self.cache = ModelCache(cache_spec, sizes, config.block_size, config.torch_dtype, config.device)
        if self.tp is not None:
            self.tp.send("cache", sizes, self.max_model_len, self.cache_format)
        self.blocks = BlockManager(sizes.num_blocks, config.block_size)
        self.slots = StateSlotAllocator(sizes.num_slots)
        self.prefix_cache = PrefixCache(self.blocks, sizes.num_checkpoints, bool(self.spec.state_layers)) \
            if config.enable_prefix_caching else None
        # Where prefix-cache entries leaving or entering the pool are copied from and to: this
        # cache, or every rank's shard of it (engine.entry_rows)
        self.entry_rows = entry_rows(self) if self.prefix_cache is not None else None
        self.tiers = None  # engine.tiered_cache: what the prefix cache's pool evicts, kept lower
        if self.prefix_cache is not None and config.tier_config.enabled:
            self.tiers = TieredCache(config.tier_config, self.entry_rows, self.blocks, self.prefix_cache,
                                     self.cache_fingerprint)
        # Entries exported to and imported from other workers
        self.exchange = PrefixExchange(self) if self.prefix_cache is not None else None
        # What the prefix cache and its tiers store and drop, for the router's index (a worker's
        # stats report drains it: drain_cache_events).
        self.cache_events = None
        if self.prefix_cache is not None:
            self.cache_events = CacheEvents(self._usable_prefixes)
            self.prefix_cache.events = self.cache_events
            if self.tiers is not None:
                self.tiers.attach_events(self.cache_events)
        # A pass leaves a save point's state in its checkpoint row (engine.models.batch.StateSpans)
        # unless some state is not the recurrent layers' own as computed: a narrow format's store
        # rounds whole slots after the layer, and an MTP head's hidden row is written after the
        # pass. There a chunk runs in passes that end at the save points.
        captures = self.cache.layers.narrow is None and self.mtp_head is None
        self.scheduler = Scheduler(self.blocks, self.slots, config.max_num_batched_tokens,
                                   prefill_only=config.mode == "prefill", prefix_cache=self.prefix_cache,
                                   verify_needs_scratch=bool(self.spec.state_layers),
                                   split_at_save_points=not captures)
        # (An MTP head reads each step's hidden states: the runner keeps them, graphs too.)
        # Speculative decoding (engine.verify): a prefill worker's requests never decode here.
        speculative = config.speculative_config if config.mode != "prefill" else None
        self.runner = ModelRunner(self.model, self.cache, self.slots, config.device, config.debug,
                                  config.enforce_eager, self.max_model_len, tp=self.tp,
                                  keep_hidden=self.mtp_head is not None,
                                  verify_width=1 + speculative.num_speculative_tokens if speculative else 1)
        self.mtp = MTPProposer(config.speculative_config, self.mtp_head, self) if self.mtp_head is not None else None
        self.speculation = Speculation(speculative, self) if speculative is not None else None
        self.requests: dict[str, Request] = {}
        self.trackers: dict[str, OutputTracker] = {}
        self._pending: list[RequestOutput] = []
        self.num_steps = 0  # steps that ran something: proof of progress for the router
        # Prefill tokens and the seconds of the steps that ran them, both decayed per such step:
        # their ratio is the recent prefill rate (the router weighs prefix fetches by it).
        self._prefill_tokens = self._prefill_seconds = 0.0
        self.trace_name = "engine"  # what its spans say measured them (a worker puts its name)
        self._handoffs: list[Handoff] = []
        self._ids = itertools.count()

    def _load_mtp_head(self, config: EngineConfig):
        """The MTP head (engine.mtp) on every rank; its un-sharded cache layer kept for the
        hand-offs and prefix-cache entries, which travel un-sharded."""
        speculative = config.speculative_config
        self.mtp_full_spec = None
        if speculative is None or speculative.method != "mtp":
            return None
        if self.tp is not None:
            self.tp.send("mtp_head")  # each rank loads and shards its own, as it did the model
        head, self.mtp_full_spec = load_head(config.model, config.torch_dtype, config.device,
                                             self.tp.group if self.tp is not None else None)
        return head

    def _usable_prefixes(self) -> list:
        events = [("+", "pool", key, end) for key, end in self.prefix_cache.usable()]
        if self.tiers is not None:
            events += [("+", tier, key, end) for tier, key, end in self.tiers.held()]
        return events

    @functools.cached_property
    def cache_fingerprint(self) -> str:
        """What another cache must match to take this one's entries (engine.disk_tier.
        cache_fingerprint: it reads the weight files' ends, so once)."""
        config = self.config
        return cache_fingerprint(config.model, config.dtype, config.block_size, self.entry_rows.layout)

    def drain_cache_events(self) -> dict | None:
        """What the prefix cache and its tiers stored and dropped since the last call
        (engine.cache_events); None without prefix caching."""
        return self.cache_events.drain() if self.cache_events is not None else None

    def _profiled_cache_bytes(self) -> int:
        """What the device has left for the cache (gpu_memory_utilization) after the weights and
        a profile of the largest step, on every rank's device (the smallest budget sizes all)."""
        config = self.config
        from engine import memory_profile

        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        memories = self.rank_memories(tokens, memory_profile.device_stats)
        budget, rank = memory_profile.rank_budget(memories, config.gpu_memory_utilization)
        memory = memories[rank]
        log.info("gpu_memory_utilization %.2f: %.2f GiB for the cache%s (device %.1f GiB, weights and peak step "
                 "%.2f GiB)", config.gpu_memory_utilization, budget / 2**30,
                 f" on each of {len(memories)} ranks, rank {rank}'s the smallest" if len(memories) > 1 else "",
                 memory.total / 2**30, (memory.peak - memory.profile_cache) / 2**30)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization}: the weights and the largest "
                             f"step already take {(memory.peak - memory.profile_cache) / 2**30:.2f} GiB of "
                             f"{memory.total / 2**30:.1f} GiB; raise it or lower max_num_batched_tokens")
        return budget

    def rank_memories(self, tokens: int, stats) -> list:
        """engine.memory_profile.DeviceMemory of each rank (one here without tensor parallelism)
        after the profile step of `tokens` tokens, run by every rank at once."""
        import torch

        from engine import memory_profile

        config = self.config

        def mine():
            return memory_profile.measure(self.model, self.spec, config.torch_dtype, config.block_size, tokens,
                                          torch.device(config.device), stats=stats)
        if self.tp is None:
            return [mine()]
        memory, answers = self.tp.ask_while(mine, "profile", tokens)
        for rank, (ok, value) in enumerate(answers, start=1):
            if not ok:
                raise RuntimeError(f"tensor-parallel rank {rank}: the profile step failed: {value}")
        return [memory, *(value for _, value in answers)]

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the engine is collected)."""
        if self.tp is not None:
            self.tp.close()

    # ------------------------------------------------------------------ requests in and out

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.spec.vocab_size)

    def validate_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        check_prompt_length(num_prompt_tokens, self.max_model_len)
        worst = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(worst) > self.blocks.num_blocks:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens = {worst} tokens needs "
                                 f"{self.blocks.blocks_needed(worst)} KV blocks; the cache has "
                                 f"{self.blocks.num_blocks}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, resume: Resume | None = None) -> str:
        request = self._new_request(prompt, params or SamplingParams(), request_id, resume)
        self.scheduler.add(request)
        return request.request_id

    def _new_request(self, prompt, params: SamplingParams, request_id: str | None,
                     resume: Resume | None) -> Request:
        ids = self.tokenize(prompt)
        self.validate_length(len(ids), params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        request = Request(request_id, ids, params)
        request.grammar = self.grammars.state(params.structured_output)  # compiled once, then copied
        if resume is not None:
            done = self.tokenize(list(resume.output_token_ids)) if resume.output_token_ids else []
            if len(done) >= params.max_tokens or len(ids) + len(done) >= self.max_model_len:
                raise InvalidRequest("resume", f"{len(done)} tokens already generated leave nothing to "
                                     f"generate (max_tokens {params.max_tokens}, context {self.max_model_len})")
            request.output_token_ids = list(done)
        elif params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token follows nothing
        tracker = OutputTracker(request, self.tokenizer, self.eos_token_ids,
                                self.max_model_len, resume.sent_chars if resume else 0,
                                deltas=self.config.output_kind == "delta", where=self.trace_name)
        self.requests[request_id] = request
        self.trackers[request_id] = tracker
        return request

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Finish a request early (aborted, or failed with `error`); its final output is queued."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        request.finish(RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR, error)
        self._retire(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def has_runnable(self) -> bool:
        """Whether a step can do anything: requests only waiting for their hand-off cannot."""
        return bool(self._pending) or any(r.status is not RequestStatus.WAITING_FOR_STATE
                                          for r in self.requests.values())

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.speculation is not None:
            return outputs + self.speculation.step()
        plan = self.schedule()
        return outputs + self._step(plan) if plan.seqs else outputs

    def schedule(self):
        """The scheduler's plan for the next step, after loading the prefixes the requests it
        may admit have in a lower tier back into the pool (engine.tiered_cache), and starting
        the disk reads of those queued behind them."""
        if self.tiers is not None:
            admissible = self.slots.num_free_slots
            for i, request in enumerate(itertools.islice(self.scheduler.waiting, admissible + PREFETCH_LIMIT)):
                if i < admissible:
                    self.tiers.promote(request)
                else:  # queued behind those: its disk entry read meanwhile
                    self.tiers.prefetch(request)
        return self.scheduler.schedule()

    def _step(self, plan, scratch: list[ScheduledSeq] = ()) -> list[RequestOutput]:
        """Run a scheduled step: its outputs. `scratch`: its VERIFY rows that keep their state
        first (engine.verify)."""
        outputs = []
        self.num_steps += 1
        seqs = plan.seqs
        now = time.monotonic()
        prefill_tokens = sum(s.num_new_tokens for s in seqs if s.phase in (Phase.FRESH_PREFILL, Phase.CONTINUED_PREFILL))
        for seq in seqs:  # a request handed in decodes first: it was never prefilled here
            if seq.request.scheduled_time is None and seq.phase not in (Phase.DECODE, Phase.VERIFY):
                seq.request.scheduled_time = now
        try:
            self._restore_checkpoints(plan.restores)
            if scratch:
                self.speculation.keep_state(scratch)
            self._plan_captures(seqs)
            while seqs:  # one pass, or more when a prefill chunk stops at a save point
                outputs += self._run_pass(seqs)
                seqs = [later for later in (s.then() for s in seqs) if later is not None]
        except StateOwnershipError:
            if self.config.debug:
                raise
            return outputs + self._fail(seqs, "internal error: state slot ownership")
        except Exception as e:  # one bad batch must not take the engine down
            log.exception("forward failed")
            return outputs + self._fail(seqs, f"internal error: {e}")
        finally:
            for seq in plan.seqs:  # rows a failed pass reserved and never attached
                for _, row in seq.captures:
                    self.prefix_cache.release_checkpoint_row(row)
                seq.captures.clear()
        if prefill_tokens:
            decay = PREFILL_RATE_DECAY
            self._prefill_tokens = decay * self._prefill_tokens + prefill_tokens
            self._prefill_seconds = decay * self._prefill_seconds + time.monotonic() - now
        return outputs

    def _run_pass(self, seqs: list[ScheduledSeq]) -> list[RequestOutput]:
        begins = [seq.request.num_computed_tokens for seq in seqs] if self.mtp is not None else None
        logits = self.runner.execute(seqs)
        outputs = self._after_pass(seqs, logits)
        if begins is not None:  # once the pass's tokens are known: sampled, accepted or rejected
            self.mtp.observe(seqs, begins)
        return outputs

    def _after_pass(self, seqs: list[ScheduledSeq], logits) -> list[RequestOutput]:
        """A pass's counters, prefix blocks, verified drafts and sampled tokens."""
        verified = []
        if self.speculation is not None and any(s.phase is Phase.VERIFY for s in seqs):
            logits, verified, seqs = split_verify_rows(logits, seqs)
        done = [i for i, s in enumerate(seqs)
                if not s.num_later_tokens and s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens]
        for seq in seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        if self.prefix_cache is not None:
            self._cache_prefixes(seqs)
        outputs = self.speculation.verified(verified) if verified else []
        if not done:
            return outputs
        rows = logits if len(done) == len(seqs) else logits[done]  # decode: every row, no copy
        sampled = self.runner.sample(rows, [seqs[i] for i in done])
        accept = self._accept
        return outputs + [accept(seqs[i].request, token_id, logprob)
                          for i, token_id, logprob in zip(done, sampled.token_ids, sampled.logprobs)]

    # ------------------------------------------------------------------ prefix caching

    def _restore_checkpoints(self, restores: list[tuple[int, int, str]]) -> None:
        """A prefix hit's state, copied into the request's own slot (never read in place)."""
        self.runner.copy_state([(self.cache.checkpoint_row(row), slot) for row, slot, _ in restores])
        for _, _, request_id in restores:
            self.slots.mark_written(request_id)

    def _plan_captures(self, seqs: list[ScheduledSeq]) -> None:
        """Each save point strictly inside a prefill chunk (the scheduler did not split there):
        a checkpoint row for the pass to leave the state after it in (ScheduledSeq.captures)."""
        if self.prefix_cache is None or self.scheduler.split_at_save_points:
            return
        for seq in seqs:
            begin = seq.request.num_computed_tokens
            if seq.phase not in (Phase.FRESH_PREFILL, Phase.CONTINUED_PREFILL):
                continue
            for point in sorted(seq.request.save_points):
                if begin < point < begin + seq.num_new_tokens:
                    row = self.prefix_cache.reserve_checkpoint_row()
                    if row is None:
                        break
                    seq.captures.append((point - begin, row))

    def _cache_prefixes(self, seqs: list[ScheduledSeq]) -> None:
        """After a step: index newly full blocks; checkpoint the state at the prompt's last
        block boundary and at the latest boundary a decode crossed."""
        size, saves = self.config.block_size, []
        for seq in seqs:
            request = seq.request
            computed = request.num_computed_tokens
            full = computed // size
            if full <= request.num_indexed_blocks:
                continue
            if len(request.block_hashes) < full:
                request.block_hashes = block_hashes(token_slice(request, 0, full * size), size,
                                                    request.block_hashes)
            self.prefix_cache.insert(request.block_hashes[:full], self.blocks.table(request.request_id),
                                     request.num_indexed_blocks)
            request.num_indexed_blocks = full
            while seq.captures:  # the pass left the state at these save points: their blocks' now
                offset, row = seq.captures.pop()
                point = computed - seq.num_new_tokens + offset
                self.prefix_cache.attach_checkpoint(request.block_hashes[point // size - 1], row)
            if not self.prefix_cache.needs_state or computed % size:
                continue
            key = request.block_hashes[full - 1]
            # After a VERIFY step the slot holds the state after exactly `computed` tokens too:
            # rejected drafts were rolled back (engine.verify runs this after that).
            decoded = seq.phase in (Phase.DECODE, Phase.VERIFY)
            if computed in request.save_points or (decoded and not self.prefix_cache.has_checkpoint(key)):
                row = self.prefix_cache.take_checkpoint_row(key)
                if row is None:
                    continue
                saves.append((seq.slot, self.cache.checkpoint_row(row)))
                if decoded:
                    if request.rolling_checkpoint is not None:
                        self.prefix_cache.drop_checkpoint(request.rolling_checkpoint)
                    request.rolling_checkpoint = key
        self.runner.copy_state(saves)

    def _accept(self, request: Request, token_id: int, logprob) -> RequestOutput:
        # Runs for every row of every step on caches the forward flushed: a decoding request
        # skips the first token's bookkeeping.
        if request.status is not DECODING:
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            request.status = DECODING
        tracker = self.trackers[request.request_id]
        tracker.append(token_id, logprob)
        out = tracker.output()
        if out.finished:
            self._retire(request)
        elif self._hands_off:
            request.status = RequestStatus.HANDED_OFF
            self.scheduler.running.remove(request)
            self._handoffs.append(Handoff(
                request.request_id, request.num_computed_tokens, token_id, logprob,
                list(self.blocks.table(request.request_id)), self.slots.slot_of[request.request_id],
                request.num_cached_tokens or 0, request.prompt_logprobs))
        return out

    def _fail(self, seqs: list[ScheduledSeq], message: str) -> list[RequestOutput]:
        outputs = []
        for seq in seqs:
            seq.request.finish(RequestStatus.FINISHED_ERROR, message)
            outputs.append(self.trackers[seq.request.request_id].output())
            self._retire(seq.request, emit=False)
        return outputs

    def _retire(self, request: Request, emit: bool = True) -> None:
        """Free every resource of a finished request; queue its final output if not yet sent."""
        slot = self.slots.slot_of.get(request.request_id)
        self.scheduler.release(request)
        if self.speculation is not None:
            self.speculation.proposer.forget(request.request_id)
        if slot is not None:
            self.runner.on_slot_freed(slot)
        tracker = self.trackers.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        if emit and request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR) \
                and tracker is not None:
            self._pending.append(tracker.output())

    # ------------------------------------------------------------------ disaggregation

    def take_handoffs(self) -> list[Handoff]:
        """Prefill side: requests ready to send since the last call."""
        ready, self._handoffs = self._handoffs, []
        return ready

    def prefill_progress(self, request_id: str) -> PrefillProgress | None:
        """Prefill side: where a request admitted and not yet done prefilling stands; None if
        it waits for admission, is done, or this engine does not hand off."""
        request = self.requests.get(request_id)
        if not self._hands_off or request is None or request.status is not RequestStatus.PREFILLING:
            return None
        return PrefillProgress(request_id, request.num_computed_tokens, request.num_tokens,
                               list(self.blocks.table(request_id)), self.slots.slot_of[request_id])

    def finish_handoff(self, request_id: str, error: str | None = None) -> None:
        """Prefill side: the send completed (or failed): free the request's blocks and slot."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if error is None:
            request.finish(RequestStatus.FINISHED_STOPPED)  # done here; it lives on at the decoder
        else:
            request.finish(RequestStatus.FINISHED_ERROR, error)
        self._retire(request, emit=False)

    def cancel_reservation(self, request_id: str) -> None:
        """Decode side: undo a reservation nobody was told of yet (no output is emitted)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.finish(RequestStatus.FINISHED_ABORTED)
            self._retire(request, emit=False)

    def reserve_for_handoff(self, prompt_token_ids: list[int], params: SamplingParams,
                            request_id: str, resume: Resume | None = None) -> Reservation:
        """Decode side: hold blocks for the prompt's KV and a state slot before the prefill runs."""
        request = self._new_request(list(prompt_token_ids), params, request_id, resume)
        try:
            table, slot = self.scheduler.reserve(request, request.num_tokens + 1)
        except MemoryError:
            del self.requests[request_id], self.trackers[request_id]
            raise
        request.num_prefill_tokens = request.num_tokens
        self.scheduler.add_reserved(request)
        return Reservation(request_id, list(table), slot)

    def accept_handoff(self, request_id: str, first_token: int, logprob: dict | None = None
                       ) -> RequestOutput:
        """Decode side: every KV block and state tensor has landed; start decoding."""
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_STATE:
            raise RuntimeError(f"request {request_id!r} is {request.status.name}, not waiting for state")
        request.num_computed_tokens = request.num_tokens
        self.slots.mark_written(request_id)
        request.first_token_time = time.monotonic()
        request.status = RequestStatus.DECODING
        tracker = self.trackers[request_id]
        tracker.append(first_token, logprob)
        out = tracker.output()
        if out.finished:
            self._retire(request)
        return out

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        self.slots.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()

    def stats(self) -> dict:
        return {
            # cached blocks nothing else holds count as free: they are given back on demand
            "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_free": self.blocks.num_available_blocks,
            "state_slots_total": self.slots.num_slots, "state_slots_free": self.slots.num_free_slots,
            "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
            "preemptions": self.scheduler.num_preemptions, "steps": self.num_steps,
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
            **(self.speculation.stats() if self.speculation is not None else {}),
            **(self.tiers.stats() if self.tiers is not None else {}),
            **(self.exchange.stats() if self.exchange is not None else {}),
            "prefix_cache_checkpoint_bytes": self.cache.sizes.checkpoint_bytes,
            "prefill_tokens_per_s": self._prefill_tokens / self._prefill_seconds if self._prefill_seconds else 0.0,
        }
