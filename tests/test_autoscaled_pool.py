"""A pool on a KubeRay cluster whose idle workers were scaled to zero: only the head is a
live Ray node, and the capacity check must let the pool through (its placement group is
what makes KubeRay's autoscaler start the workers), yet still refuse a pool no node group
can ever hold. The nodes the autoscaler may start reach the check through the head's
RLHF_AUTOSCALER_NODES, rendered from the worker groups (rayStartParams, maxReplicas)."""

import json

import pytest
import ray

from components.kuberay.render import render_raycluster
from components.kuberay.spec import KubeSpec
from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.controller.resource_pool import RayResourcePool, ResourcePoolError
from rlhf_core.workers.worker_set import pool_plan

AUTOSCALER_NODES_ENV = "RLHF_AUTOSCALER_NODES"  # the contract between render.py and the pool
HEAD_ONLY = [{"NodeID": "h", "Alive": True, "Resources": {"CPU": 0.0, "memory": 8e9}},
             {"NodeID": "w-gone", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}]


def gpu_run(*more) -> RunConfig:
    return apply_overrides(RunConfig(), ["actor.world_size=16", "resources.nnodes=2", "resources.gpus_per_node=8",
                                         "resources.cpus_per_node=64", *more]).validate()


def head_env(cfg: RunConfig) -> dict:
    body = render_raycluster(cfg, KubeSpec(node_gpus=8).validate(), "nightly")
    head = body["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in head["env"] if "value" in e}


def session_pool(cfg: RunConfig) -> RayResourcePool:
    """The train pool as WorkerSet.build shapes it."""
    plan = pool_plan(cfg)[0]
    return RayResourcePool(list(plan.process_on_nodes), use_gpu=True, cpus_per_process=cfg.trainer.cpus_per_worker,
                           name_prefix="rlhf_pool")


def test_the_head_renders_the_nodes_the_autoscaler_may_start():
    env = head_env(gpu_run())
    assert json.loads(env[AUTOSCALER_NODES_ENV]) == [{"resources": {"CPU": 64, "GPU": 8}, "max": 2}]


def test_a_pool_the_autoscaler_can_grow_into_passes_the_check_with_only_the_head_alive(monkeypatch):
    cfg = gpu_run()
    monkeypatch.setattr(ray, "nodes", lambda: HEAD_ONLY)
    monkeypatch.delenv(AUTOSCALER_NODES_ENV, raising=False)
    with pytest.raises(ResourcePoolError, match=r"needs 2 node\(s\) holding \[8, 8\] slots .* hold \[0\] such slots$"):
        session_pool(cfg)._check_capacity()  # no autoscaler: refused at once, as before
    monkeypatch.setenv(AUTOSCALER_NODES_ENV, head_env(cfg)[AUTOSCALER_NODES_ENV])
    session_pool(cfg)._check_capacity()  # the session's driver on the head: accepted


def test_a_pool_larger_than_the_autoscaler_can_grow_is_still_refused(monkeypatch):
    monkeypatch.setattr(ray, "nodes", lambda: HEAD_ONLY)
    monkeypatch.setenv(AUTOSCALER_NODES_ENV, head_env(gpu_run())[AUTOSCALER_NODES_ENV])  # 2 nodes of 8 GPUs
    bigger = session_pool(gpu_run("actor.world_size=24", "resources.nnodes=3"))
    with pytest.raises(ResourcePoolError, match=r"needs 3 node\(s\) holding \[8, 8, 8\] slots .* hold \[0\] such "
                                                r"slots; the autoscaler's node groups .* hold at most \[8, 8\]"):
        bigger._check_capacity()


@pytest.mark.parametrize("value", ["{}", "[{\"resources\": {\"CPU\": 4}}]", "not json"])
def test_a_malformed_autoscaler_description_is_refused_in_one_line(monkeypatch, value):
    from rlhf_core.controller.resource_pool import autoscaler_nodes_from_env

    monkeypatch.setenv(AUTOSCALER_NODES_ENV, value)
    with pytest.raises(ValueError, match=f"{AUTOSCALER_NODES_ENV}: expected a JSON list of .*; found"):
        autoscaler_nodes_from_env()
