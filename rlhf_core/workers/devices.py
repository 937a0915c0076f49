"""Where a worker's tensors live: batches in on the worker's device, results out on the host.

The controller sends and receives CPU tensors (Ray serializes them; the driver may have no
GPU). A worker moves a stage's input batch to its device before the forward and hands its
outputs back on the CPU. On a CPU worker both moves are no-ops (the same tensor objects),
so CPU runs compute exactly what they computed before.

Also here: what a GPU pool requires of a worker (CUDA, or a one-line error naming the node)
and the process-group backend its sharding needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlhf_core.distributed import sharding

if TYPE_CHECKING:  # the bare GPU smoke imports this module where tensordict is not installed
    from rlhf_core.protocol import DataProto


def to_device(data: "DataProto") -> "DataProto":
    """``data`` with its tensors on this worker's device (``sharding.device()``): a new
    DataProto sharing the object columns and meta_info; ``data`` itself on a CPU worker."""
    device = sharding.device()
    if device.type == "cpu" or data.batch is None:
        return data
    from rlhf_core.protocol import DataProto

    tensors = {key: value.to(device, non_blocking=True) for key, value in data.batch.items()}
    return DataProto.from_dict(tensors, data.non_tensor_batch, data.meta_info)


def to_host(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The tensors on the CPU, for the controller (the same objects when already there)."""
    return {key: None if value is None else value.cpu() for key, value in tensors.items()}


def require_cuda(gpus_per_node: int, accelerator_resource: str, cuda_available: bool, node: str) -> None:
    """A pool that reserves GPUs must find CUDA on every worker: without it torch would
    quietly train on the CPU over gloo (a node whose container runtime mounted no driver)."""
    if gpus_per_node > 0 and accelerator_resource == "GPU" and not cuda_available:
        raise RuntimeError(f"resources.gpus_per_node={gpus_per_node}: expected CUDA on every training node; "
                           f"node {node} has none (torch.cuda.is_available() is False, torch "
                           f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}): check its NVIDIA "
                           f"driver and NVIDIA_DRIVER_CAPABILITIES=compute,utility, or set "
                           f"resources.gpus_per_node=0 to train on CPU")


def process_group_backend(on_gpu: bool) -> str:
    """The ``init_process_group`` backend: gloo on CPU; on GPU NCCL for CUDA tensors and
    gloo for CPU ones, at every world size (torchtitan's way). CPU tensors meet a
    collective more often than it seems: the background checkpoint writer
    (``dcp.async_save`` refuses a group without a CPU backend, even at one rank), and with
    ``param_offload`` the gradients, whose norm is all-reduced on the CPU."""
    if not on_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo"
