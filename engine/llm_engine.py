"""The engine loop: schedule, run, postprocess. Shared by engine.LLM and both worker kinds."""

from __future__ import annotations

import itertools
import logging

from engine.block_manager import BlockManager
from engine.cache import ModelCache, plan_cache
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models import load_model
from engine.output import OutputTracker, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.scheduler import Scheduler, ScheduledSeq
from engine.state_slots import StateOwnershipError, StateSlotAllocator
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = load_model(config.model, config.torch_dtype, config.device)
        self.spec = self.model.spec
        limit = self.spec.max_position or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = min(config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN), limit)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(config.model)
        except FileNotFoundError:
            self.tokenizer = None
        self.eos_token_ids = list(self.spec.eos_token_ids)
        sizes = plan_cache(self.spec, config.torch_dtype, config.block_size, config.max_num_seqs,
                           self.max_model_len, config.cache_memory_bytes, config.num_kv_blocks)
        self.cache = ModelCache(self.spec, sizes, config.block_size, config.torch_dtype, config.device)
        self.blocks = BlockManager(sizes.num_blocks, config.block_size)
        self.slots = StateSlotAllocator(sizes.num_slots)
        self.scheduler = Scheduler(self.blocks, self.slots, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.slots, config.device, config.debug)
        self.requests: dict[str, Request] = {}
        self.trackers: dict[str, OutputTracker] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests in and out

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "this model has no tokenizer.json; send token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequest("prompt", "must not be empty")
        vocab = self.spec.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest("prompt", f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return ids

    def validate_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest("prompt", f"{num_prompt_tokens} tokens; the context holds "
                                 f"{self.max_model_len} and at least one must be generated")
        worst = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(worst) > self.blocks.num_blocks:
            raise InvalidRequest("max_tokens", f"prompt + max_tokens = {worst} tokens needs "
                                 f"{self.blocks.blocks_needed(worst)} KV blocks; the cache has "
                                 f"{self.blocks.num_blocks}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        self.validate_length(len(ids), params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight")
        request = Request(request_id, ids, params)
        self.requests[request_id] = request
        self.trackers[request_id] = OutputTracker(request, self.tokenizer, self.eos_token_ids,
                                                  self.max_model_len)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        request.finish(RequestStatus.FINISHED_ABORTED)
        self._retire(request)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if not plan.seqs:
            return outputs
        try:
            logits = self.runner.execute(plan.seqs)
        except StateOwnershipError:
            if self.config.debug:
                raise
            return outputs + self._fail(plan.seqs, "internal error: state slot ownership")
        except Exception as e:  # one bad batch must not take the engine down
            log.exception("forward failed")
            return outputs + self._fail(plan.seqs, f"internal error: {e}")
        done = [i for i, s in enumerate(plan.seqs)
                if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens]
        for seq in plan.seqs:
            seq.request.num_computed_tokens += seq.num_new_tokens
        if done:
            sampled = self.runner.sample(logits[done], [plan.seqs[i] for i in done])
            for row, i in enumerate(done):
                outputs.append(self._accept(plan.seqs[i], sampled.token_ids[row], sampled.logprobs[row]))
        return outputs

    def _accept(self, seq: ScheduledSeq, token_id: int, logprob) -> RequestOutput:
        request = seq.request
        if request.first_token_time is None:
            import time
            request.first_token_time = time.monotonic()
        request.status = RequestStatus.DECODING
        tracker = self.trackers[request.request_id]
        tracker.append(token_id, logprob)
        out = tracker.output()
        if request.finished:
            self._retire(request)
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
        if slot is not None:
            self.runner.on_slot_freed(slot)
        self.runner.sampler.forget(request.request_id)
        tracker = self.trackers.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        if emit and request.status is RequestStatus.FINISHED_ABORTED and tracker is not None:
            self._pending.append(tracker.output())

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        self.slots.check_integrity()

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_free": self.blocks.num_free_blocks,
            "state_slots_total": self.slots.num_slots, "state_slots_free": self.slots.num_free_slots,
            "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
        }
