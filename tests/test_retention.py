"""Retention and ``rlhf gc``: what goes, what stays, and a gc racing a live writer.

The run store is written with the real IterationStore (delta stage snapshots, manifests,
checkpoint folders, lease logs), on local disk and on SeaweedFS; no workers are needed.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.protocol import DataProto, object_column
from rlhf_core.record import retention
from rlhf_core.record.retention import MIN_GRACE_S, RetentionPolicy, collect, plan_gc
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot import IncompleteSnapshotError, load_snapshot, verify_snapshot
from rlhf_core.record.lease import LeaseLog
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef

STAGES = ("rollout", "reward", "advantage")


def _batch(seed: int, n: int = 6) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict({"input_ids": torch.randint(0, 50, (n, 4), generator=g)},
                               {"uid": object_column([f"u{i}" for i in range(n)])}, {"global_step": seed})


def _iteration(istore: IterationStore, it: int, commit: bool = True) -> str:
    """Iteration ``it``'s stages and the checkpoint after it (each under its own prefix, as
    controllers write them); committed unless ``commit`` is false. Returns the checkpoint."""
    batch = _batch(it)
    for stage in STAGES:
        batch.batch[f"{stage}_out"] = torch.full((len(batch), 4), float(it))
        istore.save(it, stage, batch)
    istore.flush()
    ckpt = sfs.resolve(istore.new_checkpoint_uri(it + 1), istore.storage_options)
    sfs.write_durably(ckpt.uri, {"actor_model.safetensors": b"w" * 1000, "trainer_state.json": b"{}"},
                      istore.storage_options)
    if commit:
        istore.commit_iteration(it, _manifest(ckpt.uri, it + 1))
    return ckpt.uri


def _manifest(checkpoint: str, step: int) -> dict:
    """What a controller commits for the iteration that wrote ``checkpoint`` (step ``step``)."""
    return {"config": RunConfig().to_dict(), "checkpoint": checkpoint, "global_step": step,
            "weights": {"checkpoint": checkpoint, "checkpoint_step": step, "redo": []}}


def _unattempted(rel: str) -> str:
    """``checkpoints/step-000003-<attempt>`` as ``checkpoints/step-000003``."""
    parts = rel.split("/")
    if parts[0] == "checkpoints":
        parts[1] = parts[1][:len("step-000000")]
    return "/".join(parts)


def later() -> dict:
    """gc with the shortest grace period, at a store time past it for everything written
    so far (as if it ran MIN_GRACE_S later): only leases and manifests protect."""
    return {"grace_s": MIN_GRACE_S, "now": time.time() + MIN_GRACE_S + 1}


@pytest.fixture(params=["local", "s3"])
def run_store(request, tmp_path):
    if request.param == "local":
        return f"file://{tmp_path}/store", None
    server = request.getfixturevalue("s3_server")
    return f"s3://{server.bucket}/{uuid.uuid4().hex}", server.storage_options


def test_policy_keeps_the_last_k_every_mth_and_always_the_newest():
    policy = RetentionPolicy(keep_checkpoints=2, keep_checkpoints_every=5, keep_snapshots=3, keep_snapshots_every=4)
    assert sorted(policy.kept_checkpoints(list(range(13)))) == [0, 5, 10, 11, 12]
    assert sorted(policy.kept_checkpoints([0, 10, 20, 30])) == [0, 10, 20, 30]  # every 5th
    assert sorted(RetentionPolicy(keep_checkpoints=2).kept_checkpoints([0, 10, 20, 30])) == [20, 30]
    assert [i for i in range(12) if policy.keeps_snapshots(i, newest=11)] == [0, 4, 8, 9, 10, 11]
    assert RetentionPolicy().kept_checkpoints([1, 2, 3]) == {1, 2, 3}
    assert all(RetentionPolicy().keeps_snapshots(s, 9) for s in range(10))
    cfg = apply_overrides(RunConfig(), ["trainer.keep_checkpoints=2", "trainer.keep_snapshots_every=4"])
    assert RetentionPolicy.from_config(cfg) == RetentionPolicy(2, 0, 0, 4)
    assert cfg.config_hash() == RunConfig().config_hash(), "what gc keeps is not part of what is trained"


def _age(istore, relpath: str, seconds: float) -> None:
    """Make every object under a local path look ``seconds`` old (S3 objects are now)."""
    root = istore.run.path + "/" + relpath
    for dirpath, _, files in os.walk(root):
        for f in files:
            past = time.time() - seconds
            os.utime(os.path.join(dirpath, f), (past, past))


def test_gc_removes_what_the_policy_lets_go_and_keeps_what_kept_iterations_need(run_store):
    store, opts = run_store
    istore = IterationStore(RunRef(store, "run-a"), opts)
    for it in range(6):
        _iteration(istore, it)
    # an orphaned writer prefix in a committed iteration (a writer that lost a race)
    orphan = sfs.resolve(f"{istore.stage_uri(1, 'reward')}/data-deadbeef", opts)
    sfs.write_durably(orphan.uri, {"zarr.json": b"{}"}, opts)
    # a committed iteration's released lease log, and a live controller on iteration 6 writing now
    done = LeaseLog(istore.run, 2, ttl_s=900)
    done.release(done.acquire("task-2"))
    assert LeaseLog(istore.run, 6, ttl_s=900).acquire("task-6").token >= 0
    _iteration(istore, 6, commit=False)
    live_orphan = sfs.resolve(f"{istore.stage_uri(6, 'rollout')}/data-inflight", opts)
    sfs.write_durably(live_orphan.uri, {"zarr.json": b"{}"}, opts)

    policy = RetentionPolicy(keep_checkpoints=2, keep_snapshots=2, keep_snapshots_every=3)
    dry = collect(istore.run_uri, policy, dry_run=True, storage_options=opts, **later())
    rel = sorted(_unattempted(u[len(istore.run_uri) + 1:]) for u in dry.all())
    assert rel == sorted([*(f"checkpoints/step-{s:06d}" for s in (1, 2, 3, 4)),
                          *(f"iter-{i:06d}/{s}" for i in (1, 2) for s in STAGES),
                          "leases/iter-000002"]), rel
    assert dry.bytes > 0
    assert IterationStore(RunRef(store, "run-a"), opts).load(1, "advantage") is not None, "a dry run removes nothing"

    done = collect(istore.run_uri, policy, storage_options=opts, **later())
    assert sorted(done.all()) == sorted(dry.all())
    fresh = IterationStore(RunRef(store, "run-a"), opts)
    assert fresh.committed_iterations() == list(range(6)), "manifests are always kept"
    for it in (0, 3, 4, 5):  # every 3rd and the last 2: their whole chains verify and load
        for stage in STAGES:
            verify_snapshot(fresh.stage_uri(it, stage), storage_options=opts)
        assert fresh.load(it, "advantage").batch["rollout_out"][0, 0].item() == it
    for it in (1, 2):  # refused as uncommitted (S3: a listing cached before gc may still show data-*)
        with pytest.raises(IncompleteSnapshotError, match="no committed snapshot|has no SNAPSHOT.json"):
            load_snapshot(fresh.stage_uri(it, "rollout"), storage_options=opts)
    if hasattr(fresh.run.fs, "invalidate_cache"):
        fresh.run.fs.invalidate_cache()
    steps = sorted({p[len(fresh.run.path):].split("/")[2][:len("step-000000")]
                    for p in fresh.run.fs.find(fresh.run.child("checkpoints").path)})
    # the last 2 of the committed steps (the newest, 6, is what resume loads) and the live
    # controller's step 7, which no committed iteration produced yet
    assert steps == ["step-000005", "step-000006", "step-000007"]
    # the live controller's iteration is untouched, its in-flight prefix included
    assert sfs.read_bytes(live_orphan.child("zarr.json")) is not None
    verify_snapshot(fresh.stage_uri(6, "advantage"), storage_options=opts)
    # nothing more to do
    assert collect(istore.run_uri, policy, storage_options=opts, **later()).all() == []


def test_orphans_younger_than_the_grace_period_stay(tmp_path):
    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-b"))
    for it in range(2):
        _iteration(istore, it)
    sfs.write_durably(f"{istore.stage_uri(0, 'reward')}/data-young", {"zarr.json": b"{}"})
    sfs.write_durably(f"{istore.stage_uri(0, 'reward')}/data-old", {"zarr.json": b"{}"})
    _age(istore, "iter-000000/reward/data-old", 7200)
    plan = plan_gc(istore.run_uri, RetentionPolicy(), grace_s=3600)
    assert [u.rsplit("/", 1)[-1] for u in plan.orphans] == ["data-old"]
    assert plan.checkpoints == [] and plan.snapshots == []


def test_gc_racing_a_writer_never_removes_what_it_commits(run_store, monkeypatch):
    """A controller keeps writing and committing iterations while gc runs again and again
    with the shortest grace period passed for all it sees and a tight policy: every iteration the policy keeps loads and
    verifies at the end, and the newest checkpoint is there. Both start together, and the
    writer waits for a gc pass between two of its iterations, so gc demonstrably ran (and
    removed what the policy drops) while iterations were being written."""
    store, opts = run_store
    # every age here is past the grace period, a live write's scratch file (which exists
    # for the milliseconds of one create-only write) included: only the grace period
    # protects those, so this test leaves them out (the scratch test covers them)
    monkeypatch.setattr(retention, "_stale_scratch", lambda *a: [])
    istore = IterationStore(RunRef(store, "run-c"), opts)
    policy = RetentionPolicy(keep_checkpoints=1, keep_snapshots=2)
    stop, errors, start = threading.Event(), [], threading.Barrier(2)
    passes_during_writes, removed_during_writes = [0], [0]
    gc_passed = threading.Condition()

    def writer():
        try:
            start.wait(timeout=60)
            for it in range(8):
                log = LeaseLog(istore.run, it, ttl_s=900)
                lease = log.acquire("controller")
                _iteration(istore, it)
                log.release(lease)
                if it in (3, 5):  # let gc act on a run that is still being written
                    with gc_passed:
                        seen = passes_during_writes[0]
                        gc_passed.wait_for(lambda: passes_during_writes[0] > seen, timeout=120)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            stop.set()

    def gc_loop():
        start.wait(timeout=60)
        while not stop.is_set():
            try:
                plan = collect(istore.run_uri, policy, storage_options=opts, **later())
            except Exception as exc:
                errors.append(exc)
                return
            with gc_passed:
                if not stop.is_set():
                    passes_during_writes[0] += 1
                    removed_during_writes[0] += len(plan.all())
                gc_passed.notify_all()

    threads = [threading.Thread(target=writer), threading.Thread(target=gc_loop)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a contender did not finish"
    assert not errors, errors
    assert passes_during_writes[0] >= 2 and removed_during_writes[0] > 0, (passes_during_writes, removed_during_writes)
    collect(istore.run_uri, policy, storage_options=opts, **later())
    fresh = IterationStore(RunRef(store, "run-c"), opts)
    assert fresh.committed_iterations() == list(range(8))
    for it in (6, 7):
        for stage in STAGES:
            verify_snapshot(fresh.stage_uri(it, stage), storage_options=opts)
    newest = fresh.read_manifest(7)["checkpoint"]
    assert sfs.read_bytes(sfs.resolve(f"{newest}/trainer_state.json", opts)) is not None


def test_a_checkpoint_committed_while_gc_plans_is_kept_and_so_is_its_lease_log(tmp_path, monkeypatch):
    """The interleaving the race above can hit: gc reads the committed iterations, then
    the writer commits iteration 1 (which names its checkpoint) and releases its lease,
    then gc looks at the checkpoint folders and the leases. The checkpoint is named by a
    commit gc did not see, and must stay; iteration 0's lease log, still held by a live
    holder after its commit, stays too."""
    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-r"))
    _iteration(istore, 0)
    LeaseLog(istore.run, 0, ttl_s=900).acquire("still-releasing")  # committed, not yet released
    log = LeaseLog(istore.run, 1, ttl_s=900)
    lease = log.acquire("controller")
    checkpoint = _iteration(istore, 1, commit=False)
    original, reads = IterationStore.committed_iterations, []

    def committed_then_the_writer_commits(self):
        seen = original(self)
        if not reads:
            reads.append(seen)
            istore.commit_iteration(1, _manifest(checkpoint, 2))
            log.release(lease)
        return seen

    monkeypatch.setattr(IterationStore, "committed_iterations", committed_then_the_writer_commits)
    plan = plan_gc(istore.run_uri, RetentionPolicy(keep_checkpoints=0), **later())
    assert reads == [[0]]  # gc planned from a list without iteration 1
    assert not [u for u in plan.all() if "step-000002" in u], plan.all()
    assert not [u for u in plan.leases if u.endswith("iter-000000")], plan.leases


def test_rlhf_gc_command_prints_what_it_removes(tmp_path, capsys):
    from rlhf_core.cli import main

    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-d"))
    for it in range(4):
        _iteration(istore, it)
    for given in (istore.run_uri, f"{tmp_path}/store/run-d", f"{tmp_path}/store/run-d/"):  # a URI, a plain path
        assert main(["gc", given, "trainer.keep_checkpoints=1", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "would remove checkpoint: checkpoints/step-000001" in out and "would remove 3 item(s)" in out, out
    assert main(["gc", istore.run_uri, "trainer.keep_checkpoints=1"]) == 0
    assert "removed 3 item(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"trainer.keep_checkpoints: expected a value >= 0; found -1"):
        main(["gc", istore.run_uri, "trainer.keep_checkpoints=-1"])


def test_gc_keeps_the_checkpoint_and_the_stage_inputs_a_redo_needs(tmp_path):
    """trainer.checkpoint_every=4: iterations 4..6 have no checkpoint of their own; their
    weights are checkpoint 4 plus a redo of 4..6. A tight policy still keeps checkpoint 4
    and the stages of 4, 5 and 6."""
    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-e"))
    for it in range(7):
        batch = _batch(it)
        for stage in STAGES:
            batch.batch[f"{stage}_out"] = torch.full((len(batch), 4), float(it))
            istore.save(it, stage, batch)
        step = it + 1
        if step % 4 == 0:
            written = istore.new_checkpoint_uri(step)
            sfs.write_durably(written, {"trainer_state.json": b"{}"})
            weights = {"checkpoint": written, "checkpoint_step": step, "redo": []}
        else:
            weights = {"checkpoint": written if step > 4 else f"{istore.run_uri}/checkpoints/step-000000-0",
                       "checkpoint_step": step - step % 4, "redo": list(range(step - step % 4, step))}
        istore.commit_iteration(it, {"config": RunConfig().to_dict(), "global_step": step, "weights": weights,
                                     "checkpoint": written if step % 4 == 0 else None})
    plan = plan_gc(istore.run_uri, RetentionPolicy(keep_checkpoints=1, keep_snapshots=1), **later())
    assert plan.checkpoints == []  # step 4 is the only one, and the newest weights start from it
    dropped = sorted({u.rsplit("/", 2)[-2] for u in plan.snapshots})
    assert dropped == [f"iter-{i:06d}" for i in range(4)], dropped


def test_gc_refuses_a_grace_below_the_floor(tmp_path):
    """`rlhf gc --grace-s -1` once removed a data-* prefix written a moment before (a
    write still under way): a grace below MIN_GRACE_S is refused in one line, by the
    command and by the library, and nothing is removed."""
    from rlhf_core.cli import main

    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "run-f"))
    _iteration(istore, 0)
    inflight = sfs.resolve(f"{istore.stage_uri(0, 'reward')}/data-inflight")
    sfs.write_durably(inflight.uri, {"zarr.json": b"{}"})
    for grace in (-1, 0, MIN_GRACE_S - 1):
        with pytest.raises(SystemExit, match=rf"^rlhf: --grace-s: expected at least {MIN_GRACE_S:g} \(.*\); "
                                             rf"found {grace:g}$"):
            main(["gc", istore.run_uri, "--grace-s", str(grace)])
        with pytest.raises(ValueError, match=rf"^grace_s: expected at least {MIN_GRACE_S:g} .*; found {grace:g}$"):
            collect(istore.run_uri, RetentionPolicy(), grace_s=grace)
    assert sfs.read_bytes(inflight.child("zarr.json")) is not None


def test_gc_ages_are_the_stores_not_this_machines(run_store, monkeypatch):
    """gc on a machine whose clock runs two hours ahead of the store: a data-* prefix
    written a moment ago is young by the store's clock (object times against the store's
    present time), so a one-hour grace keeps it; an hour later by the store it goes."""
    store, opts = run_store
    istore = IterationStore(RunRef(store, "run-g"), opts)
    _iteration(istore, 0)
    orphan = sfs.resolve(f"{istore.stage_uri(0, 'reward')}/data-young", opts)
    sfs.write_durably(orphan.uri, {"zarr.json": b"{}"}, opts)
    real = time.time
    monkeypatch.setattr(retention, "time", SimpleNamespace(time=lambda: real() + 7200))
    assert plan_gc(istore.run_uri, RetentionPolicy(), grace_s=3600, storage_options=opts).orphans == []
    aged = plan_gc(istore.run_uri, RetentionPolicy(), grace_s=3600, storage_options=opts, now=real() + 3601)
    assert aged.orphans == [orphan.uri]


def test_gc_removes_checkpoints_no_record_names(run_store):
    """Every checkpoint write has a prefix of its own and the record that commits it
    (an iteration's manifest, the run's INITIAL.json) names it. A prefix nothing names (a
    writer that lost to the committed one, or died) goes after the grace period; the
    named ones follow the policy; one that a live controller of an uncommitted iteration
    may be writing stays."""
    store, opts = run_store
    istore = IterationStore(RunRef(store, "run-h"), opts)

    def checkpoint(step: int) -> str:
        uri = istore.new_checkpoint_uri(step)
        sfs.write_durably(uri, {"__0_0.distcp": b"w" * 100, "trainer_state.json": b"{}"}, opts)
        return uri

    initial, lost = checkpoint(0), [checkpoint(0)]  # two controllers started the run
    assert istore.commit_initial_checkpoint(initial, {}) == initial
    assert istore.commit_initial_checkpoint(lost[0], {}) == initial, "the first record wins"
    named = [initial]
    for it in range(2):
        batch = _batch(it)
        istore.save(it, "rollout", batch)
        named.append(checkpoint(it + 1))
        lost.append(checkpoint(it + 1))
        istore.commit_iteration(it, {"config": RunConfig().to_dict(), "global_step": it + 1, "checkpoint": named[-1],
                                     "weights": {"checkpoint_step": it + 1, "checkpoint": named[-1], "redo": []}})
    assert LeaseLog(istore.run, 2, ttl_s=900).acquire("task-2").token >= 0
    inflight = checkpoint(3)  # iteration 2's controller holds its lease: it may be writing
    lost.append(checkpoint(4))  # iteration 3 has no live controller: a crashed writer's

    plan = collect(istore.run_uri, RetentionPolicy(keep_checkpoints=1), storage_options=opts, **later())
    assert sorted(plan.orphans) == sorted(lost)
    assert plan.checkpoints == named[:2]  # the policy keeps the newest named one
    if hasattr(istore.run.fs, "invalidate_cache"):
        istore.run.fs.invalidate_cache()
    left = {p.split("/")[-2] for p in istore.run.fs.find(istore.run.child("checkpoints").path)}  # objects
    assert left >= {named[2].rsplit("/", 1)[-1], inflight.rsplit("/", 1)[-1]}
    assert not left & {u.rsplit("/", 1)[-1] for u in lost + named[:2]}


def test_gc_removes_stale_scratch_files_and_incomplete_uploads(run_store):
    """What a writer killed mid-write leaves: a create-only write's temp file (``.tmp-*``,
    on disk; a create-only probe, anywhere) and, on S3, a multipart upload never
    completed (its parts are kept, unseen, until aborted). gc removes the ones under the
    run older than the grace period, and nothing outside the run."""
    store, opts = run_store
    istore = IterationStore(RunRef(store, "run-i"), opts)
    _iteration(istore, 0)
    scratch = sfs.resolve(f"{istore.iteration_uri(0)}/.tmp-{uuid.uuid4().hex}", opts)
    scratch.fs.pipe_file(scratch.path, b"partial")
    fs, uploads, outside = istore.run.fs, [], None
    if store.startswith("s3://"):
        def begin(path: str) -> tuple[str, str]:
            bucket, _, key = path.partition("/")
            upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
            fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
            return f"s3://{path}", upload
        uploads = [begin(f"{istore.run.path}/checkpoints/step-000001-0badc0de/actor/__0_0.distcp")]
        outside = begin(f"{istore.run.path}-other/checkpoints/step-000001-0badc0de/actor/__0_0.distcp")

    young = plan_gc(istore.run_uri, RetentionPolicy(), grace_s=3600, storage_options=opts)
    assert young.scratch == [] and young.uploads == []
    plan = collect(istore.run_uri, RetentionPolicy(), storage_options=opts, **later())
    assert plan.scratch == [scratch.uri] and plan.uploads == uploads
    assert sfs.read_bytes(scratch) is None
    if uploads:
        bucket = istore.run.path.split("/", 1)[0]
        left = {(f"s3://{bucket}/{u['Key']}", u["UploadId"]) for u in fs.list_multipart_uploads(bucket)}
        assert outside in left and not left & set(uploads)
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=outside[0].split("/", 3)[3], UploadId=outside[1])
    assert IterationStore(RunRef(store, "run-i"), opts).load(0, "advantage") is not None


def test_the_create_only_probe_writes_next_to_the_commit_not_at_the_bucket_root(s3_server, monkeypatch):
    """Credentials may cover only a run's prefix: the one-time probe that a store honours
    create-only writes goes beside the object being committed, named as scratch (gc
    removes one a killed writer left), never at the bucket's root."""
    monkeypatch.setattr(sfs, "_PROBED", {})
    run = sfs.resolve(f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/run", s3_server.storage_options)
    written = []
    real = run.fs.pipe_file
    monkeypatch.setattr(run.fs, "pipe_file", lambda path, *a, **kw: (written.append(path), real(path, *a, **kw))[1])
    sfs.put_create_only(run.child("iter-000000", "MANIFEST.json"), b"{}")
    probes = [p for p in written if not p.endswith("MANIFEST.json")]
    assert probes and all(p.startswith(f"{run.path}/iter-000000/.tmp-") for p in probes), written
    assert sfs.read_bytes(run.child("iter-000000", "MANIFEST.json")) == b"{}"
