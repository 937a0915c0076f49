"""Where a run stands and how its workers get there: open a run, checkpoints.

Used by the iteration loop (``trainer/run.py``), the long-lived session and replay; it
imports neither, so none of them imports another through it.
"""

from __future__ import annotations

import dataclasses
import json

from rlhf_core.config import ConfigError, RunConfig
from rlhf_core.workers.worker_set import TRAINER_STATE_FILE, WorkerSet, checkpoint_exists


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def open_run(cfg: RunConfig, store: str, run_id: str, log=print):
    """Read where the run stands: (IterationStore, TrainerState). A committed run must
    continue with the config it was trained with (the error lists the differences)."""
    from rlhf_core.trainer.iteration_store import IterationStore
    from rlhf_core.trainer.ppo import TrainerState

    cfg.validate()
    istore = IterationStore(store, run_id)
    state = TrainerState(kl_coef=cfg.algorithm.kl_ctrl.kl_coef)
    committed = istore.committed_iterations()
    if committed:
        last = istore.read_manifest(committed[-1])
        if last["config_hash"] != cfg.config_hash():
            diff = config_diff(last["config"], cfg.to_dict())
            raise ConfigError(f"run {run_id} was trained with another config; continuing it would mix "
                              f"them. Differences (committed -> now): {'; '.join(diff[:10])}. Use a new "
                              f"--run-id or the same overrides.")
        state = TrainerState(global_step=last["global_step"], cursor=last["data_cursor"], kl_coef=last["kl_coef"])
        log(f"[rlhf] run {run_id}: continuing after iteration {committed[-1]}")
    return istore, state


def iterations_to_run(store: str, run_id: str, total: int | None = None, more: int | None = None) -> tuple[int, int]:
    """(committed so far, iterations to run now). A count is the run's *total*: running
    the same command again after a failure finishes the fine-tune and then does nothing;
    ``more`` adds iterations to what is committed. Exactly one of the two is given."""
    from rlhf_core.trainer.iteration_store import IterationStore

    if (total is None) == (more is None):
        raise ValueError("give either a total number of iterations or a number of iterations more, not both")
    for name, value in (("iterations", total), ("more", more)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}: expected a whole number >= 0; found {value!r}")
    committed = len(IterationStore(store, run_id).committed_iterations())
    return committed, (more if more is not None else max(0, total - committed))


def save_checkpoint(workers: WorkerSet, state, cfg: RunConfig, uri: str,
                    storage_options: dict | None = None) -> dict[str, str]:
    """Everything needed to continue exactly: the trainable roles write weights,
    optimizer, LR schedule and their RNG; the controller writes its own state (global
    step, data cursor, KL coefficient) and the config hash, last (it marks the
    checkpoint complete). Returns {file: sha256} for the iteration manifest."""
    workers.start_checkpoint(uri, storage_options)
    return finish_checkpoint(workers, state, cfg, uri, storage_options)


def finish_checkpoint(workers: WorkerSet, state, cfg: RunConfig, uri: str,
                      storage_options: dict | None = None) -> dict[str, str]:
    """Wait for the checkpoint the workers started (``WorkerSet.start_checkpoint``), then
    write the controller's state, last."""
    from rlhf_core.snapshot import fs as sfs

    digests = workers.finish_checkpoint()
    body = {**dataclasses.asdict(state), "config_hash": cfg.config_hash(), "config": cfg.to_dict()}
    digests.update(sfs.write_durably(uri, {TRAINER_STATE_FILE: json.dumps(body, indent=1).encode()},
                                     storage_options))
    return dict(sorted(digests.items()))


def committed_checksums(istore, step: int) -> dict:
    """{file: sha256} of the checkpoint after ``step`` iterations as its commit recorded
    it: the manifest of iteration ``step - 1`` (which wrote it), or for step 0 the run's
    INITIAL.json (``IterationStore.initial_checkpoint``). A checkpoint whose record has no
    checksums or that no record names is refused."""
    from rlhf_core.workers.checked_load import CheckpointRefusedError

    if step == 0:
        initial = istore.initial_checkpoint()
        uri, checksums = initial if initial else (f"{istore.run_uri}/checkpoints/INITIAL.json", None)
    else:
        manifest = istore.read_manifest(step - 1)
        uri, checksums = manifest.get("checkpoint"), manifest.get("checkpoint_sha256")
    if not checksums:
        raise CheckpointRefusedError(f"{uri}: no committed checksums (the checkpoint was never committed); a "
                                     f"checkpoint is loaded only from files whose sha256 its record lists")
    return checksums


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether the iteration that ends at ``step`` writes a checkpoint: every
    ``trainer.checkpoint_every`` steps and at the run's last (``trainer.total_iterations``)."""
    return step % cfg.trainer.checkpoint_every == 0 or step >= cfg.trainer.total_iterations


def weights_plan(istore, step: int) -> tuple[int, list[int]]:
    """How to rebuild the workers' state after ``step`` iterations: (the checkpoint step
    to load, the committed iterations whose update stages to redo after it), as the
    manifest of iteration ``step - 1`` recorded it."""
    if step == 0:
        return 0, []
    weights = istore.read_manifest(step - 1)["weights"]
    return int(weights["checkpoint_step"]), [int(i) for i in weights["redo"]]


def weights_checkpoint(istore, step: int) -> str | None:
    """The URI of the checkpoint ``weights_plan(istore, step)`` starts from, as the
    committed record names it (every write has its own prefix, so it is never recomputed
    from the step): iteration ``step - 1``'s manifest, or at step 0 the run's initial
    checkpoint (None before one is committed)."""
    if step == 0:
        initial = istore.initial_checkpoint()
        return initial[0] if initial else None
    return istore.read_manifest(step - 1)["weights"]["checkpoint"]


def checkpoint_plan(cfg: RunConfig, istore):
    """What a session's controller announces in the lease of iteration N (``lease.py``):
    the fresh prefix of the checkpoint it will write after N, or None when none is due."""
    return lambda iteration: {"checkpoint": istore.new_checkpoint_uri(iteration + 1)
                              if checkpoint_due(cfg, iteration + 1) else None}


def announced_weights_checkpoint(istore, iteration: int, ttl_s: float) -> str | None:
    """``weights_checkpoint(istore, iteration + 1)`` before ``iteration`` has committed, as
    its live controller announced it in its lease: the parent of a run started ahead
    (pipelined). None while nobody live runs ``iteration`` or its holder announces
    nothing; "" when the run has no checkpoint yet."""
    latest = istore.lease_log(iteration, ttl_s).latest()
    if latest is None or latest[1].get("state") != "held" or "checkpoint" not in latest[1]:
        return None
    if istore.lease_log(iteration, ttl_s).is_free(latest[1], holder=""):
        return None  # its holder is gone: whoever takes it over announces anew
    return latest[1]["checkpoint"] or weights_checkpoint(istore, iteration) or ""


def load_checkpoint(workers: WorkerSet, istore, step: int, trainer=None) -> list[int]:
    """Restore the workers to the state after ``step`` iterations, refusing any file that
    differs from what was committed: the newest checkpoint at or before it, then a redo of
    the update stages of the iterations after it, from their committed stage inputs (on
    CPU bit-identical to having trained them; ``trainer`` runs the stages). Returns the
    iterations redone."""
    start, redo = weights_plan(istore, step)
    expected = committed_checksums(istore, start)  # refused here when no record names it
    workers.load_checkpoint(weights_checkpoint(istore, step), expected=expected)
    if redo and trainer is None:
        raise ValueError(f"step {step} is checkpoint step {start} plus a redo of iterations {redo}: pass the trainer")
    for iteration in redo:
        redo_updates(trainer, istore, iteration)
    if redo:
        trainer.actor.sync_weights()  # the engine generates with the redone weights
    return redo


def redo_updates(trainer, istore, iteration: int) -> None:
    """Run the committed ``iteration``'s stateful (update) stages again on its saved input
    (the snapshot of the stage before the first of them), as they ran the first time."""
    plan = trainer.stages()
    first = next(i for i, stage in enumerate(plan) if stage.stateful)
    before = [stage for stage in plan[:first] if stage.persisted]
    updates = [s for s in plan[first:] if s.stateful]
    for _ in trainer.run_stages(istore.load(iteration, before[-1].name), updates, notify=False):
        pass


def restore_or_init(workers: WorkerSet, istore, state, cfg: RunConfig, workers_at_step: int | None,
                    trainer=None) -> None:
    """Bring the workers to the state iteration ``state.global_step`` starts from: nothing
    to do when they are known to be there (a live session that committed it); else the
    last checkpoint and a redo of the iterations after it (``load_checkpoint``), or at step
    0 write the initial checkpoint under a fresh prefix and record it in INITIAL.json with
    its checksums (so iteration 0 can be resumed and replayed too)."""
    if workers_at_step == state.global_step:
        return
    uri = weights_checkpoint(istore, state.global_step)
    # at step 0 a run without a record of its initial checkpoint writes one under a fresh
    # prefix and records it (a folder no record names is never loaded: nothing is unchecked)
    fresh = state.global_step == 0 and istore.initial_checkpoint() is None
    if not fresh and uri is not None and checkpoint_exists(uri):
        load_checkpoint(workers, istore, state.global_step, trainer)
    elif state.global_step == 0:  # a fresh prefix, then the record that makes it the run's
        uri = istore.new_checkpoint_uri(0)
        istore.commit_initial_checkpoint(uri, save_checkpoint(workers, state, cfg, uri))
    else:
        raise FileNotFoundError(f"run {istore.run_id}: step {state.global_step} is committed but the checkpoint it "
                                f"starts from, {uri}, is missing")


