"""Ranks 1..N-1 of a tensor-parallel worker as Ray actors, in the worker's placement group.

The worker actor is rank 0 and owns these actors: Ray kills them when it dies (and restarts it,
which starts new ones), and they are never restarted on their own, since a rank's state only
makes sense with its rank 0. Each has the bundle Ray reserved for it (its CPUs, and on GPUs its
own device).
"""

from __future__ import annotations

import os


class RankActor:
    def run(self, *args) -> None:
        from engine.tp.ranks import follower_main

        follower_main(*args)

    def pid(self) -> int:
        return os.getpid()


class RayRank:
    """One rank's actor, shaped like a multiprocessing.Process for engine.tp.ranks.TPLeader."""

    def __init__(self, actor, run_ref):
        self.actor, self._run = actor, run_ref
        self.exitcode = None

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self._run], timeout=0)
        if done and self.exitcode is None:
            try:
                ray.get(self._run)
                self.exitcode = 0
            except Exception as e:  # the actor died, or follower_main raised
                self.exitcode = f"{type(e).__name__}"
        return not done

    @property
    def pid(self) -> int:
        import ray

        return ray.get(self.actor.pid.remote(), timeout=30)

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self._run], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayRanks:
    """Starts rank r in bundle `bundles[r - 1]` of `group`."""

    def __init__(self, group, bundles: list[int], num_cpus: float, num_gpus: float):
        self.group, self.bundles, self.num_cpus, self.num_gpus = group, bundles, num_cpus, num_gpus

    def start(self, rank: int, args: tuple) -> RayRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(RankActor).options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundles[rank - 1]),
        ).remote()
        return RayRank(actor, actor.run.remote(*args))
