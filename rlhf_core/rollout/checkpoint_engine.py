"""The checkpoint engine: the trainer's weights to rollout replicas on a pool of their own.

The actor's first rank and every replica rank form a process group of their own (a TCP
store the sender hosts, apart from the trainer's torch.distributed world; gloo on CPU,
NCCL on GPU, verl's ``rollout.checkpoint_engine.backend``). The weights go as bucketed
broadcasts: tensors packed into a buffer of at most ``update_weights_bucket_megabytes``
(a tensor larger than that goes alone), each bucket announced by a JSON header (names,
dtypes, shapes, offsets; no pickle), so no rank ever holds the whole model for the
transfer. The last header says the version: a receiver counts the weights as that version
only once the last bucket is in.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Iterable, Iterator

import torch

#: byte alignment of each tensor in a bucket (a view of any dtype starts aligned)
ALIGN = 64


class WeightGroup:
    """One process group between the sender (rank 0) and the replicas' ranks."""

    def __init__(self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float = 600.0,
                 store=None) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.backend = rank, size, backend
        timeout = timedelta(seconds=timeout_s)
        self.store = store if store is not None else dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("rlhf-weights", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
            self.device = torch.device("cpu")

    @staticmethod
    def host_store(host: str, size: int, timeout_s: float = 600.0):
        """The sender's store on a free port (returned with it: the replicas connect there)."""
        import torch.distributed as dist

        store = dist.TCPStore(host, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return store, store.port

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast(tensor, 0).wait()
        return tensor


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint engine: expected a torch dtype in a bucket header; found {name!r}")
    return dtype


def _send_bucket(group: WeightGroup, entries: list, payload: list[torch.Tensor], size: int, last: bool,
                 version: int) -> int:
    header = json.dumps({"tensors": entries, "bytes": size, "last": last, "version": version}).encode()
    group.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=group.device))
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
    buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
    for (_, _, _, offset, nbytes), tensor in zip(entries, payload):
        buffer[offset:offset + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(group.device)
    group.broadcast(buffer)
    return size


def send(group: WeightGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
         version: int) -> int:
    """Broadcast every tensor of ``named_tensors`` in buckets (sender side); returns the
    bytes sent. The stream is consumed one tensor at a time (gathered ones can go)."""
    entries, payload, used, sent = [], [], 0, 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if payload and used + nbytes > bucket_bytes:
            sent += _send_bucket(group, entries, payload, used, False, version)
            entries, payload, used = [], [], 0
        entries.append([name, str(tensor.dtype), list(tensor.shape), used, nbytes])
        payload.append(tensor)
        used += -(-nbytes // ALIGN) * ALIGN
    return sent + _send_bucket(group, entries, payload, used, True, version)


def receive(group: WeightGroup, on_version=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as they arrive (receiver side), views into the current bucket: the
    consumer copies each before asking for the next bucket. ``on_version(v)`` is called
    once the last bucket has been consumed."""
    while True:
        length = group.broadcast(torch.zeros(1, dtype=torch.int64, device=group.device))
        raw = group.broadcast(torch.empty(int(length.item()), dtype=torch.uint8, device=group.device))
        header = json.loads(bytes(raw.cpu().numpy()))
        buffer = group.broadcast(torch.empty(int(header["bytes"]), dtype=torch.uint8, device=group.device))
        for name, dtype, shape, offset, nbytes in header["tensors"]:
            yield name, buffer[offset:offset + nbytes].view(_dtype(dtype)).reshape(shape)
        if header["last"]:
            if on_version is not None:
                on_version(int(header["version"]))
            return
