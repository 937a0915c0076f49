"""Resource pools: where a WorkerGroup's processes go, as Ray placement groups.

A pool is "N processes on each of these nodes". Each process slot is one placement-group
bundle (1 GPU when ``use_gpu``); ``max_colocate_count`` roles may share a slot, each
taking ``1 / max_colocate_count`` of its GPU. Ranks are numbered node by node in a stable
order (by node IP, then bundle index), so rank 0 is the same machine on every restart.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

#: The nodes the cluster's autoscaler may start, as JSON: ``[{"resources": {"CPU": 64, "GPU": 8},
#: "max": 2}, ...]``, each node group's resources and its largest node count. A KubeRay
#: deployment renders it on the head from its worker groups (components/kuberay/render.py).
AUTOSCALER_NODES_ENV = "RLHF_AUTOSCALER_NODES"


def autoscaler_nodes_from_env() -> list[dict]:
    """The node groups ``RLHF_AUTOSCALER_NODES`` describes ([] when unset: no autoscaler)."""
    text = os.environ.get(AUTOSCALER_NODES_ENV, "").strip()
    if not text:
        return []
    try:
        groups = json.loads(text)
        if isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("resources"), dict)
                                            and isinstance(g.get("max"), int) for g in groups):
            return groups
    except ValueError:
        pass
    raise ValueError(f"{AUTOSCALER_NODES_ENV}: expected a JSON list of {{\"resources\": {{...}}, \"max\": int}}; "
                     f"found {text[:200]!r}")


def slots_per_node(bundle: dict, nodes: list[dict]) -> list[int]:
    """How many ``bundle``s each node (its resources) holds, largest first."""
    return sorted((min(int(res.get(k, 0) // v) for k, v in bundle.items()) for res in nodes), reverse=True)


def fits(process_on_nodes: list[int], slots: list[int]) -> bool:
    """Whether each node's group of slots fits on a node of its own (first fit, largest first)."""
    free = list(slots)
    for count in sorted(process_on_nodes, reverse=True):
        fit = next((i for i, have in enumerate(free) if have >= count), None)
        if fit is None:
            return False
        free[fit] -= count
    return True


def placement_group_name(name_prefix: str, node_index: int) -> str:
    """The name of a detached pool's placement group on its ``node_index``-th node."""
    return f"{name_prefix}_pg{node_index}"


def placement_groups_named(name_prefixes) -> list[str]:
    """The ids (hex) of the live placement groups of the pools named ``name_prefixes``
    (every node of each), from the cluster's placement-group table."""
    from ray.util.placement_group import placement_group_table

    pattern = re.compile("(?:%s)_pg[0-9]+" % "|".join(re.escape(p) for p in name_prefixes))
    return [pg_id for pg_id, entry in placement_group_table().items()
            if entry.get("state") != "REMOVED" and pattern.fullmatch(entry.get("name") or "")]


def remove_placement_groups(pg_ids) -> list[str]:
    """Remove placement groups by id (their actors are killed by Ray); returns the ones that
    could not be removed, with why (one failure does not stop the others)."""
    import ray
    from ray.util.placement_group import PlacementGroup

    failed = []
    for pg_id in pg_ids:
        try:
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the rest still go
            failed.append(f"{pg_id}: {type(exc).__name__}: {exc}")
    return failed


class ResourcePoolError(RuntimeError):
    """A pool cannot be placed on this cluster; the message has the numbers."""


@dataclass
class ResourcePool:
    """The shape of a pool, independent of Ray: processes per node."""

    process_on_nodes: list[int] = field(default_factory=lambda: [1])
    max_colocate_count: int = 1
    use_gpu: bool = False
    name_prefix: str = "pool"

    def __post_init__(self) -> None:
        if not self.process_on_nodes or any(not isinstance(n, int) or n < 1 for n in self.process_on_nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints; found "
                             f"{self.process_on_nodes!r}")
        if self.max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1; found {self.max_colocate_count}")

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def store(self) -> list[int]:  # verl's name
        return self.process_on_nodes


@dataclass
class RayResourcePool(ResourcePool):
    """A ResourcePool realised as one STRICT_PACK placement group per node.

    ``cpus_per_process``: CPUs reserved per process slot (fractions allowed, e.g. on small
    CPU machines). ``detached``: placement groups outlive the creating driver (for the
    long-lived training session). ``ready_timeout_s`` bounds the wait for placement.
    ``autoscaler_nodes``: the node groups an autoscaler may start (``RLHF_AUTOSCALER_NODES``
    by default), which the capacity check counts besides the live nodes.
    """

    cpus_per_process: float = 1.0
    detached: bool = False
    accelerator_resource: str = "GPU"
    ready_timeout_s: float = 60.0
    autoscaler_nodes: list[dict] = field(default_factory=autoscaler_nodes_from_env)
    _pgs: list | None = field(default=None, init=False, repr=False)

    def bundle(self) -> dict:
        """What one process slot reserves."""
        bundle = {"CPU": self.cpus_per_process}
        if self.use_gpu:
            bundle[self.accelerator_resource] = 1
        return bundle

    def _check_capacity(self) -> None:
        """Fail at once, with the numbers, when the cluster's nodes can never hold the pool
        (each node's group of slots must fit on one node); otherwise placement would wait
        for ``ready_timeout_s`` and fail without saying why. A pool fits when it fits the
        live nodes or the nodes the autoscaler may start (each group at its maximum): a
        cluster whose idle workers were scaled to zero has only its head alive, and the
        placement group this check lets through is what makes the autoscaler start them."""
        import ray

        bundle = self.bundle()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        live = slots_per_node(bundle, nodes)
        grown = slots_per_node(bundle, [g["resources"] for g in self.autoscaler_nodes for _ in range(g["max"])])
        if fits(self.process_on_nodes, live) or fits(self.process_on_nodes, grown):
            return
        autoscaled = (f"; the autoscaler's node groups {self.autoscaler_nodes} hold at most {grown}"
                      if self.autoscaler_nodes else "")
        raise ResourcePoolError(
            f"resource pool {self.name_prefix!r} needs {len(self.process_on_nodes)} node(s) holding "
            f"{self.process_on_nodes} slots of {bundle}; the cluster's {len(nodes)} node(s) hold "
            f"{live} such slots{autoscaled}")

    def get_placement_groups(self, strategy: str = "STRICT_PACK") -> list:
        """Create (once) and return the placement groups, sorted into stable rank order."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        if self._pgs is not None:
            return self._pgs
        self._check_capacity()
        bundle = self.bundle()
        pgs = [placement_group([dict(bundle) for _ in range(count)], strategy=strategy,
                               name=placement_group_name(self.name_prefix, i) if self.detached else "",
                               lifetime="detached" if self.detached else None)
               for i, count in enumerate(self.process_on_nodes)]
        ready = [pg.ready() for pg in pgs]
        done, pending = ray.wait(ready, num_returns=len(ready), timeout=self.ready_timeout_s)
        if pending:
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise ResourcePoolError(
                f"resource pool {self.name_prefix!r}: {len(pending)} of {len(pgs)} placement "
                f"groups not placed after {self.ready_timeout_s:.0f}s (bundles {bundle} x "
                f"{self.process_on_nodes}); cluster has {ray.available_resources()} available")
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

        def where(pg):
            table = placement_group_table(pg)
            first = table["bundles_to_node_id"][0]
            return tuple(int(p) if p.isdigit() else p for p in node_ip.get(first, "").split("."))

        order = sorted(range(len(pgs)), key=lambda i: (where(pgs[i]), i))
        self._pgs = [pgs[i] for i in order]
        self.process_on_nodes = [self.process_on_nodes[i] for i in order]
        return self._pgs

    def release(self) -> None:
        """Remove the placement groups (actors placed in them are killed by Ray)."""
        import ray

        for pg in self._pgs or []:
            ray.util.remove_placement_group(pg)
        self._pgs = None


def check_pools_fit(pools: list["RayResourcePool"]) -> None:
    """Fail at once when the run's pools together need more of a resource than the live
    nodes hold (each may fit alone: a rollout or reward-model pool beside the training
    pool), instead of a placement wait that ends without saying why. Skipped where an
    autoscaler may start nodes (placing is what asks it to)."""
    import ray

    if not pools or any(pool.autoscaler_nodes for pool in pools):
        return
    for pool in pools:  # one that cannot fit even alone: its own message, naming its nodes
        pool._check_capacity()
    total: dict[str, float] = {}
    for node in (n["Resources"] for n in ray.nodes() if n.get("Alive")):
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value
    need: dict[str, float] = {}
    for pool in pools:
        for key, value in pool.bundle().items():
            need[key] = need.get(key, 0.0) + value * pool.world_size
    short = [key for key, value in need.items() if value > total.get(key, 0.0) + 1e-9]
    if short:
        parts = ", ".join(f"{pool.name_prefix!r} {pool.world_size} x {pool.bundle()}" for pool in pools)
        raise ResourcePoolError(f"the run's pools need {', '.join(f'{need[k]:g} {k}' for k in short)} together "
                                f"({parts}); the cluster's live nodes hold "
                                f"{', '.join(f'{total.get(k, 0.0):g} {k}' for k in short)} (fewer ranks per pool, or "
                                f"trainer.cpus_per_worker smaller)")
