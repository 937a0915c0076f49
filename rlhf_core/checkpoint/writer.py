"""Writing a role's checkpoint: every rank's shards of model and optimizer through
``torch.distributed.checkpoint`` in the background, then its rank file (LR schedule, RNG
states), each file hashed as its bytes go out so the commit can record {file: sha256}.
Its reader is ``reader.py``."""

from __future__ import annotations

import io
import warnings

import torch

from rlhf_core.checkpoint.layout import RANK_FILE
from rlhf_core.distributed import sharding

# DCP without a process group (one process, ``no_dist``) warns on every save and load,
# from its writer thread too, that it assumes one process: that is what is meant
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized, assuming")


def _rng_states() -> dict:
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    states = {"torch": torch.get_rng_state(),
              "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)},
              "python": {"version": version, "state": list(py_state), "gauss": py_gauss}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


class _HashingFile:
    """A file being written whose sha256 is computed from the bytes as they go out. On an
    object store (``upload``) the bytes are kept and sent as one PUT when it closes: DCP
    writes tensor by tensor, and a stream to S3 would be many requests."""

    def __init__(self, raw, name: str, digests: dict, upload=None) -> None:
        import hashlib

        self._raw, self._name, self._digests, self._hash = raw, name, digests, hashlib.sha256()
        self._upload, self._closed = upload, False

    def write(self, data) -> int:
        self._hash.update(data)
        return self._raw.write(data)

    def close(self) -> None:
        if self._closed:  # DCP closes, then leaves the with-block
            return
        self._closed = True
        if self._upload is not None:
            self._upload(self._raw.getvalue())
        self._raw.close()
        self._digests[self._name] = self._hash.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _name(path) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


class _FsProxy:
    """The fsspec filesystem under a DCP writer, with ``open`` replaced (and
    ``on_rename`` told of renames); everything else passes through."""

    def __init__(self, inner, open, on_rename=None) -> None:
        self._inner, self._open, self._on_rename = inner, open, on_rename

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open(self, path, mode="rb", **kwargs):
        return self._open(path, mode, **kwargs)

    def rename(self, path, new_path, **kwargs):
        self._inner.rename(path, new_path, **kwargs)
        if self._on_rename is not None:
            self._on_rename(_name(path), _name(new_path))


def _writer(folder, digests: dict):
    """DCP's fsspec writer for ``folder``, recording the sha256 of every file it writes
    (by name, renames followed) while writing: no second read of the checkpoint."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # local disk: fsync each file; an object store has no fsync (DCP would sync the whole
    # machine's disks instead): an object exists, durably, once its PUT returned
    writer = FsspecWriter(folder.uri, sync_files=folder.is_local, **folder.storage_options)
    inner = writer.fs.fs

    def open(path, mode, **kwargs):
        if "w" not in mode:
            return inner.open(path, mode, **kwargs)
        if folder.is_local:
            return _HashingFile(inner.open(path, mode, **kwargs), _name(path), digests)
        return _HashingFile(io.BytesIO(), _name(path), digests, upload=lambda data: inner.pipe_file(str(path), data))

    def renamed(old: str, new: str) -> None:
        if old in digests:
            digests[new] = digests.pop(old)

    writer.fs.fs = _FsProxy(inner, open, renamed)
    return writer


def _folder(uri: str, role: str, storage_options: dict | None):
    from rlhf_core.snapshot import fs as sfs

    return sfs.resolve(f"{uri.rstrip('/')}/{role}", storage_options)


class PendingCheckpoint:
    """A rank's checkpoint being written in the background (``start_sharded``)."""

    def __init__(self, future, folder, role: str, rank: int, extra: bytes, storage_options, digests: dict) -> None:
        self.future, self.folder, self.role, self.rank = future, folder, role, rank
        self.extra, self.storage_options, self.digests = extra, storage_options, digests


def start_sharded(uri: str, role: str, model, optimizer, scheduler, storage_options: dict | None = None,
                  process_group=None, base: dict | None = None) -> PendingCheckpoint:
    """Copy this rank's shards aside and start writing them (``torch.distributed.checkpoint
    .async_save``); the schedule and RNG states are taken now too. ``base``: the identity
    ({"path", "sha256"}) of the frozen model a LoRA checkpoint's adapter was trained on,
    which its loads check (``reader.load_sharded``)."""
    import torch.distributed.checkpoint as dcp

    if process_group is None and sharding.world_size() > 1:
        # the writer thread's collectives would interleave with the caller's on the default group
        raise ValueError("a background checkpoint at world size > 1 needs a process group of its own")
    folder, digests = _folder(uri, role, storage_options), {}
    future = dcp.async_save(sharding.sharded_state(model, optimizer), storage_writer=_writer(folder, digests),
                            process_group=process_group, no_dist=sharding.world_size() == 1)
    return PendingCheckpoint(future, folder, role, sharding.rank(), _rank_file(scheduler, base), storage_options,
                             digests)


def _rank_file(scheduler, base: dict | None = None) -> bytes:
    extra = io.BytesIO()
    torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_states(), "world_size": sharding.world_size(),
                **({"base": dict(base)} if base else {})}, extra)
    return extra.getvalue()


def finish_sharded(pending: PendingCheckpoint) -> dict:
    """Wait for the shards, write the rank file; returns {"{role}/{file}": sha256} of what
    this rank wrote (its shard file, its rank file, and rank 0 the DCP metadata)."""
    from rlhf_core.snapshot import fs as sfs

    pending.future.result()
    folder, role, rank = pending.folder, pending.role, pending.rank
    digests = {f"{role}/{k}": v for k, v in sfs.write_durably(
        folder.uri, {RANK_FILE.format(rank): pending.extra}, pending.storage_options).items()}
    digests.update({f"{role}/{name}": digest for name, digest in pending.digests.items()
                    if name.startswith(f"__{rank}_") or name == ".metadata"})
    return digests
