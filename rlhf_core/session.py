"""The long-lived training session: the run's worker groups, alive across iterations.

The session's WorkerGroups are named, detached actors in the Ray namespace ``rlhf-{run_id}``,
so models, optimizers and the vLLM engine stay loaded while each iteration's controller
(a CLI call or a Kubeflow component) attaches, runs one iteration and exits. A small
detached ``session`` actor records what the session holds (config hash, roles, worker
names, the step its weights are at). If the session is gone (cluster restarted, a worker
killed), ``ensure_session`` builds it again and restores the last committed checkpoint.
"""

from __future__ import annotations

import time

from rlhf_core.config import RunConfig

SESSION_ACTOR = "session"
WORKER_PREFIX = "rlhf_worker"


def namespace_of(run_id: str) -> str:
    return f"rlhf-{run_id}"


class SessionRecord:
    """Detached actor: the session's bookkeeping (tiny; never holds tensors)."""

    def __init__(self, info: dict) -> None:
        self.info = dict(info)
        self.last_used = time.time()

    def get(self) -> dict:
        self.last_used = time.time()
        return dict(self.info)

    def update(self, **changes) -> None:
        self.info.update(changes)
        self.last_used = time.time()

    def idle_seconds(self) -> float:
        return time.time() - self.last_used


def _roles(cfg: RunConfig) -> dict:
    from rlhf_core.controller import RayClassWithInitArgs
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.critic import CriticWorker
    from rlhf_core.workers.reward import RewardWorker

    roles = {"actor": RayClassWithInitArgs(ActorRolloutRefWorker, cfg),
             "reward": RayClassWithInitArgs(RewardWorker, cfg)}
    if cfg.use_critic:
        roles["critic"] = RayClassWithInitArgs(CriticWorker, cfg)
    return roles


def _alive(group) -> bool:
    import ray

    try:
        ray.get([w.__ray_ready__.remote() for w in group.workers], timeout=30)
        return True
    except Exception:
        return False


def attach(cfg: RunConfig, run_id: str) -> dict | None:
    """The session's worker groups, or None when there is no live session."""
    import ray

    from rlhf_core.controller import RayWorkerGroup, create_colocated_worker_cls

    try:
        record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
        info = ray.get(record.get.remote(), timeout=30)
    except Exception:
        return None
    if info["config_hash"] != cfg.config_hash():
        raise RuntimeError(f"session of run {run_id} runs another config (hash {info['config_hash'][:12]}, "
                           f"now {cfg.config_hash()[:12]}); stop it first (rlhf stop-session)")
    roles = _roles(cfg)
    try:
        group = RayWorkerGroup.from_detached(info["worker_names"], create_colocated_worker_cls(roles),
                                             namespace=namespace_of(run_id), role=WORKER_PREFIX)
    except ValueError:
        return None
    if not _alive(group):
        return None
    workers = group.spawn(prefix_set=roles.keys())
    workers.update(_group=group, _record=record, _info=info)
    return workers


def start(cfg: RunConfig, run_id: str) -> dict:
    """Create the session's worker groups (detached) and its record."""
    import ray
    import torch

    from rlhf_core.controller import RayResourcePool, RayWorkerGroup, create_colocated_worker_cls

    roles = _roles(cfg)
    pool = RayResourcePool([cfg.actor.world_size], use_gpu=torch.cuda.is_available(),
                           cpus_per_process=cfg.trainer.cpus_per_worker, name_prefix=f"{run_id}_pool",
                           detached=True)
    group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix=f"{WORKER_PREFIX}_{run_id}",
                           detached=True)
    workers = group.spawn(prefix_set=roles.keys())
    for role in roles:
        workers[role].init_model()
    info = {"run_id": run_id, "config_hash": cfg.config_hash(), "roles": sorted(roles),
            "worker_names": group.worker_names, "step": None, "started_at": time.time()}
    record = ray.remote(SessionRecord).options(name=SESSION_ACTOR, namespace=namespace_of(run_id),
                                               lifetime="detached", num_cpus=0).remote(info)
    workers.update(_group=group, _record=record, _info=info, _pool=pool)
    return workers


def stop(run_id: str) -> bool:
    """Kill the session's actors (its placement groups go with the namespace's actors)."""
    import ray

    try:
        record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
        info = ray.get(record.get.remote(), timeout=30)
    except Exception:
        return False
    for name in info["worker_names"]:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace_of(run_id)), no_restart=True)
        except Exception:
            pass
    ray.kill(record, no_restart=True)
    for pg_name in (f"{run_id}_pool_pg0",):
        try:
            ray.util.remove_placement_group(ray.util.get_placement_group(pg_name))
        except Exception:
            pass
    return True


def ensure(cfg: RunConfig, run_id: str) -> tuple[dict, bool]:
    """Attach to the live session, or (re)start it; returns (workers, started_now)."""
    workers = attach(cfg, run_id)
    if workers is not None:
        return workers, False
    stop(run_id)  # clear the remains of a broken session, if any
    return start(cfg, run_id), True
