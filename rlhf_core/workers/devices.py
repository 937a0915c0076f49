"""What a worker's device requires: CUDA in a GPU pool (or a one-line error naming the
node) and the process-group backend its sharding needs.
"""

from __future__ import annotations

import torch


def require_cuda(gpus_per_node: int, accelerator_resource: str, cuda_available: bool, node: str) -> None:
    """A pool that reserves GPUs must find CUDA on every worker: without it torch would
    quietly train on the CPU over gloo (a node whose container runtime mounted no driver)."""
    if gpus_per_node > 0 and accelerator_resource == "GPU" and not cuda_available:
        raise RuntimeError(f"resources.gpus_per_node={gpus_per_node}: expected CUDA on every training node; "
                           f"node {node} has none (torch.cuda.is_available() is False, torch "
                           f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}): check its NVIDIA "
                           f"driver and NVIDIA_DRIVER_CAPABILITIES=compute,utility, or set "
                           f"resources.gpus_per_node=0 to train on CPU")


def process_group_backend(on_gpu: bool, param_offload: bool) -> str:
    """The ``init_process_group`` backend: gloo on CPU, NCCL on GPU, and both when FSDP
    offloads parameters: their gradients then stay on the CPU, and the gradient-norm
    all-reduce (and whole-state gathers) run on CPU tensors, which NCCL cannot carry
    (torchtitan adds ``cpu:gloo`` for CPU offload the same way)."""
    if not on_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if param_offload else "nccl"
