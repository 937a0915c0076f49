"""A run's persisted history: stage snapshots, checkpoints and iteration manifests.

Where each lives in the store: ``rlhf_core.record.run_layout``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_core.record import run_layout
from rlhf_core.record.run_layout import (ITERATION_FORMAT, MANIFEST, RUN_FORMATS, RunRef, checkpoint_dir,
                                        iteration_dir, iteration_of_dir)
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError

if TYPE_CHECKING:
    from rlhf_core.protocol import DataProto

ITERATION_SCHEMA_VERSION = 1


def code_version() -> dict:
    """What code produced an iteration: package version, a hash of rlhf_core's sources,
    and the git commit when running from a checkout."""
    import rlhf_core

    root = Path(rlhf_core.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    version = {"package": "rlhf-core", "source_sha256": digest.hexdigest()}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=5).stdout.strip()
        if commit:
            version["git_commit"] = commit
    except (OSError, subprocess.SubprocessError):
        pass
    return version


def iteration_manifest(cfg, state, metrics: dict, version: dict, checkpoint: str, checkpoint_sha256: dict,
                       snapshots: dict, computed_ahead: list[str] = ()) -> dict:
    """The body of an iteration's MANIFEST.json (``commit_iteration`` adds the format,
    run id, iteration number, parent and commit time): what produced the iteration and
    everything needed to continue after it. ``computed_ahead``: the stages the session
    computed before this iteration's controller started (``rlhf_core.session.prefetch``)."""
    return {"config_hash": cfg.config_hash(), "config": cfg.to_dict(), "code_version": version,
            "checkpoint": checkpoint, "checkpoint_sha256": checkpoint_sha256, "data_cursor": state.cursor, "kl_coef": state.kl_coef,
            "global_step": state.global_step,
            "rng": {"trainer_seed": cfg.trainer.seed, "rollout_seed": cfg.rollout.seed,
                    "note": "every random draw is seeded from these and the global step"},
            "stage_timings_s": {k[len("timing_s/"):]: v for k, v in metrics.items() if k.startswith("timing_s/")},
            "metrics": {k: v for k, v in metrics.items() if not k.startswith(("timing", "perf"))},
            "snapshots": snapshots, "computed_ahead": list(computed_ahead)}


def changed_fields(batch: "DataProto", previous: "DataProto") -> "DataProto":
    """The fields of ``batch`` that ``previous`` lacks or holds with other values (same
    rows), with ``batch``'s whole meta_info."""
    import numpy as np
    import torch

    old_tensors = dict(previous.batch.items()) if previous.batch is not None else {}
    tensors = [k for k, v in (batch.batch.items() if batch.batch is not None else [])
               if k not in old_tensors or old_tensors[k].shape != v.shape or old_tensors[k].dtype != v.dtype
               or not torch.equal(old_tensors[k], v)]
    columns = [k for k, v in batch.non_tensor_batch.items()
               if k not in previous.non_tensor_batch or not isinstance(v, np.ndarray)
               or v.shape != previous.non_tensor_batch[k].shape or v.tolist() != previous.non_tensor_batch[k].tolist()]
    return batch.select(tensors, columns)


class IterationStore:
    """Reads and writes one run's stage snapshots, checkpoints and iteration manifests."""

    def __init__(self, ref: RunRef, storage_options: dict | None = None) -> None:
        if not isinstance(ref, RunRef):
            raise TypeError(f"IterationStore: expected a RunRef(store, run_id); found {type(ref).__name__}")
        self.ref, self.run_id = ref, ref.run_id
        self.storage_options = storage_options
        self.run = sfs.resolve(ref.uri, storage_options)
        # the last stage saved or loaded: (iteration, its URI, a private copy of its batch);
        # the next stage's snapshot stores only what differs from it
        self._previous: tuple | None = None
        # snapshot writes run on one background thread, in stage order, so a stage's
        # snapshot is written while the next stage runs; ``flush`` (after each stage's work,
        # before a commit) waits for them
        self._writer = None
        self._pending: list = []
        self._written: dict[str, object] = {}  # the last committed stage: URI -> SnapshotInfo

    @property
    def run_uri(self) -> str:
        return self.run.uri

    def iteration_uri(self, iteration: int) -> str:
        return f"{self.run.uri}/{iteration_dir(iteration)}"

    def stage_uri(self, iteration: int, stage: str) -> str:
        return f"{self.iteration_uri(iteration)}/{stage}"

    def new_checkpoint_uri(self, step: int) -> str:
        """A fresh prefix for one write of the checkpoint after ``step`` iterations. A
        retried or second writer on the run (a direct run next to a session) gets its
        own, so a committed checkpoint is never overwritten; the manifest that commits it
        names it, and readers take it from there (``restore.weights_checkpoint``)."""
        return f"{self.run.uri}/{checkpoint_dir(step, uuid.uuid4().hex[:12])}"

    def initial_checkpoint(self) -> tuple[str, dict | None] | None:
        """(URI, {file: sha256}) of the step-0 checkpoint the run starts from, as
        ``commit_initial_checkpoint`` recorded it; None before it is recorded. The record's
        checksums are the ones every load of the step-0 checkpoint checks its bytes against
        (``restore.committed_checksums``); a record that is not one is refused in one line."""
        from rlhf_core.record.checkpoints import checked_checkpoint_uri

        record = self.initial_record()
        if record is None:
            return None
        where = f"{self.run.uri}/{run_layout.CHECKPOINTS}/{run_layout.INITIAL_CHECKPOINT}"
        return checked_checkpoint_uri(self, record["checkpoint"], 0, where), record["checkpoint_sha256"]

    def initial_record(self) -> dict | None:
        """INITIAL.json: the step-0 checkpoint's URI and checksums, and the config (and its
        hash) that wrote it; None before it is recorded."""
        loc = self.run.child(run_layout.CHECKPOINTS, run_layout.INITIAL_CHECKPOINT)
        if hasattr(loc.fs, "invalidate_cache"):
            loc.fs.invalidate_cache()
        raw = sfs.read_bytes(loc)
        if raw is not None:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) \
                    or not isinstance(body.get("checkpoint_sha256"), dict):
                from rlhf_core.checkpoint.reader import CheckpointRefusedError

                raise CheckpointRefusedError(f"{loc.uri}: expected the run's initial-checkpoint record (checkpoint, "
                                             f"checkpoint_sha256); found something else")
            return body
        return None

    def commit_initial_checkpoint(self, uri: str, checksums: dict, config: dict | None = None,
                                  config_hash: str | None = None) -> str:
        """Record ``uri`` (written and complete) as the run's step-0 checkpoint, with the
        config that wrote it (``restore.open_run`` compares it), create-only: of two
        controllers starting the run, the first record wins (both wrote the same initial
        state); returns the URI the record names."""
        body = {"checkpoint": uri, "checkpoint_sha256": checksums,
                **({"config": config, "config_hash": config_hash} if config_hash else {})}
        try:
            sfs.put_create_only(self.run.child(run_layout.CHECKPOINTS, run_layout.INITIAL_CHECKPOINT),
                                json.dumps(body, indent=1, sort_keys=True).encode())
        except SnapshotExistsError:
            pass  # another controller's initial checkpoint is the run's; ours is garbage for gc
        return self.initial_checkpoint()[0]

    # ---------------------------------------------------------------- stages

    def has(self, iteration: int, stage: str) -> bool:
        self.flush()
        loc = sfs.resolve(f"{self.stage_uri(iteration, stage)}/{run_layout.SNAPSHOT_MARKER}", self.storage_options)
        if hasattr(loc.fs, "invalidate_cache"):
            loc.fs.invalidate_cache()
        return sfs.read_bytes(loc) is not None

    def load(self, iteration: int, stage: str, standalone: bool = False) -> "DataProto":
        """The whole batch as it stood after ``stage`` (a delta composed with its chain).
        ``standalone``: a side stage's batch (validation), not the base of the next save."""
        from rlhf_core.snapshot import load_snapshot, snapshot_info

        self.flush()
        uri = self.stage_uri(iteration, stage)
        batch = load_snapshot(uri, storage_options=self.storage_options)
        if standalone:
            return batch
        self._written = {uri: snapshot_info(uri, storage_options=self.storage_options)}
        self._previous = (iteration, uri, batch.select(deepcopy=True))
        return batch

    def save(self, iteration: int, stage: str, batch: "DataProto", standalone: bool = False) -> None:
        """Commit the stage's output as a delta of the iteration's previous stage: only the
        columns it added or changed, plus its meta_info (readers compose the chain). A
        stage re-run after a restart (the stateful update stages re-run from the restored
        checkpoint) finds its snapshot committed and keeps it: snapshots are immutable.

        Returns once the delta is decided and copied; the write itself runs in the
        background (one thread, stage order: a snapshot is committed only after the one it
        is a delta of). ``flush`` waits for every write and raises the first failure.
        ``standalone``: a side stage's batch (validation): written whole, and the next
        stage's delta is of the stage before it, as if it had not run."""
        from concurrent.futures import ThreadPoolExecutor

        uri = self.stage_uri(iteration, stage)
        previous = self._previous
        if standalone:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
            self._pending.append(self._writer.submit(self._write, iteration, stage, uri, batch.select(deepcopy=True),
                                                     None, True))
            return
        if previous is not None and previous[0] == iteration and len(previous[2]) == len(batch):
            # copies are needed because later stages may change tensors in place; the
            # unchanged columns' copies are the previous stage's, so only the delta is copied
            base_uri, delta = previous[1], changed_fields(batch, previous[2]).select(deepcopy=True)
            unchanged = previous[2].select([k for k in batch.batch.keys() if k not in delta.batch.keys()],
                                           [k for k in batch.non_tensor_batch if k not in delta.non_tensor_batch],
                                           meta_info_keys=[])
            copy = unchanged.union(delta.select(meta_info_keys=[]))
            copy.meta_info = delta.meta_info
        else:
            base_uri, delta = None, batch.select(deepcopy=True)
            copy = delta
        self._previous = (iteration, uri, copy)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._pending.append(self._writer.submit(self._write, iteration, stage, uri, delta, base_uri))

    def _write(self, iteration: int, stage: str, uri: str, delta: "DataProto", base_uri: str | None,
               standalone: bool = False) -> None:
        from rlhf_core.snapshot import save_snapshot, snapshot_info

        if base_uri is not None and base_uri not in self._written:
            raise RuntimeError(f"snapshot {uri} not written: its base {base_uri} was not committed")
        try:
            info = save_snapshot(delta, uri, storage_options=self.storage_options,
                                 base=self._written.get(base_uri) if base_uri else None,
                                 annotations={"run_id": self.run_id, "iteration": iteration, "stage": stage})
        except SnapshotExistsError:
            info = snapshot_info(uri, storage_options=self.storage_options)
        if not standalone:
            self._written = {uri: info}  # the only base the next write can name

    def flush(self) -> None:
        """Wait until every snapshot ``save`` handed over is committed; raises the first
        write that failed (the iteration must then not commit)."""
        pending, self._pending = self._pending, []
        errors = []
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # the first one is the cause; later ones lack their base
                errors.append(exc)
        if errors:
            raise errors[0]

    # ---------------------------------------------------------------- leases

    def lease_log(self, iteration: int, ttl_s: float):
        """The iteration's lease (``rlhf_core.record.lease``)."""
        from rlhf_core.record.lease import LeaseLog

        return LeaseLog(self.run, iteration, ttl_s)

    # ---------------------------------------------------------------- iterations

    def committed_iterations(self) -> list[int]:
        fs = self.run.fs
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache()
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.run.path, detail=False)]
        except FileNotFoundError:
            return []
        # iterations commit in order (each continues from the one before), so the newest
        # with a manifest says which are committed: one LIST and, usually, one read,
        # however long the run (a resuming controller asks this first)
        found = sorted((n, name) for n, name in ((iteration_of_dir(name), name) for name in names) if n is not None)
        for n, name in reversed(found):
            if sfs.read_bytes(self.run.child(name, MANIFEST)) is not None:
                return [i for i, _ in found if i <= n]
        return []

    def read_manifest(self, iteration: int, format: str | None = ITERATION_FORMAT) -> dict:
        """The committed manifest of ``iteration``, checked (``manifest_schema``): a damaged
        or foreign one raises ``ManifestError``, one line naming the manifest and the key.
        ``format``: what the run records (a PPO iteration; a reward model's training epoch;
        None: either, as ``RUN_FORMATS``)."""
        from rlhf_core.record.manifest_schema import ManifestError, parse_manifest

        where = f"{self.iteration_uri(iteration)}/{MANIFEST}"
        raw = sfs.read_bytes(self.run.child(iteration_dir(iteration), MANIFEST))
        if raw is None:
            raise FileNotFoundError(f"iteration {iteration} of run {self.run_id} is not committed "
                                    f"({where} missing)")
        manifest = parse_manifest(raw, where)
        version = manifest.get("schema_version", 0)
        formats = RUN_FORMATS if format is None else (format,)
        if manifest.get("format") not in formats or not isinstance(version, int) \
                or version > ITERATION_SCHEMA_VERSION:
            raise ManifestError(f"{where}: not an iteration manifest this build reads (format "
                                f"{manifest.get('format')!r}, schema {manifest.get('schema_version')!r}; expected "
                                f"{' or '.join(map(repr, formats))}, schema <= {ITERATION_SCHEMA_VERSION})")
        if manifest.get("iteration", iteration) != iteration:
            raise ManifestError(f"{where}: iteration: expected {iteration} (the folder it is in); found "
                                f"{manifest['iteration']!r}")
        return manifest

    def run_format(self) -> str | None:
        """What the run records, as its newest committed manifest says: PPO's iterations
        (``ITERATION_FORMAT``) or a reward model's training epochs; None before a commit."""
        committed = self.committed_iterations()
        return self.read_manifest(committed[-1], format=None)["format"] if committed else None

    def commit_iteration(self, iteration: int, manifest: dict, format: str = ITERATION_FORMAT) -> str:
        """Write the iteration manifest, create-only: the iteration now exists. Its stage
        snapshots are all committed first (``flush``)."""
        self.flush()
        body = {"format": format, "schema_version": ITERATION_SCHEMA_VERSION, "run_id": self.run_id,
                "iteration": iteration, "parent_iteration": iteration - 1 if iteration > 0 else None,
                "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                **manifest}
        sfs.put_create_only(self.run.child(iteration_dir(iteration), MANIFEST),
                            json.dumps(body, indent=1, sort_keys=True).encode())
        return f"{self.iteration_uri(iteration)}/{MANIFEST}"
