"""The gRPC front: splitserve.v1.SplitServe, grpc.health.v1.Health and server reflection."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine.sampling_params import InvalidRequest, SamplingParams
from engine.structured import StructuredOutput
from protos.splitserve.v1 import splitserve_pb2 as pb
from protos.splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from router.auth import GrpcTokenInterceptor, TokenCheck
from router.placement import PlacementError
from router.backend import Overloaded, Unavailable
from router.chat_template import checkpoint_template
from router.serving import Delta, GenerationFailed, ServingCore
from router.tools import ToolPlan, tool_plan

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SplitServe"].full_name  # "splitserve.v1.SplitServe"
SAMPLING_SCALARS = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields
                    if f.has_presence and f.message_type is None]
SAMPLING_LISTS = ["stop", "stop_token_ids"]
SAMPLING_MESSAGES = ["structured_output"]
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
WORKER_FIELDS = [f.name for f in pb.WorkerStatus.DESCRIPTOR.fields]
MAX_REQUEST_ID_CHARS = 256


def sampling_from_proto(msg: pb.SamplingParams, forced: StructuredOutput | None = None) -> SamplingParams:
    """Only the fields the caller set; unset ones keep engine.SamplingParams' defaults."""
    kwargs = {name: getattr(msg, name) for name in SAMPLING_SCALARS if msg.HasField(name)}
    kwargs.update({name: list(getattr(msg, name)) for name in SAMPLING_LISTS if getattr(msg, name)})
    structured = structured_from_proto(msg.structured_output) if msg.HasField("structured_output") else None
    if structured is not None and forced is not None:
        raise InvalidRequest("structured_output", "cannot be combined with a required or named tool_choice")
    if structured or forced:
        kwargs["structured_output"] = structured or forced
    return SamplingParams(**kwargs)


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object") if msg.json_object else None
    if kind == "choice":
        return StructuredOutput.choice(list(msg.choice.choices))
    return StructuredOutput(kind, getattr(msg, kind))


def tools_from_proto(request: pb.GenerateRequest, template: str | None) -> ToolPlan | None:
    """The OpenAI-shaped tools of a GenerateRequest, checked by router.tools."""
    tools = []
    for i, tool in enumerate(request.tools):
        try:
            params = json.loads(tool.parameters_json) if tool.parameters_json else None
        except ValueError as e:
            raise InvalidRequest(f"tools[{i}].parameters_json", f"not valid JSON: {e}") from None
        fn = {"name": tool.name, "description": tool.description}
        tools.append({"type": "function", "function": fn if params is None else {**fn, "parameters": params}})
    kind = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    choice = None if kind is None else getattr(request.tool_choice, kind)
    if kind == "function":
        choice = {"type": "function", "function": {"name": choice}}
    return tool_plan(tools, choice, template)


class Undecodable:
    """What bytes that are not the expected message decode to: the handler then answers
    INVALID_ARGUMENT, where a raising deserializer would make grpc answer INTERNAL."""

    def __init__(self, message_cls, error: Exception):
        why = str(error).rsplit(": ", 1)[-1]  # protobuf's message repeats the type name first
        self.message = f"not a valid {message_cls.DESCRIPTOR.full_name}: {why}"


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:  # bad wire format, bad UTF-8 in a string field
            return Undecodable(message_cls, e)
    return parse


def add_servicer(servicer: SplitServeServicer, server) -> None:
    """splitserve_pb2_grpc.add_SplitServeServicer_to_server, decoding requests leniently."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["SplitServe"].methods:
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def request_from_proto(request, template: str | None = None) -> tuple[str | list[int], SamplingParams]:
    """A GenerateRequest's prompt and sampling parameters; InvalidRequest naming the field."""
    prompt, params, _ = parse_generate(request, template)
    return prompt, params


def parse_generate(request, template: str | None) -> tuple[str | list[int], SamplingParams, ToolPlan | None]:
    if isinstance(request, Undecodable):
        raise InvalidRequest("request", request.message)
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # it is echoed in every response
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, "
                             f"got {len(request.request_id)}")
    tools = tools_from_proto(request, template)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    forced = tools.structured(parallel) if tools is not None else None
    return prompt_from_proto(request), sampling_from_proto(request.sampling, forced), tools


def prompt_from_proto(request: pb.GenerateRequest) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    raise InvalidRequest("prompt", "set text or token_ids")


def field_path(field: str) -> str:
    """engine's field name -> where it lives in GenerateRequest."""
    sampling = SAMPLING_SCALARS + SAMPLING_LISTS + SAMPLING_MESSAGES
    return f"sampling.{field}" if field in sampling else field


def model_info_proto(core: ServingCore) -> pb.ModelInfo:
    info = core.backend.info
    return pb.ModelInfo(model_name=info.model_name, model_type=info.model_type,
                        vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                        layer_kinds=list(info.layer_kinds), eos_token_ids=list(info.eos_token_ids),
                        has_tokenizer=core.backend.tokenizer is not None)


def worker_proto(worker: dict) -> pb.WorkerStatus:
    known = {}
    for name in WORKER_FIELDS:
        value = worker.get(name)
        if value is not None:
            known[name] = str(value) if name in ("id", "kind", "node") else value
    return pb.WorkerStatus(**known)


class SplitServeServicer(pb_grpc.SplitServeServicer):
    def __init__(self, core: ServingCore):
        self.core = core

    async def Generate(self, request, context):
        request_id = getattr(request, "request_id", "") or f"grpc-{uuid.uuid4().hex}"
        deadline = DeadlineWatch(context)
        try:
            try:
                prompt, params, tools = parse_generate(request, checkpoint_template(self.core.backend.tokenizer))
            except InvalidRequest:
                self.core.count_invalid("grpc")
                raise
            async with aclosing(self.core.generate(request_id, prompt, params, "grpc")) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        yield pb.GenerateResponse(request_id=request_id, token_ids=event.token_ids,
                                                  text=event.text,
                                                  logprobs=[_logprob_proto(t, lp) for t, lp in
                                                            zip(event.token_ids, event.logprobs)],
                                                  prompt_logprobs=_prompt_logprobs_proto(event))
                    elif event.finish_reason == "abort":
                        await context.abort(grpc.StatusCode.CANCELLED,
                                            f"request {request_id!r} was aborted")
                    else:
                        yield _final_proto(request_id, event, tools)
        except asyncio.CancelledError:
            if not deadline.passed:
                raise  # the client went away; aclosing above already aborted the request
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; request aborted")
        except InvalidRequest as e:
            path = field_path(e.field)
            message = f"{path}: {e.message}"  # not str(e): from a Ray worker that is its traceback
            context.set_trailing_metadata((("invalid-field", path),))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e) or "server overloaded")
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e) or "no live worker")
        except GenerationFailed as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("Generate %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            deadline.cancel()

    async def Abort(self, request, context):
        await _refuse_undecodable(request, context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return pb.AbortResponse(aborted=await self.core.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        await _refuse_undecodable(request, context)
        return model_info_proto(self.core)

    async def GetStatus(self, request, context):
        await _refuse_undecodable(request, context)
        status = await self.core.status()
        return pb.ServerStatus(ready=await self.core.ready(), requests_in_flight=self.core.in_flight,
                               max_queued=self.core.max_queued, model=model_info_proto(self.core),
                               workers=[worker_proto(w) for w in status.get("workers", [])])

    async def Scale(self, request, context):
        await _refuse_undecodable(request, context)
        given = lambda name, default=None: getattr(request, name) if request.HasField(name) else default  # noqa: E731
        return await self._resize(context, "scale", given("prefill"), given("decode"),
                                  drain_timeout_s=given("drain_timeout_s", 30.0))

    async def RestartWorkers(self, request, context):
        await _refuse_undecodable(request, context)
        timeout = request.drain_timeout_s if request.HasField("drain_timeout_s") else 30.0
        return await self._resize(context, "restart_workers", drain_timeout_s=timeout)

    async def _resize(self, context, method: str, *args, **kwargs):
        try:
            counts = await self.core.resize(method, *args, **kwargs)
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PlacementError as e:  # nothing was started; the cluster serves on as it was
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {type(e).__name__}: {e}")
        return pb.ScaleResponse(prefill=counts["prefill"], decode=counts["decode"])


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, Undecodable):
        context.set_trailing_metadata((("invalid-field", "request"),))
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.message}")


class DeadlineWatch:
    """Cancels the handler's task when the call's deadline passes, so the request is aborted
    then rather than whenever the transport notices."""

    def __init__(self, context):
        remaining = context.time_remaining()
        self.passed = False
        self._timer = None
        if remaining is not None:
            task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(max(remaining, 0.0), self._fire, task)

    def _fire(self, task):
        self.passed = True
        task.cancel()

    def cancel(self):
        if self._timer is not None:
            self._timer.cancel()


def _logprob_proto(token_id: int, lp: dict) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.get("top", [])]
    return pb.TokenLogprob(token_id=token_id, logprob=lp["token"], top=top)


def _prompt_logprobs_proto(event: Delta) -> list[pb.PromptTokenLogprob]:
    if event.prompt_logprobs is None:
        return []
    out = []
    for token_id, lp in zip(event.prompt_token_ids, event.prompt_logprobs):
        if lp is None:
            out.append(pb.PromptTokenLogprob(token_id=token_id))
            continue
        top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.get("top", [])]
        out.append(pb.PromptTokenLogprob(token_id=token_id, logprob=lp["token"], rank=lp["rank"], top=top))
    return out


def _final_proto(request_id: str, final, tools: ToolPlan | None = None) -> pb.GenerateResponse:
    u = final.usage
    calls = tools.calls(final.text)[0] if tools is not None and final.finish_reason == "stop" else []
    reason = "tool_calls" if calls else final.finish_reason
    return pb.GenerateResponse(
        request_id=request_id, finished=True, finish_reason=FINISH_REASONS.get(reason, 0),
        tool_calls=[pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                    for c in calls],
        usage=pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                       cached_tokens=u.cached_tokens, total_tokens=u.total_tokens),
        timings=pb.Timings(time_to_first_token_s=final.time_to_first_token_s,
                           time_per_output_token_s=final.time_per_output_token_s, e2e_s=final.e2e_s),
        spans=[pb.Span(name=s.name, where=s.where, start_unix_nano=s.start_ns, end_unix_nano=s.end_ns)
               for s in final.spans])


class GrpcFront:
    """The gRPC server with health and reflection; health for SERVICE_NAME follows readiness."""

    def __init__(self, core: ServingCore, host: str, port: int, auth_token: str | None,
                 tls_cert: str | None, tls_key: str | None, health_poll_s: float):
        interceptors = [GrpcTokenInterceptor(TokenCheck(auth_token))] if auth_token else []
        # so_reuseport off: a second server asking for a taken port must fail, not share it
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        self.core = core
        self.health = health_aio.HealthServicer()  # "" is SERVING from the start: liveness
        add_servicer(SplitServeServicer(core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls_cert:
            with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
                credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"gRPC: could not bind {address}")
        self._health_poll_s = health_poll_s
        self._readiness_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        await self._refresh_readiness()
        self._readiness_task = asyncio.get_running_loop().create_task(self._follow_readiness())

    async def _refresh_readiness(self) -> None:
        try:
            ready = await self.core.ready()
        except Exception:
            log.exception("backend.ready() failed")
            ready = False
        states = health_pb2.HealthCheckResponse
        await self.health.set(SERVICE_NAME, states.SERVING if ready else states.NOT_SERVING)

    async def _follow_readiness(self) -> None:
        while True:
            await asyncio.sleep(self._health_poll_s)
            await self._refresh_readiness()

    async def stop(self, grace_s: float) -> None:
        if self._readiness_task is not None:
            self._readiness_task.cancel()
        await self.health.enter_graceful_shutdown()  # balancers stop sending before we close
        await self.server.stop(grace_s)
