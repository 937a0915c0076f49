"""A run's worker groups as one typed object: the role table, build / attach / kill, and
checkpoint save / load for every trainable role.

Both the trainer (direct runs, replay) and the long-lived session place their workers
through this module, so it sits below both. Adding a role is a worker class, one entry in
``ROLES`` and the stage(s) that call it (``rlhf_core/trainer/stages.py``)::

    Role("verifier", "my_pkg.workers:VerifierWorker", trainable=False,
         enabled=lambda cfg: cfg.reward.function == "my_pkg.rewards:verified")

Roles are colocated in one process per rank of their pool (``pool_plan``): the ``train``
pool hosts every role but the critic and the reward model when they have pools of their own. A pool is one placement
group per node, ranks numbered node by node. The role's handle is a ``RayWorkerGroup``
whose methods are the role's ``@register``-ed methods.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from rlhf_core.config import RunConfig


@dataclass(frozen=True)
class Role:
    """One worker role: its class (``module:Class``, imported when placed), whether it
    holds trainable state (written to and restored from checkpoints) and when a run has it."""

    name: str
    worker_class: str
    trainable: bool
    enabled: Callable[[RunConfig], bool] = lambda cfg: True

    def load_class(self) -> type:
        module, _, name = self.worker_class.partition(":")
        return getattr(importlib.import_module(module), name)


#: Every role the trainer knows, in the order they are initialized.
ROLES: tuple[Role, ...] = (
    Role("actor", "rlhf_core.workers.actor:ActorRolloutRefWorker", trainable=True),
    Role("reward", "rlhf_core.workers.reward:RewardWorker", trainable=False),
    Role("critic", "rlhf_core.workers.critic:CriticWorker", trainable=True, enabled=lambda cfg: cfg.use_critic),
    Role("reward_model", "rlhf_core.workers.reward_model:RewardModelWorker", trainable=False,
         enabled=lambda cfg: cfg.reward_model.enable),
    Role("rollout", "rlhf_core.workers.rollout_replica:RolloutReplicaWorker", trainable=False,
         enabled=lambda cfg: cfg.rollout.own_pool),
)


def roles_of(cfg: RunConfig) -> list[Role]:
    return [role for role in ROLES if role.enabled(cfg)]


@dataclass(frozen=True)
class Pool:
    """One resource pool of a run: its name, ranks per node, and the roles colocated in
    each of its processes."""

    name: str
    process_on_nodes: tuple[int, ...]
    roles: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)


TRAIN_POOL, CRITIC_POOL, REWARD_MODEL_POOL, ROLLOUT_POOL = "train", "critic", "reward_model", "rollout"


POOL_KINDS = (TRAIN_POOL, CRITIC_POOL, REWARD_MODEL_POOL, ROLLOUT_POOL)


def pool_prefix(pool_name: str, kind: str) -> str:
    """The name prefix of a run's pool of ``kind`` (its placement groups, its workers):
    the train pool is ``pool_name`` itself, every other ``{pool_name}_{kind}``."""
    return pool_name if kind == TRAIN_POOL else f"{pool_name}_{kind}"


def pool_prefixes(pool_name: str) -> list[str]:
    """Every pool prefix a run placed under ``pool_name`` can have (whatever its config)."""
    return [pool_prefix(pool_name, kind) for kind in POOL_KINDS]


def pool_plan(cfg: RunConfig) -> list[Pool]:
    """Where the roles run: the ``train`` pool hosts actor/rollout/reference, the reward
    and (by default) the critic and the reward model; with ``critic.world_size > 0`` the
    critic gets a ``critic`` pool of its own (``resources.critic_nnodes`` nodes), with
    ``reward_model.enable_resource_pool`` the reward model a ``reward_model`` pool
    (``reward_model.nnodes`` x ``reward_model.n_gpus_per_node``, verl's), with
    ``rollout.nnodes`` the rollout replicas a ``rollout`` pool (``rollout.n_gpus_per_node``
    ranks per node, verl's fully-async names)."""
    res, rm = cfg.resources, cfg.reward_model
    names = [r.name for r in roles_of(cfg)]
    own = []
    if cfg.use_critic and cfg.critic.world_size:
        nodes = min(res.critic_nnodes, cfg.critic.world_size)
        own.append(Pool(CRITIC_POOL, tuple([cfg.critic.world_size // nodes] * nodes), ("critic",)))
    if rm.enable and rm.enable_resource_pool:
        own.append(Pool(REWARD_MODEL_POOL, tuple([rm.n_gpus_per_node] * rm.nnodes), ("reward_model",)))
    if cfg.rollout.own_pool:
        own.append(Pool(ROLLOUT_POOL, tuple([cfg.rollout.n_gpus_per_node] * cfg.rollout.nnodes), ("rollout",)))
    elsewhere = {role for pool in own for role in pool.roles}
    return [Pool(TRAIN_POOL, tuple(res.process_on_nodes(cfg.actor.world_size)),
                 tuple(n for n in names if n not in elsewhere)), *own]


def colocated_class(cfg: RunConfig, role_names: tuple[str, ...] | None = None):
    """The worker class hosting ``role_names`` (default: every role of the run) in a process."""
    from rlhf_core.controller import RayClassWithInitArgs, create_colocated_worker_cls

    roles = [r for r in roles_of(cfg) if role_names is None or r.name in role_names]
    return create_colocated_worker_cls({r.name: RayClassWithInitArgs(r.load_class(), cfg) for r in roles})


@dataclass
class WorkerSet:
    """The handles of a run's placed workers: ``workers["actor"].compute_log_prob(...)``."""

    roles: dict                       # role name -> RayWorkerGroup of that role
    groups: list                      # one colocated RayWorkerGroup per pool, in pool_plan order
    pools: list = field(default_factory=list)  # the RayResourcePools it owns (empty when attached)
    trainable: tuple[str, ...] = field(default_factory=tuple)

    def __getitem__(self, role: str):
        return self.roles[role]

    def __contains__(self, role: str) -> bool:
        return role in self.roles

    def get(self, role: str, default=None):
        return self.roles.get(role, default)

    @property
    def group(self):
        """The train pool's group (actor, rollout, reference, reward)."""
        return self.groups[0]

    @property
    def worker_names(self) -> list[str]:
        """Every worker's name, pool after pool (``attach`` splits them by the plan)."""
        return [name for group in self.groups for name in group.worker_names]

    # ------------------------------------------------------------------ placing

    @classmethod
    def build(cls, cfg: RunConfig, name_prefix: str = "rlhf_worker", pool_name: str = "global_pool",
              detached: bool = False) -> "WorkerSet":
        """One process per rank of every pool (``pool_plan``), each hosting its pool's
        roles; ``detached`` ones outlive this driver (the long-lived session's). Models
        are initialized before returning."""
        from rlhf_core.controller import RayResourcePool, RayWorkerGroup
        from rlhf_core.controller.resource_pool import check_pools_fit

        # the pools' shape comes from the config, not from this process's hardware: on a
        # cluster the driver runs on a head node without GPUs
        res = cfg.resources
        groups, pools = [], []
        plans = pool_plan(cfg)
        try:
            for plan in plans:
                pools.append(RayResourcePool(list(plan.process_on_nodes), use_gpu=res.gpus_per_node > 0,
                                             accelerator_resource=res.accelerator_resource,
                                             cpus_per_process=cfg.trainer.cpus_per_worker,
                                             name_prefix=pool_name + pool_prefix("", plan.name),
                                             max_colocate_count=1, detached=detached,
                                             ready_timeout_s=res.placement_timeout_s))
            check_pools_fit(pools)
            for plan, pool in zip(plans, pools):
                groups.append(RayWorkerGroup(pool, colocated_class(cfg, plan.roles),
                                             name_prefix=name_prefix + pool_prefix("", plan.name), detached=detached))
        except BaseException:
            for group in groups:
                group.kill()
            for pool in pools:
                pool.release()
            raise
        workers = cls._from_groups(cfg, groups, pools)
        for role in roles_of(cfg):
            workers[role.name].init_model()
        return workers

    @classmethod
    def attach(cls, cfg: RunConfig, worker_names: list[str], namespace: str, role: str,
               busy_wait_s: float = 30.0) -> "WorkerSet | None":
        """The detached workers named ``worker_names`` (a session's), or None when any is
        gone or dead. A worker still busy after ``busy_wait_s`` counts as alive: it is in
        the middle of a call (the session computing the next iteration ahead, or a stage
        of a controller that died), and what we send next queues behind it."""
        import ray

        from rlhf_core.controller import RayWorkerGroup

        plan = pool_plan(cfg)
        if len(worker_names) != sum(p.world_size for p in plan):
            return None  # placed for another layout
        groups, start = [], 0
        try:
            for pool in plan:
                names = worker_names[start:start + pool.world_size]
                start += pool.world_size
                groups.append(RayWorkerGroup.from_detached(names, colocated_class(cfg, pool.roles),
                                                           namespace=namespace, role=role))
        except ValueError:
            return None
        workers = [w for group in groups for w in group.workers]
        pings = [w.__ray_ready__.remote() for w in workers]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=busy_wait_s)
        try:
            ray.get(answered)  # a dead worker answers at once, with its death
        except Exception:
            return None
        return cls._from_groups(cfg, groups, [])

    @classmethod
    def _from_groups(cls, cfg: RunConfig, groups: list, pools: list) -> "WorkerSet":
        roles = {}
        for plan, group in zip(pool_plan(cfg), groups):
            roles.update(group.spawn(prefix_set=list(plan.roles)))
        return cls(roles=roles, groups=groups, pools=pools,
                   trainable=tuple(r.name for r in roles_of(cfg) if r.trainable))

    def kill(self) -> None:
        """End the workers and give their resources back (idempotent)."""
        for group in self.groups:
            group.kill()
        for pool in self.pools:
            pool.release()

    def fence(self, claim: int) -> None:
        """Make this handle the only one the workers obey: every call it makes from now on
        carries ``claim``, and once this returns every rank has seen it, so each refuses
        the calls of an earlier claim (a controller that lost the workers to this one, its
        queued updates included). A worker runs one call at a time, so a call of the
        earlier claim already running has finished by then."""
        for group in [*self.groups, *self.roles.values()]:
            group.fence_claim = claim
        for group in self.groups:
            group.fence()

    # ------------------------------------------------------------------ checkpoints

    def start_checkpoint(self, uri: str, storage_options: dict | None = None) -> None:
        """Start every trainable role's checkpoint; it is written in the background."""
        for name in self.trainable:
            self.roles[name].start_checkpoint(uri, storage_options)

    def finish_checkpoint(self) -> dict[str, str]:
        """Wait for the checkpoint ``start_checkpoint`` began; {file: sha256} of it all."""
        digests: dict[str, str] = {}
        for name in self.trainable:
            for written in self.roles[name].finish_checkpoint():
                digests.update(written or {})
        return digests

    def set_weight_version(self, version: int) -> None:
        """The trainer step whose weights the actor's policy and engines hold (after a restore)."""
        self.roles["actor"].set_weight_version(version)

    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Restore every trainable role from the files ``expected`` lists ({file: sha256},
        as the checkpoint's commit recorded it). A file that differs is refused, in one
        line: the workers' ``CheckpointRefusedError`` itself, not the worker's traceback."""
        from rlhf_core.controller import WorkerError
        from rlhf_core.checkpoint.reader import CheckpointRefusedError

        for name in self.trainable:
            try:
                self.roles[name].load_checkpoint(uri, storage_options, expected)
            except WorkerError as exc:
                if isinstance(exc.__cause__, CheckpointRefusedError):
                    raise type(exc.__cause__)(str(exc.__cause__)) from None
                raise
