"""Reading snapshots: manifest first, checks before decoding, only what was asked for."""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from rlhf_core.protocol import DataProto
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import (
    CorruptSnapshotError, IncompleteSnapshotError, SnapshotSchemaError, SnapshotTooLargeError,
)
from rlhf_core.snapshot.layout import (
    DATA_PREFIX, MANIFEST_NAME, MAX_CHUNK_BYTES, check_array_metadata, parse_manifest, shard_parts,
    unicode_width,
)


@dataclass
class SnapshotInfo:
    """What a manifest says about a snapshot (nothing here requires reading data)."""

    uri: str
    state: str                          # "committed", "incomplete" or "unreadable" (a listing's)
    num_rows: int = 0
    fields: dict[str, dict] = field(default_factory=dict)
    stored_bytes: int = 0
    created_at: str = ""
    schema_version: int = 0
    data_prefix: str = ""
    annotations: dict = field(default_factory=dict)
    manifest_sha256: str = ""
    base: str | None = None             # a delta's base snapshot ("../<stage>"), None for a full one


def _info_from_manifest(uri: str, manifest: dict, manifest_sha256: str) -> SnapshotInfo:
    return SnapshotInfo(
        uri=uri, state="committed", num_rows=int(manifest["num_rows"]),
        fields=manifest["fields"],
        stored_bytes=sum(int(o["size"]) for o in manifest["objects"].values()),
        created_at=manifest.get("created_at", ""), schema_version=manifest["schema_version"],
        data_prefix=manifest["data_prefix"], annotations=manifest.get("annotations") or {},
        manifest_sha256=manifest_sha256, base=(manifest.get("base") or {}).get("path"),
    )


def _refuse_link(root: sfs.Location, loc: sfs.Location) -> None:
    link = sfs.link_below(root, loc)
    if link is not None:
        raise CorruptSnapshotError(f"{root.uri}: {link} is a symbolic link; a snapshot is read from regular "
                                   f"files and folders only (links are never followed)")


def _open_manifest(loc: sfs.Location) -> tuple[dict, str]:
    _refuse_link(loc, loc.child(MANIFEST_NAME))
    raw = sfs.read_bytes(loc.child(MANIFEST_NAME))
    if raw is None:
        try:
            found = [p.rsplit("/", 1)[-1] for p in loc.fs.ls(loc.path, detail=False)]
        except FileNotFoundError:
            found = []
        except PermissionError as exc:
            raise sfs.describe_access_error(loc, exc) from exc
        partial = [p for p in found if p.startswith(DATA_PREFIX)]
        if partial:
            raise IncompleteSnapshotError(
                f"{loc.uri} has no {MANIFEST_NAME}: its writer did not commit (found "
                f"uncommitted data {partial}); the snapshot is refused. Re-run the stage that "
                f"writes it."
            )
        raise IncompleteSnapshotError(f"no committed snapshot at {loc.uri} (no {MANIFEST_NAME})")
    return parse_manifest(raw, loc.uri), hashlib.sha256(raw).hexdigest()


def snapshot_info(uri: str, *, storage_options: dict | None = None) -> SnapshotInfo:
    """The committed snapshot's manifest summary (reads one object)."""
    loc = sfs.resolve(uri, storage_options)
    manifest, digest = _open_manifest(loc)
    return _info_from_manifest(loc.uri, manifest, digest)


def verify_snapshot(uri: str, *, storage_options: dict | None = None) -> SnapshotInfo:
    """Check every object against the manifest (exists, size, SHA-256), and so for every
    base of a delta; raise CorruptSnapshotError listing each mismatch."""
    loc = sfs.resolve(uri, storage_options)
    manifest, digest = _open_manifest(loc)
    _open_chain(loc, verify="full")
    return _info_from_manifest(loc.uri, manifest, digest)


def _verify_objects(loc: sfs.Location, manifest: dict) -> None:
    data_loc = loc.child(manifest["data_prefix"])

    def check(item):
        key, expected = item
        link = sfs.link_below(data_loc, data_loc.child(key))
        if link is not None:
            return f"{key}: a symbolic link ({link}), never followed"
        raw = sfs.read_bytes(data_loc.child(key))
        if raw is None:
            return f"{key}: missing"
        if len(raw) != expected["size"]:
            return f"{key}: size {len(raw)} != {expected['size']} in the manifest"
        if hashlib.sha256(raw).hexdigest() != expected["sha256"]:
            return f"{key}: checksum mismatch (altered after commit)"
        return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        problems = [p for p in pool.map(check, manifest["objects"].items()) if p]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CorruptSnapshotError(f"{loc.uri} does not match its manifest: {shown}")


def _checked_metadata(manifest: dict, key: str, uri: str) -> dict:
    """The zarr metadata document ``key`` as committed in the manifest.

    Readers never decode with metadata read from the data objects themselves: the
    manifest is the one trusted root, and ``verify="full"`` separately checks that the
    stored ``zarr.json`` objects still match it byte for byte.
    """
    doc = (manifest.get("metadata") or {}).get(key)
    if doc is None:
        legacy = [k for k in manifest["objects"] if k.endswith((".zarray", ".zattrs", ".zgroup"))]
        hint = f" (found zarr v2 metadata {legacy})" if legacy else ""
        raise SnapshotSchemaError(f"{uri}: the manifest lists no {key}{hint}; only zarr v3 is read")
    return doc


def _resolve_rows(rows: Any, num_rows: int) -> slice | np.ndarray:
    if rows is None:
        return slice(None)
    if isinstance(rows, slice):
        return slice(*rows.indices(num_rows))
    index = np.asarray(rows)
    if index.dtype == bool:
        if index.shape != (num_rows,):
            raise ValueError(f"rows: boolean mask has {index.size} entries; the snapshot has {num_rows} rows")
        return np.nonzero(index)[0]
    if index.dtype.kind not in "iu":
        raise TypeError(f"rows must be a slice, int indices or a bool mask; found dtype {index.dtype}")
    index = index.reshape(-1).astype(np.int64)
    if index.size and (index.max() >= num_rows or index.min() < -num_rows):
        raise IndexError(f"rows: index out of range for a snapshot of {num_rows} rows")
    return index % max(num_rows, 1)


@dataclass(frozen=True)
class _ArrayLayout:
    """What a reader checks a chunk of one array against before zarr decodes it."""

    codecs: tuple[str, ...]   # the codecs that encode one (inner) chunk, in order
    elements: int             # values in one (inner) chunk
    item_size: int            # bytes per value; 0 for strings
    shard_entries: int        # inner chunks per shard (0: not sharded)


def _array_layout(metadata: dict) -> _ArrayLayout:
    chunk = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    codecs = [c if isinstance(c, dict) else {"name": c} for c in metadata["codecs"]]
    item = 0 if metadata["data_type"] == "string" else np.dtype(metadata["data_type"]).itemsize
    for codec in codecs:
        if codec["name"] == "sharding_indexed":
            config = codec["configuration"]
            inner = config["chunk_shape"]
            names = tuple(c if isinstance(c, str) else c["name"] for c in config["codecs"])
            return _ArrayLayout(names, int(np.prod(inner, dtype=np.int64)), item,
                                int(np.prod([s // i for s, i in zip(chunk, inner)], dtype=np.int64)))
    return _ArrayLayout(tuple(c["name"] for c in codecs), int(np.prod(chunk, dtype=np.int64)), item, 0)


def _check_chunk_size(chunk: bytes, layout: _ArrayLayout, where: str) -> None:
    """Refuse a chunk whose encoded header promises more than its declared size, so no
    codec inflates beyond the buffer the array's metadata declares."""
    body = chunk[:-4] if layout.codecs and layout.codecs[-1] == "crc32c" else chunk
    expected = layout.elements * layout.item_size
    if "blosc" in layout.codecs:
        if len(body) < 16:
            raise CorruptSnapshotError(f"{where}: a blosc chunk of {len(body)} bytes has no header")
        nbytes, cbytes = struct.unpack_from("<I", body, 4)[0], struct.unpack_from("<I", body, 12)[0]
        if cbytes != len(body) or (nbytes != expected if expected else nbytes > MAX_CHUNK_BYTES):
            raise CorruptSnapshotError(f"{where}: a blosc chunk declares {nbytes} decoded bytes in {cbytes}; "
                                       f"the array's chunk is {expected or 'at most ' + str(MAX_CHUNK_BYTES)} "
                                       f"bytes in {len(body)}")
    elif layout.codecs and layout.codecs[0] == "vlen-utf8":
        count = struct.unpack_from("<I", body, 0)[0] if len(body) >= 4 else -1
        if count != layout.elements:
            raise CorruptSnapshotError(f"{where}: a string chunk declares {count} values; the array's chunk "
                                       f"holds {layout.elements}")
    elif len(body) != expected:
        raise CorruptSnapshotError(f"{where}: an uncompressed chunk of {len(body)} bytes; the array's chunk "
                                   f"is {expected}")


def _verified_store(data_loc: sfs.Location, manifest: dict, uri: str, layouts: dict[str, _ArrayLayout]):
    """A read store that hands zarr only bytes it checked against the manifest.

    Every object is read bounded by its listed size and checked against its SHA-256
    (or, for one chunk of a shard, against that chunk's own recorded digest) before
    zarr sees it; each chunk's encoded header is checked against the array's declared
    chunk size. An object the manifest does not list is not part of the snapshot (zarr
    reads fill values, as it does for a chunk the writer skipped); one listed but gone
    is an error, never silent zeros.
    """
    import asyncio

    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import WrapperStore
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    listed = manifest["objects"]
    whole: dict[str, bytes] = {}
    locks: dict[str, asyncio.Lock] = {}

    def layout_of(key: str) -> _ArrayLayout | None:
        return layouts.get(key.split("/c/", 1)[0]) if "/c/" in key else None

    class VerifiedObjects(WrapperStore):
        async def _fetch(self, key: str, start: int, end: int) -> bytes:
            _refuse_link(data_loc, data_loc.child(key))
            got = await self._store.get(key, default_buffer_prototype(), RangeByteRequest(start, end))
            if got is None:
                raise CorruptSnapshotError(f"{uri}: {key} is listed in the manifest but missing")
            return got.to_bytes()

        async def _whole(self, key: str) -> bytes:
            async with locks.setdefault(key, asyncio.Lock()):
                if key not in whole:
                    size = listed[key]["size"]
                    raw = await self._fetch(key, 0, size + 1)  # one byte more shows a grown object
                    if len(raw) != size:
                        raise CorruptSnapshotError(f"{uri}: {key}: size {len(raw)}{'+' if len(raw) > size else ''} "
                                                   f"!= {size} in the manifest")
                    if hashlib.sha256(raw).hexdigest() != listed[key]["sha256"]:
                        raise CorruptSnapshotError(f"{uri}: {key}: checksum mismatch (altered after commit)")
                    layout = layout_of(key)
                    if layout is not None and layout.shard_entries:
                        for offset, nbytes, _ in shard_parts(raw, layout.shard_entries)[:-1]:
                            _check_chunk_size(raw[offset:offset + nbytes], layout, f"{uri}: {key}")
                    elif layout is not None:
                        _check_chunk_size(raw, layout, f"{uri}: {key}")
                    whole[key] = raw
            return whole[key]

        async def get(self, key, prototype, byte_range=None):
            entry = listed.get(key)
            if entry is None:
                return None
            size = entry["size"]
            if byte_range is None:
                start, end = 0, size
            elif isinstance(byte_range, RangeByteRequest):
                start, end = byte_range.start, byte_range.end
            elif isinstance(byte_range, OffsetByteRequest):
                start, end = byte_range.offset, size
            elif isinstance(byte_range, SuffixByteRequest):
                start, end = max(0, size - byte_range.suffix), size
            else:
                raise CorruptSnapshotError(f"{uri}: {key}: unsupported byte range {byte_range!r}")
            if not 0 <= start <= end <= size:
                raise CorruptSnapshotError(f"{uri}: {key}: bytes {start}..{end} lie outside its {size} bytes")
            part = next((p for p in entry.get("parts") or () if p[0] == start and p[1] == end - start), None)
            if (start, end) != (0, size) and part is not None:
                raw = await self._fetch(key, start, end)
                if len(raw) != end - start or hashlib.sha256(raw).hexdigest() != part[2]:
                    raise CorruptSnapshotError(f"{uri}: {key}: bytes {start}..{end} do not match their checksum "
                                               f"(altered after commit)")
                layout = layout_of(key)
                if layout is not None and end != size:  # a chunk, not the index at the end
                    _check_chunk_size(raw, layout, f"{uri}: {key}")
            else:
                raw = (await self._whole(key))[start:end]
            return prototype.buffer.from_bytes(raw)

    return VerifiedObjects(sfs.zarr_store(data_loc, read_only=True))


async def _read_array(store, path: str, metadata: dict, rows):
    """Read ``rows`` of one array (a coroutine on zarr's loop, so fields read concurrently)."""
    import zarr
    from zarr.storage import StorePath

    array = zarr.AsyncArray(metadata, StorePath(store, path))
    rest = (slice(None),) * (len(array.shape) - 1)
    if isinstance(rows, slice):
        return await array.getitem((rows, *rest))
    if rows.size == 0:
        return np.empty((0, *array.shape[1:]), dtype=array.dtype)
    # zarr's orthogonal selection wants sorted unique indices; map back afterwards.
    unique, inverse = np.unique(rows, return_inverse=True)
    return (await array.get_orthogonal_selection((unique, *rest)))[inverse]


#: how long a failed read waits for the other reads it started
READ_SETTLE_S = 30.0


def _read_arrays(store, requests: list[tuple[str, dict]], rows) -> list[np.ndarray]:
    import asyncio

    from zarr.core.sync import sync

    async def gather():
        before = asyncio.all_tasks()
        try:
            return await asyncio.gather(*(_read_array(store, path, meta, rows) for path, meta in requests))
        except BaseException:
            # a refused read ends the call; the reads it started (zarr's chunk reads among
            # them) are let finish here, so none is left pending when the process exits
            # (asyncio's "Task was destroyed but it is pending!" after the refusal line)
            left = asyncio.all_tasks() - before - {asyncio.current_task()}
            if left:
                done, _ = await asyncio.wait(left, timeout=READ_SETTLE_S)
                for task in done:
                    if not task.cancelled():
                        task.exception()  # seen: no "exception was never retrieved" either
            raise

    return sync(gather())


def _decode(info: dict, data: np.ndarray, name: str, uri: str) -> torch.Tensor | np.ndarray:
    encoding = info.get("encoding")
    if info["layer"] == "batch":
        if encoding == "raw_bits":
            from rlhf_core.protocol.dtypes import from_bits

            return from_bits(info["dtype"], data)
        return torch.from_numpy(np.ascontiguousarray(data))
    if encoding == "native":
        return data
    if encoding == "utf8":
        if info["dtype"].startswith("<U"):
            return data.astype(info["dtype"])
        out = np.empty(data.shape, dtype=object)
        out[...] = data
        return out
    if encoding == "json":
        flat = data.ravel()
        out = np.empty(flat.shape, dtype=object)
        for i, text in enumerate(flat.tolist()):
            out[i] = json.loads(text)
        return out.reshape(data.shape)
    raise SnapshotSchemaError(f"{uri}: field {name!r} has unknown encoding {encoding!r}")


def _open_chain(loc: sfs.Location, verify: str) -> list[tuple[sfs.Location, dict]]:
    """The snapshot and the bases it is a delta of, newest first; each base must be the
    exact snapshot the delta was written against (manifest sha256) with the same rows."""
    chain = []
    manifest, _ = _open_manifest(loc)
    while True:
        if verify == "full":
            _verify_objects(loc, manifest)
        chain.append((loc, manifest))
        base = manifest.get("base")
        if base is None:
            return chain
        if len(chain) > 64:
            raise CorruptSnapshotError(f"{chain[0][0].uri}: a delta chain longer than 64 snapshots (a cycle?)")
        parent = sfs.resolve(loc.uri.rstrip("/").rsplit("/", 1)[0] + "/" + base["path"][3:], loc.storage_options)
        base_manifest, digest = _open_manifest(parent)
        if digest != base["manifest_sha256"]:
            raise CorruptSnapshotError(f"{loc.uri}: its base {parent.uri} is not the snapshot it was written "
                                       f"against (manifest sha256 {digest[:16]}... != {base['manifest_sha256'][:16]}...)")
        if int(base_manifest["num_rows"]) != int(manifest["num_rows"]):
            raise CorruptSnapshotError(f"{loc.uri}: {manifest['num_rows']} rows but its base {parent.uri} has "
                                       f"{base_manifest['num_rows']}")
        loc, manifest = parent, base_manifest


def snapshot_fields(uri: str, *, storage_options: dict | None = None) -> dict[str, dict]:
    """Every field a snapshot reads as (a delta's own and its bases'), in column order."""
    chain = _open_chain(sfs.resolve(uri, storage_options), verify="marker")
    fields: dict[str, dict] = {}
    for _, manifest in reversed(chain):
        fields.update(manifest["fields"])
    return fields


def _read_fields(loc: sfs.Location, manifest: dict, names: list[str], selection) -> dict:
    """Decoded fields ``names`` of one snapshot (no chain), rows ``selection``."""
    catalog = manifest["fields"]
    requests, layouts = [], {}
    for name in names:
        info = catalog[name]
        metadata = check_array_metadata(_checked_metadata(manifest, f"{info['array']}/zarr.json", loc.uri),
                                        f"{loc.uri}: field {name!r}")
        if list(metadata.get("shape", [])) != list(info["shape"]):
            raise CorruptSnapshotError(f"{loc.uri}: field {name!r} has shape {metadata.get('shape')} "
                                       f"but the manifest says {info['shape']}")
        requests.append((info["array"], metadata))
        layouts[info["array"]] = _array_layout(metadata)
    _check_fits_in_memory(loc.uri, catalog, names, requests, selection, int(manifest["num_rows"]))
    store = _verified_store(loc.child(manifest["data_prefix"]), manifest, loc.uri, layouts)
    arrays = _read_arrays(store, requests, selection)
    return {name: _decode(catalog[name], data, name, loc.uri) for name, data in zip(names, arrays)}


def _check_fits_in_memory(uri: str, catalog: dict, names: list[str], requests: list, selection,
                          num_rows: int) -> None:
    """Refuse, before reading, a read whose declared size exceeds the memory available:
    a manifest declaring 2**42 rows is a one-line refusal, not a MemoryError mid-decode."""
    rows = len(range(num_rows)[selection]) if isinstance(selection, slice) else len(selection)
    need = 0
    for name, (_, metadata) in zip(names, requests):
        dtype = metadata["data_type"]
        width = unicode_width(catalog[name].get("dtype"))
        item = np.dtype(dtype).itemsize if dtype != "string" else (4 * width if width else 8)
        need += rows * int(np.prod(metadata["shape"][1:], dtype=np.int64)) * item
    available = available_memory()
    if need > available:
        raise SnapshotTooLargeError(
            f"{uri}: reading {rows} rows of {names} needs {need / 2**30:.1f} GiB as the manifest declares "
            f"the fields; {available / 2**30:.1f} GiB of memory is available (read fewer rows or fields)")


def available_memory() -> int:
    """Bytes this process may still allocate: the machine's available memory, or less
    where a cgroup (a pod's memory limit) caps it."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return max(0, available)


def load_snapshot(uri: str, *, fields: Sequence[str] | None = None, rows: Any = None,
                  uids: Sequence[str] | None = None, verify: str = "marker",
                  storage_options: dict | None = None) -> DataProto:
    """Load a committed snapshot (or part of it) as a DataProto.

    ``fields``: names of tensor fields and/or object columns (default: all).
    ``rows``: a slice, int indices or a bool mask. ``uids``: every row whose ``uid``
    column equals one of these (in the order given). Only the chunks holding the chosen
    rows of the chosen fields are read. ``verify="marker"`` requires the manifest and
    checks metadata checksums; ``verify="full"`` also checks every object's size and
    SHA-256 first (CorruptSnapshotError on any mismatch). meta_info is always loaded.
    A delta snapshot reads each field from the newest snapshot of its chain that has it.
    """
    if verify not in ("marker", "full"):
        raise ValueError(f"verify must be 'marker' or 'full'; found {verify!r}")
    if rows is not None and uids is not None:
        raise ValueError("pass rows or uids, not both")
    loc = sfs.resolve(uri, storage_options)
    chain = _open_chain(loc, verify)
    source: dict[str, int] = {}  # field -> index in chain of the snapshot holding it
    for index in range(len(chain) - 1, -1, -1):  # oldest first: columns keep the order they appeared in
        for name in chain[index][1]["fields"]:
            source[name] = index
    catalog = {name: chain[i][1]["fields"][name] for name, i in source.items()}
    wanted = list(catalog) if fields is None else list(fields)
    unknown = [f for f in wanted if f not in catalog]
    if unknown:
        raise KeyError(f"{loc.uri}: no field(s) {unknown}; available: {sorted(catalog)}")
    manifest = chain[0][1]
    root = _checked_metadata(manifest, "zarr.json", loc.uri)
    meta_info = dict((root.get("attributes") or {}).get("meta_info") or {})
    num_rows = int(manifest["num_rows"])

    if uids is not None:
        if "uid" not in catalog:
            raise KeyError(f"{loc.uri}: selecting by uid needs a 'uid' column; fields: {sorted(catalog)}")
        uid_column = _read_fields(*chain[source["uid"]], ["uid"], slice(None))["uid"]
        positions: dict[str, list[int]] = {}
        for i, u in enumerate(uid_column.tolist()):
            positions.setdefault(u, []).append(i)
        missing = [u for u in uids if u not in positions]
        if missing:
            raise KeyError(f"{loc.uri}: uid(s) {missing[:5]} not in this snapshot "
                           f"({len(positions)} distinct uids)")
        selection: Any = np.array([i for u in uids for i in positions[u]], dtype=np.int64)
    else:
        selection = _resolve_rows(rows, num_rows)

    columns: dict = {}
    for index in sorted({source[name] for name in wanted}):
        columns.update(_read_fields(*chain[index], [n for n in wanted if source[n] == index], selection))
    columns = {name: columns[name] for name in wanted}
    tensors = {k: v for k, v in columns.items() if catalog[k]["layer"] == "batch"}
    non_tensors = {k: v for k, v in columns.items() if catalog[k]["layer"] != "batch"}
    if not wanted:  # a delta that added nothing, or fields=[]: still the snapshot's rows
        size = len(range(num_rows)[selection]) if isinstance(selection, slice) else len(selection)
        return DataProto(batch=TensorDict({}, batch_size=[size]), meta_info=meta_info)
    return DataProto.from_dict(tensors, non_tensors, meta_info)


def list_snapshots(prefix_uri: str, *, storage_options: dict | None = None,
                   include_incomplete: bool = False) -> list[SnapshotInfo]:
    """Every committed snapshot under ``prefix_uri`` (sorted by URI); with
    ``include_incomplete``, also folders holding uncommitted data (state="incomplete")."""
    loc = sfs.resolve(prefix_uri, storage_options)
    try:
        if hasattr(loc.fs, "invalidate_cache"):
            loc.fs.invalidate_cache()
        paths = loc.fs.find(loc.path, withdirs=True, detail=False)
    except FileNotFoundError:
        return []
    except PermissionError as exc:
        raise sfs.describe_access_error(loc, exc) from exc
    base = loc.path.rstrip("/")
    committed, partial = set(), set()
    for path in paths:
        rel = path[len(base):].strip("/") if path.startswith(base) else path
        parts = rel.split("/") if rel else []
        if parts and parts[-1] == MANIFEST_NAME:
            committed.add("/".join(parts[:-1]))
        for i, part in enumerate(parts):
            if part.startswith(DATA_PREFIX):
                partial.add("/".join(parts[:i]))
                break
    out = []
    for rel in sorted(committed):
        child = loc.child(rel) if rel else loc
        try:
            manifest, digest = _open_manifest(child)
            out.append(_info_from_manifest(child.uri, manifest, digest))
        except (CorruptSnapshotError, SnapshotSchemaError) as exc:
            if not include_incomplete:
                raise
            # one broken manifest does not hide the rest of a listing: it is listed as such
            out.append(SnapshotInfo(uri=child.uri, state="unreadable", annotations={"error": str(exc)}))
    if include_incomplete:
        for rel in sorted(partial - committed):
            out.append(SnapshotInfo(uri=(loc.child(rel) if rel else loc).uri, state="incomplete"))
        out.sort(key=lambda i: i.uri)
    return out
