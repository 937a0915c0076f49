"""Where a run stands and how its workers get there: open a run, write a checkpoint,
load one and redo the updates after it. Which checkpoint a step starts from is the
record's (``rlhf_core/record/checkpoints.py``); this module acts on the workers.

Used by the iteration loop (``trainer/run.py``), the long-lived session and replay; it
imports none of them, so none of them imports another through it.
"""

from __future__ import annotations

import dataclasses
import json

from rlhf_core.config import ConfigError, RunConfig
from rlhf_core.checkpoint.layout import TRAINER_STATE_FILE, checkpoint_exists
from rlhf_core.checkpoint.reader import CheckpointRefusedError
from rlhf_core.record.checkpoints import committed_checksums, weights_checkpoint, weights_plan
from rlhf_core.workers.worker_set import WorkerSet


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


def open_run(cfg: RunConfig, istore, log=print):
    """Where the run ``istore`` records stands: its TrainerState. A committed run must
    continue with the config it was trained with (the error lists the differences)."""
    from rlhf_core.trainer.ppo import TrainerState

    cfg.validate()
    run_id = istore.run_id
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
        return state
    # nothing committed yet, but a start may have written the initial checkpoint: it is this
    # config's only if that config wrote it (a reused run id would start from another model)
    initial = istore.initial_record()
    if initial is not None and initial.get("config_hash", cfg.config_hash()) != cfg.config_hash():
        recorded = initial.get("config")
        diff = config_diff(recorded, cfg.to_dict()) if isinstance(recorded, dict) else []
        raise ConfigError(f"run {run_id}'s initial checkpoint was written with another config; starting from it "
                          f"would mix them. Differences (recorded -> now): {'; '.join(diff[:10]) or 'unknown'}. "
                          f"Use a new --run-id or the same overrides.")
    return state


#: The models a run is scored or taught by, as its manifests record them: (the manifest's
#: key, the config field naming the folder, what it is, what it did to the run, the
#: trainer's identity of it now).
RECORDED_MODELS = (("reward_model", "reward_model.model.path", "the reward model", "scored", "reward_model_identity"),
                   ("teacher", "distillation.teacher_model.model_path", "the teacher", "taught", "teacher_identity"))


def check_models_unchanged(istore, trainer) -> None:
    """A run continues with the reward model that scored it and the teacher it distilled
    from: the same paths are in the config hash, and each folder's content must hash as the
    last committed iteration recorded (a model retrained in place would otherwise mix two
    rewards, or two teachers, in one run, unseen)."""
    committed = istore.committed_iterations()
    manifest = istore.read_manifest(committed[-1]) if committed else {}
    for key, field, what, did, identity in RECORDED_MODELS:
        recorded = manifest.get(key)
        if recorded is None:
            continue
        changed = model_change(recorded, getattr(trainer, identity)())
        if changed:
            raise ConfigError(f"{field}: expected {what} run {istore.run_id} was {did} by {changed} (the "
                              f"folder's content changed: restore it, or start a new --run-id)")


def model_change(recorded: dict, now: dict | None) -> str | None:
    """``(recorded path, sha256 ...); found ...`` when the model loaded now (its identity,
    or None) is not the one a manifest recorded; None when it is."""
    if now is not None and now["sha256"] == recorded["sha256"]:
        return None
    found = "no such model" if now is None else f"{now['path']} with sha256 {now['sha256'][:16]}..."
    return f"({recorded['path']}, sha256 {recorded['sha256'][:16]}...); found {found}"


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


def load_checkpoint(workers: WorkerSet, istore, step: int, trainer=None) -> list[int]:
    """Restore the workers to the state after ``step`` iterations, refusing any file that
    differs from what was committed: the newest checkpoint at or before it, then a redo of
    the update stages of the iterations after it, from their committed stage inputs (on
    CPU bit-identical to having trained them; ``trainer`` runs the stages). Returns the
    iterations redone."""
    start, redo = weights_plan(istore, step)
    expected = committed_checksums(istore, start)  # refused here when no record names it
    uri = weights_checkpoint(istore, step)
    check_checkpoint_config(istore, start, uri, expected)
    workers.load_checkpoint(uri, expected=expected)
    if redo and trainer is None:
        raise ValueError(f"step {step} is checkpoint step {start} plus a redo of iterations {redo}: pass the trainer")
    for iteration in redo:
        redo_updates(trainer, istore, iteration)
    if redo:
        trainer.actor.sync_weights()  # the engine generates with the redone weights
    workers.set_weight_version(step)  # the weights are the trainer's after `step` iterations
    return redo


def check_checkpoint_config(istore, start: int, uri: str, expected: dict[str, str]) -> None:
    """The checkpoint after ``start`` iterations was written with the config its record
    names: its own trainer_state.json (checked against the committed sha256) carries the
    config hash, compared with the manifest's (or INITIAL.json's) before any weights load."""
    from rlhf_core.checkpoint.reader import CheckedFiles
    from rlhf_core.snapshot import fs as sfs

    record = istore.initial_record() if start == 0 else istore.read_manifest(start - 1)
    recorded = (record or {}).get("config_hash")
    if recorded is None:  # an INITIAL.json from before it recorded one: nothing to compare
        return
    state = json.loads(CheckedFiles(sfs.resolve(uri, istore.storage_options), expected).get(TRAINER_STATE_FILE))
    if state.get("config_hash") != recorded:
        raise CheckpointRefusedError(
            f"{uri}/{TRAINER_STATE_FILE}: config_hash: expected {recorded[:16]}..., the hash its record names; "
            f"found {str(state.get('config_hash'))[:16]}...: the checkpoint was written with another config")


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
        istore.commit_initial_checkpoint(uri, save_checkpoint(workers, state, cfg, uri), cfg.to_dict(),
                                         cfg.config_hash())
    else:
        raise FileNotFoundError(f"run {istore.run_id}: step {state.global_step} is committed but the checkpoint it "
                                f"starts from, {uri}, is missing")
