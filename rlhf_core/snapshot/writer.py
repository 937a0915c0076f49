"""Writing a snapshot: encode columns, write zarr under a private prefix, commit last."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_core.protocol import DataProto, UnsupportedObjectError, _to_json_value
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.snapshot.layout import (
    DATA_PREFIX, FORMAT, MANIFEST_NAME, SCHEMA_VERSION, field_path,
)

#: Target uncompressed bytes of one inner chunk (the unit a partial read fetches) and of
#: one shard (the unit written as one object). Small chunks keep one-sample reads cheap;
#: big shards keep object-store request counts low.
INNER_CHUNK_BYTES = 256 * 1024
SHARD_BYTES = 256 * 1024 * 1024

# dtypes numpy cannot hold natively travel as their raw bit patterns.
_RAW_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float8_e4m3fn: (torch.uint8, np.uint8),
             torch.float8_e5m2: (torch.uint8, np.uint8)}


@dataclass
class EncodedField:
    name: str
    layer: str                # "batch" or "non_tensor"
    data: np.ndarray          # what zarr stores
    info: dict                # manifest entry: logical dtype, shape, encoding


def encode_tensor(name: str, t: torch.Tensor) -> EncodedField:
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype in _RAW_BITS:
        view, stored = _RAW_BITS[t.dtype]
        data, encoding = t.view(view).numpy().view(stored), "raw_bits"
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
        encoded[i] = json.dumps(_to_json_value(value, where), ensure_ascii=False, allow_nan=True)
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


class _RecordingStore:
    """Build lazily: a zarr WrapperStore that records size and SHA-256 of every object
    written, so the manifest is made from the bytes that went out, not a re-read."""

    @staticmethod
    def wrap(store):
        from zarr.storage import WrapperStore

        class Recording(WrapperStore):
            def __init__(self, inner, written=None):
                super().__init__(inner)
                self.written = {} if written is None else written

            def _with_store(self, inner):
                return type(self)(inner, self.written)

            def with_read_only(self, read_only: bool = False):
                return type(self)(self._store.with_read_only(read_only), self.written)

            async def set(self, key, value):
                raw = value.to_bytes()
                self.written[key] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
                await self._store.set(key, value)

            async def set_if_not_exists(self, key, value):
                if not await self._store.exists(key):
                    await self.set(key, value)

            async def delete(self, key):
                self.written.pop(key, None)
                await self._store.delete(key)

        return Recording(store)


def _write_field(group, field: EncodedField) -> None:
    from zarr.codecs import BloscCodec

    path = field_path(field.layer, field.name)
    if field.info["stored_dtype"] == "string":
        chunks = (max(1, min(field.data.shape[0], 4096)), *field.data.shape[1:])
        array = group.create_array(path, shape=field.data.shape, dtype=str, chunks=chunks,
                                   compressors=None, fill_value="")
    else:
        chunks, shards = _chunking(field.data)
        array = group.create_array(
            path, shape=field.data.shape, dtype=field.data.dtype, chunks=chunks, shards=shards,
            compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"), fill_value=0,
        )
    if field.data.size:
        array[...] = field.data
    field.info["array"] = path


def save_snapshot(dp: DataProto, uri: str, *, storage_options: dict | None = None,
                  annotations: dict | None = None, max_workers: int = 4) -> "SnapshotInfo":
    """Persist ``dp`` at ``uri`` and commit it; returns its :class:`SnapshotInfo`.

    The data goes under ``uri/data-<fresh id>/`` (a prefix no other writer uses); the
    manifest ``uri/SNAPSHOT.json`` is written last and only if absent, so concurrent or
    repeated commits to one URI fail with SnapshotExistsError and a crashed writer leaves
    nothing a reader would accept. ``annotations`` (JSON) are stored in the manifest,
    e.g. ``{"replay_of": ...}``. The input DataProto is not modified.
    """
    import zarr

    from rlhf_core.snapshot.reader import SnapshotInfo, _info_from_manifest

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
    meta = {str(k): _to_json_value(v, f"meta_info[{k!r}]") for k, v in dp.meta_info.items()}

    data_prefix = f"{DATA_PREFIX}{uuid.uuid4().hex}"
    data_loc = loc.child(data_prefix)
    store = _RecordingStore.wrap(sfs.zarr_store(data_loc, read_only=False))
    try:
        group = zarr.create_group(store=store, zarr_format=3,
                                  attributes={"meta_info": meta, "rlhf_snapshot": {"schema_version": SCHEMA_VERSION}})
        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            list(pool.map(lambda f: _write_field(group, f), fields))
    except PermissionError as exc:
        raise sfs.describe_access_error(loc, exc) from exc

    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "data_prefix": data_prefix,
        "num_rows": len(dp),
        "fields": {f.name: f.info for f in fields},
        "objects": dict(sorted(store.written.items())),
        "annotations": annotations or {},
        "writer": {"host": socket.gethostname(), "pid": os.getpid()},
    }
    raw = json.dumps(manifest, indent=1, sort_keys=False).encode("utf-8")
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
