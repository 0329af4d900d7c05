"""Bearer-token auth for both servers. Health stays open: it is what probes and balancers call."""

from __future__ import annotations

import hmac
import json

import grpc

AUTH_TOKEN_ENV = "SPLITSERVE_AUTH_TOKEN"
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
OPEN_HTTP_PATHS = ("/health",)


class TokenCheck:
    def __init__(self, token: str):
        self._token = token.encode()

    def accepts(self, authorization: str | bytes | None) -> bool:
        if not authorization:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        scheme, _, value = authorization.strip().partition(b" ")
        # compare_digest: the time taken must not reveal how much of the token matched
        return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), self._token)


class GrpcTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` metadata (UNAUTHENTICATED)."""

    def __init__(self, check: TokenCheck):
        self._check = check

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._check.accepts(metadata.get("authorization")):
            return handler
        return _refusing(handler)


async def _refuse(context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong token: send metadata 'authorization: Bearer <token>'")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses before reading any request."""
    codecs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)

    async def unary(request, context):
        await _refuse(context)

    async def streaming(request_or_iterator, context):
        await _refuse(context)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codecs)
    return grpc.stream_stream_rpc_method_handler(streaming, **codecs)


class HttpTokenMiddleware:
    """ASGI middleware: 401 with an OpenAI-style body for a missing or wrong bearer token.

    Plain ASGI rather than a Starlette BaseHTTPMiddleware so streamed responses pass through
    untouched (disconnects still reach the endpoint and abort the request).
    """

    def __init__(self, app, check: TokenCheck):
        self.app = app
        self._check = check

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_HTTP_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self._check.accepts(headers.get(b"authorization")):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {
            "message": "missing or wrong token: send 'Authorization: Bearer <token>'",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
