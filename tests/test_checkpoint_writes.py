"""Checkpoint writes: each goes to a prefix of its own and becomes visible only through
the record that commits it (an iteration's manifest, the run's INITIAL.json), so no
writer overwrites a committed checkpoint; readers take the URI from the record, and runs
written before attempt ids (fixed ``step-N`` folders) still read. The workers are
stand-ins that write a checkpoint's files the way a WorkerSet does; no Ray."""

from __future__ import annotations

import hashlib
import json
import threading
from types import SimpleNamespace

import pytest

from rlhf_core.config import RunConfig
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.trainer.ppo import TrainerState
from rlhf_core.record.checkpoints import weights_checkpoint
from rlhf_core.trainer.restore import restore_or_init
from rlhf_core.trainer.run import IterationCommit, commit
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef


class StandInWorkers:
    """Writes a checkpoint in two steps like ``WorkerSet`` (started, then finished), with
    bytes of its own; remembers what it loaded."""

    def __init__(self, tag: bytes) -> None:
        self.tag, self.writing, self.loaded = tag, None, []

    def start_checkpoint(self, uri: str, storage_options=None) -> None:
        self.writing = uri

    def finish_checkpoint(self) -> dict:
        return sfs.write_durably(self.writing, {"actor.distcp": self.tag * 4096})

    def load_checkpoint(self, uri: str, storage_options=None, expected=None) -> None:
        self.loaded.append((uri, expected))

    def set_weight_version(self, version: int) -> None:
        self.version = version


def changed_files(uri: str, checksums: dict) -> list[str]:
    """The files of the checkpoint at ``uri`` whose bytes differ from ``checksums``."""
    return [name for name, digest in checksums.items()
            if hashlib.sha256(sfs.read_bytes(sfs.resolve(f"{uri}/{name}")) or b"").hexdigest() != digest]


def end_iteration_0(istore, workers) -> None:
    trainer = SimpleNamespace(state=TrainerState(global_step=1), adopted=[],
                              starting_model_identity=lambda: {"path": "builtin:digits", "sha256": "0" * 64,
                                                               "weights_sha256": None})
    commit(RunConfig(), workers, istore, trainer, 0, {}, {}, IterationCommit())


def test_a_late_writer_never_overwrites_a_committed_checkpoint(tmp_path):
    """Two controllers end iteration 0 of one run. A commits. B's lease lapsed while its
    checkpoint was being written (a fencing token cannot stop a write already under way),
    so B writes its checkpoint, other bytes, and only then is its commit refused. A's
    committed checkpoint keeps every byte A's manifest records, B's lies in a prefix of
    its own, and readers take A's from the manifest."""
    store = f"file://{tmp_path}/store"
    end_iteration_0(IterationStore(RunRef(store, "run")), StandInWorkers(b"A"))
    with pytest.raises(SnapshotExistsError, match="MANIFEST.json already exists"):
        end_iteration_0(IterationStore(RunRef(store, "run")), StandInWorkers(b"B"))
    istore = IterationStore(RunRef(store, "run"))
    manifest = istore.read_manifest(0)
    assert manifest["weights"]["checkpoint"] == manifest["checkpoint"]
    assert not changed_files(manifest["checkpoint"], manifest["checkpoint_sha256"]), "B overwrote A's checkpoint"
    assert weights_checkpoint(istore, 1) == manifest["checkpoint"]
    assert len(list((tmp_path / "store/run/checkpoints").glob("step-000001*"))) == 2


def test_controllers_starting_a_run_at_once_agree_on_its_initial_checkpoint(tmp_path):
    """Two controllers start a fresh run at the same time: each writes the initial
    checkpoint under a prefix of its own, one record (create-only) names the first; it
    is intact, and a third controller loads exactly it, checked against its checksums."""
    store = f"file://{tmp_path}/store"
    barrier, errors = threading.Barrier(2), []

    def start(tag: bytes) -> None:
        try:
            barrier.wait(timeout=30)
            restore_or_init(StandInWorkers(tag), IterationStore(RunRef(store, "run")), TrainerState(), RunConfig(), None)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(tag,)) for tag in (b"A", b"B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    record = json.loads((tmp_path / "store/run/checkpoints/INITIAL.json").read_text())
    assert not changed_files(record["checkpoint"], record["checkpoint_sha256"]), "the initial checkpoint was overwritten"
    third = StandInWorkers(b"C")
    restore_or_init(third, IterationStore(RunRef(store, "run")), TrainerState(), RunConfig(), None)
    assert third.loaded == [(record["checkpoint"], record["checkpoint_sha256"])]


def test_a_run_at_step_0_records_a_new_initial_checkpoint_rather_than_load_one_unchecked(tmp_path):
    """A run still at step 0 with a step-0 folder no INITIAL.json names (its writer died
    before recording it): nothing records its checksums, so it is not loaded; the
    controller writes the initial checkpoint under a prefix of its own and records it,
    checksums included, as the run's one step-0 record."""
    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "old"))
    sfs.write_durably(f"{istore.run_uri}/checkpoints/step-000000", {"trainer_state.json": b"{}"})
    workers = StandInWorkers(b"E")
    restore_or_init(workers, istore, TrainerState(), RunConfig(), None)
    assert workers.loaded == []
    uri, checksums = istore.initial_checkpoint()
    assert uri.startswith(f"{istore.run_uri}/checkpoints/step-000000-") and checksums
    assert not changed_files(uri, checksums) and weights_checkpoint(istore, 0) == uri
