"""Snapshot store: the same suite on local disk and on a real S3 server (SeaweedFS)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_core.protocol import DataProto, UnsupportedObjectError, object_column
from rlhf_core.snapshot import (
    CorruptSnapshotError,
    IncompleteSnapshotError,
    SnapshotAccessError,
    SnapshotExistsError,
    SnapshotSchemaError,
    list_snapshots,
    load_snapshot,
    save_snapshot,
    snapshot_info,
    verify_snapshot,
)
from rlhf_core.snapshot import fs as sfs
from rlhf_core.record.run_layout import RunRef


obj = object_column  # one object per row (lists stay cells)


def sample_batch(n=12, seq=5):
    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 1000, (n, seq), generator=g),
            "attention_mask": torch.rand(n, seq, generator=g) > 0.3,
            "old_log_probs": -torch.rand(n, seq, generator=g),
            "ref_log_prob": (-torch.rand(n, seq, generator=g)).to(torch.bfloat16),
            "values": torch.rand(n, seq, generator=g).to(torch.float16),
            "scores": torch.arange(n, dtype=torch.float64),
        },
        non_tensors={
            "uid": obj([f"p{i // 3}" for i in range(n)]),  # 3 samples per prompt
            "prompt": obj([f"What is {i} + {i}? ünïcode ✓" for i in range(n)]),
            "reward_extra": obj([{"acc": i % 2, "why": ["a", None]} if i % 2 else None for i in range(n)]),
            "data_source": np.array(["gsm8k"] * n),       # fixed-width numpy unicode
            "index": np.arange(n, dtype=np.int32),
        },
        meta_info={"temperature": 0.7, "global_step": 3, "metrics": {"x": [1.0, 2.5]}},
    )


def assert_same(a: DataProto, b: DataProto):
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for k in a.batch.keys():
        assert a.batch[k].dtype == b.batch[k].dtype, k
        assert torch.equal(a.batch[k], b.batch[k]), k
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for k in a.non_tensor_batch:
        assert a.non_tensor_batch[k].dtype == b.non_tensor_batch[k].dtype, k
        assert a.non_tensor_batch[k].tolist() == b.non_tensor_batch[k].tolist(), k
    assert a.meta_info == b.meta_info


# ------------------------------------------------------------------ backends


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(base URI, storage_options) of a fresh, empty place on each backend."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/{uuid.uuid4().hex}", server.storage_options


def put(loc, data: bytes):
    """Overwrite one object (as an attacker or a bad disk would)."""
    loc.fs.makedirs(loc.path.rsplit("/", 1)[0], exist_ok=True)
    if loc.fs.exists(loc.path):
        loc.fs.rm(loc.path)
    loc.fs.pipe_file(loc.path, data)


def objects_under(base, options, prefix):
    loc = sfs.resolve(f"{base}/{prefix}", options)
    if hasattr(loc.fs, "invalidate_cache"):
        loc.fs.invalidate_cache()
    return loc, sorted(p for p in loc.fs.find(loc.path))


# ------------------------------------------------------------------ round trips


def test_roundtrip_every_dtype_and_layer(store):
    base, opts = store
    dp = sample_batch()
    info = save_snapshot(dp, f"{base}/s", storage_options=opts)
    assert info.state == "committed" and info.num_rows == 12
    assert info.fields["ref_log_prob"]["dtype"] == "bfloat16"
    assert info.fields["ref_log_prob"]["stored_dtype"] == "uint16"
    assert_same(load_snapshot(f"{base}/s", storage_options=opts), dp)
    assert_same(load_snapshot(f"{base}/s", storage_options=opts, verify="full"), dp)


def test_empty_batch_roundtrip(store):
    base, opts = store
    dp = DataProto.from_dict({"x": torch.zeros(0, 3)}, {"uid": obj([])}, {"k": 1})
    save_snapshot(dp, f"{base}/empty", storage_options=opts)
    back = load_snapshot(f"{base}/empty", storage_options=opts)
    assert len(back) == 0 and back.batch["x"].shape == (0, 3) and back.meta_info == {"k": 1}


def test_partial_reads_fields_rows_and_uids(store):
    base, opts = store
    dp = sample_batch()
    uri = f"{base}/s"
    save_snapshot(dp, uri, storage_options=opts)
    only = load_snapshot(uri, fields=["old_log_probs", "prompt"], storage_options=opts)
    assert list(only.batch.keys()) == ["old_log_probs"] and list(only.non_tensor_batch) == ["prompt"]
    assert only.meta_info == dp.meta_info
    assert_same(load_snapshot(uri, rows=slice(2, 9, 3), storage_options=opts), dp.slice(2, 9, 3))
    assert_same(load_snapshot(uri, rows=[7, 1, 1], storage_options=opts), dp.select_idxs([7, 1, 1]))
    mask = np.arange(12) % 5 == 0
    assert_same(load_snapshot(uri, rows=mask, storage_options=opts), dp.select_idxs(mask))
    by_uid = load_snapshot(uri, uids=["p3", "p0"], storage_options=opts)
    assert_same(by_uid, dp.select_idxs([9, 10, 11, 0, 1, 2]))


def test_partial_read_errors_name_what_exists(store):
    base, opts = store
    save_snapshot(sample_batch(), f"{base}/s", storage_options=opts)
    with pytest.raises(KeyError, match=r"no field\(s\) \['nope'\]; available: \['attention_mask'"):
        load_snapshot(f"{base}/s", fields=["nope"], storage_options=opts)
    with pytest.raises(KeyError, match=r"uid\(s\) \['zz'\] not in this snapshot \(4 distinct uids\)"):
        load_snapshot(f"{base}/s", uids=["zz"], storage_options=opts)
    with pytest.raises(IndexError, match="out of range for a snapshot of 12 rows"):
        load_snapshot(f"{base}/s", rows=[12], storage_options=opts)


def test_partial_read_touches_only_the_chosen_field_and_chunk(tmp_path, monkeypatch):
    from zarr.storage import WrapperStore

    n, seq = 512, 4096  # each int64 row is 32 KiB, so one row's chunk is a small part
    dp = DataProto.from_dict({"a": torch.arange(n * seq).reshape(n, seq),
                              "b": torch.zeros(n, seq)},
                             {"uid": obj([f"u{i}" for i in range(n)])})
    uri = str(tmp_path / "s")
    info = save_snapshot(dp, uri)
    reads = []

    class Counting(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            result = await self._store.get(key, prototype, byte_range)
            reads.append((key, 0 if result is None else len(result.to_bytes())))
            return result

    real = sfs.zarr_store
    monkeypatch.setattr(sfs, "zarr_store", lambda loc, read_only: Counting(real(loc, read_only=read_only)))
    part = load_snapshot(uri, fields=["a"], uids=["u200"])
    assert part.batch["a"].tolist() == [list(range(200 * seq, 201 * seq))]
    touched = {k for k, _ in reads}
    assert not any(k.startswith("batch/b") for k in touched), touched
    a_bytes = sum(size for k, size in reads if k.startswith("batch/a/c"))
    field_bytes = info.fields["a"] and sum(
        o["size"] for k, o in json.loads((tmp_path / "s" / "SNAPSHOT.json").read_text())["objects"].items()
        if k.startswith("batch/a/c"))
    assert 0 < a_bytes < field_bytes / 4, f"read {a_bytes} of {field_bytes} stored bytes of field a"


def test_list_snapshots_finds_committed_and_incomplete(store):
    base, opts = store
    save_snapshot(sample_batch(4), f"{base}/run/iter-000000/rollout", storage_options=opts)
    save_snapshot(sample_batch(4), f"{base}/run/iter-000000/reward", storage_options=opts)
    # a writer that died after writing data but before its manifest
    put(sfs.resolve(f"{base}/run/iter-000001/rollout/data-deadbeef/zarr.json", opts), b"{}")
    infos = list_snapshots(f"{base}/run", storage_options=opts)
    assert [i.uri.rsplit("/", 2)[-2:] for i in infos] == [["iter-000000", "reward"], ["iter-000000", "rollout"]]
    everything = list_snapshots(f"{base}/run", storage_options=opts, include_incomplete=True)
    assert [(i.uri.rsplit("/", 2)[-2], i.state) for i in everything][-1] == ("iter-000001", "incomplete")
    assert list_snapshots(f"{base}/nothing-here", storage_options=opts) == []


def test_annotations_are_kept(store):
    base, opts = store
    save_snapshot(sample_batch(3), f"{base}/r", storage_options=opts,
                  annotations={"replay_of": "s3://x/y", "override": {"clip": 0.3}})
    assert snapshot_info(f"{base}/r", storage_options=opts).annotations == {
        "replay_of": "s3://x/y", "override": {"clip": 0.3}}


# ------------------------------------------------------------------ commit protocol


def test_second_commit_is_refused_and_first_is_untouched(store):
    base, opts = store
    first = save_snapshot(sample_batch(), f"{base}/s", storage_options=opts)
    with pytest.raises(SnapshotExistsError, match="already holds a committed snapshot"):
        save_snapshot(sample_batch(5), f"{base}/s", storage_options=opts)
    assert verify_snapshot(f"{base}/s", storage_options=opts).manifest_sha256 == first.manifest_sha256


def test_racing_writers_one_wins_and_the_loser_cleans_up(store, monkeypatch):
    base, opts = store
    uri = f"{base}/race"
    # Both writers pass the early existence check, as two processes would, and write at
    # the same time (threads released together): exactly one commit lands.
    monkeypatch.setattr(sfs, "read_bytes", lambda loc: None)
    go, results = threading.Barrier(2), {}

    def write(rows: int) -> None:
        go.wait(timeout=30)
        try:
            results[rows] = save_snapshot(sample_batch(rows), uri, storage_options=opts)
        except SnapshotExistsError as exc:
            results[rows] = exc

    writers = [threading.Thread(target=write, args=(rows,)) for rows in (4, 6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join(60)
    monkeypatch.undo()
    assert not any(t.is_alive() for t in writers) and set(results) == {4, 6}
    lost = [rows for rows, r in results.items() if isinstance(r, SnapshotExistsError)]
    assert len(lost) == 1, results
    won = 10 - lost[0]
    winner = results[won]
    assert_same(load_snapshot(uri, storage_options=opts, verify="full"), sample_batch(won))
    _, paths = objects_under(base, opts, "race")
    prefixes = {p.split("/race/")[1].split("/")[0] for p in paths}
    assert prefixes == {"SNAPSHOT.json", winner.data_prefix}, prefixes


def test_missing_manifest_is_incomplete(store):
    base, opts = store
    with pytest.raises(IncompleteSnapshotError, match="no committed snapshot at"):
        load_snapshot(f"{base}/never", storage_options=opts)
    save_snapshot(sample_batch(), f"{base}/s", storage_options=opts)
    loc = sfs.resolve(f"{base}/s/SNAPSHOT.json", opts)
    loc.fs.rm(loc.path)
    with pytest.raises(IncompleteSnapshotError, match="did not commit.*uncommitted data"):
        load_snapshot(f"{base}/s", storage_options=opts)


WRITER = textwrap.dedent("""
    import sys, time, torch, numpy as np
    from rlhf_core.protocol import DataProto
    from rlhf_core.snapshot import writer
    real = writer._Uploader._put
    def put_then_stall(self, key, raw):
        real(self, key, raw)
        open(sys.argv[2], "w").write("an object is out")
        time.sleep(600)  # the test kills us here, mid-snapshot
    writer._Uploader._put = put_then_stall
    dp = DataProto.from_dict({"a": torch.ones(64, 64), "b": torch.zeros(64, 64)})
    writer.save_snapshot(dp, sys.argv[1], max_workers=1)
""")


def test_sigkilled_writer_leaves_nothing_a_reader_accepts(tmp_path, s3_server, request):
    for backend in ("local", "s3"):
        if backend == "local":
            base, opts, env = str(tmp_path / "kill"), None, {}
        else:
            base, opts, env = f"s3://{s3_server.bucket}/kill-{uuid.uuid4().hex}", s3_server.storage_options, s3_server.env
        committed = save_snapshot(sample_batch(), f"{base}/iter-000000/rollout", storage_options=opts)
        marker = tmp_path / f"{backend}.started"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, f"{base}/iter-000001/rollout", str(marker)],
                                env={**os.environ, **env})
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert proc.poll() is None, "writer exited before it was killed"
                assert time.monotonic() < deadline, "writer never got going"
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        with pytest.raises(IncompleteSnapshotError, match="did not commit"):
            load_snapshot(f"{base}/iter-000001/rollout", storage_options=opts)
        again = verify_snapshot(f"{base}/iter-000000/rollout", storage_options=opts)
        assert again.manifest_sha256 == committed.manifest_sha256
        states = {i.uri.rsplit("/", 2)[-2]: i.state
                  for i in list_snapshots(base, storage_options=opts, include_incomplete=True)}
        assert states == {"iter-000000": "committed", "iter-000001": "incomplete"}


# ------------------------------------------------------------------ corruption


def test_full_verify_refuses_deleted_resized_or_altered_chunks(store):
    base, opts = store
    for damage in ("delete", "resize", "alter"):
        uri = f"{base}/{damage}"
        info = save_snapshot(sample_batch(), uri, storage_options=opts)
        loc = sfs.resolve(f"{uri}/{info.data_prefix}/batch/old_log_probs/c/0/0", opts)
        raw = loc.fs.cat_file(loc.path)
        if damage == "delete":
            loc.fs.rm(loc.path)
        elif damage == "resize":
            put(loc, raw + b"\0")
        else:
            put(loc, raw[:-1] + bytes([raw[-1] ^ 0xFF]))
        expected = {"delete": "missing", "resize": "size", "alter": "checksum mismatch"}[damage]
        with pytest.raises(CorruptSnapshotError, match=rf"batch/old_log_probs/c/0/0: {expected}"):
            load_snapshot(uri, storage_options=opts, verify="full")
        if damage == "delete":  # even the cheap check never fills a lost chunk with zeros
            with pytest.raises(CorruptSnapshotError, match="c/0/0 is listed in the manifest but missing"):
                load_snapshot(uri, storage_options=opts, fields=["old_log_probs"])


def test_altered_metadata_object_is_never_used_and_full_verify_flags_it(store):
    base, opts = store
    info = save_snapshot(sample_batch(), f"{base}/s", storage_options=opts)
    loc = sfs.resolve(f"{base}/s/{info.data_prefix}/batch/input_ids/zarr.json", opts)
    doc = json.loads(loc.fs.cat_file(loc.path))
    doc["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
    put(loc, json.dumps(doc).encode())
    # Readers decode with the metadata committed in the manifest, not the object.
    assert_same(load_snapshot(f"{base}/s", storage_options=opts), sample_batch())
    with pytest.raises(CorruptSnapshotError, match="input_ids/zarr.json: (size|checksum)"):
        load_snapshot(f"{base}/s", storage_options=opts, verify="full")


def _rewrite_manifest(base, opts, name, edit):
    loc = sfs.resolve(f"{base}/{name}/SNAPSHOT.json", opts)
    manifest = json.loads(loc.fs.cat_file(loc.path))
    edit(manifest)
    put(loc, json.dumps(manifest).encode())


def test_newer_schema_version_is_refused(store):
    base, opts = store
    save_snapshot(sample_batch(), f"{base}/s", storage_options=opts)
    _rewrite_manifest(base, opts, "s", lambda m: m.update(schema_version=99))
    with pytest.raises(SnapshotSchemaError, match="schema_version 99 is not readable by this build"):
        load_snapshot(f"{base}/s", storage_options=opts)


class _Canary:
    """Unpickling this would create a file: the proof that nothing was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_coded_arrays_are_refused_and_never_unpickled(tmp_path):
    import hashlib
    import pickle

    canary = tmp_path / "UNPICKLED"
    base = str(tmp_path / "evil")
    info = save_snapshot(sample_batch(), f"{base}/s")
    data = tmp_path / "evil" / "s" / info.data_prefix

    # 1) a zarr v2 array with numcodecs' pickle object codec, listed in a valid manifest
    payload = pickle.dumps(obj([_Canary(str(canary))]))
    v2 = data / "non_tensor" / "prompt"
    for f in v2.iterdir():
        if f.is_dir():
            import shutil
            shutil.rmtree(f)
        else:
            f.unlink()
    (v2 / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": None,
        "fill_value": None, "filters": [{"id": "pickle", "protocol": 5}], "order": "C"}))
    (v2 / "0").write_bytes(payload)

    def relist(manifest):
        objects = {}
        for path in sorted(data.rglob("*")):
            if path.is_file():
                raw = path.read_bytes()
                objects[str(path.relative_to(data))] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        manifest["objects"] = objects
        manifest["metadata"] = {k: v for k, v in manifest["metadata"].items() if k in objects}

    _rewrite_manifest(base, None, "s", relist)
    with pytest.raises(SnapshotSchemaError, match=r"lists no non_tensor/prompt/zarr.json \(found zarr v2 metadata"):
        load_snapshot(f"{base}/s", verify="full")
    assert not canary.exists()

    # 2) a zarr v3 array whose codec list names a pickle codec, the manifest and every
    # checksum consistent with it (a forger who controls the whole bucket)
    meta_path = data / "batch" / "input_ids" / "zarr.json"
    doc = json.loads(meta_path.read_text())
    doc["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
    meta_path.write_text(json.dumps(doc))

    def forge(manifest):
        relist(manifest)
        manifest["metadata"]["batch/input_ids/zarr.json"] = doc

    _rewrite_manifest(base, None, "s", forge)
    with pytest.raises(SnapshotSchemaError, match="codec 'numcodecs.pickle' is not allowed"):
        load_snapshot(f"{base}/s", fields=["input_ids"], verify="full")
    assert not canary.exists()


# ------------------------------------------------------------------ bad input


def test_unsupported_object_is_refused_before_anything_is_committed(store):
    base, opts = store
    dp = sample_batch(3)
    dp.non_tensor_batch["raw_image"] = obj([b"\x89PNG", None, None])
    with pytest.raises(UnsupportedObjectError, match=r"non_tensor_batch\['raw_image'\].*builtins.bytes"):
        save_snapshot(dp, f"{base}/s", storage_options=opts)
    with pytest.raises(IncompleteSnapshotError):
        load_snapshot(f"{base}/s", storage_options=opts)


def test_wrong_credentials_fail_fast_with_a_clear_error(s3_server):
    bad = {**s3_server.storage_options, "secret": "not-the-secret"}
    outcome = {}

    def attempt():
        try:
            save_snapshot(sample_batch(2), f"s3://{s3_server.bucket}/denied", storage_options=bad)
        except Exception as exc:
            outcome["exc"] = exc

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=120)  # a hang guard, not a speed check
    assert not worker.is_alive(), "save_snapshot hung on bad credentials"
    exc = outcome.get("exc")
    assert isinstance(exc, SnapshotAccessError), repr(exc)
    assert "refused" in str(exc) and "AWS_SECRET_ACCESS_KEY" in str(exc)
    assert "not-the-secret" not in str(exc)


def test_credentials_from_environment_and_never_stored(s3_server, monkeypatch):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    uri = f"s3://{s3_server.bucket}/env-{uuid.uuid4().hex}"
    save_snapshot(sample_batch(3), uri)  # no storage_options: AWS_* variables only
    assert_same(load_snapshot(uri, verify="full"), sample_batch(3))
    loc = sfs.resolve(uri, None)
    for path in loc.fs.find(loc.path):
        raw = loc.fs.cat_file(path)
        assert s3_server.secret_key.encode() not in raw and s3_server.access_key.encode() not in raw, path


# ------------------------------------------------------------------ S3 commit edge cases


def _wrap_s3_calls(fs, monkeypatch, hook):
    """Route the S3 client's calls through ``hook(call, method, kwargs)`` (the real call)."""
    real = fs._call_s3

    async def call(method, *args, **kwargs):
        return await hook(lambda: real(method, *args, **kwargs), method, kwargs)

    monkeypatch.setattr(fs, "_call_s3", call)


def test_a_retried_commit_whose_first_answer_was_lost_succeeds(s3_server, monkeypatch):
    """The client's PUT of the manifest lands, its answer is lost, the retry gets 412:
    the snapshot is committed once, its data kept, and it reads back whole."""
    from rlhf_core.snapshot import fs as sfs

    uri = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/s"
    fs = sfs.resolve(uri, s3_server.storage_options).fs
    attempts = []

    async def lose_first_answer(real, method, kwargs):
        if method == "put_object" and kwargs.get("IfNoneMatch") == "*" and kwargs["Key"].endswith("SNAPSHOT.json"):
            attempts.append(kwargs["Key"])
            await real()  # it lands ...
            return await real()  # ... and the client's retry meets the object it just wrote: 412
        return await real()

    _wrap_s3_calls(fs, monkeypatch, lose_first_answer)
    dp = sample_batch()
    save_snapshot(dp, uri, storage_options=s3_server.storage_options)
    assert len(attempts) == 1
    monkeypatch.undo()
    assert_same(load_snapshot(uri, storage_options=s3_server.storage_options, verify="full"), dp)
    # a different writer's commit to the same URI is still refused
    with pytest.raises(SnapshotExistsError):
        save_snapshot(dp, uri, storage_options=s3_server.storage_options)


def test_a_409_is_retried_then_raised_as_a_typed_error(s3_server, monkeypatch):
    from botocore.exceptions import ClientError

    from rlhf_core.snapshot import CommitConflictError
    from rlhf_core.snapshot import fs as sfs

    from s3fs.errors import translate_boto_error

    # what AWS S3 answers, as the S3 client library hands it over
    conflict = translate_boto_error(ClientError(
        {"Error": {"Code": "ConditionalRequestConflict", "Message": "A conflicting conditional operation is "
                   "currently in progress against this resource. Please try again."},
         "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject"))
    uri = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/obj"
    loc = sfs.resolve(uri, s3_server.storage_options)
    sfs.check_create_only(loc)  # probe first, outside the injected failures
    failures = {"left": 2}

    async def conflict_twice(real, method, kwargs):
        if method == "put_object" and kwargs.get("IfNoneMatch") == "*" and failures["left"]:
            failures["left"] -= 1
            raise conflict
        return await real()

    _wrap_s3_calls(loc.fs, monkeypatch, conflict_twice)
    sfs.put_create_only(loc, b"payload")  # two 409s, then it goes through
    assert failures["left"] == 0 and sfs.read_bytes(loc) == b"payload"
    failures["left"] = 100
    with pytest.raises(CommitConflictError, match="answered 409"):
        sfs.put_create_only(sfs.resolve(uri + "2", s3_server.storage_options), b"x")


def test_a_store_that_ignores_if_none_match_is_refused(s3_server, monkeypatch):
    from rlhf_core.snapshot import UnsupportedStoreError
    from rlhf_core.snapshot import fs as sfs

    loc = sfs.resolve(f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/obj", s3_server.storage_options)

    async def drop_condition(real, method, kwargs):
        kwargs.pop("IfNoneMatch", None)  # what a store without conditional writes does
        return await real()

    _wrap_s3_calls(loc.fs, monkeypatch, drop_condition)
    monkeypatch.setattr(sfs, "_PROBED", {})
    with pytest.raises(UnsupportedStoreError, match="does not honour conditional writes"):
        sfs.put_create_only(loc, b"x")
    assert sfs.read_bytes(loc) is None  # nothing committed


def test_local_commit_is_idempotent_for_the_same_bytes(tmp_path):
    from rlhf_core.snapshot import fs as sfs

    loc = sfs.resolve(str(tmp_path / "m.json"))
    sfs.put_create_only(loc, b"same")
    sfs.put_create_only(loc, b"same")  # a retry of our own write
    with pytest.raises(SnapshotExistsError):
        sfs.put_create_only(loc, b"other")


# ------------------------------------------------------------------ delta snapshots


def test_a_delta_stores_only_what_changed_and_reads_as_the_whole_batch(store):
    from rlhf_core.record.iteration_store import changed_fields

    base_uri, opts = store
    full = sample_batch()
    first = save_snapshot(full.select(["input_ids", "attention_mask", "old_log_probs"], ["uid", "prompt"]),
                          f"{base_uri}/iter/rollout", storage_options=opts)
    later = sample_batch()
    later.batch["old_log_probs"] = later.batch["old_log_probs"] * 2  # changed
    later.meta_info["stage"] = "reward"
    delta = changed_fields(later, full.select(["input_ids", "attention_mask", "old_log_probs"], ["uid", "prompt"]))
    assert sorted(delta.batch.keys()) == ["old_log_probs", "ref_log_prob", "scores", "values"]
    assert sorted(delta.non_tensor_batch) == ["data_source", "index", "reward_extra"]
    info = save_snapshot(delta, f"{base_uri}/iter/reward", storage_options=opts, base=first)
    assert info.base == "../rollout" and "input_ids" not in info.fields
    assert_same(load_snapshot(f"{base_uri}/iter/reward", storage_options=opts), later)
    # partial reads reach into the chain: fields from the base, rows and uids as asked
    part = load_snapshot(f"{base_uri}/iter/reward", fields=["input_ids", "old_log_probs", "uid"], rows=[1, 4],
                         storage_options=opts)
    assert torch.equal(part.batch["input_ids"], full.batch["input_ids"][[1, 4]])
    assert torch.equal(part.batch["old_log_probs"], later.batch["old_log_probs"][[1, 4]])
    by_uid = load_snapshot(f"{base_uri}/iter/reward", uids=["p2"], fields=["scores"], storage_options=opts)
    assert by_uid.batch["scores"].tolist() == [6.0, 7.0, 8.0]
    assert verify_snapshot(f"{base_uri}/iter/reward", storage_options=opts).base == "../rollout"


def test_a_delta_refuses_a_base_that_is_not_the_one_it_was_written_against(store):
    base_uri, opts = store
    first = save_snapshot(sample_batch().select(["input_ids"], []), f"{base_uri}/it/a", storage_options=opts)
    save_snapshot(sample_batch().select(["scores"], []), f"{base_uri}/it/b", storage_options=opts, base=first)
    _rewrite_manifest(base_uri, opts, "it/a", lambda m: m["annotations"].update(tampered=True))
    with pytest.raises(CorruptSnapshotError, match=r"its base .*/it/a is not the snapshot it was written against"):
        load_snapshot(f"{base_uri}/it/b", storage_options=opts)
    # a base reference can only name a sibling
    _rewrite_manifest(base_uri, opts, "it/b", lambda m: m.update(base={"path": "../../x/a", "manifest_sha256": "0"}))
    with pytest.raises(SnapshotSchemaError, match=r"is not a sibling snapshot reference"):
        load_snapshot(f"{base_uri}/it/b", storage_options=opts)


def test_iteration_store_writes_in_the_background_and_commits_nothing_after_a_failed_write(tmp_path):
    """Stage snapshots are written on a background thread: a stage may change a tensor in
    place right after handing it over without changing what is stored; a write that fails
    surfaces at the commit, which then writes no manifest (and the stages after the failed
    one, deltas of it, are not written either)."""
    from rlhf_core.record.iteration_store import IterationStore

    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-1"))
    batch = sample_batch().select(["input_ids", "attention_mask"], ["uid"])
    saved = batch.select(deepcopy=True)
    istore.save(0, "rollout", batch)
    batch.batch["input_ids"].add_(1)  # the next stage works in place at once
    istore.flush()
    assert_same(load_snapshot(istore.stage_uri(0, "rollout")), saved)

    batch.non_tensor_batch["bad"] = np.array([{1, 2}] * len(batch), dtype=object)  # sets cannot be stored
    istore.save(0, "reward", batch)
    del batch.non_tensor_batch["bad"]
    batch.batch["scores"] = torch.ones(len(batch))
    istore.save(0, "advantage", batch)
    with pytest.raises(UnsupportedObjectError):
        istore.commit_iteration(0, {"note": "must not be written"})
    assert not os.path.exists(tmp_path / "store" / "run-1" / "iter-000000" / "MANIFEST.json")
    assert [i.uri.rsplit("/", 1)[-1] for i in list_snapshots(istore.iteration_uri(0))] == ["rollout"]


def test_iteration_store_writes_each_stage_as_a_delta_of_the_one_before(tmp_path):
    from rlhf_core.record.iteration_store import IterationStore

    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-1"))
    batch = sample_batch().select(["input_ids", "attention_mask"], ["uid", "prompt"])
    istore.save(0, "rollout", batch)
    batch.batch["scores"] = torch.arange(len(batch), dtype=torch.float64)
    batch.non_tensor_batch["data_source"] = np.array(["gsm8k"] * len(batch))
    istore.save(0, "reward", batch)
    batch.meta_info["kl_coef"] = 0.1  # a stage that adds nothing but meta
    istore.save(0, "advantage", batch)
    istore.flush()  # the writes run in the background
    infos = {i.uri.rsplit("/", 1)[-1]: i for i in list_snapshots(istore.iteration_uri(0))}
    assert set(infos["reward"].fields) == {"scores", "data_source"} and infos["reward"].base == "../rollout"
    assert infos["advantage"].fields == {} and infos["advantage"].base == "../reward"
    assert infos["advantage"].num_rows == len(batch)
    fresh = IterationStore(RunRef(f"file://{tmp_path}/store", "run-1"))  # another controller process
    assert_same(fresh.load(0, "advantage"), batch)
    # a stage saved after a load (a resumed iteration) is a delta of the loaded one
    loaded = fresh.load(0, "advantage")
    loaded.batch["values"] = torch.ones(len(loaded), 5)
    fresh.save(0, "values", loaded)
    fresh.flush()
    assert set(snapshot_info(fresh.stage_uri(0, "values")).fields) == {"values"}
    assert_same(load_snapshot(fresh.stage_uri(0, "values")), loaded)


# ------------------------------------------------------------------ older formats

SCHEMA1 = Path(__file__).parent / "data" / "schema1-snapshot"


def test_a_schema_1_snapshot_written_by_the_old_writer_still_reads():
    """tests/data/schema1-snapshot was written by the writer of commit c91df48 (schema 1,
    before delta snapshots): today's reader verifies it in full, loads it whole and in
    part, and reports its schema version."""
    manifest = json.loads((SCHEMA1 / "SNAPSHOT.json").read_text())
    assert manifest["schema_version"] == 1 and "base" not in manifest
    uri = f"file://{SCHEMA1}"
    assert verify_snapshot(uri).schema_version == 1
    dp = load_snapshot(uri, verify="full")
    assert torch.equal(dp.batch["ids"], torch.arange(12, dtype=torch.int64).reshape(4, 3))
    assert torch.equal(dp.batch["scores"], torch.linspace(0, 1, 8, dtype=torch.float32).reshape(4, 2))
    assert dp.batch["mask"].dtype == torch.int32 and dp.batch["mask"].sum().item() == 6
    assert list(dp.non_tensor_batch["uid"]) == ["a", "b", "c", "d"]
    assert list(dp.non_tensor_batch["text"]) == ["x", "yy", "", "zzz"]
    assert dp.meta_info == {"global_step": 3, "note": "schema 1"}
    part = load_snapshot(uri, fields=["scores", "text"], rows=[1, 3])
    assert set(part.batch.keys()) == {"scores"} and list(part.non_tensor_batch["text"]) == ["yy", "zzz"]
