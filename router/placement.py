"""Where workers run: one Ray placement group per worker, or per prefill/decode pair.

Each worker kind can be pinned to a node type through a custom resource that only those
nodes advertise (`ray start --resources='{"splitserve_prefill": 4}'`), as Splitwise puts
prefill and decode on different hardware. `pack_pairs` puts prefill i and decode i on one
node (STRICT_PACK) so their hand-off stays on the fast local path.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_RESOURCE = "splitserve_prefill"
DECODE_RESOURCE = "splitserve_decode"


class PlacementError(RuntimeError):
    """Ray could not place the workers asked for (no node offers the resources, within the wait)."""


@dataclass
class PlacementConfig:
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    # A custom resource only nodes of the wanted kind offer; "auto": PREFILL_RESOURCE /
    # DECODE_RESOURCE when some node of the Ray cluster advertises it, else no pinning.
    prefill_resource: str | None = "auto"
    decode_resource: str | None = "auto"
    pack_pairs: bool = False
    ready_timeout_s: float = 120.0
    # Tensor-parallel ranks per worker: a bundle each (the resources above are per rank), packed
    # on one node (their gloo group and command sockets are local).
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self):
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("cpus_per_worker and gpus_per_worker must be >= 0")
        for name in ("prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        tp = max(self.prefill_tp, self.decode_tp)
        if tp > 1 and self.gpus_per_worker and self.gpus_per_worker != 1:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker} with tensor-parallel workers: each rank "
                             "takes exactly one GPU (its NCCL group needs a device per rank)")
        if not self.ready_timeout_s > 0:
            raise ValueError("ready_timeout_s must be > 0")

    def bundle(self, kind: str) -> dict:
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        resource = self.prefill_resource if kind == "prefill" else self.decode_resource
        if resource:
            bundle[resource] = 1
        return {k: v for k, v in bundle.items() if v}

    def ranks(self, kind: str) -> int:
        return self.prefill_tp if kind == "prefill" else self.decode_tp


def resolve_auto_resources(config: PlacementConfig, cluster_resources: dict) -> None:
    for attr, default in (("prefill_resource", PREFILL_RESOURCE), ("decode_resource", DECODE_RESOURCE)):
        if getattr(config, attr) == "auto":
            setattr(config, attr, default if cluster_resources.get(default) else None)


def check_capacity(config: PlacementConfig, num_prefill: int, num_decode: int, available: dict,
                   total_workers: int) -> None:
    """Refuse at once what a Ray of fixed size (one `splitserve serve` started itself) cannot
    place, instead of waiting ready_timeout_s for resources that will never come; name what is
    short and the setting that would fit. `total_workers`: ranks the cluster would then run."""
    need: dict[str, float] = {}
    for kind, count in (("prefill", num_prefill), ("decode", num_decode)):
        for name, amount in config.bundle(kind).items():
            need[name] = need.get(name, 0.0) + amount * count * config.ranks(kind)
    short = {name: (amount, available.get(name, 0.0)) for name, amount in need.items()
             if amount > available.get(name, 0.0) + 1e-9}
    if not short:
        return
    what = ", ".join(f"{amount:g} {name} (free: {free:g})" for name, (amount, free) in short.items())
    hints = []
    if "CPU" in short and total_workers:
        fits = int(available.get("CPU", 0.0) / max(num_prefill * config.ranks("prefill")
                                                   + num_decode * config.ranks("decode"), 1) * 100) / 100
        if fits > 0:
            hints.append(f"--cpus-per-worker {fits:g} (now {config.cpus_per_worker:g}) when starting the server")
    if "GPU" in short:
        hints.append("fewer GPUs per worker (--gpus-per-worker) or a GPU node more")
    hints.append("or join a larger Ray cluster with --address")
    raise PlacementError(f"{num_prefill} prefill and {num_decode} decode worker(s) more need {what} on this "
                         f"Ray of fixed size: try {'; '.join(hints)}")


def place_workers(config: PlacementConfig, num_prefill: int, num_decode: int):
    """Placement groups for the workers: returns (groups, [(group, bundle indices)] per P, per D);
    a worker's first bundle is its rank 0 (the actor), the others its other TP ranks."""
    import ray
    from ray.util.placement_group import placement_group

    resolve_auto_resources(config, ray.cluster_resources())
    groups, prefill_slots, decode_slots = [], [], []
    pairs = min(num_prefill, num_decode) if config.pack_pairs else 0
    p_ranks, d_ranks = config.ranks("prefill"), config.ranks("decode")
    for _ in range(pairs):
        group = placement_group([config.bundle("prefill")] * p_ranks + [config.bundle("decode")] * d_ranks,
                                strategy="STRICT_PACK")
        groups.append(group)
        prefill_slots.append((group, list(range(p_ranks))))
        decode_slots.append((group, list(range(p_ranks, p_ranks + d_ranks))))
    for kind, count, slots in (("prefill", num_prefill, prefill_slots), ("decode", num_decode, decode_slots)):
        ranks = config.ranks(kind)
        for _ in range(count - pairs):
            group = placement_group([config.bundle(kind)] * ranks, strategy="STRICT_PACK" if ranks > 1 else "PACK")
            groups.append(group)
            slots.append((group, list(range(ranks))))
    for group in groups:
        try:
            ray.get(group.ready(), timeout=config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_groups(groups)
            raise PlacementError(
                f"Ray could not place bundles {group.bundle_specs} within {config.ready_timeout_s}s: "
                "no node offers those resources (check --resources of `ray start`)"
            ) from None
    return groups, prefill_slots, decode_slots


def remove_groups(groups) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:
            pass
