"""The path grammar of a run in the store (DESIGN.md, "Snapshot layout"), in one place::

    {store}/{run_id}/iter-{N:06d}/{stage}/         a stage's snapshot (its SNAPSHOT.json last)
    {store}/{run_id}/iter-{N:06d}/MANIFEST.json    the iteration, committed last (create-only)
    {store}/{run_id}/checkpoints/step-{S:06d}-{A}/ worker + controller state after S iterations,
                                 .../trainer_state.json   written by one writer (attempt A), marker last
    {store}/{run_id}/checkpoints/INITIAL.json      which step-0 checkpoint the run starts from (create-only)
    {store}/{run_id}/leases/iter-{N:06d}/{G:08d}.json   who runs iteration N (a log of records)
    {store}/{run_id}/leases/{job}/{G:08d}.json     the lease of another exclusive job (a driver)
    {store}/{run_id}/replays/iter-{N:06d}/{stage}-{stamp}/   what-if replays, apart from the originals

Every checkpoint write goes to a fresh prefix (its attempt id), so no writer overwrites a
committed checkpoint: the manifest that commits an iteration names the one it wrote (its
``weights.checkpoint``), and readers use that URI, never one recomputed from the step.

An iteration exists once its MANIFEST.json does; everything else under it is either a
finished stage (committed snapshot) of an interrupted iteration, or garbage of a writer
that died (refused by readers). Everything that builds or parses such a path uses this
module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlhf_core.snapshot.layout import MANIFEST_NAME

SNAPSHOT_MARKER = MANIFEST_NAME  # a stage's commit marker (the snapshot format's manifest)

MANIFEST = "MANIFEST.json"
ITERATION_FORMAT = "rlhf.iteration"                               # a PPO iteration's manifest
REWARD_MODEL_TRAINING_FORMAT = "rlhf.reward_model_training"      # a reward model's training epoch's
RUN_FORMATS = (ITERATION_FORMAT, REWARD_MODEL_TRAINING_FORMAT)   # what a run in a store records
CHECKPOINTS, LEASES, REPLAYS = "checkpoints", "leases", "replays"
INITIAL_CHECKPOINT = "INITIAL.json"
_ITERATION_DIR = re.compile(r"^iter-(\d{6})$")
_CHECKPOINT_DIR = re.compile(r"^step-(\d{6})(?:-[0-9a-f]+)?$")
_LEASE_RECORD = re.compile(r"^(\d{8})\.json$")
_LOCATION = re.compile(r"^(?P<run>.+?)/(?:iter-(?P<iter>\d{6})(?:/(?P<rest>.*))?"
                       rf"|{CHECKPOINTS}/step-(?P<step>\d{{6}})(?:-[0-9a-f]+)?(?:/.*)?)$")


def iteration_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def checkpoint_dir(step: int, attempt: str | None = None) -> str:
    """The folder of one write of step S's checkpoint (``attempt``: the writer's unique id;
    None: the fixed name runs used before attempt ids, read only)."""
    return f"{CHECKPOINTS}/step-{step:06d}" + (f"-{attempt}" if attempt else "")


def step_of_checkpoint_dir(name: str) -> int | None:
    """S for a folder named ``step-SSSSSS`` or ``step-SSSSSS-A`` (inside ``checkpoints/``), else None."""
    return _number(_CHECKPOINT_DIR, name)


def lease_dir(iteration: int, job: str | None = None) -> str:
    """The lease log of iteration N, or of another exclusive ``job`` of the run."""
    return f"{LEASES}/{job or iteration_dir(iteration)}"


def lease_record(generation: int) -> str:
    return f"{generation:08d}.json"


def generation_of_lease_record(name: str) -> int | None:
    """G for a lease record named ``GGGGGGGG.json``, else None."""
    return _number(_LEASE_RECORD, name)


def _number(pattern: re.Pattern, name: str) -> int | None:
    m = pattern.match(name)
    return int(m.group(1)) if m else None


def replay_dir(iteration: int, stage: str, stamp: str) -> str:
    return f"{REPLAYS}/{iteration_dir(iteration)}/{stage}-{stamp}"


@dataclass(frozen=True)
class RunRef:
    """One run: the store that holds runs and the run's id, checked when made. Everything
    that reads or writes a run's record is handed one of these (or the IterationStore
    opened on it), never the two strings."""

    store: str
    run_id: str

    def __post_init__(self) -> None:
        from rlhf_core.record.run_ids import validate_run_id, validate_store_uri

        validate_store_uri(self.store)
        validate_run_id(self.run_id)

    @property
    def uri(self) -> str:
        return f"{self.store.rstrip('/')}/{self.run_id}"

    @classmethod
    def from_uri(cls, run_uri: str) -> "RunRef":
        """The run ``{store}/{run_id}`` names."""
        store, _, run_id = run_uri.rstrip("/").rpartition("/")
        return cls(store, run_id)


def run_id_of(run_uri: str) -> str:
    """The last part of ``{store}/{run_id}``, unchecked (``RunRef.from_uri`` checks it)."""
    return run_uri.rstrip("/").rpartition("/")[2]


def iteration_of_dir(name: str) -> int | None:
    """N for a folder named ``iter-NNNNNN``, else None."""
    return _number(_ITERATION_DIR, name)


@dataclass(frozen=True)
class Location:
    """What a URI inside a run names."""

    run_uri: str
    iteration: int | None = None   # an iteration, or something inside one
    stage: str | None = None       # the first path component inside the iteration
    step: int | None = None        # a checkpoint

    @property
    def run(self) -> RunRef:
        return RunRef.from_uri(self.run_uri)

    @property
    def iteration_uri(self) -> str | None:
        return None if self.iteration is None else f"{self.run_uri}/{iteration_dir(self.iteration)}"


def parse(uri: str) -> Location | None:
    """The run, iteration, stage or checkpoint ``uri`` names; None when it names none of
    them (a run or store URI)."""
    m = _LOCATION.match(uri.rstrip("/"))
    if m is None:
        return None
    if m.group("step") is not None:
        return Location(m.group("run"), step=int(m.group("step")))
    stage = (m.group("rest") or "").split("/", 1)[0] or None
    return Location(m.group("run"), iteration=int(m.group("iter")), stage=stage)
