"""A snapshot read is bounded and checked: every object against the manifest before it is
decoded, every declared size against a limit before it is allocated, and no link followed.

The attacker here can write to the store: replace an object after the commit (the
manifest untouched), or forge the manifest and every checksum with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from rlhf_core.protocol import DataProto, object_column
from rlhf_core.snapshot import (
    CorruptSnapshotError, SnapshotSchemaError, SnapshotTooLargeError, load_snapshot, save_snapshot,
    verify_snapshot,
)
from rlhf_core.snapshot import fs as sfs
from tests.test_snapshot import store  # noqa: F401 (the local-disk and S3 fixture)


def _batch(n=512, seq=4096) -> DataProto:
    """Field ``a``: one 16 MiB shard of 16 inner chunks (32 rows each); ``small``: a
    one-chunk shard; ``text``: a string column."""
    return DataProto.from_dict({"a": torch.arange(n * seq).reshape(n, seq),
                                "small": torch.ones(n, 8, dtype=torch.float32)},
                               {"text": object_column([f"row {i}" for i in range(n)])})


def _put(loc, data: bytes):
    if loc.fs.exists(loc.path):
        loc.fs.rm(loc.path)
    loc.fs.pipe_file(loc.path, data)


def _manifest(uri, opts):
    return json.loads(sfs.read_bytes(sfs.resolve(f"{uri}/SNAPSHOT.json", opts)))


def _forge(uri, opts, edit):
    """Rewrite the manifest (a forger who controls the whole bucket)."""
    manifest = _manifest(uri, opts)
    edit(manifest)
    _put(sfs.resolve(f"{uri}/SNAPSHOT.json", opts), json.dumps(manifest).encode())


def _relist(uri, opts, manifest, key):
    """The manifest entry of ``key`` recomputed from what is stored now, without parts."""
    raw = sfs.read_bytes(sfs.resolve(f"{uri}/{manifest['data_prefix']}/{key}", opts))
    manifest["objects"][key] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def test_a_chunk_altered_after_commit_is_refused_on_every_read_and_only_read_bytes_are_checked(store):
    base, opts = store
    uri = f"{base}/s"
    save_snapshot(_batch(), uri, storage_options=opts)
    manifest = _manifest(uri, opts)
    key = "batch/a/c/0/0"
    assert len(manifest["objects"][key]["parts"]) == 17, "16 inner chunks and the index"
    loc = sfs.resolve(f"{uri}/{manifest['data_prefix']}/{key}", opts)
    raw = bytearray(sfs.read_bytes(loc))
    index = struct.unpack_from("<32Q", raw, len(raw) - 16 * 16 - 4)
    offset, nbytes = index[0], index[1]  # inner chunk 0: rows 0..31
    raw[offset + nbytes // 2] ^= 0xFF
    _put(loc, bytes(raw))

    # rows in another inner chunk: only that chunk and the index are read, and they match
    assert load_snapshot(uri, storage_options=opts, fields=["a"], rows=[100]).batch["a"][0, 0].item() == 100 * 4096
    for rows in ([5], None):  # the altered chunk, alone or with the whole shard
        with pytest.raises(CorruptSnapshotError, match=r"batch/a/c/0/0: (bytes \d+\.\.\d+ do not match their "
                                                       r"checksum|checksum mismatch) \(altered after commit\)"):
            load_snapshot(uri, storage_options=opts, fields=["a"], rows=rows)
    # an object grown after commit is refused by size, reading at most one byte past it
    text = sfs.resolve(f"{uri}/{manifest['data_prefix']}/non_tensor/text/c/0", opts)
    _put(text, sfs.read_bytes(text) + b"x" * 10_000)
    with pytest.raises(CorruptSnapshotError, match=r"non_tensor/text/c/0: size \d+\+ != \d+ in the manifest"):
        load_snapshot(uri, storage_options=opts, fields=["text"])
    assert load_snapshot(uri, storage_options=opts, fields=["small"]).batch["small"].sum().item() == 512 * 8


def _blosc_bomb(decoded_bytes: int) -> bytes:
    from numcodecs import Blosc

    return Blosc(cname="lz4", clevel=9, shuffle=Blosc.BITSHUFFLE).encode(np.zeros(decoded_bytes, dtype=np.uint8))


def _shard(chunk: bytes) -> bytes:
    """A one-chunk shard holding ``chunk``, its index and the index's crc32c, as zarr writes it."""
    import google_crc32c

    index = struct.pack("<2Q", 0, len(chunk))
    return chunk + index + struct.pack("<I", google_crc32c.value(index))


PEAK = textwrap.dedent("""
    import resource, sys
    from rlhf_core.snapshot import load_snapshot
    try:
        load_snapshot(sys.argv[1], fields=["small"])
        print("loaded")
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[0][:300])
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
""")


def _peak_mib(uri: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PEAK, uri], capture_output=True, text=True, check=True,
                         timeout=300).stdout.strip().splitlines()
    return out[-2], int(out[-1])


def test_an_inflating_chunk_is_refused_before_it_decodes_with_peak_memory_bounded(tmp_path):
    """A 384 MiB blosc bomb in place of a 16 KiB chunk: refused by checksum when the manifest
    is untouched, and by its declared decoded size when the manifest is forged to match."""
    uri = str(tmp_path / "s")
    save_snapshot(_batch(), uri)
    manifest = _manifest(uri, None)
    key = "batch/small/c/0/0"
    loc = sfs.resolve(f"{uri}/{manifest['data_prefix']}/{key}", None)
    bomb = _blosc_bomb(384 << 20)
    assert len(bomb) < 4 << 20
    baseline_line, baseline = _peak_mib(uri)
    assert baseline_line == "loaded"

    _put(loc, _shard(bomb))
    line, peak = _peak_mib(uri)
    assert line.startswith("CorruptSnapshotError") and "size" in line, line
    assert peak - baseline < 128, f"peak RSS grew {peak - baseline} MiB for a refused chunk"

    _forge(uri, None, lambda m: _relist(uri, None, m, key))
    line, peak = _peak_mib(uri)
    assert line.startswith("CorruptSnapshotError") and "declares 402653184 decoded bytes" in line, line
    assert peak - baseline < 128, f"peak RSS grew {peak - baseline} MiB for a refused chunk"


def test_a_forged_string_chunk_cannot_declare_more_values_than_its_chunk(tmp_path):
    uri = str(tmp_path / "s")
    save_snapshot(_batch(n=8, seq=4), uri)
    manifest = _manifest(uri, None)
    key = "non_tensor/text/c/0"
    loc = sfs.resolve(f"{uri}/{manifest['data_prefix']}/{key}", None)
    _put(loc, struct.pack("<I", 1 << 31) + b"\0" * 64)
    _forge(uri, None, lambda m: _relist(uri, None, m, key))
    with pytest.raises(CorruptSnapshotError, match="declares 2147483648 values; the array's chunk holds 8"):
        load_snapshot(uri, fields=["text"])


def _declare_rows(rows: int):
    def edit(manifest):
        manifest["num_rows"] = rows
        for name, info in manifest["fields"].items():
            info["shape"][0] = rows
            manifest["metadata"][f"{info['array']}/zarr.json"]["shape"][0] = rows
    return edit


def test_declared_sizes_are_bounded_before_anything_is_allocated(tmp_path):
    uri = str(tmp_path / "s")
    save_snapshot(_batch(n=8, seq=4), uri)
    pristine = (tmp_path / "s" / "SNAPSHOT.json").read_bytes()
    # 2**34 rows of 4 int64: 512 GiB as declared, refused in one line before a byte is read
    _forge(uri, None, _declare_rows(1 << 34))
    with pytest.raises(SnapshotTooLargeError, match=r"reading 17179869184 rows of \['a'\] needs 512\.0 GiB as "
                                                    r"the manifest declares the fields; [\d.]+ GiB of memory"):
        load_snapshot(uri, fields=["a"])

    cases = {
        "rows": (lambda m: m["fields"]["a"]["shape"].__setitem__(0, 7),
                 r"field 'a': shape must be a list of non-negative integers starting with num_rows=8; found \[7, 4\]"),
        "elements": (_declare_rows(1 << 42), r"shape \[4398046511104, \d+\] declares \d+ elements; at most"),
        "width": (lambda m: m["fields"]["text"].__setitem__("dtype", "<U999999999"),
                  r"fixed-width string dtype '<U999999999' must be <U with a width of at most"),
        "chunk": (lambda m: m["metadata"]["batch/a/zarr.json"]["chunk_grid"]["configuration"]
                  .__setitem__("chunk_shape", [1 << 30, 4]), r"declares 34359738368 bytes per chunk; at most"),
        "gzip": (lambda m: m["metadata"]["batch/a/zarr.json"]["codecs"][0]["configuration"]["codecs"]
                 .__setitem__(1, {"name": "gzip", "configuration": {"level": 1}}),
                 r"codec 'gzip' is not allowed \(it could execute code, its decoded size cannot be checked"),
        "size": (lambda m: m["objects"]["batch/a/c/0/0"].__setitem__("size", "big"),
                 r"object 'batch/a/c/0/0' must have an integer size and a sha256"),
    }
    for name, (edit, message) in cases.items():
        (tmp_path / "s" / "SNAPSHOT.json").write_bytes(pristine)
        _forge(uri, None, edit)
        with pytest.raises(SnapshotSchemaError, match=message):
            load_snapshot(uri, fields=["a", "text"], rows=[0])


def test_no_link_is_followed_on_read_or_by_gc(tmp_path):
    from rlhf_core.record.retention import RetentionPolicy, collect
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef

    secret = tmp_path / "secret.bin"
    uri = str(tmp_path / "s")
    save_snapshot(_batch(n=8, seq=4), uri)
    manifest = _manifest(uri, None)
    chunk = tmp_path / "s" / manifest["data_prefix"] / "non_tensor" / "text" / "c" / "0"
    secret.write_bytes(chunk.read_bytes())  # same bytes: only the link gives it away
    chunk.unlink()
    os.symlink(secret, chunk)
    with pytest.raises(CorruptSnapshotError, match=r"non_tensor/text/c/0 is a symbolic link; a snapshot is read "
                                                   r"from regular files and folders only"):
        load_snapshot(uri, fields=["text"])
    with pytest.raises(CorruptSnapshotError, match=r"text/c/0: a symbolic link .* never followed"):
        verify_snapshot(uri)
    linked = tmp_path / "linked"
    os.symlink(tmp_path / "other", linked)
    save_snapshot(_batch(n=8, seq=4), str(tmp_path / "other"))
    with pytest.raises(CorruptSnapshotError, match="linked is a symbolic link"):
        load_snapshot(str(linked))

    # gc of a run whose stage is a link into another run removes the link, not the victim's stage
    from tests.test_retention import _iteration, later

    victim = IterationStore(RunRef(f"file://{tmp_path}/store", "victim"), None)
    attacker = IterationStore(RunRef(f"file://{tmp_path}/store", "attacker"), None)
    for it in range(3):
        _iteration(victim, it)
        _iteration(attacker, it)
    stage = attacker.run.child("iter-000000", "rollout").path
    import shutil
    shutil.rmtree(stage)
    os.symlink(victim.run.child("iter-000000", "rollout").path, stage)
    done = collect(attacker.run_uri, RetentionPolicy(keep_checkpoints=1, keep_snapshots=1), **later())
    assert any(u.endswith("iter-000000/rollout") for u in done.snapshots)
    assert not os.path.lexists(stage)
    verify_snapshot(victim.stage_uri(0, "rollout"))
    assert victim.load(0, "rollout") is not None


def test_a_refused_read_leaves_no_read_pending(monkeypatch):
    """The reads a refused one started are finished before the refusal surfaces: nothing
    is left pending on zarr's loop for asyncio to report at exit."""
    import asyncio

    from rlhf_core.snapshot import reader

    started = []

    async def read(store, path, meta, rows):
        started.append(asyncio.current_task())
        if path == "bad":
            raise ValueError("refused")
        await asyncio.sleep(0.3)
        if path == "also bad":
            raise ValueError("refused too")
        return path

    monkeypatch.setattr(reader, "_read_array", read)
    with pytest.raises(ValueError, match="^refused$"):
        reader._read_arrays(None, [("slow", {}), ("bad", {}), ("also bad", {})], None)
    assert len(started) == 3 and all(task.done() for task in started)
