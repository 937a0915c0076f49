"""Pickle-free Zarr snapshots of DataProtos on any fsspec store (local disk, S3).

Public API (names are part of the contract)::

    save_snapshot(dp, uri, *, storage_options=None, annotations=None, base=None) -> SnapshotInfo
    load_snapshot(uri, *, fields=None, rows=None, uids=None, verify="marker"|"full",
                  storage_options=None) -> DataProto
    list_snapshots(prefix_uri, *, storage_options=None, include_incomplete=False)
    snapshot_info(uri) / verify_snapshot(uri) -> SnapshotInfo
    snapshot_fields(uri) -> {field: info}   (a delta's fields with its bases')

A snapshot becomes visible only when its manifest is committed (written last,
create-only); readers refuse anything else. See ``layout.py`` for the format.
"""

from rlhf_core.snapshot.errors import (
    CorruptSnapshotError,
    IncompleteSnapshotError,
    CommitConflictError,
    SnapshotAccessError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotSchemaError,
    SnapshotTooLargeError,
    UnsupportedStoreError,
)

# The reader and writer need torch; they load on first use so that tools which only read
# manifests (reports, the Kubeflow components that do no tensor work) start fast.
_LAZY = {"SnapshotInfo": "reader", "list_snapshots": "reader", "load_snapshot": "reader",
         "snapshot_info": "reader", "verify_snapshot": "reader", "snapshot_fields": "reader", "save_snapshot": "writer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"rlhf_core.snapshot.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rlhf_core.snapshot' has no attribute {name!r}")

__all__ = [
    "save_snapshot", "load_snapshot", "list_snapshots", "snapshot_info", "verify_snapshot", "snapshot_fields",
    "SnapshotInfo", "SnapshotError", "IncompleteSnapshotError", "CorruptSnapshotError",
    "SnapshotExistsError", "SnapshotSchemaError", "SnapshotTooLargeError", "SnapshotAccessError", "CommitConflictError",
    "UnsupportedStoreError",
]
