"""The front door: the gRPC and OpenAI HTTP servers over one backend, on one event loop.

Both servers run on an asyncio loop in a thread of their own, so a plain synchronous caller
(`splitserve serve`, tests) starts them with start_frontdoor() and gets the bound ports back.
The backend's async methods run on that loop; its sync ones (ready, status) in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from router.auth import AUTH_TOKEN_ENV
from router.backend import Backend
from router.serving import ServingCore

log = logging.getLogger(__name__)
LOCALHOST = "127.0.0.1"


@dataclass
class FrontDoorConfig:
    grpc_port: int | None = 50051  # 0: any free port; None: no gRPC server
    http_port: int | None = 8000  # 0: any free port; None: no HTTP server
    # 127.0.0.1 unless the operator asks for more: "0.0.0.0" (or "::") listens on all interfaces.
    host: str = LOCALHOST
    # None: take $SPLITSERVE_AUTH_TOKEN; "" or unset there: no auth.
    auth_token: str | None = None
    tls_cert: str | None = None  # PEM paths; both or neither; TLS for gRPC and HTTP alike
    tls_key: str | None = None
    max_queued: int = 256  # requests in flight in the front door; beyond: RESOURCE_EXHAUSTED / 429
    grace_s: float = 5.0  # stop(): how long in-flight requests get to finish
    health_poll_s: float = 1.0  # how often gRPC health for the service follows backend.ready()
    metrics_compat: str = "none"  # "vllm": /metrics also serves vLLM's names (router.metrics)

    def __post_init__(self):
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                     or not 0 <= port < 65536):
                raise ValueError(f"{name}: must be a port in [0, 65535] or None, got {port!r}")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("grpc_port, http_port: at least one server must run")
        if self.grpc_port and self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port, http_port: both are {self.grpc_port}")
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"host: must be an address such as {LOCALHOST}, got {self.host!r}")
        if self.auth_token is None:
            self.auth_token = os.environ.get(AUTH_TOKEN_ENV)
        self.auth_token = self.auth_token or None
        token = self.auth_token
        if token is not None and not (isinstance(token, str) and token.isascii() and token.isprintable()
                                      and " " not in token):
            raise ValueError(f"auth_token (or ${AUTH_TOKEN_ENV}): printable ASCII without spaces, "
                             "since it travels in headers")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert, tls_key: give both or neither")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path!r} is not a file")
        if isinstance(self.max_queued, bool) or not isinstance(self.max_queued, int) or self.max_queued < 1:
            raise ValueError(f"max_queued: must be a positive integer, got {self.max_queued!r}")
        for name in ("grace_s", "health_poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


class FrontDoor:
    """Running servers. stop() is graceful: new calls are refused, in-flight ones get grace_s."""

    def __init__(self, backend: Backend, config: FrontDoorConfig):
        self.backend = backend
        self.config = config
        self.core = ServingCore(backend, config.max_queued, config.metrics_compat)
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc = self._http = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_requested: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="splitserve-frontdoor", daemon=True)

    @property
    def metrics_registry(self):
        return self.core.metrics.registry

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()
            self._stopped.set()
            self._started.set()  # never leave start() waiting

    async def _serve(self) -> None:
        from router.grpc_server import GrpcFront
        from router.http_server import HttpFront

        c = self.config
        self._stop_requested = asyncio.Event()
        try:
            if c.grpc_port is not None:
                self._grpc = GrpcFront(self.core, c.host, c.grpc_port, c.auth_token, c.tls_cert,
                                       c.tls_key, c.health_poll_s)
                await self._grpc.start()
                self.grpc_port = self._grpc.port
            if c.http_port is not None:
                self._http = HttpFront(self.core, c.host, c.http_port, c.auth_token, c.tls_cert,
                                       c.tls_key, c.grace_s)
                await self._http.start()
                self.http_port = self._http.port
        except BaseException as e:
            self._start_error = e
            await self._shutdown()
            return
        self._started.set()
        await self._stop_requested.wait()
        await self._shutdown()

    async def _shutdown(self) -> None:
        stops = []
        if self._grpc is not None:
            stops.append(self._grpc.stop(self.config.grace_s))
        if self._http is not None:
            stops.append(self._http.stop())
        for result in await asyncio.gather(*stops, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("front door shutdown: %r", result)

    def start(self) -> FrontDoor:
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        scheme = "https" if self.config.tls else "http"
        log.info("front door: gRPC on %s:%s, HTTP on %s://%s:%s%s", self.config.host, self.grpc_port,
                 scheme, self.config.host, self.http_port, " (auth on)" if self.config.auth_token else "")
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (or timeout); True once stopped."""
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        if self._thread.ident is None:
            return  # never started
        if not self._stopped.is_set() and self._stop_requested is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_requested.set)
            except RuntimeError:  # the loop closed meanwhile: already stopped
                pass
        self._thread.join()

    def __enter__(self) -> FrontDoor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_frontdoor(backend: Backend, config: FrontDoorConfig | None = None) -> FrontDoor:
    """Start the configured servers; returns once they listen (ports in .grpc_port/.http_port)."""
    return FrontDoor(backend, config or FrontDoorConfig()).start()
