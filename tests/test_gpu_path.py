"""The GPU path, checked on the CPU: which device a Ray worker binds.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlhf_core.controller import Worker
from rlhf_core.controller import worker as worker_module
from rlhf_core.controller.worker import local_device_index

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
