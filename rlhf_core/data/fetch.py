"""Inputs from an object store: ``model.path`` and ``data.train_files`` as ``s3://`` /
``gs://`` URIs, fetched once per node into the cache and checked.

A URI names one object (a parquet file) or a folder (every object under the prefix: a
Hugging Face model folder). ``fetch`` lists it (key, size, ETag), and the cache folder's
name is derived from the URI and that listing, so a changed object is a new folder, never
a stale copy. The first process on a node to take the folder's lock (``fcntl``, on the
node's cache: the ranks of a node share it) downloads into a private temp folder under
the cache and renames it into place; the others wait for the lock and find the folder
there. Every object is checked as it arrives: its size, its ETag against the listing
(the read itself is conditional on that ETag, so an object replaced mid-transfer fails),
and, when the ETag is a plain MD5 (single-part uploads without SSE-KMS/SSE-C), the MD5 of
the bytes; a folder with a ``SHA256SUMS`` file (``sha256sum`` output) is checked against
it instead, for stores whose ETags are not MD5s. Nothing that fails a check is cached.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

#: Schemes fetched into the cache (``file://`` and plain paths are read in place).
REMOTE_SCHEMES = ("s3", "gs", "gcs")
#: Files a tokenizer-only fetch leaves out (the controller needs the tokenizer, not 15 GB).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
#: Written into every fetched folder: what was listed, so a reuse can check the copy.
RECORD = ".rlhf-fetch.json"
SUMS = "SHA256SUMS"
CHUNK = 8 * 1024 * 1024
_MD5 = re.compile(r"[0-9a-f]{32}")


class FetchError(ValueError):
    """An input that cannot be fetched or fails its check; the message names the object."""


def is_remote(uri: str) -> bool:
    return isinstance(uri, str) and uri.split("://", 1)[0].lower() in REMOTE_SCHEMES and "://" in uri


def node_cache() -> Path:
    """This node's cache (``RLHF_CACHE``, default ``~/.cache/rlhf-core``): fetched inputs and
    built models, each under a name derived from what it holds."""
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf-core"))


def cache_root() -> Path:
    return node_cache() / "inputs"


@dataclass(frozen=True)
class Entry:
    name: str          # path relative to the URI ("" for a single object: its base name)
    size: int
    etag: str          # quotes stripped; "" when the store gives none
    md5: str           # hex MD5 the store vouches for ("" when unknown)


def listing(uri: str, field: str = "input", storage_options: dict | None = None,
            weights: bool = True) -> tuple[object, bool, list[Entry]]:
    """(Location, is_single_object, entries) for ``uri``; FetchError when it names nothing."""
    from rlhf_core.record.run_ids import StoreUriError, validate_store_uri
    from rlhf_core.snapshot import fs as sfs

    try:
        validate_store_uri(uri, field)
    except StoreUriError as exc:
        raise FetchError(str(exc)) from None
    loc = sfs.resolve(uri, storage_options)
    if hasattr(loc.fs, "invalidate_cache"):  # a long-lived session lists afresh, never from its cache
        loc.fs.invalidate_cache(loc.path)
    try:
        single = loc.fs.isfile(loc.path)
        found = {loc.path: loc.fs.info(loc.path)} if single else loc.fs.find(loc.path, detail=True)
    except PermissionError as exc:
        raise sfs.describe_access_error(loc, exc) from exc
    base = loc.path.rstrip("/")
    entries = []
    for key, info in sorted(found.items()):
        name = key.rsplit("/", 1)[-1] if single else key[len(base) + 1:]
        if not name or info.get("type") == "directory" or (not weights and name.endswith(WEIGHT_SUFFIXES)):
            continue
        _check_name(name, uri, field)
        etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
        md5 = etag.lower() if _MD5.fullmatch(etag.lower()) else ""
        if not md5 and info.get("md5Hash"):  # GCS: base64 of the MD5
            md5 = base64.b64decode(info["md5Hash"]).hex()
        entries.append(Entry(name, int(info["size"]), etag, md5))
    if not entries:
        raise FetchError(f"{field}: expected an object or a folder of objects at {uri}; found nothing there")
    return loc, single, entries


def _check_name(name: str, uri: str, field: str) -> None:
    """An object's key below the URI names a file inside the cache folder, nothing else:
    no empty, ``.`` or ``..`` part, no absolute name, no backslash or NUL (a key such as
    ``model/../../x`` would otherwise be written outside the cache)."""
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise FetchError(f"{field}: expected object keys under {uri} that name files inside it; found {name!r} "
                         f"(an empty, '.' or '..' part, or an absolute name); nothing was fetched")


def fetch(uri: str, field: str = "input", storage_options: dict | None = None, weights: bool = True) -> str:
    """The local path of ``uri`` (a file for one object, a folder for a prefix), fetched
    into this node's cache unless a checked copy is already there. ``weights=False``
    leaves model weight files out (a tokenizer and config only)."""
    loc, single, entries = listing(uri, field, storage_options, weights)
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", loc.path.rstrip("/").rsplit("/", 1)[-1])[:60] or "input"
    fingerprint = hashlib.sha256(json.dumps([loc.uri, weights, [e.__dict__ for e in entries]],
                                            sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{tail}-{fingerprint}"
    result = target / entries[0].name if single else target
    if target.exists():
        return str(_checked_copy(target, entries, uri, result))
    with open(root / f"{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node; the others wait here, then reuse it
        try:
            if target.exists():
                return str(_checked_copy(target, entries, uri, result))
            for stale in root.glob(f"{target.name}.tmp-*"):  # a fetcher killed mid-way (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                digests = download(loc, single, entries, tmp, uri)
                (tmp / RECORD).write_text(json.dumps({"uri": loc.uri, "objects": [e.__dict__ for e in entries],
                                                      "sha256": digests}))
                os.rename(tmp, target)  # atomic: readers see the whole folder or none
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(result)


def download(loc, single: bool, entries: list[Entry], into: Path, uri: str, threads: int = 4) -> dict[str, str]:
    """Every entry into ``into``, each checked (size, ETag, MD5 or SHA256SUMS); FetchError
    naming the first object that fails. Returns {name: sha256} of what was written."""
    def source(entry: Entry) -> str:
        return loc.path if single else f"{loc.path.rstrip('/')}/{entry.name}"

    sums = {}
    if any(e.name == SUMS for e in entries) and not single:
        text = loc.fs.cat_file(source(next(e for e in entries if e.name == SUMS))).decode()
        sums = {line.split(None, 1)[1].lstrip("*").strip(): line.split(None, 1)[0].lower()
                for line in text.splitlines() if len(line.split(None, 1)) == 2}

    inside = into.resolve()

    def one(entry: Entry) -> dict:
        path = into / entry.name
        if not path.resolve().is_relative_to(inside):  # (listing checked the names; this is the last guard)
            raise FetchError(f"{uri}: the object {entry.name!r} would be written outside {into}; nothing was cached")
        path.parent.mkdir(parents=True, exist_ok=True)
        md5, sha, size = hashlib.md5(), hashlib.sha256(), 0
        where = f"{uri.rstrip('/')}/{entry.name}" if not single else uri
        changed = FetchError(f"{where}: expected ETag {entry.etag} (listed), found another: the object changed "
                             f"while it was fetched; nothing was cached, run again")
        with loc.fs.open(source(entry), "rb") as src, open(path, "wb") as out:
            # s3fs reads with If-Match on the listed ETag: a replaced object fails the read
            etag = str((getattr(src, "details", None) or {}).get("ETag", entry.etag) or "").strip('"')
            if entry.etag and etag != entry.etag:
                raise changed
            try:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    md5.update(chunk)
                    sha.update(chunk)
                    size += len(chunk)
            except OSError as exc:
                if exc.errno == errno.EBUSY or type(exc).__name__ == "FileExpired":
                    raise changed from None
                raise
        if size != entry.size:
            raise FetchError(f"{where}: expected {entry.size} bytes (listed), received {size}; nothing was cached")
        if entry.name in sums and sha.hexdigest() != sums[entry.name]:
            raise FetchError(f"{where}: expected SHA-256 {sums[entry.name]} ({SUMS}), found {sha.hexdigest()}; "
                             f"nothing was cached")
        if not sums and entry.md5 and md5.hexdigest() != entry.md5:
            raise FetchError(f"{where}: expected MD5 {entry.md5} (its ETag), found {md5.hexdigest()}; nothing was "
                             f"cached (a store whose ETags are not MD5s needs a {SUMS} file in the folder)")
        return {entry.name: sha.hexdigest()}

    digests = {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(entries)))) as pool:
        for done in [pool.submit(one, e) for e in entries]:
            digests.update(done.result())
    return digests


def _checked_copy(target: Path, entries: list[Entry], uri: str, result: Path) -> Path:
    """``result`` when the cached folder still holds every listed file with the sha256 its
    fetch recorded (every reuse reads the files again: about 1 s per GB; the bytes were
    checked against the store when they arrived)."""
    try:
        recorded = json.loads((target / RECORD).read_text()).get("sha256") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    for entry in entries:
        path = target / entry.name
        found = path.stat().st_size if path.is_file() and not path.is_symlink() else None
        if found != entry.size:
            raise FetchError(f"{uri}: the cached copy {path} has {found} bytes, expected {entry.size}; it was changed "
                             f"after the fetch: remove {target} and run again")
        digest = recorded.get(entry.name) if isinstance(recorded, dict) else None
        if digest is None:
            raise FetchError(f"{uri}: the cached copy {target} records no sha256 of {entry.name} (fetched by an "
                             f"earlier version, or its {RECORD} changed): remove {target} and run again")
        if _sha256(path) != digest:
            raise FetchError(f"{uri}: the cached copy {path} does not have the sha256 its fetch recorded "
                             f"({RECORD}); it was changed after the fetch: remove {target} and run again")
    return result


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            sha.update(block)
    return sha.hexdigest()
