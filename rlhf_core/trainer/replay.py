"""Replay a stage of a committed iteration from what was saved, and compare.

A stage's recorded input is the batch as it stood before the stage: the previous stage's
snapshot (each snapshot is the whole batch), or for ``rollout`` the prompt batch that the
data cursor of the parent iteration yields. The workers start from the checkpoint the
iteration started from, so every stage sees exactly the state it saw the first time;
the stateful stages (``update_critic``, ``update_actor``) each get that checkpoint
reloaded before they run, and their replayed weights are compared with the checkpoint
the iteration committed.

With config overrides the replay answers "what would this stage have produced"; its
output is saved as a new snapshot under ``{run}/replays/`` marked as a replay of the
original, which is never touched.

The config comes from the stored manifest, and with it ``reward.function``, which names
code: the replay imports it only when it is built in or registered by an installed
package, named by the replay's own ``--override``, or the caller trusts the manifest's
choice (``trust_reward_function``, ``--trust-reward-function``).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_core.record import run_layout
from rlhf_core.record.run_layout import RunRef
from rlhf_core.record.checkpoints import checked_checkpoint_uri
from rlhf_core.config import ConfigError, RunConfig, apply_overrides, config_from_dict, fields_where
from rlhf_core.protocol import DataProto
from rlhf_core.trainer import stages as stage_table

#: Config fields a checkpoint's tensors depend on (``checkpoint=True``): a replay cannot change them.
CHECKPOINT_FIELDS = tuple(fields_where(lambda meta: meta["checkpoint"]))


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message says what was expected."""


@dataclass
class FieldDiff:
    field: str
    kind: str                 # exact | float | missing | not recorded (a column added since)
    equal: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_uids: list = field(default_factory=list)


@dataclass
class StageReplay:
    stage: str
    recorded_uri: str
    diffs: list[FieldDiff]
    weights: dict = field(default_factory=dict)   # file -> (recorded sha256, replayed sha256)
    saved_uri: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(d.equal for d in self.diffs) and all(a == b for a, b in self.weights.values())


def parse_location(uri: str, iteration: int | None = None) -> tuple[RunRef, int, str | None]:
    """(run, iteration, stage) from an iteration or stage URI, or a run URI plus
    ``iteration``."""

    uri = uri.rstrip("/")
    loc = run_layout.parse(uri)
    if loc is not None and loc.iteration is not None:
        run_uri, n, stage = loc.run_uri, loc.iteration, loc.stage
    elif iteration is not None:
        run_uri, n, stage = uri, iteration, None
    else:
        raise ReplayError(f"{uri}: expected {{store}}/{{run_id}}/iter-NNNNNN[/stage], or a run URI with --iteration")
    return RunRef.from_uri(run_uri), n, stage


def replay_config(manifest: dict, overrides: list[str]) -> RunConfig:
    recorded = config_from_dict(manifest["config"])
    cfg = apply_overrides(config_from_dict(manifest["config"]), list(overrides)).validate()
    changed = []
    for path in CHECKPOINT_FIELDS:
        a, b = recorded, cfg
        for part in path.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if a != b:
            changed.append(f"{path}: {a!r} -> {b!r}")
    if changed:
        raise ConfigError("the iteration's checkpoint was trained with another model layout; a replay cannot "
                          f"change {', '.join(changed)}")
    return cfg


#: Columns a stage writes today that snapshots written before them lack (provenance, not
#: results): a replay of an older snapshot that adds one is not a difference.
ADDED_SINCE = {"weight_version": "the rollout's weight version (recorded since generation became a service)"}


def compare(recorded: DataProto, replayed: DataProto, atol: float = 0.0, rtol: float = 0.0,
            worst: int = 3) -> list[FieldDiff]:
    """Field by field: exact for integer/bool/string fields; max abs / rel difference for
    floats (equal when within ``atol + rtol * |recorded|``; 0/0 means exact)."""
    uids = recorded.non_tensor_batch.get("uid")
    diffs = []
    rec_keys = set(recorded.batch.keys()) if recorded.batch is not None else set()
    rep_keys = set(replayed.batch.keys()) if replayed.batch is not None else set()
    for key in sorted(rec_keys | rep_keys):
        if key not in rec_keys and key in ADDED_SINCE:
            diffs.append(FieldDiff(key, "not recorded", True))  # an older snapshot: nothing to compare
            continue
        if key not in rec_keys or key not in rep_keys:
            diffs.append(FieldDiff(key, "missing", False))
            continue
        a, b = recorded.batch[key], replayed.batch[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            diffs.append(FieldDiff(key, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}", False))
            continue
        if a.is_floating_point():
            delta = (a.double() - b.double()).abs()
            rel = delta / a.double().abs().clamp_min(1e-12)
            equal = bool((delta <= atol + rtol * a.double().abs()).all())
            per_row = delta.reshape(len(a), -1).amax(dim=1) if a.dim() else delta.reshape(1)
            diffs.append(FieldDiff(key, "float", equal, float(delta.max()) if delta.numel() else 0.0,
                                   float(rel.max()) if rel.numel() else 0.0, _worst(per_row, uids, worst)))
        else:
            unequal = (a != b).reshape(len(a), -1).any(dim=1) if a.dim() else (a != b).reshape(1)
            diffs.append(FieldDiff(key, "exact", not bool(unequal.any()),
                                   worst_uids=_worst(unequal.float(), uids, worst)))
    for key in sorted(set(recorded.non_tensor_batch) | set(replayed.non_tensor_batch)):
        a, b = recorded.non_tensor_batch.get(key), replayed.non_tensor_batch.get(key)
        if a is None or b is None:
            diffs.append(FieldDiff(key, "missing", False))
            continue
        unequal = torch.tensor([x != y for x, y in zip(a.tolist(), b.tolist())] + [len(a) != len(b)])
        diffs.append(FieldDiff(key, "exact", not bool(unequal.any()), worst_uids=_worst(unequal[:-1].float(), uids, worst)))
    rec_metrics = (recorded.meta_info.get("stage_metrics") or {})
    rep_metrics = (replayed.meta_info.get("stage_metrics") or {})
    for stage in sorted(set(rec_metrics) | set(rep_metrics)):
        for name in sorted(set(rec_metrics.get(stage, {})) | set(rep_metrics.get(stage, {}))):
            a, b = rec_metrics.get(stage, {}).get(name), rep_metrics.get(stage, {}).get(name)
            if a is None or b is None:
                diffs.append(FieldDiff(f"metric {name}", "missing", False))
                continue
            delta = abs(float(a) - float(b))
            diffs.append(FieldDiff(f"metric {name}", "float", delta <= atol + rtol * abs(float(a)), delta,
                                   delta / max(abs(float(a)), 1e-12)))
    return diffs


def _worst(per_row: torch.Tensor, uids, k: int) -> list:
    if uids is None or not per_row.numel() or float(per_row.max()) == 0.0:
        return []
    order = torch.argsort(per_row, descending=True)[:k]
    return [str(uids[int(i)]) for i in order if float(per_row[int(i)]) > 0]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _chosen(overrides: list[str]) -> set[str]:
    """The config keys a replay's own ``--override``s name."""
    return {o.split("=", 1)[0].strip() for o in overrides}


def check_reward_function(cfg: RunConfig, overrides: list[str], trusted: bool) -> None:
    """Refuse, before anything imports it, a ``reward.function`` that only the stored
    manifest chose and this machine does not vouch for (``reward.installed``)."""
    from rlhf_core.workers import reward

    chosen = _chosen(overrides)
    if cfg.custom_reward_function.path and not (trusted or chosen & {"custom_reward_function.path",
                                                                      "custom_reward_function.name"}):
        raise ReplayError(f"custom_reward_function.path {cfg.custom_reward_function.path!r} (from the iteration's "
                          f"manifest): expected none or one named by --override; replay executes a reward file here "
                          f"only with --trust-reward-function")
    # an endpoint the stored config names would be sent the stored responses (and code):
    # a store's writer must not choose where a replay posts
    from rlhf_core.config import _get, _leaf_paths

    for path in _leaf_paths(cfg):
        value = _get(cfg, path)
        if path.rsplit(".", 1)[-1] in ("url", "endpoint", "base_url") and value and not (trusted or path in chosen):
            raise ReplayError(f"{path} {value!r} (from the iteration's manifest): expected none or one named by "
                              f"--override; replay sends data to an address the record chose only with "
                              f"--trust-reward-function")
    # the models that score or teach the policy: a remote folder only the record names
    # would be fetched here, with this machine's credentials, from wherever it points
    from rlhf_core.data.fetch import is_remote

    for path in ("reward_model.model.path", "distillation.teacher_model.model_path"):
        value = _get(cfg, path)
        if value and is_remote(value) and not (trusted or path in chosen):
            raise ReplayError(f"{path} {value!r} (from the iteration's manifest): expected a local folder or one "
                              f"named by --override; replay fetches a model from an address the record chose only "
                              f"with --trust-reward-function")
    # agent loops and tools: a loop file, or a tool class that is not one of ours, is code
    # the stored config chose (a replay gives recorded answers and builds no tool)
    multi = cfg.rollout.multi_turn
    if multi.enable and not trusted:
        if cfg.rollout.agent.agent_loop_config_path and "rollout.agent.agent_loop_config_path" not in chosen:
            raise ReplayError(f"rollout.agent.agent_loop_config_path {cfg.rollout.agent.agent_loop_config_path!r} "
                              f"(from the iteration's manifest): expected none or one named by --override; replay "
                              f"imports a user's agent loop only with --trust-reward-function")
    chosen_here = "reward.function" in chosen
    spec = cfg.reward.function
    if not (cfg.custom_reward_function.path or trusted or chosen_here or reward.installed(spec)):
        raise ReplayError(f"reward.function {spec!r} (from the iteration's manifest): expected a built-in reward or one "
                          f"an installed package registers (entry points {reward.REWARD_ENTRY_POINTS!r}); replay "
                          f"imports and runs this code here only with --trust-reward-function")


def replay(uri: str, stages: list[str] | None = None, iteration: int | None = None, overrides: list[str] = (),
           atol: float = 0.0, rtol: float = 0.0, log=print, trust_reward_function: bool = False) -> list[StageReplay]:
    """Replay ``stages`` (default: the URI's stage, else every stage) of one committed
    iteration on fresh local worker groups; returns one comparison per stage.
    ``trust_reward_function``: import the manifest's ``reward.function`` even when this
    machine does not vouch for it (``check_reward_function``)."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.trainer.restore import load_checkpoint
    from rlhf_core.trainer.loaders import make_loader
    from rlhf_core.runtime.ray_head import start_local_ray
    from rlhf_core.workers.worker_set import WorkerSet

    run, n, uri_stage = parse_location(uri, iteration)
    istore, run_id, store = IterationStore(run), run.run_id, run.store
    if n not in istore.committed_iterations():
        raise ReplayError(f"iteration {n} of run {run_id} in {store} is not committed (no MANIFEST.json); committed: "
                          f"{istore.committed_iterations() or 'none'}")
    manifest = istore.read_manifest(n)
    cfg = replay_config(manifest, list(overrides))
    check_reward_function(cfg, list(overrides), trust_reward_function)
    _check_tools(manifest, cfg, list(overrides))
    cfg.trainer.progress = False
    parent = istore.read_manifest(manifest["parent_iteration"]) if manifest["parent_iteration"] is not None else None
    state = TrainerState(global_step=n, cursor=dict(parent["data_cursor"]) if parent else {"epoch": 0, "position": 0},
                         kl_coef=parent["kl_coef"] if parent else cfg.algorithm.kl_ctrl.kl_coef)
    end_ckpt = manifest["checkpoint"]
    if end_ckpt:
        end_ckpt = checked_checkpoint_uri(istore, end_ckpt, n + 1, f"{istore.iteration_uri(n)}/{run_layout.MANIFEST}")

    replayable = [stage.name for stage in stage_table.side_plan(cfg, n) + stage_table.plan(cfg) if stage.persisted]
    wanted = stages or ([uri_stage] if uri_stage else replayable)
    for stage in wanted:  # before any worker is placed
        if stage not in replayable:
            raise ReplayError(f"stage {stage!r} cannot be replayed for this run; its stages are {replayable}")
    _check_live_agent(cfg, wanted, list(overrides), trust_reward_function, manifest)
    start_local_ray()
    workers = WorkerSet.build(cfg)
    try:
        trainer = PPOTrainer(cfg, workers, make_loader(cfg, TrainerState(cursor=dict(state.cursor))), state)
        _check_models(manifest, trainer, n, list(overrides), wanted)
        plan = [stage.name for stage in trainer.stages()]
        results = []
        # stateless stages first (one restore serves them all), then each update stage
        # from a fresh restore: the state every stage saw the first time
        stateful = {s.name for s in stage_table.STAGES if s.stateful}
        loaded = None  # the step whose weights the workers hold (None: changed by an update stage)
        # side stages (validation) first: on the weights the iteration started from
        for stage in sorted(wanted, key=lambda s: (s in stateful, plan.index(s) if s in plan else -1)):
            t0 = time.perf_counter()
            # a batch generated ahead (async_training) is generated again on the weights that made it
            start = generated_by(istore, n) if stage == "rollout" and cfg.async_training.enable else n
            if loaded != start or stage in stateful:  # the last checkpoint, and a redo of what followed it
                load_checkpoint(workers, istore, start, trainer)
                loaded = None if stage in stateful else start
            trainer.policy_version = start if start != n else None
            trainer.kl_ctrl.value = state.kl_coef
            batch = _stage_input(istore, trainer, n, stage, plan)
            if stage == "filter_groups":  # its further batches, with the answers recorded of them
                trainer.replayed_gen_batches, trainer.unrecorded_gen_batch = _recorded_gen_batches(
                    istore, n, manifest, _live_agent_refusal(cfg, list(overrides), trust_reward_function))
            [(_, out, _)] = trainer.run_stages(batch, [stage_table.BY_NAME[stage]])
            recorded = istore.load(n, stage, standalone=stage_table.BY_NAME[stage].side)
            result = StageReplay(stage, istore.stage_uri(n, stage), compare(recorded, out, atol, rtol))
            if stage == "filter_groups":
                used, listed = _gen_batch_record(manifest)
                result.diffs += _compare_gen_batches(trainer, atol, rtol, old_record=bool(used) and not listed)
            if stage in stateful and manifest.get("checkpoint_sha256"):  # else no checkpoint to compare with
                result.weights = _compare_weights(workers, trainer, cfg, end_ckpt, stage_table.BY_NAME[stage])
            if overrides:
                result.saved_uri = _save_replay(istore, n, stage, out, overrides)
            result.seconds = time.perf_counter() - t0
            log(f"[replay] {stage}: {'same' if result.ok else 'DIFFERENT'} ({result.seconds:.1f}s)")
            results.append(result)
        return results
    finally:
        workers.kill()


def generated_by(istore, n: int) -> int:
    """The weight version that generated iteration ``n``'s committed rollout batch (one
    call of the rollouter: every row has the same)."""
    from rlhf_core.agent.batch import generated_versions

    versions = generated_versions(istore.load(n, "rollout").batch["weight_version"])
    if len(versions) != 1:
        raise ReplayError(f"iteration {n}: expected one weight version in its rollout batch; found {sorted(versions)}")
    version = versions.pop()
    if not isinstance(version, int) or not 0 <= version <= n:  # a snapshot is data: no step from the future
        raise ReplayError(f"iteration {n}: weight_version: expected a step in [0, {n}] (the weights that generated "
                          f"its rollout); found {version!r}")
    return version


def _check_tools(manifest: dict, cfg: RunConfig, overrides: list[str]) -> None:
    """An agent rollout replays with the tool config it was generated with (its schemas are
    in the prompts): the file's content hash as the manifest records it, unless an
    override names another on purpose."""
    recorded = manifest.get("tools")
    path = cfg.rollout.multi_turn.tool_config_path
    if not path or any(o.startswith("rollout.multi_turn.tool_config_path") for o in overrides):
        return
    if not isinstance(recorded, dict):  # every agent iteration records its tool config's hash
        raise ReplayError(f"rollout.multi_turn.tool_config_path: expected the iteration's record of its tool config "
                          f"(the manifest's tools: its sha256); found {str(recorded)[:60]!r}")
    from rlhf_core.agent.tool_config import config_file

    file = config_file(path)
    if not file.is_file() or _sha256(file) != recorded.get("sha256"):
        raise ReplayError(f"rollout.multi_turn.tool_config_path: expected the tool config the iteration was "
                          f"generated with at {path} (sha256 {recorded.get('sha256')}); found "
                          f"{'none there' if not file.is_file() else 'other content'} (restore it, or replay "
                          f"against another with --override)")


def _live_agent_refusal(cfg: RunConfig, overrides: list[str], trusted: bool) -> str | None:
    """Why a further generation batch of ``filter_groups`` that the record does not hold
    (an iteration recorded before they were, or a what-if that needs more) may not be
    generated here, or None: an agent's tools and interactions for it would be built from
    the stored config (classes to import, addresses to call, chosen by whoever wrote the
    store). Only the built-in configs, one an override names, or ``--trust-reward-function``."""
    multi = cfg.rollout.multi_turn
    if not multi.enable or trusted:
        return None
    chosen = _chosen(overrides)
    for key in ("tool_config_path", "interaction_config_path"):
        value = getattr(multi, key)
        if value and not value.startswith("builtin:") and f"rollout.multi_turn.{key}" not in chosen:
            return (f"rollout.multi_turn.{key} {value!r} (from the iteration's manifest): expected a builtin: config "
                    f"or one named by --override; replaying filter_groups generates batches the record does not "
                    f"hold, with the tools this config builds, only with --trust-reward-function")
    return None


def _check_live_agent(cfg: RunConfig, wanted: list[str], overrides: list[str], trusted: bool,
                      manifest: dict | None = None) -> None:
    """Before any worker is placed: refuse to replay a ``filter_groups`` whose further
    generation batches the ``manifest`` does not list (all of them without a manifest)
    when they would be generated with tools the stored config chose."""
    if "filter_groups" not in wanted:
        return
    if manifest is not None and not overrides:  # (a what-if may draw more batches than the record holds)
        used, listed = _gen_batch_record(manifest)
        if used == listed:
            return  # every batch's answers are in the record: none is asked
    refusal = _live_agent_refusal(cfg, overrides, trusted)
    if refusal:
        raise ReplayError(refusal)


def _gen_batch_record(manifest: dict) -> tuple[list[str], list[str]]:
    """(the further generation batches' snapshots the iteration used, those its manifest
    lists: an iteration committed before they were recorded lists none)."""
    used = stage_table.gen_batch_snapshots(manifest.get("metrics") or {})
    listed = set(manifest.get("snapshots") or {})
    return used, [name for name in used if name in listed]


def _recorded_gen_batches(istore, n: int, manifest: dict, refusal: str | None):
    """(recorded further batches of ``filter_groups``, generation -> batch; the hook a
    trainer calls for a batch past them)."""
    _, listed = _gen_batch_record(manifest)
    recorded = {int(name.rsplit("-", 1)[1]): istore.load(n, name, standalone=True) for name in listed}

    def unrecorded(generation: int) -> None:
        if refusal:
            raise ReplayError(f"filter_groups' generation batch {generation} (iteration {n} recorded "
                              f"{len(recorded)}): {refusal}")

    return recorded, unrecorded


#: The stages each recorded model computes: a replay of one uses the model the iteration used.
_COMPUTED_BY = {"reward_model": {"rm_score", "validate", "filter_groups"},  # (its further batches are scored)
                "teacher": {"teacher_log_prob", "filter_groups"}}


def _check_models(manifest: dict, trainer, n: int, overrides: list[str], wanted: list[str]) -> None:
    """A stage the reward model or the teacher computes replays only with the model the
    iteration used (its content hash as the manifest records it), unless an override
    names another on purpose (a what-if, saved apart)."""
    from rlhf_core.trainer.restore import RECORDED_MODELS, model_change

    for key, field, what, _, identity in RECORDED_MODELS:
        recorded = manifest.get(key)
        if recorded is None or not _COMPUTED_BY[key] & set(wanted) or \
                any(o.startswith(field.rsplit(".", 1)[0] + ".") for o in overrides):
            continue
        changed = model_change(recorded, getattr(trainer, identity)())
        if changed:
            raise ReplayError(f"{field}: expected {what} iteration {n} used {changed} (the folder's content "
                              f"changed: restore it, or replay against another with --override)")


def _stage_input(istore, trainer, n: int, stage: str, plan: list[str]) -> DataProto:
    from rlhf_core.trainer import stages as stage_table
    from rlhf_core.agent.batch import recorded_calls
    from rlhf_core.trainer.ppo import RECORDED_JUDGE_CALLS, RECORDED_TOOL_CALLS
    from rlhf_core.workers.reward_loop import CALLS_COLUMN

    cfg = trainer.config
    side = stage_table.BY_NAME[stage].side
    if not side and plan.index(stage) > 0:
        batch = istore.load(n, plan[plan.index(stage) - 1])
        if stage == stage_table.SCORED and cfg.judge_served:  # the judge's answers as recorded
            recorded = istore.load(n, stage).non_tensor_batch
            if CALLS_COLUMN in recorded:
                batch.non_tensor_batch[CALLS_COLUMN] = recorded[CALLS_COLUMN]
        return batch
    if side:  # its own input, never the iteration's batch
        batch = trainer.side_input(n, stage)
    else:  # rollout: the prompts the parent's data cursor yields
        batch = trainer.loader.next_batch()
        batch.meta_info.update(global_step=n, temperature=cfg.rollout.temperature)
    # what the stage recorded of its calls (read once): the judge's answers to a
    # validation's responses, the tools' answers: none is asked again
    recorded = istore.load(n, stage, standalone=side).non_tensor_batch \
        if (side and cfg.judge_served) or cfg.rollout.multi_turn.enable else {}
    if side and cfg.judge_served and CALLS_COLUMN in recorded:
        batch.meta_info[RECORDED_JUDGE_CALLS] = recorded[CALLS_COLUMN].tolist()
    calls = recorded_calls(recorded) if cfg.rollout.multi_turn.enable else None
    if calls is not None:
        batch.meta_info[RECORDED_TOOL_CALLS] = calls
    return batch


def _compare_gen_batches(trainer, atol: float, rtol: float, old_record: bool) -> list[FieldDiff]:
    """filter_groups' further batches as replayed vs as recorded, field by field (named
    ``gen_batch-K/field``): a batch only one side has is a difference, unless the record
    is older than recorded further batches (``old_record``)."""
    diffs = []
    recorded, replayed = trainer.replayed_gen_batches or {}, trainer.gen_batches
    for k in sorted(set(recorded) | set(replayed)):
        if k not in recorded and old_record:
            continue  # an iteration recorded before its further batches were: nothing to compare
        prefix = stage_table.gen_batch_snapshot(k).split(".", 1)[1]
        if k not in recorded or k not in replayed:
            diffs.append(FieldDiff(prefix, "missing", False))
            continue
        for diff in compare(recorded[k], replayed[k], atol, rtol):
            diff.field = f"{prefix}/{diff.field}"
            diffs.append(diff)
    return diffs


def _compare_weights(workers, trainer, cfg, end_ckpt: str, stage) -> dict:
    """Checksums of the replayed weights of the stage's roles vs the ones the iteration
    committed."""
    from rlhf_core.snapshot import fs as sfs
    from rlhf_core.trainer.restore import save_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlhf-replay-ckpt-") as tmp:
        save_checkpoint(workers, trainer.state, cfg, f"file://{tmp}")
        out = {}
        # the shard files hold the tensors; DCP's .metadata also records where it was written
        for path in sorted(p for role in stage.roles for p in Path(tmp, role).glob("__*.distcp")):
            name = f"{path.parent.name}/{path.name}"
            recorded = sfs.read_bytes(sfs.resolve(f"{end_ckpt}/{name}"))
            out[name] = (hashlib.sha256(recorded).hexdigest() if recorded is not None else "missing", _sha256(path))
        return out


def _save_replay(istore, n: int, stage: str, out: DataProto, overrides: list[str]) -> str:
    from rlhf_core.snapshot import save_snapshot

    stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
    uri = f"{istore.run_uri}/{run_layout.replay_dir(n, stage, stamp)}"
    save_snapshot(out, uri, storage_options=istore.storage_options,
                  annotations={"replay_of": istore.stage_uri(n, stage), "overrides": list(overrides)})
    return uri


def format_table(results: list[StageReplay]) -> str:
    lines = [f"{'stage':<14}{'field':<32}{'kind':<8}{'status':<10}{'max abs':>12}{'max rel':>12}  worst uids"]
    for r in results:
        shown = [d for d in r.diffs if not d.equal] or [FieldDiff(f"{len(r.diffs)} fields", "", True)]
        for d in shown:
            lines.append(f"{r.stage:<14}{d.field[:31]:<32}{d.kind[:7]:<8}{'same' if d.equal else 'DIFFERS':<10}"
                         f"{d.max_abs:>12.3g}{d.max_rel:>12.3g}  {' '.join(d.worst_uids)}")
        for name, (a, b) in r.weights.items():
            lines.append(f"{r.stage:<14}{name[:31]:<32}{'sha256':<8}{'same' if a == b else 'DIFFERS':<10}"
                         f"{'':>12}{'':>12}  {a[:12]} vs {b[:12]}")
        if r.saved_uri:
            lines.append(f"{r.stage:<14}saved as {r.saved_uri}")
    return "\n".join(lines)
