"""A run's worker groups as one typed object: the role table, build / attach / kill, and
checkpoint save / load for every trainable role.

Both the trainer (direct runs, replay) and the long-lived session place their workers
through this module, so it sits below both. Adding a role is a worker class, one entry in
``ROLES`` and the stage(s) that call it (``rlhf_core/trainer/stages.py``)::

    Role("reward_model", "my_pkg.workers:RewardModelWorker", trainable=False,
         enabled=lambda cfg: cfg.reward.function == "model")

Every role of a run is colocated in one process per rank; the ranks form one pool of one
placement group per node (``resources.nnodes``), numbered node by node. The role's handle
is a ``RayWorkerGroup`` whose methods are the role's ``@register``-ed methods.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from rlhf_core.config import RunConfig

TRAINER_STATE_FILE = "trainer_state.json"


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
)


def roles_of(cfg: RunConfig) -> list[Role]:
    return [role for role in ROLES if role.enabled(cfg)]


def colocated_class(cfg: RunConfig):
    """The one worker class hosting every role of the run in a process."""
    from rlhf_core.controller import RayClassWithInitArgs, create_colocated_worker_cls

    return create_colocated_worker_cls({r.name: RayClassWithInitArgs(r.load_class(), cfg) for r in roles_of(cfg)})


@dataclass
class WorkerSet:
    """The handles of a run's placed workers: ``workers["actor"].compute_log_prob(...)``."""

    roles: dict                       # role name -> RayWorkerGroup of that role
    group: object                     # the colocated RayWorkerGroup (all roles, all ranks)
    pool: object | None = None        # the RayResourcePool it owns (None when attached)
    trainable: tuple[str, ...] = field(default_factory=tuple)

    def __getitem__(self, role: str):
        return self.roles[role]

    def __contains__(self, role: str) -> bool:
        return role in self.roles

    def get(self, role: str, default=None):
        return self.roles.get(role, default)

    @property
    def worker_names(self) -> list[str]:
        return self.group.worker_names

    # ------------------------------------------------------------------ placing

    @classmethod
    def build(cls, cfg: RunConfig, name_prefix: str = "rlhf_worker", pool_name: str = "global_pool",
              detached: bool = False) -> "WorkerSet":
        """One process per actor rank hosting every role; ``detached`` ones outlive this
        driver (the long-lived session's). Models are initialized before returning."""
        from rlhf_core.controller import RayResourcePool, RayWorkerGroup

        # the pool's shape comes from the config, not from this process's hardware: on a
        # cluster the driver runs on a head node without GPUs
        res = cfg.resources
        pool = RayResourcePool(res.process_on_nodes(cfg.actor.world_size), use_gpu=res.gpus_per_node > 0,
                               accelerator_resource=res.accelerator_resource,
                               cpus_per_process=cfg.trainer.cpus_per_worker, name_prefix=pool_name,
                               max_colocate_count=1, detached=detached, ready_timeout_s=res.placement_timeout_s)
        group = RayWorkerGroup(pool, colocated_class(cfg), name_prefix=name_prefix, detached=detached)
        workers = cls._from_group(cfg, group, pool)
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

        try:
            group = RayWorkerGroup.from_detached(worker_names, colocated_class(cfg), namespace=namespace, role=role)
        except ValueError:
            return None
        pings = [w.__ray_ready__.remote() for w in group.workers]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=busy_wait_s)
        try:
            ray.get(answered)  # a dead worker answers at once, with its death
        except Exception:
            return None
        return cls._from_group(cfg, group, None)

    @classmethod
    def _from_group(cls, cfg: RunConfig, group, pool) -> "WorkerSet":
        roles = roles_of(cfg)
        return cls(roles=group.spawn(prefix_set=[r.name for r in roles]), group=group, pool=pool,
                   trainable=tuple(r.name for r in roles if r.trainable))

    def kill(self) -> None:
        """End the workers and give their resources back (idempotent)."""
        self.group.kill()
        if self.pool is not None:
            self.pool.release()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, uri: str, storage_options: dict | None = None) -> dict[str, str]:
        """Every trainable role writes weights, optimizer, LR schedule and RNG under
        ``uri``; returns {file: sha256} of everything written."""
        digests: dict[str, str] = {}
        for name in self.trainable:
            for written in self.roles[name].save_checkpoint(uri, storage_options):
                digests.update(written or {})
        return digests

    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Restore every trainable role; ``expected`` ({file: sha256}) refuses changed files."""
        for name in self.trainable:
            self.roles[name].load_checkpoint(uri, storage_options, expected)


def checkpoint_exists(uri: str, storage_options: dict | None = None) -> bool:
    """A checkpoint is complete once the controller's state file, written last, exists."""
    from rlhf_core.snapshot import fs as sfs

    return sfs.read_bytes(sfs.resolve(f"{uri.rstrip('/')}/{TRAINER_STATE_FILE}", storage_options)) is not None
