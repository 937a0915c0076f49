"""The checkpoint engine: the trainer's weights to rollout replicas on a pool of their own.

The actor's first rank and every replica rank form a process group of their own (a TCP
store the sender hosts, apart from the trainer's torch.distributed world; gloo on CPU,
NCCL on GPU, verl's ``rollout.checkpoint_engine.backend``). The weights go as bucketed
broadcasts: tensors packed into a buffer of at most ``update_weights_bucket_megabytes``
(a tensor larger than that goes alone), each bucket announced by a JSON header (names,
dtypes, shapes, offsets; no pickle), so no rank ever holds the whole model for the
transfer. The last header says the version: a receiver counts the weights as that version
only once the last bucket is in.

When every member is on the sender's node (a CPU machine, or replicas on the trainer's
node), a bucket's bytes do not go through the group's sockets: the sender packs it into a
shared-memory file only its user can read (``/dev/shm``), the header names the file, each
receiver copies the tensors out of its mapping, and a barrier frees the bucket for the
next. Otherwise (or with NCCL, whose broadcast is the device's own link) the bucket is
broadcast.
"""

from __future__ import annotations

import json
import os
import tempfile
import weakref
from datetime import timedelta
from typing import Iterable, Iterator

import torch

#: byte alignment of each tensor in a bucket (a view of any dtype starts aligned)
ALIGN = 64


class WeightGroup:
    """One process group between the sender (rank 0) and the replicas' ranks."""

    def __init__(self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float = 600.0,
                 store=None, node: str | None = None) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.backend = rank, size, backend
        self.node = node or _node()
        self._shared: dict = {}  # shared-memory buckets: path -> the mapped tensor
        self._same_node: bool | None = None
        timeout = timedelta(seconds=timeout_s)
        self.store = store if store is not None else dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore("rlhf-weights", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
            self.device = torch.device("cpu")
        if rank:
            self.store.set(f"rlhf-weights-node-{rank}", self.node)

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

    def barrier(self):
        """Every member has reached this point (returns the pending work: wait on it)."""
        return self.pg.allreduce([torch.zeros(1, device=self.device)])

    def shares_memory(self) -> bool:
        """(Sender) whether every member runs on this node, with gloo: buckets go through
        shared memory."""
        if self._same_node is None:
            nodes = {self.store.get(f"rlhf-weights-node-{r}").decode() for r in range(1, self.size)}
            self._same_node = (self.backend == "gloo" and nodes <= {self.node}
                               and os.access("/dev/shm", os.W_OK))
        return self._same_node

    def shared_bucket(self, nbytes: int, slot: int = 0, path: str | None = None) -> tuple[str, torch.Tensor]:
        """A shared-memory buffer of at least ``nbytes``: the sender's for ``slot`` (two
        alternate, so one is packed while the other is read; created mode 0600, removed
        when the group goes), or a receiver's mapping of ``path``."""
        if path is None:
            held = self._shared.get(slot)
            if held is not None and held[1].numel() >= nbytes:
                return held
            if not self._shared:
                _remove_orphans()
            # the sender's pid in the name: a bucket whose sender was killed (no finalizer
            # ran) is found and removed by the next sender on the node
            fd, path = tempfile.mkstemp(prefix=f"rlhf-weights-{os.getpid()}-", dir="/dev/shm")
            os.ftruncate(fd, max(nbytes, 1))
            os.close(fd)
            weakref.finalize(self, _remove, path)
            if held is not None:  # the smaller buffer is not used again
                _remove(held[0])
            self._shared[slot] = (path, torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8))
            return self._shared[slot]
        if not (os.path.dirname(path) == "/dev/shm" and os.path.basename(path).startswith("rlhf-weights-")):
            raise ValueError(f"checkpoint engine: expected a bucket under /dev/shm/rlhf-weights-*; found {path!r}")
        mapped = self._shared.get(path)
        if mapped is None or mapped.numel() < nbytes:
            if len(self._shared) >= 4:  # buffers the sender has replaced
                self._shared.clear()
            mapped = self._shared[path] = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return path, mapped


def _node() -> str:
    import socket

    return socket.gethostname()


def _remove_orphans(folder: str = "/dev/shm") -> list[str]:
    """Remove this user's buckets whose sending process is gone (a SIGKILL runs no
    finalizer); returns their paths. Another user's files and live senders' are left."""
    removed = []
    for name in os.listdir(folder):
        parts = name.split("-")
        if not (name.startswith("rlhf-weights-") and len(parts) >= 4 and parts[2].isdigit()):
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            _remove(path)
            removed.append(path)
        except OSError:  # gone already, or a live process of another user: not ours to judge
            continue
    return removed


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint engine: expected a torch dtype in a bucket header; found {name!r}")
    return dtype


def _send_bucket(group: WeightGroup, entries: list, payload: list[torch.Tensor], size: int, last: bool,
                 version: int, pending: list) -> int:
    shared = None
    if group.shares_memory():
        slot = len(pending) % 2
        if len(pending) >= 2:
            pending[-2].wait()  # the receivers have copied the bucket that used this slot
        shared, buffer = group.shared_bucket(size, slot)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
    for (_, _, _, offset, nbytes), tensor in zip(entries, payload):
        buffer[offset:offset + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(group.device)
    header = json.dumps({"tensors": entries, "bytes": size, "last": last, "version": version,
                         "shared": shared}).encode()
    group.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=group.device))
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(group.device))
    if shared is None:
        group.broadcast(buffer[:size])
    else:
        pending.append(group.barrier())  # done when every receiver has copied the bucket out
        if last:
            pending[-1].wait()
    return size


def send(group: WeightGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
         version: int) -> int:
    """Broadcast every tensor of ``named_tensors`` in buckets (sender side); returns the
    bytes sent. The stream is consumed one tensor at a time (gathered ones can go)."""
    entries, payload, used, sent, pending = [], [], 0, 0, []
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if payload and used + nbytes > bucket_bytes:
            sent += _send_bucket(group, entries, payload, used, False, version, pending)
            entries, payload, used = [], [], 0
        entries.append([name, str(tensor.dtype), list(tensor.shape), used, nbytes])
        payload.append(tensor)
        used += -(-nbytes // ALIGN) * ALIGN
    return sent + _send_bucket(group, entries, payload, used, True, version, pending)


def receive(group: WeightGroup, on_version=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as they arrive (receiver side), views into the current bucket: the
    consumer copies each before asking for the next bucket. ``on_version(v)`` is called
    once the last bucket has been consumed."""
    while True:
        length = group.broadcast(torch.zeros(1, dtype=torch.int64, device=group.device))
        raw = group.broadcast(torch.empty(int(length.item()), dtype=torch.uint8, device=group.device))
        header = json.loads(bytes(raw.cpu().numpy()))
        if header.get("shared"):
            _, buffer = group.shared_bucket(int(header["bytes"]), path=header["shared"])
        else:
            buffer = group.broadcast(torch.empty(int(header["bytes"]), dtype=torch.uint8, device=group.device))
        for name, dtype, shape, offset, nbytes in header["tensors"]:
            yield name, buffer[offset:offset + nbytes].view(_dtype(dtype)).reshape(shape)
        if header.get("shared"):
            group.barrier().wait()  # this bucket's tensors are copied: the sender may reuse its slot
        if header["last"]:
            if on_version is not None:
                on_version(int(header["version"]))
            return
