"""Which checkpoint each step of a run starts from, as its record names it: the plan a
restore follows (a checkpoint, then a redo of the updates after it), when checkpoints are
due, and what a live controller announces before it commits. Reads the record only; the
workers' side of a restore is ``rlhf_core/trainer/restore.py``."""

from __future__ import annotations

from rlhf_core.checkpoint.reader import CheckpointRefusedError
from rlhf_core.config import RunConfig
from rlhf_core.record.run_layout import ITERATION_FORMAT, REWARD_MODEL_TRAINING_FORMAT


def iterations_to_run(istore, total: int | None = None, more: int | None = None) -> tuple[int, int]:
    """(committed so far, iterations to run now). A count is the run's *total*: running
    the same command again after a failure finishes the fine-tune and then does nothing;
    ``more`` adds iterations to what is committed. Exactly one of the two is given."""
    if (total is None) == (more is None):
        raise ValueError("give either a total number of iterations or a number of iterations more, not both")
    for name, value in (("iterations", total), ("more", more)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}: expected a whole number >= 0; found {value!r}")
    run_format = istore.run_format()
    if run_format not in (None, ITERATION_FORMAT):
        raise ValueError(f"{istore.run_uri}: expected a PPO run (manifests of format {ITERATION_FORMAT!r}) to "
                         f"continue; found {run_format!r}" + (" (a reward model's training: `rlhf reward-model "
                                                              "train --run-id` continues it)"
                                                              if run_format == REWARD_MODEL_TRAINING_FORMAT else ""))
    committed = len(istore.committed_iterations())
    return committed, (more if more is not None else max(0, total - committed))


def checked_checkpoint_uri(istore, uri, step: int, where: str) -> str:
    """This run's checkpoint folder for ``step`` that ``uri`` names; refused in one line,
    before anything reads it, unless ``uri`` is ``{run}/checkpoints/step-SSSSSS[-attempt]``.
    A record is data: a URI taken from one that named another scheme, host or run would be
    fetched by whoever resumes, replays or exports.

    ``{run}`` is matched by the run id, not the store: a run copied or moved with its
    record (another bucket, a local folder for an audit) names its checkpoints where they
    were written, and what is returned, and read, is always the folder of that name in
    *this* run. The files read are checked against the record's sha256 either way."""
    from rlhf_core.record.run_ids import store_uri_problem
    from rlhf_core.record.run_layout import CHECKPOINTS, step_of_checkpoint_dir

    problem = store_uri_problem(uri)
    prefix = f"{istore.run_uri.rstrip('/')}/{CHECKPOINTS}/"
    written_at = f"/{istore.run_id}/{CHECKPOINTS}/"  # the same run, wherever it was written
    name = ""
    if problem is None and uri.startswith(prefix):
        name = uri[len(prefix):]
    elif problem is None and written_at in uri:
        name = uri.rsplit(written_at, 1)[1]
    name = name.rstrip("/")
    if problem is not None or "/" in name or step_of_checkpoint_dir(name) != step:
        raise CheckpointRefusedError(
            f"{where}: checkpoint {uri!r} is not a checkpoint of this run for step {step} (expected "
            f"{prefix}step-{step:06d}-<attempt>){'; ' + problem if problem else ''}; nothing was read from it")
    return prefix + name


def committed_checksums(istore, step: int) -> dict:
    """{file: sha256} of the checkpoint after ``step`` iterations as its commit recorded
    it: the manifest of iteration ``step - 1`` (which wrote it), or for step 0 the run's
    INITIAL.json (``IterationStore.initial_checkpoint``). A checkpoint whose record has no
    checksums or that no record names is refused."""

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
    weights = istore.read_manifest(step - 1)["weights"]
    if not weights["checkpoint"]:  # "": the run had no checkpoint yet (a record written before its first)
        return weights["checkpoint"]
    return checked_checkpoint_uri(istore, weights["checkpoint"], int(weights["checkpoint_step"]),
                                  f"{istore.iteration_uri(step - 1)}/MANIFEST.json weights")


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
    announced = latest[1]["checkpoint"]
    if announced:
        return checked_checkpoint_uri(istore, announced, iteration + 1, f"the lease of iteration {iteration}")
    return weights_checkpoint(istore, iteration) or ""


def writer_iteration(step: int, run_format: str | None) -> int:
    """The iteration whose manifest commits step S's checkpoint: in a PPO run iteration
    S - 1 (the weights after S iterations), in a reward model's training epoch S (its
    weights after that epoch; epoch 0, the evaluation before training, writes none)."""
    return step if run_format == REWARD_MODEL_TRAINING_FORMAT else step - 1


def named_checkpoints(istore, committed: list[int], run_format: str | None = None) -> dict[str, int]:
    """{folder name: step} of every checkpoint a committed record of ``committed`` names:
    a PPO run's initial one and each iteration's weights (``weights_checkpoint``); each
    epoch's checkpoint of a reward model's training. ``run_format``: the run's
    (``IterationStore.run_format``; asked when None)."""
    from rlhf_core.record.run_layout import step_of_checkpoint_dir

    if committed and (run_format or istore.run_format()) == REWARD_MODEL_TRAINING_FORMAT:
        uris = []
        for epoch in committed:
            uri = istore.read_manifest(epoch, format=REWARD_MODEL_TRAINING_FORMAT).get("checkpoint")
            if uri:
                uris.append(checked_checkpoint_uri(istore, uri, epoch, f"{istore.iteration_uri(epoch)}/MANIFEST.json"))
    else:
        uris = [weights_checkpoint(istore, step) for step in [0, *(n + 1 for n in committed)]]
    named = {}
    for uri in uris:
        if uri:
            name = uri.rstrip("/").rsplit("/", 1)[-1]
            named[name] = step_of_checkpoint_dir(name)
    return named


def newest_weights(istore, committed: list[int], run_format: str | None = None,
                   named: dict[str, int] | None = None) -> tuple[str | None, list[int]]:
    """(the checkpoint the run's newest weights are loaded from, the committed iterations
    redone after it): what a resume needs. A reward model's training resumes from its last
    epoch's checkpoint alone. ``named``: ``named_checkpoints``' answer, when asked already."""
    if not committed:
        return None, []
    if (run_format or istore.run_format()) == REWARD_MODEL_TRAINING_FORMAT:
        named = named if named is not None else named_checkpoints(istore, committed, REWARD_MODEL_TRAINING_FORMAT)
        newest = max(named, key=named.get, default=None)
        return (f"{istore.run_uri.rstrip('/')}/checkpoints/{newest}" if newest else None), []
    return weights_checkpoint(istore, committed[-1] + 1), weights_plan(istore, committed[-1] + 1)[1]
