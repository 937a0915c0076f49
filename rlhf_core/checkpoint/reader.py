"""Reading a role's checkpoint (its writer is ``writer.py``): from the store as data, never as code.

Every file is fetched once, its sha256 compared with the one its commit recorded (the
manifest of the iteration that wrote it; for step 0 the initial checkpoint's own
commit), and only those bytes are used afterwards: a second fetch could return other
bytes. Nothing is unpickled before that check, and what is unpickled cannot name code:

- DCP's ``.metadata`` is a pickle (DCP reads it with ``pickle.load``): it goes through an
  unpickler that admits only the classes checkpoint metadata is made of;
- DCP's non-tensor items (the optimizer's hyperparameters) are read with
  ``torch.load(weights_only=True)``; DCP's own planner uses ``weights_only=False``;
- tensors and the rank files are ``torch.load(weights_only=True)`` already.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rlhf_core.distributed import sharding

METADATA = ".metadata"


class CheckpointRefusedError(ValueError):
    """A checkpoint that is not loaded; the message (one line) names the file and why."""


class CorruptCheckpointError(CheckpointRefusedError):
    """A checkpoint file whose bytes are not the ones its commit recorded, or are not what
    a checkpoint file holds."""


# What a DCP .metadata pickle is made of (torch 2.x): the metadata dataclasses, the
# storage info of the filesystem writer, torch.Size, dtypes and layouts (by name).
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layouts by name
}


def _admitted(module: str, name: str) -> bool:
    if name in _METADATA_CLASSES.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if not _admitted(module, name):
            raise CorruptCheckpointError(f"{self.where}: the DCP metadata names {module}.{name}; only the classes "
                                         f"checkpoint metadata is made of are admitted")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise CorruptCheckpointError(f"{self.where}: the DCP metadata holds a persistent id; expected none")


def load_metadata(data: bytes, where: str) -> Metadata:
    """DCP's ``.metadata`` from its bytes, through the allow-list unpickler."""
    try:
        metadata = _MetadataUnpickler(data, where).load()
    except CheckpointRefusedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is one refusal
        raise CorruptCheckpointError(f"{where}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: expected DCP Metadata; found {type(metadata).__name__}")
    return metadata


class CheckedFiles:
    """The committed files of one checkpoint as this process uses them: ``expected`` is
    {path inside the checkpoint: sha256} as its commit recorded it; each file is fetched
    once, checked, and its bytes kept. A file the commit does not list is never read."""

    def __init__(self, root, expected: dict[str, str]) -> None:
        self.root, self.expected = root, dict(expected)
        self._data: dict[str, bytes] = {}

    def problem(self, name: str) -> str | None:
        """Fetch and check ``name``: None when its bytes are the committed ones (kept),
        else the reason, in one line."""
        if name in self._data:
            return None
        where = f"{self.root.uri}/{name}"
        if name not in self.expected:
            return f"{where}: not a file its commit lists; only committed files are read"
        try:
            data = self.root.fs.cat_file(self.root.child(name).path)
        except FileNotFoundError:
            return f"{where}: missing; its commit lists it"
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.expected[name]:
            return (f"{where}: sha256 {digest[:16]}... is not the {self.expected[name][:16]}... its iteration "
                    f"committed; the checkpoint was changed or damaged after the commit")
        self._data[name] = data
        return None

    def get(self, name: str) -> bytes:
        """The checked bytes of ``name`` (fetched and checked now if not yet)."""
        problem = self.problem(name)
        if problem is not None:
            raise CorruptCheckpointError(problem)
        return self._data[name]

    def metadata(self, folder: str) -> Metadata:
        """The DCP metadata of the sharded state under ``folder`` (a role's)."""
        return load_metadata(self.get(f"{folder}/{METADATA}"), f"{self.root.uri}/{folder}/{METADATA}")


class _CheckedFs:
    """The fsspec filesystem under a DCP reader with ``open`` serving checked bytes only."""

    def __init__(self, inner, files: CheckedFiles, folder: str) -> None:
        self._inner, self._files, self._folder = inner, files, folder

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open(self, path, mode="rb", **kwargs):
        if "r" not in mode or "+" in mode:
            raise CheckpointRefusedError(f"{path}: a checkpoint reader opened it with mode {mode!r}; expected 'rb'")
        # the last path component only: whatever path the metadata names, the bytes served
        # are a committed file of this folder
        return io.BytesIO(self._files.get(f"{self._folder}/{str(path).rstrip('/').rsplit('/', 1)[-1]}"))


class CheckedReader(FsspecReader):
    """DCP's fsspec reader of the sharded state under ``folder`` of a checkpoint that
    reads nothing but checked bytes: the metadata given (parsed by ``load_metadata``),
    every other file through ``files``."""

    def __init__(self, files: CheckedFiles, folder: str, metadata: Metadata) -> None:
        root = files.root.child(folder)
        super().__init__(root.uri, **root.storage_options)
        self.fs.fs = _CheckedFs(self.fs.fs, files, folder)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never asks for per-rank metadata
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with its non-tensor items read by
    ``torch.load(weights_only=True)`` (plain containers and numbers: the optimizer's
    hyperparameters) instead of ``weights_only=False``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CorruptCheckpointError(f"non-tensor item {read_item.dest_index.fqn}: refused by "
                                         f"torch.load(weights_only=True): {str(exc).splitlines()[0]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = states["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if torch.cuda.is_available() and "cuda" in states and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def _checked_by(names: list[str], rank: int, world: int, always: tuple[str, ...] = ()) -> list[str]:
    """The committed files rank ``rank`` reads and checks before anything is loaded: what
    it will use itself (``always``: the DCP metadata every rank unpickles, its rank file;
    its own shard file, the one it loads at an unchanged world size) and a round-robin
    share of the rest, so that together the ranks check every file."""
    own, rest = [n for n in always if n in names], []
    for name in sorted(names):
        if name in always:
            continue
        match = re.match(r"__(\d+)_", name.rsplit("/", 1)[-1])
        if match and int(match.group(1)) < world:
            if int(match.group(1)) == rank:
                own.append(name)
        else:
            rest.append(name)
    return own + rest[rank::world]


def other_base_problem(rank_file: dict, base: dict, where: str) -> str | None:
    """The one-line refusal of an adapter checkpoint (``where``) whose rank file records
    another base than ``base`` ({"path", "sha256"}); None if it is the same, or none is
    recorded (a full fine-tune's)."""
    saved = rank_file.get("base") if isinstance(rank_file, dict) else None
    if not isinstance(saved, dict) or saved.get("sha256") == base.get("sha256"):
        return None
    return (f"model.path: expected the base model the adapter in {where} was trained on ({saved.get('path')}, "
            f"content sha256 {str(saved.get('sha256'))[:16]}...); found {base.get('path')} (content sha256 "
            f"{str(base.get('sha256'))[:16]}...)")


def load_sharded(uri: str, role: str, model, optimizer, scheduler, storage_options: dict | None = None,
                 expected: dict | None = None, base: dict | None = None) -> None:
    """Load the role's checkpoint into this rank's shards, at any world size, from bytes
    checked against ``expected`` ({"{role}/{file}": sha256}, as the checkpoint's commit
    recorded it): every committed file is checked by some rank before anything is loaded,
    and each rank loads only bytes it fetched and checked itself (``CheckedFiles``).
    ``base``: the identity ({"path", "sha256"}) of the frozen model under this rank's
    adapter; a checkpoint whose rank file records another base is refused, on every rank."""
    import torch.distributed.checkpoint as dcp

    from rlhf_core.snapshot import fs as sfs

    rank, world = sharding.rank(), sharding.world_size()
    if not expected:
        raise CheckpointRefusedError(
            f"{uri}: no committed checksums; a checkpoint is loaded only from files whose sha256 its commit records")
    files = CheckedFiles(sfs.resolve(uri, storage_options), expected)
    names = [n for n in expected if n.startswith(f"{role}/")]
    # the same rank's RNG and schedule; at another world size, rank r takes saved rank r mod N
    saved_ranks = sorted(n for n in names if re.fullmatch(rf"{role}/rank-\d+\.pt", n))
    if not saved_ranks:
        raise CorruptCheckpointError(f"{uri}/{role}: its commit lists no rank file (rank-NNNNN.pt); "
                                                  f"expected one per saved rank")
    rank_file = saved_ranks[rank % len(saved_ranks)]
    used = (f"{role}/{METADATA}", rank_file)
    bad = [p for p in map(files.problem, _checked_by(names, rank, world, always=used)) if p is not None]
    metadata = extra = None
    other_base = []  # not corrupt: refused
    if not bad:
        try:
            metadata = files.metadata(role)
        except CheckpointRefusedError as exc:
            bad.append(str(exc))
        extra = torch.load(io.BytesIO(files.get(rank_file)), weights_only=True)  # tensors and plain containers
        problem = base is not None and other_base_problem(extra, base, f"{uri}/{role}")
        if problem:
            other_base.append(problem)
    found = sharding.all_gather_objects((bad, other_base))
    bad, other_base = [b for each, _ in found for b in each], [b for _, each in found for b in each]
    if other_base and not bad:
        raise CheckpointRefusedError(other_base[0])
    if bad:
        raise CorruptCheckpointError(
            bad[0] + (f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""))
    state = sharding.sharded_state(model, optimizer)
    dcp.load(state, storage_reader=CheckedReader(files, role, metadata),
             planner=WeightsOnlyPlanner(), no_dist=world == 1)
    sharding.set_sharded_state(model, optimizer, state)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_states(extra["rng"])
