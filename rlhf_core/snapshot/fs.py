"""Where snapshots live: fsspec URIs, credentials, create-only writes, zarr stores.

Any fsspec URI works; ``file://`` (and plain paths) and ``s3://`` are tested. S3
credentials and endpoint come from ``storage_options`` or from the standard AWS
environment variables; they are only ever passed to the client, never written anywhere.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import time
import uuid
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import fsspec

from rlhf_core.snapshot.errors import (
    CommitConflictError, SnapshotAccessError, SnapshotExistsError, UnsupportedStoreError,
)
from rlhf_core.snapshot.layout import TMP_PREFIX

# Fail fast instead of hanging when an endpoint is unreachable or refuses us.
_S3_CONFIG = {"connect_timeout": 5, "read_timeout": 120,
              "retries": {"max_attempts": 3, "mode": "standard"}}


@dataclass(frozen=True)
class Location:
    """A resolved URI: the filesystem, the path inside it, and how to name it again."""

    fs: Any
    path: str          # protocol-less path as the filesystem wants it
    uri: str           # canonical URI, printed in messages and recorded in SnapshotInfo
    protocol: str
    storage_options: dict

    @property
    def is_local(self) -> bool:
        return self.protocol in ("file", "local")

    def child(self, *parts: str) -> "Location":
        path = "/".join([self.path.rstrip("/"), *[p.strip("/") for p in parts]])
        uri = "/".join([self.uri.rstrip("/"), *[p.strip("/") for p in parts]])
        return Location(self.fs, path, uri, self.protocol, self.storage_options)


def s3_options_from_env(storage_options: dict | None) -> dict:
    """Merge explicit options with AWS_* environment variables (explicit wins)."""
    opts = dict(storage_options or {})
    env_key, env_secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if "key" not in opts and env_key:
        opts["key"] = env_key
    if "secret" not in opts and env_secret:
        opts["secret"] = env_secret
    client_kwargs = dict(opts.get("client_kwargs") or {})
    endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url") \
        or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    config = dict(_S3_CONFIG)
    config.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = config
    opts.setdefault("max_concurrency", 1)
    return opts


def resolve(uri: str, storage_options: dict | None = None) -> Location:
    """Turn a URI (or a plain local path) into a :class:`Location`."""
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"snapshot uri must be a non-empty string; found {uri!r}")
    if "::" in uri:  # the last guard for URIs that skipped validate_store_uri: no fsspec chains
        raise ValueError(f"expected one filesystem's URI (no fsspec '::' chain); found {uri!r}")
    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    if protocol == "s3":
        opts = s3_options_from_env(storage_options)
    else:
        opts = dict(storage_options or {})
    fs, path = fsspec.core.url_to_fs(uri, **opts)
    if protocol == "file":
        path = os.path.abspath(path)
        canonical = "file://" + path
    else:
        canonical = uri.rstrip("/")
    return Location(fs=fs, path=path.rstrip("/") or "/", uri=canonical.rstrip("/"),
                    protocol=protocol, storage_options=opts)


def describe_access_error(loc: Location, exc: BaseException) -> SnapshotAccessError:
    """A clear error for refused credentials, without echoing the secret."""
    endpoint = (loc.storage_options.get("client_kwargs") or {}).get("endpoint_url", "AWS default")
    key = loc.storage_options.get("key")
    source = "storage_options/AWS_ACCESS_KEY_ID" if key else "no access key (anonymous or instance role)"
    key_hint = f"{key[:4]}..." if key else "-"
    return SnapshotAccessError(
        f"access to {loc.uri} was refused by {endpoint}: {exc}. Credentials used: key {key_hint} "
        f"from {source}. Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or storage_options "
        f"'key'/'secret') and AWS_ENDPOINT_URL."
    )


def put_create_only(loc: Location, data: bytes, folder_may_go: bool = False) -> None:
    """Write ``data`` at ``loc`` only if nothing is there yet; atomically visible.

    Local disk: write a private temp file, fsync, then ``link`` it into place (link fails
    when the name exists, and readers never see a partly written file). Object stores:
    a conditional PUT (``If-None-Match: *``), after a one-time probe that the store
    enforces it. Idempotent: when the object exists with exactly these bytes (our own
    earlier attempt, e.g. a PUT retried by the client after its response was lost), the
    write has succeeded; anything else there raises ``SnapshotExistsError``. A 409
    (concurrent conditional write) is retried, then raises ``CommitConflictError``.
    ``folder_may_go``: the folder may be removed once this write is visible (a lease log
    that gc removes once its release is written): its going is not an error then.
    """
    if loc.is_local:
        directory = os.path.dirname(loc.path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, loc.path)
        except FileExistsError:
            if read_bytes(loc) == data:
                return
            raise SnapshotExistsError(f"{loc.uri} already exists; snapshots are written once") from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                if not folder_may_go:
                    raise
        try:
            fsync_path(directory)
        except FileNotFoundError:
            if not folder_may_go:
                raise
        return
    check_create_only(loc)
    for attempt in range(CONFLICT_RETRIES + 1):
        try:
            loc.fs.pipe_file(loc.path, data, mode="create")
            return
        except PermissionError as exc:
            raise describe_access_error(loc, exc) from exc
        except OSError as exc:
            if _precondition_failed(exc):
                if hasattr(loc.fs, "invalidate_cache"):
                    loc.fs.invalidate_cache(loc.path)
                if read_bytes(loc) == data:
                    return  # our own write landed; only its answer was lost
                raise SnapshotExistsError(f"{loc.uri} already exists; snapshots are written once") from None
            if not _conflict(exc):
                raise
            if attempt == CONFLICT_RETRIES:
                raise CommitConflictError(f"{loc.uri}: the store answered 409 (a concurrent conditional write to "
                                          f"this key) {CONFLICT_RETRIES + 1} times; nothing was committed") from exc
            time.sleep(0.05 * 2 ** attempt)


CONFLICT_RETRIES = 4
_PROBED: dict[tuple, bool] = {}


def _precondition_failed(exc: OSError) -> bool:
    text = str(exc).lower()
    return isinstance(exc, FileExistsError) or "precondition" in text or "pre-condition" in text or "412" in text


def _conflict(exc: OSError) -> bool:
    """A 409 ConditionalRequestConflict, however the S3 client library wrapped it."""
    response = getattr(exc.__cause__, "response", None) or {}
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    text = str(exc)
    return (code == "ConditionalRequestConflict" or status == 409 or getattr(exc, "errno", None) == errno.EBUSY
            or "ConditionalRequestConflict" in text or "conflicting conditional" in text.lower())


def check_create_only(loc: Location) -> None:
    """Once per store (bucket and endpoint): write a probe object twice with
    ``If-None-Match: *``; the second write must be refused. A store that accepts it would
    let two commits overwrite each other, so it is refused for commits. The probe goes
    next to the object to commit (credentials may cover only the run's prefix, not the
    bucket root), named as scratch (``rlhf gc`` removes one a killed writer left)."""
    bucket = loc.path.split("/", 1)[0]
    endpoint = (loc.storage_options.get("client_kwargs") or {}).get("endpoint_url", "")
    key = (loc.protocol, endpoint, bucket)
    if _PROBED.get(key):
        return
    probe = f"{loc.path.rsplit('/', 1)[0]}/{TMP_PREFIX}create-only-probe-{uuid.uuid4().hex}"
    try:
        loc.fs.pipe_file(probe, b"1", mode="create")
        try:
            loc.fs.pipe_file(probe, b"2", mode="create")
            honoured = False
        except PermissionError as exc:
            raise describe_access_error(loc, exc) from exc
        except OSError as exc:
            honoured = _precondition_failed(exc)
            if not honoured:
                raise
    finally:
        try:
            loc.fs.rm(probe)
        except Exception:
            pass
    if not honoured:
        raise UnsupportedStoreError(f"{loc.protocol}://{bucket} ({endpoint or 'default endpoint'}) accepted a second "
                                    f"create-only write (If-None-Match: *) to one key: it does not honour conditional "
                                    f"writes, so concurrent commits could overwrite each other. Use a store that does "
                                    f"(AWS S3, MinIO, SeaweedFS, GCS through its S3 API with conditional writes)")
    _PROBED[key] = True


def fsync_path(path: str) -> None:
    """Flush a local file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(uri: str, files: dict[str, bytes], storage_options: dict | None = None) -> dict[str, str]:
    """Write ``files`` ({name: bytes}) under ``uri``; on local disk each file and the
    folder are fsynced before this returns (what a later commit makes visible must
    survive a power loss). Returns {name: sha256}."""
    import hashlib

    loc = resolve(uri, storage_options)
    digests = {}
    if loc.is_local:
        os.makedirs(loc.path, exist_ok=True)
    for name, data in files.items():
        target = loc.child(name)
        if loc.is_local:
            with open(target.path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            target.fs.pipe_file(target.path, data)
        digests[name] = hashlib.sha256(data).hexdigest()
    if loc.is_local:
        fsync_path(loc.path)
    return digests


def link_below(root: Location, loc: Location) -> str | None:
    """On a local store, the first of ``root`` and the folders and file from it down to
    ``loc`` that is a symbolic link (None when there is none, or off local disk). A store
    never follows a link: a linked chunk would be read as this snapshot's data, and a
    delete through a linked folder would remove another run's objects."""
    if not loc.is_local:
        return None
    base = root.path.rstrip("/")
    rel = loc.path[len(base):].strip("/") if loc.path.startswith(base) else None
    if rel is None:
        return loc.path if os.path.islink(loc.path) else None
    path = base
    for part in [""] + (rel.split("/") if rel else []):
        path = f"{path}/{part}" if part else path
        if os.path.islink(path):
            return path
    return None


def read_bytes(loc: Location) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    try:
        return loc.fs.cat_file(loc.path)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise describe_access_error(loc, exc) from exc


def zarr_store(loc: Location, *, read_only: bool):
    """A zarr v3 store rooted at ``loc`` (LocalStore on disk, FsspecStore elsewhere)."""
    from zarr.storage import FsspecStore, LocalStore

    if loc.is_local:
        return LocalStore(loc.path, read_only=read_only)
    # zarr needs the async flavour of the filesystem. One instance per set of options, on
    # zarr's own event loop: a second instance of the same client would later be closed
    # from the wrong loop (aiohttp "attached to a different loop" noise at exit).
    key = (loc.protocol, json.dumps(loc.storage_options, sort_keys=True, default=str))
    async_fs = _ASYNC_FS.get(key)
    if async_fs is None:
        try:
            from zarr.core.sync import _get_loop
            loop_kwargs = {"loop": _get_loop()}
        except ImportError:  # pragma: no cover - other zarr layouts
            loop_kwargs = {}
        async_fs, _ = fsspec.core.url_to_fs(loc.uri, asynchronous=True, skip_instance_cache=True,
                                            **loop_kwargs, **loc.storage_options)
        _ASYNC_FS[key] = async_fs
        if len(_ASYNC_FS) == 1:
            atexit.register(_close_async_filesystems)
    return FsspecStore(fs=async_fs, path=async_fs._strip_protocol(loc.uri), read_only=read_only)


_ASYNC_FS: dict[tuple, Any] = {}


def _close_async_filesystems() -> None:
    """Close the S3 clients on zarr's loop while it still runs (at interpreter exit)."""
    from zarr.core.sync import sync

    for fs in _ASYNC_FS.values():
        client = getattr(fs, "_s3", None)
        if client is not None:
            try:
                sync(client.__aexit__(None, None, None))
            except Exception:
                pass
            fs._s3 = None
    _ASYNC_FS.clear()


def store_now(run: "Location") -> float:
    """The store's present time, as the clock that stamps its objects has it: on S3 the
    ``Date`` of its answer to a HEAD of the bucket; on disk the mtime of a scratch file
    made in the run's folder (a network filesystem stamps with the server's clock). This
    machine's clock only when the store gives none."""
    try:
        if run.protocol == "s3":
            answer = run.fs.call_s3("head_bucket", Bucket=run.path.split("/", 1)[0])
            date = (answer.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
            if date:
                return parsedate_to_datetime(date).timestamp()
        elif run.is_local and os.path.isdir(run.path):
            probe = os.path.join(run.path, f"{TMP_PREFIX}clock-{uuid.uuid4().hex}")
            with open(probe, "wb"):
                pass
            try:
                return os.stat(probe).st_mtime
            finally:
                os.unlink(probe)
    except OSError:
        pass
    return time.time()


def stamp(info: dict) -> float:
    """When the store wrote an object, by its own clock (mtime on disk, LastModified on S3),
    from a listing's or ``info``'s entry; 0 when it says nothing."""
    stamp = info.get("mtime") or info.get("LastModified") or info.get("Initiated") or info.get("created")
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp or 0)
