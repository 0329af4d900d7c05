"""Under Ray Serve: one router actor owns the cluster; every ingress replica shares it.

The router is a deployment-scoped actor of the ingress deployment (Serve's `deployment_actors`):
it runs router.cluster.Cluster (launch(), the same code as `splitserve serve`: the prefill and
decode worker actors, the hand-off, retries and resume), and the ingress replicas reach it through
RouterBackend, the Backend protocol over actor calls. So the front door code (router/serving.py,
http_server.py, grpc_server.py) runs unchanged in the replicas, and the replicas hold nothing a
request needs after it ends: there can be any number of them.

Serve keeps one router per code version of the deployment while replicas of that version exist:
a redeploy with other options starts a new router (new workers) for the new replicas, and the old
router serves the old replicas' in-flight requests until they have drained, then Serve stops it.
The worker actors and their placement groups are the router's own, so Ray removes them with it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ray

from engine.hub import resolve_model
from engine.output import Cumulative
from engine.tokenizer import Tokenizer
from router.backend import ModelInfo

log = logging.getLogger(__name__)
ROUTER_ACTOR = "router"  # its name among the ingress deployment's deployment_actors


@ray.remote
class ClusterRouter:
    def __init__(self, model: str | None, launch_options: dict):
        from router.cluster import launch

        # address "auto": the Ray cluster this actor runs in
        self.cluster = launch(model, **{**launch_options, "address": "auto"})

    def describe(self) -> dict:
        config = self.cluster.config
        return {"info": self.cluster.info, "model": config.model,
                "revision": config.engine_options.get("revision")}

    def ready(self) -> bool:
        return self.cluster.ready()

    async def status(self) -> dict:
        return await asyncio.to_thread(self.cluster.status)

    async def stream(self, request_id: str, prompt, params, whole: bool = True):
        """whole=False: the cluster's deltas as they come (the final output whole). Else deltas
        (RequestOutput.delta), the first with the prompt: RouterBackend rebuilds the rest."""
        if not whole:
            async for out in self.cluster.stream(request_id, prompt, params, whole=False):
                yield out
            return
        first = True
        async for out in self.cluster.stream(request_id, prompt, params):
            delta = out.delta()
            if first:
                delta.prompt_token_ids, first = out.prompt_token_ids, False
            yield delta

    async def abort(self, request_id: str) -> bool:
        return await self.cluster.abort(request_id)

    async def inject_slow_steps(self, seconds: float) -> None:
        """Drills and tests: every worker's engine steps take `seconds` longer (0 to stop)."""
        workers = self.cluster.workers.prefill + self.cluster.workers.decode
        await asyncio.gather(*(w.handle.inject_slow_steps.remote(seconds) for w in workers))


class RouterBackend:
    """router.backend.Backend over the ClusterRouter: what the front door in a replica serves."""

    def __init__(self, lookup):
        self._lookup = lookup  # () -> the router's current handle (Serve may recreate the actor)
        self.router = lookup()
        described = ray.get(self.router.describe.remote())
        self.info: ModelInfo = described["info"]
        # Prompts are tokenized and checked here, before they reach the router: from this node's
        # copy of the same folder, or of the same Hub commit.
        folder, _ = resolve_model(described["model"], described["revision"])
        try:
            self._tokenizer = Tokenizer(Path(folder))
        except FileNotFoundError:
            self._tokenizer = None

    @property
    def tokenizer(self):
        return self._tokenizer

    def _relookup_if_dead(self, error: BaseException) -> None:
        from ray.exceptions import RayActorError

        if isinstance(error, RayActorError):
            try:
                self.router = self._lookup()
            except Exception:  # not recreated yet: the next call tries again
                pass

    def _call(self, method: str, *args):
        try:
            return ray.get(getattr(self.router, method).remote(*args))
        except Exception as e:
            self._relookup_if_dead(e)
            raise

    def ready(self) -> bool:
        try:
            return bool(self._call("ready"))
        except Exception:
            return False

    def status(self) -> dict:
        return self._call("status")

    async def abort(self, request_id: str) -> bool:
        return bool(await self.router.abort.remote(request_id))

    async def stream(self, request_id: str, prompt, params, whole: bool = True):
        outputs = self.router.stream.options(num_returns="streaming").remote(request_id, prompt, params, whole)
        finished, so_far = False, None
        try:
            async for ref in outputs:
                out = await ref
                finished = out.finished
                if not whole:
                    yield out
                    continue
                if so_far is None:
                    so_far = Cumulative(out.prompt_token_ids, params.logprobs is not None)
                yield so_far.add(out)
        except Exception as e:
            self._relookup_if_dead(e)
            raise
        finally:
            if not finished:  # the caller went away: stop the request on the router and workers
                self.router.abort.remote(request_id)
                try:
                    ray.cancel(outputs)
                except Exception:  # finished meanwhile
                    pass
