"""splitserve as a Ray Serve application.

    serve run router.serve_app:build model=org/name prefill=2 decode=2 transport=gloo

or, in a Serve config file (a RayService's serveConfigV2), `import_path: router.serve_app:build`
with the same options under `args:`. The options are those of `splitserve serve`, parsed by the
same argparse definitions (router/cli.py); the listening ones (ports, host, TLS) belong to Serve's
http_options / grpc_options instead, and `address` to Ray. The ingress answers the OpenAI-style
HTTP API through Serve's HTTP proxy (the Starlette app of router/http_server.py) and
splitserve.v1.SplitServe plus grpc.health.v1 Health/Check through Serve's gRPC proxy (the
servicer of router/grpc_server.py); the cluster behind it lives in router/serve_router.py.
"""

from __future__ import annotations

import argparse
import json

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.config import DeploymentActorConfig

from protos.splitserve.v1 import splitserve_pb2 as pb
from router.auth import TokenCheck
from router.cli import add_serve_arguments, serve_options
from router.grpc_server import SERVICE_NAME, SplitServeServicer
from router.http_server import build_app as build_http_app
from router.serve_router import ROUTER_ACTOR, ClusterRouter, RouterBackend
from router.serving import ServingCore

# Serve's gRPC proxy needs these in grpc_options.grpc_servicer_functions.
GRPC_SERVICER_FUNCTIONS = ["router.grpc_server.add_servicer",
                           "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]
SET_BY_SERVE = {"address": "Ray (the application runs in the Ray cluster Serve runs in)",
                "grpc_port": "grpc_options.port", "http_port": "http_options.port",
                "host": "http_options.host", "tls_cert": "http_options.ssl_certfile",
                "tls_key": "http_options.ssl_keyfile"}
# Beyond max_queued Serve would queue a request where `splitserve serve` refuses it (429 /
# RESOURCE_EXHAUSTED); the margin keeps health, metrics and status calls out of that count.
ONGOING_MARGIN = 16
# A redeploy drains old replicas: their streams get this long to finish.
GRACEFUL_SHUTDOWN_S = 300.0


def parse_options(args: dict | None):
    """Application args (`key=value` of `serve run`, or `args:` of a config file) -> (model,
    router.cluster.launch options, FrontDoorConfig); ValueError naming the option."""
    parser = argparse.ArgumentParser(prog="router.serve_app:build", add_help=False, exit_on_error=False)
    add_serve_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    argv = []
    for key, value in (args or {}).items():
        dest = str(key).replace("-", "_")
        if dest in SET_BY_SERVE:
            raise ValueError(f"{key}: not an application option under Ray Serve; set {SET_BY_SERVE[dest]}")
        if dest not in actions:
            known = sorted(set(actions) - set(SET_BY_SERVE))
            raise ValueError(f"{key}: not an option of `splitserve serve` (known: {', '.join(known)})")
        flag = actions[dest].option_strings[0]
        if actions[dest].nargs == 0:  # a switch: pack_pairs=true
            if str(value).lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{key}: true or false, got {value!r}")
            argv += [flag] if str(value).lower() in ("true", "1", "yes") else []
        elif value is not None:  # a mapping (speculative_config in a config file) as the flag's JSON
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    try:
        namespace = parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    launch_options, door = serve_options(namespace)
    del launch_options["address"]
    return namespace.model, launch_options, door


class _ServeGrpcContext:
    """What SplitServeServicer uses of a grpc.aio context, over Serve's RayServegRPCContext."""

    def __init__(self, context):
        self._context = context

    def time_remaining(self):
        return None  # the proxy enforces deadlines (and grpc_options.request_timeout_s)

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(list(metadata))

    async def abort(self, code, details: str):
        self._context.set_code(code)
        self._context.set_details(details)
        raise grpc.aio.AbortError()


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
@serve.ingress()
class SplitServeIngress:
    def __init__(self, args: dict):
        # Parsed again here so the auth token comes from this replica's $SPLITSERVE_AUTH_TOKEN,
        # never from the (stored) application config.
        _, _, door = parse_options(args)
        self.backend = RouterBackend(lambda: serve.get_deployment_actor(ROUTER_ACTOR))
        self.core = ServingCore(self.backend, door.max_queued, door.metrics_compat)
        self.auth_token = door.auth_token
        self._check = TokenCheck(door.auth_token) if door.auth_token else None
        self._servicer = SplitServeServicer(self.core)

    def __serve_build_asgi_app__(self):
        return build_http_app(self.core, self.auth_token)

    # ---- gRPC, called by Serve's gRPC proxy by method name ----

    async def Generate(self, request, grpc_context):
        # Serve's proxy copies a streaming call's context only with a yielded message; a status
        # set before any arrives reaches the client only if the call raises (Serve then wraps
        # the exception with the code and details set on the context).
        if self._refused(grpc_context):
            raise PermissionError("missing or wrong token")
        async for response in self._servicer.Generate(request, _ServeGrpcContext(grpc_context)):
            yield response  # an abort raises grpc.aio.AbortError with its status on the context

    async def Abort(self, request, grpc_context):
        return await self._unary("Abort", request, grpc_context, pb.AbortResponse)

    async def GetModelInfo(self, request, grpc_context):
        return await self._unary("GetModelInfo", request, grpc_context, pb.ModelInfo)

    async def GetStatus(self, request, grpc_context):
        return await self._unary("GetStatus", request, grpc_context, pb.ServerStatus)

    async def Check(self, request, grpc_context):
        """grpc.health.v1: "" is liveness (SERVING while this replica runs); the service is
        SERVING once the cluster can serve. Open without a token, as with `splitserve serve`."""
        states = health_pb2.HealthCheckResponse
        if request.service not in ("", SERVICE_NAME):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return states()
        serving = request.service == "" or await self.core.ready()
        return states(status=states.SERVING if serving else states.NOT_SERVING)

    async def _unary(self, method: str, request, grpc_context, empty):
        if self._refused(grpc_context):
            return empty()
        try:
            return await getattr(self._servicer, method)(request, _ServeGrpcContext(grpc_context))
        except grpc.aio.AbortError:
            return empty()

    def _refused(self, grpc_context) -> bool:
        if self._check is None:
            return False
        if self._check.accepts(dict(grpc_context.invocation_metadata()).get("authorization")):
            return False
        grpc_context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        grpc_context.set_details("missing or wrong token: send metadata 'authorization: Bearer <token>'")
        return True


def build(args: dict | None = None):
    """The application builder: `serve run router.serve_app:build key=value ...`."""
    args = dict(args or {})
    model, launch_options, door = parse_options(args)  # bad options fail here, before any replica
    router = DeploymentActorConfig(name=ROUTER_ACTOR, actor_class=ClusterRouter,
                                   init_args=(model, launch_options),
                                   actor_options={"num_cpus": 0, "max_concurrency": 1000})
    return SplitServeIngress.options(max_ongoing_requests=door.max_queued + ONGOING_MARGIN,
                                     deployment_actors=[router]).bind(args)
