"""Python client for the splitserve gRPC API, sync and async.

    from router.client import SplitServeClient
    with SplitServeClient("127.0.0.1:50051") as client:
        print(client.generate("def fib(n):", max_tokens=32, temperature=0.0).text)

Sampling options are the fields of splitserve.v1.SamplingParams as keyword arguments.
Failed calls raise grpc.RpcError (e.code(): INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.splitserve.v1 import splitserve_pb2 as pb
from protos.splitserve.v1 import splitserve_pb2_grpc as pb_grpc

DEFAULT_SERVER = "127.0.0.1:50051"
AUTH_TOKEN_ENV = "SPLITSERVE_AUTH_TOKEN"


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    usage: pb.Usage
    timings: pb.Timings
    logprobs: list[pb.TokenLogprob]
    prompt_logprobs: list[pb.PromptTokenLogprob] = field(default_factory=list)  # with prompt_logprobs=n
    spans: list[pb.Span] = field(default_factory=list)  # where the request's time went (docs/tracing.md)


def finish_reason_name(value: int) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def build_request(prompt: str | list[int], request_id: str = "", **sampling) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling_message(sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def sampling_message(sampling: dict) -> pb.SamplingParams:
    """The SamplingParams message; a value the wire cannot carry (a negative count in an
    unsigned field, a wrong type, an unknown name) is a ValueError naming the field, as the
    server's INVALID_ARGUMENT would, not protobuf's bare "Value out of range"."""
    try:
        return pb.SamplingParams(**sampling)
    except (ValueError, TypeError):
        pass  # find the field to name
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for name, value in sampling.items():
        if name not in fields:
            raise ValueError(f"sampling.{name}: not a field of splitserve.v1.SamplingParams "
                             f"(known: {', '.join(sorted(fields))})")
        try:
            pb.SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            unsigned = fields[name].type in (fields[name].TYPE_UINT32, fields[name].TYPE_UINT64)
            reason = "must be >= 0" if unsigned and isinstance(value, int) and value < 0 else str(e)
            raise ValueError(f"sampling.{name}: {reason}, got {value!r}") from None
    return pb.SamplingParams(**sampling)  # the fields pass one by one: raises as protobuf does


class CompletionBuilder:
    """Accumulates streamed responses into a Completion."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs, self.final = [], [], [], None
        self.prompt_logprobs = []

    def add(self, response: pb.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finished:
            self.final = response

    def build(self) -> Completion:
        if self.final is None:
            raise RuntimeError("the stream ended without a final message")
        f = self.final
        return Completion(f.request_id, "".join(self.text), self.token_ids,
                          finish_reason_name(f.finish_reason), f.usage, f.timings, self.logprobs,
                          self.prompt_logprobs, list(f.spans))


def _credentials(tls_ca, tls: bool | None):
    if tls_ca is not None:
        pem = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
        return grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.ssl_channel_credentials() if tls else None


class _ClientBase:
    def __init__(self, server: str = DEFAULT_SERVER, *, auth_token: str | None = None,
                 tls_ca: str | Path | bytes | None = None, tls: bool | None = None,
                 timeout: float | None = None, options: list | None = None):
        """tls_ca: PEM of the CA (or the self-signed cert) to trust; tls=True: system roots.

        auth_token defaults to $SPLITSERVE_AUTH_TOKEN; timeout is the default per-call deadline.
        """
        self.server = server
        token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self._credentials = _credentials(tls_ca, tls)
        self._options = options or []

    def _timeout(self, timeout):
        return self.timeout if timeout is None else timeout


class SplitServeClient(_ClientBase):
    def __init__(self, server: str = DEFAULT_SERVER, **kwargs):
        super().__init__(server, **kwargs)
        if self._credentials is not None:
            self.channel = grpc.secure_channel(server, self._credentials, self._options)
        else:
            self.channel = grpc.insecure_channel(server, self._options)
        self.stub = pb_grpc.SplitServeStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def stream(self, prompt: str | list[int], *, request_id: str = "", timeout: float | None = None,
               **sampling):
        """The streaming call: iterate it for GenerateResponse messages; .cancel() aborts."""
        return self.stub.Generate(build_request(prompt, request_id, **sampling),
                                  timeout=self._timeout(timeout), metadata=self.metadata)

    def generate(self, prompt: str | list[int], *, request_id: str = "", timeout: float | None = None,
                 **sampling) -> Completion:
        builder = CompletionBuilder()
        for response in self.stream(prompt, request_id=request_id, timeout=timeout, **sampling):
            builder.add(response)
        return builder.build()

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                               metadata=self.metadata).aborted

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                      metadata=self.metadata)

    def status(self, timeout: float | None = None) -> pb.ServerStatus:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=self._timeout(timeout),
                                   metadata=self.metadata)

    def scale(self, prefill: int | None = None, decode: int | None = None, drain_timeout_s: float | None = None,
              timeout: float | None = None) -> pb.ScaleResponse:
        """Admin: grow or shrink the worker pools; returns once done (drains can take a while)."""
        request = pb.ScaleRequest(prefill=prefill, decode=decode, drain_timeout_s=drain_timeout_s)
        return self.stub.Scale(request, timeout=self._timeout(timeout), metadata=self.metadata)

    def restart_workers(self, drain_timeout_s: float | None = None, timeout: float | None = None) -> pb.ScaleResponse:
        """Admin: replace every worker one at a time, failing no request."""
        return self.stub.RestartWorkers(pb.RestartWorkersRequest(drain_timeout_s=drain_timeout_s),
                                        timeout=self._timeout(timeout), metadata=self.metadata)

    def health(self, service: str = "", timeout: float | None = None) -> bool:
        """service "": the server is up; "splitserve.v1.SplitServe": it can serve now."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=self._timeout(timeout))
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SplitServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSplitServeClient(_ClientBase):
    """The same calls with async/await; create it inside the event loop that uses it."""

    def __init__(self, server: str = DEFAULT_SERVER, **kwargs):
        super().__init__(server, **kwargs)
        if self._credentials is not None:
            self.channel = grpc.aio.secure_channel(server, self._credentials, self._options)
        else:
            self.channel = grpc.aio.insecure_channel(server, self._options)
        self.stub = pb_grpc.SplitServeStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def stream(self, prompt: str | list[int], *, request_id: str = "", timeout: float | None = None,
               **sampling):
        """The streaming call: `async for` it; .cancel() aborts."""
        return self.stub.Generate(build_request(prompt, request_id, **sampling),
                                  timeout=self._timeout(timeout), metadata=self.metadata)

    async def generate(self, prompt: str | list[int], *, request_id: str = "",
                       timeout: float | None = None, **sampling) -> Completion:
        builder = CompletionBuilder()
        async for response in self.stream(prompt, request_id=request_id, timeout=timeout, **sampling):
            builder.add(response)
        return builder.build()

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        response = await self.stub.Abort(pb.AbortRequest(request_id=request_id),
                                         timeout=self._timeout(timeout), metadata=self.metadata)
        return response.aborted

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                            metadata=self.metadata)

    async def status(self, timeout: float | None = None) -> pb.ServerStatus:
        return await self.stub.GetStatus(pb.GetStatusRequest(), timeout=self._timeout(timeout),
                                         metadata=self.metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> bool:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._timeout(timeout))
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncSplitServeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
