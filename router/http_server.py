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
from router.batch_streams import finals_of, merge_streams, summed_usage
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.openai_shapes import ChatShape, CompletionShape
from router.serving import Final, GenerationFailed, ServingCore

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 16 << 20  # a million-token prompt as JSON fits; more is refused before parsing


class BodyTooLarge(Exception):
    pass


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
        return await self._answer(request, lambda body: oa.parse_completion(body, self.info), CompletionShape)

    async def chat_completions(self, request: Request) -> Response:
        tokenizer = self.core.backend.tokenizer
        return await self._answer(request, lambda body: oa.parse_chat(body, self.info, tokenizer), ChatShape)

    async def _answer(self, request: Request, parse, shape_cls) -> Response:
        try:
            requests = await self._parse(request, parse)
        except Exception as e:
            return _error_for(e)
        return await self._generate(request, requests, shape_cls)

    async def _parse(self, request: Request, parse):
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

    async def _generate(self, request: Request, requests: list[oa.ParsedRequest], shape_cls) -> Response:
        """A request per choice the body asks for (one; or several prompts, `n`), run together:
        one failing fails the whole and aborts the rest."""
        shapes = [shape_cls(parsed, self.core.backend.tokenizer) for parsed in requests]
        request_id = f"{shapes[0].id_prefix}-{uuid.uuid4().hex}"
        ids = [request_id] if len(requests) == 1 else [f"{request_id}-{p.choice_index}" for p in requests]
        events = merge_streams([self.core.generate(i, p.prompt, p.params, "http") for i, p in zip(ids, requests)],
                               [p.prompt_field for p in requests])
        try:
            if requests[0].stream:
                # A request's first event comes after the backend validated it: wait for each, so
                # that bad input is still a 400 here rather than an error inside a 200 stream.
                started, early = set(), []
                while len(started) < len(requests):
                    index, event = await events.__anext__()
                    started.add(index)
                    early.append((index, event))
                return StreamingResponse(self._stream(request_id, shapes, early, events),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            finals = await _unless_disconnected(request, finals_of(events, len(requests)))
            if finals is None:
                return Response(status_code=499)  # nobody is listening; the requests were aborted
            choices = [shape.full(final) for shape, final in zip(shapes, finals)]
            usage = summed_usage([(s.usage(f), s.parsed.counts_prompt) for s, f in zip(shapes, finals)])
            return JSONResponse(self._envelope(request_id, shapes[0], shapes[0].object_name, choices, usage=usage,
                                               **shapes[0].response_fields(finals[0])))
        except BaseException as e:
            await events.aclose()  # aborts what still runs
            if not isinstance(e, Exception):
                raise
            return _error_for(e)

    def _envelope(self, request_id, shape, object_name, choices, **extra) -> dict:
        return {"id": request_id, "object": object_name, "created": shape.created,
                "model": self.info.model_name, "choices": choices, **extra}

    async def _stream(self, request_id, shapes, early, events):
        """Each request's chunks under its choice's index as they come (`early`: the events already
        taken from `events`). The usage: on the chunk that finishes a lone choice, and, where
        stream_options asks for it, of them all on a last choice-less chunk."""
        chunk = lambda choices, **extra: _sse(self._envelope(  # noqa: E731
            request_id, shapes[0], shapes[0].chunk_object_name, choices, **extra))
        usages = []

        def sse(index, event) -> str | None:
            shape = shapes[index]
            if not isinstance(event, Final):
                choice = shape.streamed(event)
                return None if choice is None else chunk([choice])
            usages.append((shape.usage(event), shape.parsed.counts_prompt))
            return chunk([shape.last_chunk(event)], **({"usage": usages[0][0]} if len(shapes) == 1 else {}))

        async with aclosing(events):  # a client disconnect cancels us here: every request is aborted
            try:
                for shape in shapes:
                    if shape.first_chunk_choice() is not None:
                        yield chunk([shape.first_chunk_choice()])
                for index, event in early:
                    if (text := sse(index, event)) is not None:
                        yield text
                async for index, event in events:
                    if (text := sse(index, event)) is not None:
                        yield text
                if shapes[0].parsed.include_usage_chunk:
                    yield chunk([], usage=summed_usage(usages))
            except (GenerationFailed, Overloaded, Unavailable, InvalidRequest) as e:
                yield _sse(json.loads(_error_for(e).body))
            yield "data: [DONE]\n\n"


async def _unless_disconnected(request: Request, work):
    """What the coroutine `work` returns; None (and `work` cancelled, which aborts its requests)
    if the client disconnects first."""

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.ensure_future(work)
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
