"""The Worker base class: one process (Ray actor) of a WorkerGroup.

A worker knows its rank and world size, where rank 0 listens for ``torch.distributed``
rendezvous, and, for nd-mesh layouts, its dp rank and whether it is the rank whose output
is collected. Subclasses hold state (models, optimizers, engines) and expose methods with
``@register``.
"""

from __future__ import annotations

import datetime
import os
import tempfile

from rlhf_core.controller.dispatch import Dispatch, register
from rlhf_core.runtime.gpus import local_device_index


# Environment a WorkerGroup sets on each actor (torch.distributed's env:// contract).
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: One id per worker group, the same on every rank: names the group's rendezvous file
#: when every rank runs on this machine.
RENDEZVOUS_ENV = "RLHF_RDZV_ID"


def rendezvous_file(rendezvous: str):
    """Where the ranks of a group on one machine meet (``Worker.init_process_group``); the
    group removes it when it stops (a killed rank never does)."""
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"rlhf-rdzv-{rendezvous}"


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def _ray_gpu_ids() -> list[str]:
    """The GPU ids Ray assigned this process ([] outside a Ray worker, and for a driver)."""
    import sys

    ray = sys.modules.get("ray")  # a Ray worker process has imported it; anything else is no Ray actor
    if ray is None or not ray.is_initialized():
        return []
    return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class Worker:
    """Base class of every role worker.

    ``self.rank`` / ``self.world_size`` come from the environment the WorkerGroup set, so
    the same class runs under Ray and under ``torchrun`` alike.
    """

    def __init__(self) -> None:
        self._rank = int(os.environ.get("RANK", "0"))
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._dispatch_info: dict[str, int] = {}
        self._collect_info: dict[str, bool] = {}
        self._bind_gpu()

    def _bind_gpu(self) -> None:
        """Point LOCAL_RANK (and torch's current device) at the GPU Ray gave this worker:
        torch's DeviceMesh and vLLM's external launcher call ``set_device(LOCAL_RANK)``."""
        index = local_device_index(_ray_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if index is None:
            return  # no GPU from Ray: torchrun's LOCAL_RANK, or a CPU pool's bundle index, stands
        os.environ["LOCAL_RANK"] = str(index)
        import torch

        if torch.cuda.is_available():  # without CUDA, training's init_model names the node
            torch.cuda.set_device(index)

    # ---------------------------------------------------------------- identity

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fence(self) -> None:
        """Nothing but the claim the call carries: once every rank ran it, every rank
        refuses the calls of an earlier claim (``WorkerSet.fence``)."""

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Declare this rank's place in an nd mesh: its dp rank (which data chunk it gets)
        and whether its output is the one collected for that dp group."""
        self._dispatch_info[mesh_name] = int(dp_rank)
        self._collect_info[mesh_name] = bool(is_collect)

    def _query_dispatch_info(self, mesh_name: str) -> int:
        if mesh_name not in self._dispatch_info:
            raise KeyError(f"rank {self.rank} has not registered mesh {mesh_name!r}; call "
                           f"_register_dispatch_collect_info in __init__ (known: {sorted(self._dispatch_info)})")
        return self._dispatch_info[mesh_name]

    def _query_collect_info(self, mesh_name: str) -> bool:
        self._query_dispatch_info(mesh_name)
        return self._collect_info[mesh_name]

    def _get_master_addr_port(self) -> tuple[str, int]:
        """Rank 0 picks where the process group rendezvouses (its node IP, a free port)."""
        from rlhf_core.runtime.net import free_port

        return node_ip(), free_port("")

    # ---------------------------------------------------------------- distributed

    def init_process_group(self, backend: str | None = None, timeout_s: float = 600.0) -> str:
        """Join this group's ``torch.distributed`` process group (NCCL on GPU, gloo on CPU).

        Uses RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by the WorkerGroup. Returns the
        backend used. ``timeout_s`` bounds collectives, so a dead peer becomes an error
        instead of a hang.
        """
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_backend()
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise RuntimeError(f"rank {self.rank}: {missing} not set; was this worker started by a "
                               f"RayWorkerGroup (or torchrun)?")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_method = "env://"
        if _is_loopback(os.environ["MASTER_ADDR"]) and os.environ.get(RENDEZVOUS_ENV):
            # every rank on this machine: rendezvous through a file, not a TCP store (which
            # listens on every interface), and gloo's pairs on the loopback interface
            init_method = f"file://{rendezvous_file(os.environ[RENDEZVOUS_ENV])}"
            if os.path.exists("/sys/class/net/lo"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend=backend, init_method=init_method, rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        return backend

