"""The OpenAI-compatible HTTP front (Starlette app served by uvicorn on the front door's loop)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from contextlib import aclosing, suppress

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.sampling_params import InvalidRequest
from router import openai_protocol as oa
from router.auth import HttpTokenMiddleware, TokenCheck
from router.backend import Overloaded, Unavailable
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.serving import Delta, Final, GenerationFailed, ServingCore

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a million-token prompt as JSON fits; more is refused before parsing


class BodyTooLarge(Exception):
    pass


class _Shape:
    """How one endpoint writes its answer: whole, or as stream chunks."""

    def __init__(self, parsed: oa.ParsedRequest, tokenizer):
        self.parsed, self.tokenizer = parsed, tokenizer
        self.created = int(time.time())

    def first_chunk_choice(self) -> dict | None:
        return None

    def usage(self, final: Final) -> dict:
        return oa.usage_dict(final.usage)

    def response_fields(self, final: Final) -> dict:
        """Fields of the whole response beside its choices."""
        return {}


class CompletionShape(_Shape):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, parsed: oa.ParsedRequest, tokenizer):
        super().__init__(parsed, tokenizer)
        self.text_offset = 0
        self.echoed = False

    def _logprobs(self, token_ids, logprobs):
        if self.parsed.logprobs is None:
            return None
        out = oa.completion_logprobs(self.tokenizer, token_ids, logprobs, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _choice(self, text, token_ids, logprobs, finish_reason, prompt=None) -> dict:
        """prompt: (ids, entries) of the prompt, echoed before the completion (text and logprobs)."""
        if self.parsed.score_only:  # max_tokens 0: the one token that ran is not the caller's
            text, token_ids, logprobs = "", [], []
        prompt_field = None
        if prompt is not None:
            ids, entries = prompt
            if self.parsed.echo:
                text = self._prompt_text(ids) + text
                token_ids, logprobs = list(ids) + list(token_ids), list(entries or [None] * len(ids)) + list(logprobs)
            if self.parsed.prompt_logprobs is not None and entries is not None:
                prompt_field = oa.vllm_prompt_logprobs(self.tokenizer, ids, entries)
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": finish_reason}
        if self.parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_field
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _prompt_text(self, ids: list[int]) -> str:
        if isinstance(self.parsed.prompt, str):
            return self.parsed.prompt
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _prompt_once(self, ids, entries):
        if self.echoed or not (self.parsed.echo or self.parsed.prompt_logprobs is not None):
            return None
        self.echoed = True
        return ids, entries

    def full(self, final: Final) -> dict:
        return self._choice(final.text, final.token_ids, final.logprobs,
                            "length" if self.parsed.score_only else final.finish_reason,
                            self._prompt_once(final.prompt_token_ids, final.prompt_logprobs))

    def chunk(self, delta: Delta) -> dict:
        ids = delta.prompt_token_ids
        if ids is None:  # no prompt logprobs asked for: the ids as sent (a text prompt echoes as sent)
            ids = self.parsed.prompt if isinstance(self.parsed.prompt, list) else []
        return self._choice(delta.text, delta.token_ids, delta.logprobs, None,
                            self._prompt_once(ids, delta.prompt_logprobs))

    def usage(self, final: Final) -> dict:
        usage = oa.usage_dict(final.usage)
        if self.parsed.score_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def last_chunk(self, final: Final) -> dict:
        return self._choice("", [], [], final.finish_reason)


class ChatShape(_Shape):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _choice(self, key, content, token_ids, logprobs, finish_reason) -> dict:
        message = {"role": "assistant", "content": content} if key == "message" else (
            {"content": content} if content or token_ids else {})
        lp = oa.chat_logprobs(self.tokenizer, token_ids, logprobs) if (
            self.parsed.logprobs is not None and token_ids) else None
        choice = {"index": 0, key: message, "logprobs": lp, "finish_reason": finish_reason}
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def first_chunk_choice(self) -> dict:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    @property
    def buffered(self) -> bool:
        """With tools in play the text is only read for tool calls once whole: one last chunk."""
        return self.parsed.tools is not None and self.parsed.tools.mode != "none"

    def _with_tool_calls(self, key, final: Final, token_ids, logprobs) -> dict:
        calls, content = [], final.text
        if self.parsed.tools is not None and final.finish_reason == "stop":
            calls, content = self.parsed.tools.calls(final.text)
        if not calls:
            return self._choice(key, final.text, token_ids, logprobs, final.finish_reason)
        choice = self._choice(key, content, token_ids, logprobs, "tool_calls")
        choice[key]["tool_calls"] = [dict(c, index=i) if key == "delta" else c for i, c in enumerate(calls)]
        if key == "delta" and content is None:
            choice[key].pop("content", None)
        return choice

    def full(self, final: Final) -> dict:
        return self._with_tool_calls("message", final, final.token_ids, final.logprobs)

    def response_fields(self, final: Final) -> dict:
        if self.parsed.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": oa.vllm_prompt_logprobs(self.tokenizer, final.prompt_token_ids,
                                                            final.prompt_logprobs or [])}

    def chunk(self, delta: Delta) -> dict | None:
        if self.buffered:
            return None
        return self._choice("delta", delta.text, delta.token_ids, delta.logprobs, None)

    def last_chunk(self, final: Final) -> dict:
        if self.buffered:
            return self._with_tool_calls("delta", final, final.token_ids, final.logprobs)
        return self._choice("delta", "", [], [], final.finish_reason)


def _error(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(oa.error_body(message, type_, param, code), status_code=status)


def _error_for(e: Exception) -> JSONResponse:
    if isinstance(e, InvalidRequest):
        # not str(e): from a Ray worker that is the worker's traceback
        return _error(400, f"{e.field}: {e.message}", "invalid_request_error", e.field)
    if isinstance(e, BodyTooLarge):
        return _error(413, str(e), "invalid_request_error", "body")
    if isinstance(e, oa.ModelNotFound):
        return _error(404, str(e), "invalid_request_error", "model", "model_not_found")
    if isinstance(e, Overloaded):
        return _error(429, str(e) or "server overloaded", "rate_limit_error", None, "overloaded")
    if isinstance(e, Unavailable):
        return _error(503, str(e) or "no live worker", "service_unavailable", None, "unavailable")
    if isinstance(e, GenerationFailed):
        return _error(500, str(e), "internal_error")
    log.exception("unexpected error", exc_info=e)
    return _error(500, "internal error", "internal_error")


def decode_body(raw: bytes):
    """The JSON in a request body; InvalidRequest("body", ...) for anything that is not JSON."""
    try:
        return json.loads(raw)
    except ValueError as e:  # also UnicodeDecodeError: the body is not UTF-8
        raise InvalidRequest("body", f"not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]]: fits in the size limit, not in the parser's stack
        raise InvalidRequest("body", "not valid JSON: nested too deeply") from None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class OpenAIApp:
    def __init__(self, core: ServingCore):
        self.core = core
        self.created = int(time.time())

    @property
    def info(self):
        return self.core.backend.info

    async def health(self, request: Request) -> Response:
        if await self.core.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    def model_card(self) -> dict:
        return {"id": self.info.model_name, "object": "model", "created": self.created,
                "owned_by": "splitserve", "max_model_len": self.info.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.info.model_name:
            return _error_for(oa.ModelNotFound(f"the model {request.path_params['model']!r} does not exist"))
        return JSONResponse(self.model_card())

    async def metrics(self, request: Request) -> Response:
        return Response(await self.core.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, lambda body: oa.parse_completion(body, self.info),
                                    CompletionShape)

    async def chat_completions(self, request: Request) -> Response:
        tokenizer = self.core.backend.tokenizer
        return await self._generate(request, lambda body: oa.parse_chat(body, self.info, tokenizer),
                                    ChatShape)

    async def _parse(self, request: Request, parse) -> oa.ParsedRequest:
        try:
            raw = bytearray()
            async for piece in request.stream():
                raw += piece
                if len(raw) > MAX_BODY_BYTES:
                    raise BodyTooLarge(f"the body is over {MAX_BODY_BYTES} bytes")
            return parse(decode_body(raw))
        except (InvalidRequest, oa.ModelNotFound, BodyTooLarge):
            self.core.count_invalid("http")
            raise

    async def _generate(self, request: Request, parse, shape_cls) -> Response:
        try:
            parsed = await self._parse(request, parse)
            shape = shape_cls(parsed, self.core.backend.tokenizer)
            request_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
            events = self.core.generate(request_id, parsed.prompt, parsed.params, "http")
            if parsed.stream:
                # The first event comes after the backend validated the request, so bad input is
                # still a 400 here rather than an error inside a 200 stream.
                try:
                    first = await events.__anext__()
                except BaseException:
                    await events.aclose()
                    raise
                return StreamingResponse(self._stream(request_id, shape, first, events),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            final = await _collect_unless_disconnected(request, events)
            if final is None:
                return Response(status_code=499)  # nobody is listening; the request was aborted
            return JSONResponse(self._envelope(request_id, shape, shape.object_name, [shape.full(final)],
                                               usage=shape.usage(final), **shape.response_fields(final)))
        except Exception as e:
            return _error_for(e)

    def _envelope(self, request_id, shape, object_name, choices, **extra) -> dict:
        return {"id": request_id, "object": object_name, "created": shape.created,
                "model": self.info.model_name, "choices": choices, **extra}

    async def _stream(self, request_id, shape, first, events):
        chunk = lambda choices, **extra: _sse(self._envelope(  # noqa: E731
            request_id, shape, shape.chunk_object_name, choices, **extra))
        async with aclosing(events):  # a client disconnect cancels us here: the request is aborted
            try:
                if shape.first_chunk_choice() is not None:
                    yield chunk([shape.first_chunk_choice()])
                event = first
                while True:
                    if isinstance(event, Final):
                        usage = shape.usage(event)
                        yield chunk([shape.last_chunk(event)], usage=usage)
                        if shape.parsed.include_usage_chunk:
                            yield chunk([], usage=usage)
                        break
                    piece = shape.chunk(event)
                    if piece is not None and (event.text or piece.get("text") or shape.parsed.return_token_ids
                                              or shape.parsed.logprobs is not None):
                        yield chunk([piece])  # else: text held back (or buffered), nothing to show yet
                    event = await events.__anext__()
            except (GenerationFailed, Overloaded, Unavailable, InvalidRequest) as e:
                yield _sse(json.loads(_error_for(e).body))
            yield "data: [DONE]\n\n"


async def _collect_unless_disconnected(request: Request, events) -> Final | None:
    """The Final event; None (and the request aborted) if the client disconnects first."""

    async def collect():
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Final):
                    return event

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            with suppress(asyncio.CancelledError):
                await collecting
    return None if collecting.cancelled() else collecting.result()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return _error(exc.status_code, exc.detail or "error", "invalid_request_error")


def build_app(core: ServingCore, auth_token: str | None):
    api = OpenAIApp(core)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return HttpTokenMiddleware(app, TokenCheck(auth_token)) if auth_token else app


class HttpFront:
    """uvicorn on a socket bound here, so the actual port is known before serving starts."""

    def __init__(self, core: ServingCore, host: str, port: int, auth_token: str | None,
                 tls_cert: str | None, tls_key: str | None, grace_s: float):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=1024)
        self.port = self.socket.getsockname()[1]
        # log_config=None: leave the process's logging setup alone
        config = uvicorn.Config(build_app(core, auth_token), log_config=None, log_level="warning",
                                access_log=False,
                                lifespan="off", ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                timeout_graceful_shutdown=grace_s)
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("HTTP server exited during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        self.socket.close()
