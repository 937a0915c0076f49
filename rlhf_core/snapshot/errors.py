"""Errors of the snapshot store. Each message names the URI and what was found."""


class SnapshotError(Exception):
    """Base class of every snapshot store error."""


class IncompleteSnapshotError(SnapshotError, FileNotFoundError):
    """No committed manifest: the snapshot was never written, or its writer died."""


class CorruptSnapshotError(SnapshotError):
    """The stored objects no longer match the manifest (missing, resized, altered)."""


class SnapshotExistsError(SnapshotError, FileExistsError):
    """A committed snapshot already exists at this URI; snapshots are immutable."""


class SnapshotSchemaError(SnapshotError):
    """The snapshot's format is not one this build reads safely (newer schema version,
    unknown codec or data type, pickle anywhere)."""


class SnapshotTooLargeError(SnapshotError, MemoryError):
    """A read would decode more bytes than the machine has available; nothing was read."""


class SnapshotAccessError(SnapshotError, PermissionError):
    """The storage backend refused the credentials."""


class CommitConflictError(SnapshotError):
    """The object store kept answering 409 (a concurrent conditional write to the same
    key) after retries; nothing was committed by this writer."""


class UnsupportedStoreError(SnapshotError):
    """The store does not honour create-only writes (If-None-Match), so commits could
    overwrite each other; it is refused for commits."""
