"""Which CUDA device a process's GPU is: Ray hands a worker GPU ids, the process numbers
the devices it can see (torch's DeviceMesh and vLLM's external launcher call
``set_device(LOCAL_RANK)``, so LOCAL_RANK must be that number)."""

from __future__ import annotations


def local_device_index(gpu_ids: list[str], visible_devices: str | None) -> int | None:
    """The CUDA device index of this worker's GPU, as this process numbers its devices.

    ``gpu_ids`` are the GPU ids Ray assigned the worker (its runtime context's accelerator
    ids); ``visible_devices`` is the process's ``CUDA_VISIBLE_DEVICES``. Ray narrows that
    variable to the assigned ids, so a one-GPU worker's device is 0 whatever its
    placement-group bundle; with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it is left
    as the node's list (or unset), and the device is the id's place in it (or the id
    itself). None when Ray assigned no GPU (CPU pools, custom accelerator resources).
    """
    if not gpu_ids:
        return None
    if not visible_devices:
        return min(int(i) for i in gpu_ids)  # no mask: Ray's ids are the devices' own indices
    visible = [v.strip() for v in visible_devices.split(",")]
    missing = [i for i in gpu_ids if i not in visible]
    if missing:
        raise RuntimeError(f"CUDA_VISIBLE_DEVICES: expected Ray's GPU ids {sorted(gpu_ids)} among the visible "
                           f"devices; found {visible_devices!r}")
    return min(visible.index(i) for i in gpu_ids)
