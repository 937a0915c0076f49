"""Single-controller machinery: resource pools, workers, @register dispatch, worker groups.

Names follow verl (``Worker``, ``register``, ``Dispatch``, ``Execute``, ``RayResourcePool``,
``RayClassWithInitArgs``, ``RayWorkerGroup``, ``create_colocated_worker_cls``) so that
ported workers keep working; the implementation is this project's own.
"""

from rlhf_core.controller.dispatch import (
    Dispatch,
    Execute,
    StaleClaimError,
    get_dispatch_mode,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
)
from rlhf_core.controller.resource_pool import RayResourcePool, ResourcePool, ResourcePoolError
from rlhf_core.controller.worker import Worker
from rlhf_core.controller.worker_group import (
    RayClassWithInitArgs,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerError,
    create_colocated_worker_cls,
    ray_get_ranked,
)

__all__ = [
    "Dispatch", "Execute", "register", "register_dispatch_mode", "get_dispatch_mode",
    "make_nd_compute_dataproto_dispatch_fn", "ResourcePool", "RayResourcePool",
    "ResourcePoolError", "Worker", "RayClassWithInitArgs", "RayWorkerGroup", "WorkerError",
    "WorkerDiedError", "create_colocated_worker_cls", "ray_get_ranked", "StaleClaimError",
]
