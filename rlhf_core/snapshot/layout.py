"""The snapshot's on-store layout and the rules a reader enforces before decoding.

A snapshot at URI ``U`` is::

    U/SNAPSHOT.json              the manifest, written last, create-only
    U/data-<writer id>/          a zarr v3 group written by exactly one writer
        zarr.json                group metadata; attributes hold meta_info (JSON)
        batch/<field>/           one array per tensor field, sharded along rows
        non_tensor/<field>/      one array per object column (UTF-8 or JSON strings)

The manifest lists every object under the data prefix with its size and SHA-256, the
fields with their logical dtypes and shapes, and the schema version. A snapshot without
a manifest does not exist as far as readers are concerned.

A delta snapshot (schema 2) stores only the fields it adds or changes and names its base,
a sibling snapshot (``"base": {"path": "../<name>", "manifest_sha256": ...}``); readers
compose the chain, newest field wins, and refuse a base whose manifest is not the one the
delta was written against.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any
from urllib.parse import quote

from rlhf_core.snapshot.errors import SnapshotSchemaError

FORMAT = "rlhf.snapshot"
SCHEMA_VERSION = 2  # 2: delta snapshots (a "base" reference); 1 is still read
MANIFEST_NAME = "SNAPSHOT.json"
DATA_PREFIX = "data-"
#: A writer's private scratch object (a create-only write's temp file, the create-only
#: probe): never read; ``rlhf gc`` removes one its writer left behind.
TMP_PREFIX = ".tmp-"

#: zarr v3 data types a reader accepts: plain numbers, bool, and UTF-8 strings.
SAFE_DATA_TYPES = {
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "string",
}
#: zarr v3 codecs a reader accepts. None of them can run code while decoding, and each
#: one's decoded size can be checked against the chunk's declared size before it decodes
#: (blosc's header states it; gzip and zstd streams may not, and our writer never used
#: them). Anything else (a pickle or object codec, a custom numcodecs class) is refused
#: before zarr ever instantiates it.
SAFE_CODECS = {"bytes", "blosc", "crc32c", "transpose", "sharding_indexed", "vlen-utf8"}
#: Codecs of a shard's index: fixed-size little-endian (offset, nbytes) pairs.
SAFE_INDEX_CODECS = {"bytes", "crc32c"}

#: Bounds on what a manifest may declare, so a forged one cannot make a reader allocate
#: without limit. The writer's shards are at most ~256 MiB and its chunks far smaller;
#: 2 GiB is also blosc's own limit for one chunk.
MAX_CHUNK_BYTES = 2 << 30
#: Rows in one string chunk (the writer uses 4096) and characters of a fixed-width ``<U``
#: column (its values are decoded into ``rows x width x 4`` bytes).
MAX_STRING_CHUNK_ROWS = 1 << 20
MAX_UNICODE_WIDTH = 1 << 20
#: Elements in one field: beyond any batch a trainer holds, below int64 overflow of x8.
MAX_FIELD_ELEMENTS = 1 << 44


def field_path(layer: str, name: str) -> str:
    """Array path for a field; names are percent-encoded so any key is a safe node name."""
    encoded = quote(name, safe="")
    if encoded.startswith("__") or encoded in ("", ".", ".."):  # reserved in zarr v3
        encoded = "%" + format(ord(encoded[0]) if encoded else 0, "02X") + encoded[1:]
    return f"{layer}/{encoded}"


#: A shard index entry for a chunk that was not written (all fill values).
EMPTY_CHUNK = (1 << 64) - 1


def shard_parts(raw: bytes, entries: int) -> list[list]:
    """``[offset, nbytes, sha256]`` of each inner chunk of a shard and, last, of its index
    (the final ``16 * entries + 4`` bytes: little-endian (offset, nbytes) pairs and a
    crc32c). The writer records them so a reader that fetches one chunk checks exactly
    the bytes it decodes without fetching the whole shard."""
    index_bytes = 16 * entries + 4
    if len(raw) < index_bytes:
        return []
    index = struct.unpack_from(f"<{2 * entries}Q", raw, len(raw) - index_bytes)
    parts = sorted([o, n, hashlib.sha256(raw[o:o + n]).hexdigest()]
                   for o, n in zip(index[::2], index[1::2]) if o != EMPTY_CHUNK)
    parts.append([len(raw) - index_bytes, index_bytes, hashlib.sha256(raw[len(raw) - index_bytes:]).hexdigest()])
    return parts


def check_array_metadata(doc: Any, where: str) -> dict:
    """Refuse any array metadata that is not plain zarr v3 with safe types and codecs."""
    if not isinstance(doc, dict):
        raise SnapshotSchemaError(f"{where}: array metadata is not a JSON object")
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise SnapshotSchemaError(
            f"{where}: expected zarr v3 array metadata (zarr_format=3, node_type=array); found "
            f"zarr_format={doc.get('zarr_format')!r}, node_type={doc.get('node_type')!r}"
        )
    dtype = doc.get("data_type")
    if not isinstance(dtype, str) or dtype not in SAFE_DATA_TYPES:
        raise SnapshotSchemaError(
            f"{where}: data_type {dtype!r} is not allowed; allowed: {sorted(SAFE_DATA_TYPES)}"
        )
    _check_codecs(doc.get("codecs"), where)
    shape = doc.get("shape")
    grid = doc.get("chunk_grid") if isinstance(doc.get("chunk_grid"), dict) else {}
    chunk_shape = (grid.get("configuration") or {}).get("chunk_shape")
    if grid.get("name") != "regular" or not _dims(chunk_shape, positive=True) \
            or not isinstance(shape, list) or len(chunk_shape) != len(shape):
        raise SnapshotSchemaError(f"{where}: chunk_grid must be regular with one positive chunk size per "
                                  f"dimension of shape {shape!r}; found {doc.get('chunk_grid')!r}")
    item = 0 if dtype == "string" else _ITEM_SIZE[dtype]
    _check_chunk(chunk_shape, item, where)
    for codec in doc["codecs"]:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            inner = (codec.get("configuration") or {}).get("chunk_shape")
            if not _dims(inner, positive=True) or len(inner) != len(chunk_shape) \
                    or any(s % i for s, i in zip(chunk_shape, inner)):
                raise SnapshotSchemaError(f"{where}: a shard's inner chunk_shape {inner!r} must divide its "
                                          f"shard shape {chunk_shape}")
            if (codec.get("configuration") or {}).get("index_location", "end") != "end":
                raise SnapshotSchemaError(f"{where}: a shard index must be at the end of its shard")
            _check_chunk(inner, item, where + " (inner chunk)")
    return doc


_ITEM_SIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2,
              "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8}


def _dims(value: Any, *, positive: bool) -> bool:
    return isinstance(value, list) and all(
        type(d) is int and (d > 0 if positive else d >= 0) for d in value)


def _check_chunk(chunk_shape: list, item_size: int, where: str) -> None:
    elements = 1
    for d in chunk_shape:
        elements *= d
    if item_size and elements * item_size > MAX_CHUNK_BYTES:
        raise SnapshotSchemaError(f"{where}: chunk_shape {chunk_shape} declares {elements * item_size} bytes "
                                  f"per chunk; at most {MAX_CHUNK_BYTES} are read")
    if not item_size and chunk_shape and chunk_shape[0] > MAX_STRING_CHUNK_ROWS:
        raise SnapshotSchemaError(f"{where}: chunk_shape {chunk_shape} declares {chunk_shape[0]} strings per "
                                  f"chunk; at most {MAX_STRING_CHUNK_ROWS} are read")


def _check_codecs(codecs: Any, where: str, allowed: set = SAFE_CODECS) -> None:
    if not isinstance(codecs, list) or not codecs:
        raise SnapshotSchemaError(f"{where}: codecs must be a non-empty list; found {codecs!r}")
    for codec in codecs:
        name = codec.get("name") if isinstance(codec, dict) else codec
        if name not in allowed:
            raise SnapshotSchemaError(
                f"{where}: codec {name!r} is not allowed (it could execute code, its decoded size "
                f"cannot be checked before decoding, or it is unknown to this reader); allowed: "
                f"{sorted(allowed)}"
            )
        if name == "sharding_indexed":
            config = codec.get("configuration") or {}
            _check_codecs(config.get("codecs"), where + " (inner codecs)", SAFE_CODECS - {"sharding_indexed"})
            _check_codecs(config.get("index_codecs"), where + " (index codecs)", SAFE_INDEX_CODECS)


def parse_manifest(raw: bytes, uri: str) -> dict:
    """Parse and check a manifest: format marker and a schema version we can read."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: format is {found!r}, expected {FORMAT!r}")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
        raise SnapshotSchemaError(
            f"{uri}: snapshot schema_version {version!r} is not readable by this build (reads "
            f"1..{SCHEMA_VERSION}); upgrade rlhf_core to read snapshots written by a newer version"
        )
    for key in ("data_prefix", "num_rows", "fields", "objects", "metadata"):
        if key not in manifest:
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: missing required key {key!r}")
    prefix = manifest["data_prefix"]
    if not isinstance(prefix, str) or not prefix.startswith(DATA_PREFIX) or "/" in prefix:
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: data_prefix {prefix!r} is not a "
                                  f"'{DATA_PREFIX}<id>' folder of this snapshot")
    if not isinstance(manifest["objects"], dict):
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: objects must be a JSON object")
    base = manifest.get("base")
    if base is not None:
        path = base.get("path") if isinstance(base, dict) else None
        name = path[3:] if isinstance(path, str) and path.startswith("../") else ""
        if not name or "/" in name or "\\" in name or name in (".", "..") \
                or not isinstance(base.get("manifest_sha256"), str):
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: base {base!r} is not a sibling snapshot "
                                      f"reference ({{'path': '../<name>', 'manifest_sha256': ...}})")
    for key in manifest["objects"]:  # every object lies inside the snapshot's data prefix
        if not _relative_inside(key):
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: object path {key!r} is not a relative path "
                                      f"inside {prefix}/ (absolute paths and '..' are refused)")
    fields = manifest["fields"]
    if not isinstance(fields, dict):
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: fields must be a JSON object")
    num_rows = manifest["num_rows"]
    if type(num_rows) is not int or num_rows < 0:
        raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: num_rows must be a non-negative integer; "
                                  f"found {num_rows!r}")
    for key, entry in manifest["objects"].items():
        if not isinstance(entry, dict) or type(entry.get("size")) is not int or entry["size"] < 0 \
                or not isinstance(entry.get("sha256"), str):
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: object {key!r} must have an integer size and "
                                      f"a sha256; found {entry!r}")
    for name, info in fields.items():  # each field's array too: a path inside the data prefix
        array = info.get("array") if isinstance(info, dict) else None
        if array is not None and not _relative_inside(array):
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: field {name!r}'s array {array!r} is not a relative "
                                      f"path inside {prefix}/ (absolute paths and '..' are refused)")
        _check_field_shape(uri, name, info, num_rows)
    return manifest


def unicode_width(dtype: Any) -> int:
    """Characters of a fixed-width string dtype (``<U12``: 12); 0 for any other dtype.
    parse_manifest has bounded the width."""
    return int(dtype[2:]) if isinstance(dtype, str) and dtype[1:2] == "U" else 0


def _check_field_shape(uri: str, name: str, info: Any, num_rows: int) -> None:
    """A field is ``num_rows`` rows of a bounded shape; a fixed-width string's width is bounded."""
    where = f"{uri}/{MANIFEST_NAME}: field {name!r}"
    shape = info.get("shape") if isinstance(info, dict) else None
    if not _dims(shape, positive=False) or not shape or shape[0] != num_rows:
        raise SnapshotSchemaError(f"{where}: shape must be a list of non-negative integers starting with "
                                  f"num_rows={num_rows}; found {shape!r}")
    elements = 1
    for d in shape:
        elements *= d
    if elements > MAX_FIELD_ELEMENTS:
        raise SnapshotSchemaError(f"{where}: shape {shape} declares {elements} elements; at most "
                                  f"{MAX_FIELD_ELEMENTS} are read")
    dtype = info.get("dtype")
    if isinstance(dtype, str) and dtype[1:2] == "U":
        width = dtype[2:]
        if dtype[:1] not in "<>|=" or not width.isdigit() or int(width) > MAX_UNICODE_WIDTH:
            raise SnapshotSchemaError(f"{where}: fixed-width string dtype {dtype!r} must be <U with a width "
                                      f"of at most {MAX_UNICODE_WIDTH}")


def _relative_inside(path) -> bool:
    """Whether ``path`` is a relative path that stays inside its folder (no empty, ``.``
    or ``..`` part, no backslash)."""
    return isinstance(path, str) and not path.startswith("/") and "\\" not in path and all(
        p not in ("", ".", "..") for p in path.split("/"))
