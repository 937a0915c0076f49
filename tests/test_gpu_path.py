"""The GPU path, checked on the CPU: which device a Ray worker binds, that a GPU pool
refuses a node without CUDA, and the process-group backend FSDP's CPU offload needs.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.controller import Worker
from rlhf_core.controller import worker as worker_module
from rlhf_core.controller.worker import local_device_index
from rlhf_core.workers import devices, modeling, sharding

PROMPT, RESPONSE, ROWS = 6, 4, 4


def _config(tmp_path, extra=()) -> RunConfig:
    from rlhf_core.testing.model_folders import build_model_folder

    folder = tmp_path / "model"
    if not (folder / "config.json").exists():
        build_model_folder(folder)
    return apply_overrides(RunConfig(), [f"model.path={folder}", f"data.max_prompt_length={PROMPT}",
                                         f"rollout.response_length={RESPONSE}", "rollout.n=1",
                                         "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                                         "actor.use_kl_loss=true", "actor.entropy_coeff=0.01", *extra])


def _actor(tmp_path, extra=()):
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    return ActorRolloutRefWorker(_config(tmp_path, extra))


# ------------------------------------------------------------------ device index under Ray


@pytest.mark.parametrize("gpu_ids, visible, expected", [
    (["3"], "3", 0),                      # Ray narrows CUDA_VISIBLE_DEVICES to the worker's GPU
    (["GPU-b"], "GPU-b", 0),              # ... ids may be UUIDs
    (["3"], None, 3),                     # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, no mask
    (["3"], "0,1,2,3", 3),                # NOSET, the node's list
    (["6"], "4,5,6,7", 2),                # NOSET, a node restricted to some GPUs
    (["GPU-b"], "GPU-a,GPU-b", 1),
    ([], "0", None),                      # no GPU from Ray: CPU pools keep their LOCAL_RANK
])
def test_the_device_index_is_the_gpu_rays_ids_name_among_the_visible_ones(gpu_ids, visible, expected):
    assert local_device_index(gpu_ids, visible) == expected


def test_a_gpu_id_missing_from_the_visible_devices_is_one_line_naming_both():
    with pytest.raises(RuntimeError, match=r"^CUDA_VISIBLE_DEVICES: expected Ray's GPU ids \['5'\] among the "
                                           r"visible devices; found '0,1'$"):
        local_device_index(["5"], "0,1")


def test_a_worker_binds_local_rank_and_the_current_device_to_its_ray_gpu(monkeypatch):
    """The bundle index (1 here) is no device index: the worker's GPU is device 0."""
    chosen = []
    monkeypatch.setattr(worker_module, "_ray_gpu_ids", lambda: ["1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    Worker()
    assert os.environ["LOCAL_RANK"] == "0" and chosen == [0]


class Env(Worker):
    def env(self) -> dict:
        return {k: os.environ.get(k) for k in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}


def test_every_rank_of_a_gpu_pool_binds_device_zero_of_its_own_gpu(ray_local):
    """Ray (with fake GPUs) gives each rank its own GPU through CUDA_VISIBLE_DEVICES; the
    rank of bundle 1 must not ask for device 1 (CUDA: 'invalid device ordinal')."""
    from rlhf_core.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=True, name_prefix="bind", cpus_per_process=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Env), name_prefix="bind_env")
    try:
        envs = group.execute_all("env")
    finally:
        group.kill()
        pool.release()
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
    assert len({e["CUDA_VISIBLE_DEVICES"] for e in envs}) == 2  # two different GPUs


# ------------------------------------------------------------------ a GPU pool needs CUDA


def test_a_gpu_pool_without_cuda_is_one_line_naming_the_node():
    with pytest.raises(RuntimeError, match=r"^resources.gpus_per_node=8: expected CUDA on every training node; "
                                           r"node pod-7 has none \(torch.cuda.is_available\(\) is False.*"
                                           r"or set resources.gpus_per_node=0 to train on CPU$") as err:
        devices.require_cuda(8, "GPU", False, "pod-7")
    assert "\n" not in str(err.value)
    devices.require_cuda(8, "GPU", True, "pod-7")       # CUDA there
    devices.require_cuda(0, "GPU", False, "pod-7")      # a CPU pool
    devices.require_cuda(2, "sim_gpu", False, "pod-7")  # a custom accelerator resource (simulated nodes)


def test_the_actor_refuses_to_train_on_cpu_in_a_gpu_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker = _actor(tmp_path, ["resources.gpus_per_node=1"])
    with pytest.raises(RuntimeError, match=f"node {socket.gethostname()} has none"):
        worker.init_model()


# ------------------------------------------------------------------ the backend for CPU offload


@pytest.mark.parametrize("on_gpu, offload, expected", [
    (False, False, "gloo"), (False, True, "gloo"),       # CPU machines: gloo, offload is a no-op
    (True, False, "nccl"),
    (True, True, "cuda:nccl,cpu:gloo"),                   # offloaded gradients all-reduce on the CPU
])
def test_the_backend_adds_gloo_for_cpu_tensors_when_parameters_are_offloaded(on_gpu, offload, expected):
    assert devices.process_group_backend(on_gpu, offload) == expected


@pytest.mark.parametrize("offload, expected", [(False, "nccl"), (True, "cuda:nccl,cpu:gloo")])
def test_a_worker_joins_with_the_backend_its_offload_needs(monkeypatch, offload, expected):
    joined = []
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: joined.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sharding, "wrap", lambda model, spec, trainable=True: model)
    modeling.init_distributed_model(Worker(), torch.nn.Linear(2, 2), sharding.ShardingSpec(param_offload=offload))
    assert joined == [expected]
