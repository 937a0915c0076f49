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

import json
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
#: zarr v3 codecs a reader accepts. None of them can run code while decoding; anything
#: else (a pickle or object codec, a custom numcodecs class) is refused before zarr
#: ever instantiates it.
SAFE_CODECS = {"bytes", "blosc", "zstd", "gzip", "crc32c", "transpose", "sharding_indexed",
               "vlen-utf8"}


def field_path(layer: str, name: str) -> str:
    """Array path for a field; names are percent-encoded so any key is a safe node name."""
    encoded = quote(name, safe="")
    if encoded.startswith("__") or encoded in ("", ".", ".."):  # reserved in zarr v3
        encoded = "%" + format(ord(encoded[0]) if encoded else 0, "02X") + encoded[1:]
    return f"{layer}/{encoded}"


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
    return doc


def _check_codecs(codecs: Any, where: str) -> None:
    if not isinstance(codecs, list) or not codecs:
        raise SnapshotSchemaError(f"{where}: codecs must be a non-empty list; found {codecs!r}")
    for codec in codecs:
        name = codec.get("name") if isinstance(codec, dict) else codec
        if name not in SAFE_CODECS:
            raise SnapshotSchemaError(
                f"{where}: codec {name!r} is not allowed (it could execute code or is unknown "
                f"to this reader); allowed: {sorted(SAFE_CODECS)}"
            )
        if name == "sharding_indexed":
            config = codec.get("configuration") or {}
            _check_codecs(config.get("codecs"), where + " (inner codecs)")
            _check_codecs(config.get("index_codecs"), where + " (index codecs)")


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
    for name, info in fields.items():  # each field's array too: a path inside the data prefix
        array = info.get("array") if isinstance(info, dict) else None
        if array is not None and not _relative_inside(array):
            raise SnapshotSchemaError(f"{uri}/{MANIFEST_NAME}: field {name!r}'s array {array!r} is not a relative "
                                      f"path inside {prefix}/ (absolute paths and '..' are refused)")
    return manifest


def _relative_inside(path) -> bool:
    """Whether ``path`` is a relative path that stays inside its folder (no empty, ``.``
    or ``..`` part, no backslash)."""
    return isinstance(path, str) and not path.startswith("/") and "\\" not in path and all(
        p not in ("", ".", "..") for p in path.split("/"))
