"""Writing a snapshot: encode columns, write zarr under a private prefix, commit last."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlhf_core.protocol.dtypes import RAW_BITS, to_bits

from rlhf_core.protocol import DataProto, UnsupportedObjectError
from rlhf_core.protocol.wire import to_json_value
from rlhf_core.snapshot import fs as sfs
from rlhf_core.runtime import probes
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.snapshot.layout import (
    DATA_PREFIX, FORMAT, MANIFEST_NAME, SCHEMA_VERSION, field_path, shard_parts,
)

if TYPE_CHECKING:
    from rlhf_core.snapshot.reader import SnapshotInfo

#: Target uncompressed bytes of one inner chunk (the unit a partial read fetches) and of
#: one shard (the unit written as one object). Small chunks keep one-sample reads cheap;
#: big shards keep object-store request counts low.
INNER_CHUNK_BYTES = 1024 * 1024
SHARD_BYTES = 256 * 1024 * 1024
#: Blosc settings for tensor fields: byte-shuffle + a fast codec. Object stores are
#: bandwidth-bound, so fewer bytes usually beat a cheaper codec (benchmarks/snapshot_io.py).
BLOSC = {"cname": "lz4", "clevel": 1, "shuffle": "bitshuffle"}



@dataclass
class EncodedField:
    name: str
    layer: str                # "batch" or "non_tensor"
    data: np.ndarray          # what zarr stores
    info: dict                # manifest entry: logical dtype, shape, encoding


def encode_tensor(name: str, t: torch.Tensor) -> EncodedField:
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype in RAW_BITS:  # dtypes numpy cannot hold natively: their raw bit patterns
        data, encoding = to_bits(t), "raw_bits"
    else:
        try:
            data, encoding = t.numpy(), "native"
        except TypeError:
            raise UnsupportedObjectError(
                f"batch[{name!r}]: tensor dtype {t.dtype} cannot be stored in a snapshot"
            ) from None
    return EncodedField(name, "batch", data, {"layer": "batch", "dtype": dtype,
                                              "stored_dtype": str(data.dtype),
                                              "encoding": encoding, "shape": list(t.shape)})


def encode_column(name: str, column: np.ndarray) -> EncodedField:
    info = {"layer": "non_tensor", "dtype": str(column.dtype), "shape": list(column.shape)}
    if column.dtype.kind in "biuf":
        return EncodedField(name, "non_tensor", np.ascontiguousarray(column),
                            {**info, "encoding": "native", "stored_dtype": str(column.dtype)})
    if column.dtype.kind == "U":
        data = column.astype(object)
        return EncodedField(name, "non_tensor", data, {**info, "encoding": "utf8", "stored_dtype": "string"})
    if column.dtype != object:
        raise UnsupportedObjectError(
            f"non_tensor_batch[{name!r}]: numpy dtype {column.dtype} cannot be stored; use "
            f"numbers, bool, str or an object array of JSON-like values"
        )
    flat = column.ravel()
    if all(type(v) is str for v in flat.tolist()):
        return EncodedField(name, "non_tensor", flat.reshape(column.shape),
                            {**info, "encoding": "utf8", "stored_dtype": "string"})
    where = f"non_tensor_batch[{name!r}]"
    encoded = np.empty(flat.shape, dtype=object)
    for i, value in enumerate(flat.tolist()):
        encoded[i] = json.dumps(to_json_value(value, where), ensure_ascii=False, allow_nan=True)
    return EncodedField(name, "non_tensor", encoded.reshape(column.shape),
                        {**info, "encoding": "json", "stored_dtype": "string"})


def _chunking(data: np.ndarray) -> tuple[tuple, tuple | None]:
    rows = max(1, data.shape[0])
    row_bytes = max(1, int(np.prod(data.shape[1:], dtype=np.int64)) * data.dtype.itemsize)
    inner = max(1, min(rows, INNER_CHUNK_BYTES // row_bytes))
    shard = max(inner, min(rows, SHARD_BYTES // row_bytes) // inner * inner)
    shard = -(-min(shard, rows) // inner) * inner  # a multiple of inner covering <= rows
    rest = tuple(data.shape[1:])
    return (inner, *rest), (shard, *rest)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _upload_pool(workers: int) -> ThreadPoolExecutor:
    """One upload pool per size for the process: starting threads for every snapshot
    cost more than writing a small one."""
    workers = max(1, workers)
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snapshot-upload")
        return _POOLS[workers]


class _Uploader:
    """Writes encoded objects under the data prefix, hashing each as it goes.

    zarr encodes into a MemoryStore (its many existence checks stay in memory instead of
    becoming object-store requests); finished objects are handed here and written in
    parallel, each PUT with its SHA-256 computed in the same worker thread (hashlib and
    the network both release the GIL). The manifest is built from these digests, i.e.
    from the bytes that went out.
    """

    def __init__(self, loc: sfs.Location, workers: int) -> None:
        self.loc = loc
        self.pool = _upload_pool(workers)
        self.pending = []
        self.objects: dict[str, dict] = {}
        self.metadata: dict[str, dict] = {}
        self.folders: set[str] = set()
        #: array path -> entries of its shards' index (set before the array's objects come)
        self.shard_entries: dict[str, int] = {}

    def submit(self, key: str, raw: bytes) -> None:
        if key == "zarr.json" or key.endswith("/zarr.json"):
            self.metadata[key] = json.loads(raw)
        self.pending.append(self.pool.submit(self._put, key, raw))

    def _put(self, key: str, raw: bytes) -> None:
        digest = hashlib.sha256(raw).hexdigest()
        target = self.loc.child(key)
        if self.loc.is_local:
            # durable before the manifest makes it visible: data, then (in finish) folders
            os.makedirs(os.path.dirname(target.path), exist_ok=True)
            with open(target.path, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            self.folders.add(os.path.dirname(target.path))
        else:
            try:
                target.fs.pipe_file(target.path, raw)
            except PermissionError as exc:
                raise sfs.describe_access_error(self.loc, exc) from exc
        self.objects[key] = {"size": len(raw), "sha256": digest}
        entries = self.shard_entries.get(key.split("/c/", 1)[0]) if "/c/" in key else None
        if entries:
            self.objects[key]["parts"] = shard_parts(raw, entries)

    def expect(self, fields: list[EncodedField]) -> None:
        """Note the shard layout of ``fields`` before their objects are handed over."""
        for field in fields:
            if field.info["stored_dtype"] != "string":
                inner, shard = _chunking(field.data)
                self.shard_entries[field_path(field.layer, field.name)] = int(
                    np.prod([-(-s // i) for s, i in zip(shard, inner)], dtype=np.int64))

    def drain(self, memory: dict, *, metadata_too: bool) -> None:
        """Hand over what zarr has finished. Metadata documents stay in memory until the
        end: zarr looks up parent groups while creating the next arrays."""
        for key in list(memory):
            if metadata_too or not key.endswith("zarr.json"):
                self.submit(key, memory.pop(key).to_bytes())

    def finish(self) -> None:
        errors = []
        for future in self.pending:  # all of them, even after a failure: nothing writes on later
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        if self.loc.is_local and self.folders:
            # every folder from the deepest up to the snapshot's own, so the entries
            # naming the data survive a crash too
            folders = set(self.folders)
            for folder in self.folders:
                while folder.startswith(self.loc.path) and folder != os.path.dirname(self.loc.path):
                    folders.add(folder)
                    folder = os.path.dirname(folder)
            for folder in sorted(folders, key=len, reverse=True):
                sfs.fsync_path(folder)


#: Fields up to this size are encoded together in one call into zarr's event loop (each
#: call is a thread hop; per field they were most of a small snapshot's cost); larger
#: ones one at a time, so their objects upload while the next is encoded.
SMALL_FIELD_BYTES = 1 << 20


async def _write_field(parent, field: EncodedField) -> None:
    from zarr.codecs import BloscCodec

    path = field_path(field.layer, field.name)
    name = path.split("/", 1)[1]
    if field.info["stored_dtype"] == "string":
        chunks = (max(1, min(field.data.shape[0], 4096)), *field.data.shape[1:])
        array = await parent.create_array(name, shape=field.data.shape, dtype=str, chunks=chunks,
                                          compressors=None, fill_value="")
    else:
        chunks, shards = _chunking(field.data)
        array = await parent.create_array(
            name, shape=field.data.shape, dtype=field.data.dtype, chunks=chunks, shards=shards,
            compressors=BloscCodec(**BLOSC), fill_value=0,
        )
    if field.data.size:
        await array.setitem(Ellipsis, field.data)
    field.info["array"] = path


def _write_fields(parents: dict, fields: list[EncodedField]) -> None:
    from zarr.core.sync import sync

    async def write_all():
        for field in fields:
            await _write_field(parents[field.layer], field)

    sync(write_all())


def _field_groups(fields: list[EncodedField]) -> list[list[EncodedField]]:
    """Consecutive small fields together; every large field alone."""
    groups: list[list[EncodedField]] = []
    for field in fields:
        small = field.data.nbytes <= SMALL_FIELD_BYTES
        if small and groups and all(f.data.nbytes <= SMALL_FIELD_BYTES for f in groups[-1]):
            groups[-1].append(field)
        else:
            groups.append([field])
    return groups


def save_snapshot(dp: DataProto, uri: str, *, storage_options: dict | None = None,
                  annotations: dict | None = None, max_workers: int = 4,
                  base: "SnapshotInfo | None" = None) -> "SnapshotInfo":
    """Persist ``dp`` at ``uri`` and commit it; returns its :class:`SnapshotInfo`.

    The data goes under ``uri/data-<fresh id>/`` (a prefix no other writer uses); the
    manifest ``uri/SNAPSHOT.json`` is written last and only if absent, so concurrent or
    repeated commits to one URI fail with SnapshotExistsError and a crashed writer leaves
    nothing a reader would accept. ``annotations`` (JSON) are stored in the manifest,
    e.g. ``{"replay_of": ...}``. The input DataProto is not modified.

    With ``base`` (a committed sibling snapshot, e.g. the previous stage's), ``dp`` holds
    only the fields that differ from it (plus the full meta_info) and readers compose the
    two; ``dp`` must then have the base's row count even when it has no fields.
    """
    import zarr
    from zarr.storage import MemoryStore

    from rlhf_core.snapshot.reader import _info_from_manifest

    dp.check_consistency()
    loc = sfs.resolve(uri, storage_options)
    manifest_loc = loc.child(MANIFEST_NAME)
    if sfs.read_bytes(manifest_loc) is not None:  # early, friendly; the commit re-checks
        raise SnapshotExistsError(f"{loc.uri} already holds a committed snapshot; snapshots are "
                                  f"immutable, write to a new URI")
    fields: list[EncodedField] = []
    if dp.batch is not None:
        fields += [encode_tensor(k, v) for k, v in dp.batch.items()]
    fields += [encode_column(k, v) for k, v in dp.non_tensor_batch.items()]
    meta = {str(k): to_json_value(v, f"meta_info[{k!r}]") for k, v in dp.meta_info.items()}

    data_prefix = f"{DATA_PREFIX}{uuid.uuid4().hex}"
    data_loc = loc.child(data_prefix)
    memory: dict = {}
    uploader = _Uploader(data_loc, max_workers)
    try:
        group = zarr.create_group(store=MemoryStore(memory), zarr_format=3, attributes={
            "meta_info": meta, "rlhf_snapshot": {"schema_version": SCHEMA_VERSION}})
        parents = {"batch": group.create_group("batch")._async_group,
                   "non_tensor": group.create_group("non_tensor")._async_group}
        for batch_of_fields in _field_groups(fields):  # a large field's objects upload while the next encodes
            _write_fields(parents, batch_of_fields)
            uploader.expect(batch_of_fields)
            uploader.drain(memory, metadata_too=False)
        uploader.drain(memory, metadata_too=True)
    finally:
        uploader.finish()

    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "data_prefix": data_prefix,
        "num_rows": len(dp),
        "fields": {f.name: f.info for f in fields},
        "objects": dict(sorted(uploader.objects.items())),
        # The zarr metadata documents, verbatim: readers take them from here (one request
        # instead of one per field) and the manifest is the only thing they trust.
        "metadata": dict(sorted(uploader.metadata.items())),
        "annotations": annotations or {},
        "writer": {"host": socket.gethostname(), "pid": os.getpid()},
    }
    if base is not None:
        base_name = base.uri.rstrip("/").rsplit("/", 1)[-1]
        if base.uri.rstrip("/").rsplit("/", 1)[0] != loc.uri.rstrip("/").rsplit("/", 1)[0]:
            raise ValueError(f"base {base.uri} must be a sibling of {loc.uri} (same parent folder)")
        manifest["base"] = {"path": f"../{base_name}", "manifest_sha256": base.manifest_sha256}
        manifest["num_rows"] = base.num_rows if not fields else manifest["num_rows"]
    raw = json.dumps(manifest, indent=1, sort_keys=False).encode("utf-8")
    probes.reached(f"snapshot:{loc.uri}")
    try:
        sfs.put_create_only(manifest_loc, raw)
    except SnapshotExistsError:
        _remove_quietly(data_loc)  # we lost the race; leave the winner's snapshot alone
        raise
    return _info_from_manifest(loc.uri, manifest, hashlib.sha256(raw).hexdigest())


def _remove_quietly(loc: sfs.Location) -> None:
    try:
        loc.fs.rm(loc.path, recursive=True)
    except Exception:  # best effort: an orphan prefix is harmless, just wasted space
        pass
