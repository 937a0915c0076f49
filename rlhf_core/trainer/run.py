"""Running iterations: the loop direct runs and session-attached controllers share
(``run_iterations``: the stages, then the commit of each iteration), the commit itself,
and direct mode (``run_direct``: a local Ray of this process, the worker groups placed
here, N iterations, the report).

Writes ``{output_dir}/{run_id}/metrics.jsonl`` (one JSON object per iteration),
``reward_curve.png`` and the resolved config; the store gets the stage snapshots, the
iteration manifests and the checkpoints ``trainer.checkpoint_every`` asks for.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Protocol

from rlhf_core.config import RunConfig, describe
from rlhf_core.runtime.ray_head import start_local_ray
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef
from rlhf_core.record.lease import CONTROLLER_TTL_S, IterationLeases
from rlhf_core.trainer.report import write_curve
from rlhf_core.trainer.progress import REWARD_WINDOW, ProgressLine, StopRule
from rlhf_core.record.checkpoints import checkpoint_due, weights_checkpoint, weights_plan
from rlhf_core.trainer.restore import (check_models_unchanged, finish_checkpoint, open_run, restore_or_init,
                                      save_checkpoint)
from rlhf_core.trainer.loaders import make_loader
from rlhf_core.trainer.stages import gen_batch_snapshots, persisted_names
from rlhf_core.workers.worker_set import WorkerSet


class Attachment(Protocol):
    """What a controller attached to a long-lived session adds to the loop
    (``rlhf_core.session.iteration``); direct runs have none."""

    workers_at_step: int | None   # the step the session's workers are known to be at
    prefetch: object              # the session's computed-ahead stages, or None

    def stage_started(self, step: int, name: str) -> None: ...

    def committed(self, step: int) -> None: ...


@dataclass
class IterationCommit:
    """One iteration's way to its commit: the lease it runs under, whether it must write a
    checkpoint, and the checkpoint its workers began writing after the update stages."""

    keeper: object = None                  # LeaseKeeper, or None (a direct run)
    force_checkpoint: bool = False
    started: str | None = None             # the checkpoint URI the workers are writing (a fresh prefix)
    started_step: int | None = None        # ... of the state after this many iterations

    def new_checkpoint_uri(self, istore, step: int) -> str:
        """The prefix the lease announced (pipelined runs name their parent from it), else a
        fresh one: either way nothing committed is overwritten."""
        planned = self.keeper.lease.plan.get("checkpoint") if self.keeper is not None else None
        return planned if planned and step == self.keeper.lease.iteration + 1 else istore.new_checkpoint_uri(step)

    def check(self) -> None:
        if self.keeper is not None:
            self.keeper.check()  # nothing is written without the lease

    def start_checkpoint(self, cfg: RunConfig, workers, istore, step: int) -> None:
        """After the last update stage: a due checkpoint starts writing in the background
        (weight sync and the controller's bookkeeping overlap it; the commit waits)."""
        if checkpoint_due(cfg, step) or self.force_checkpoint:
            self.check()
            self.started, self.started_step = self.new_checkpoint_uri(istore, step), step
            workers.start_checkpoint(self.started)

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()


def run_iterations(cfg: RunConfig, workers, istore, state, iterations: int, run_dir: Path,
                   attachment: Attachment | None = None, on_stage: Callable[[int, str], None] | None = None,
                   stop: StopRule | None = None, checkpoint_last: bool = False,
                   leases: IterationLeases | None = None) -> tuple[list[dict], object]:
    """The iteration loop shared by direct runs and session-attached controllers:
    restore (or initialize) the workers, then per iteration the stages (resuming at the
    first uncommitted one) and the commit (checkpoint when due, then MANIFEST.json).

    ``attachment``: the session's side (its workers' known step, its computed-ahead stages).
    ``leases``: a lease per iteration, checked right before the checkpoint and the commit
    (raises ``LeaseHeld`` when another controller has one).
    ``checkpoint_last``: the last iteration writes a checkpoint even between
    ``trainer.checkpoint_every`` steps (a direct run: its workers end with it).
    """
    from tqdm import tqdm

    from rlhf_core.record.iteration_store import code_version
    from rlhf_core.trainer.ppo import PPOTrainer

    stop = stop or StopRule()
    bar = tqdm(total=iterations, desc="iteration", disable=not cfg.trainer.progress, file=sys.stderr, leave=False)
    progress = ProgressLine(iterations)

    current: list[IterationCommit] = []  # the iteration under way's lease

    def stage_hook(name: str) -> None:
        if current:
            current[-1].check()  # no stage starts on workers whose lease this controller lost
        bar.set_description(f"stage {name:<13}")
        for hook in (attachment.stage_started if attachment else None, on_stage):
            if hook is not None:
                hook(trainer.state.global_step, name)

    trainer = PPOTrainer(cfg, workers, make_loader(cfg, state), state, on_stage=stage_hook, stage_store=istore,
                         prefetch=attachment.prefetch if attachment else None)
    check_models_unchanged(istore, trainer)
    restore_or_init(workers, istore, state, cfg, attachment.workers_at_step if attachment else None, trainer)
    version = code_version()
    rows = []
    train_start = time.monotonic()
    try:
        trainer.start_rollouter(until_step=trainer.state.global_step + iterations)  # async_training only
        with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as out:
            for k in range(iterations):
                iteration = trainer.state.global_step
                this = IterationCommit(keeper=leases.for_iteration(iteration) if leases else None,
                                       force_checkpoint=checkpoint_last and k == iterations - 1)
                current[:] = [this]
                trainer.on_updated = partial(this.start_checkpoint, cfg, workers, istore, iteration + 1)
                try:
                    metrics = trainer.run_iteration()
                    t_commit = time.perf_counter()
                    checkpoint_s = commit(cfg, workers, istore, trainer, iteration, metrics, version, this)
                    metrics.update(step_timing(metrics, time.perf_counter() - t_commit, checkpoint_s))
                    if attachment is not None:  # before the lease goes: a run waiting on it finds the record marked
                        attachment.committed(trainer.state.global_step)
                finally:
                    this.close()
                row = {"iteration": iteration, "wall_clock_s": time.monotonic() - train_start, **metrics}
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
                bar.update(1)
                if cfg.trainer.progress:
                    bar.write(progress.line(iteration, metrics["critic/score/mean"]), file=sys.stderr)
                if stop.reason([r["critic/score/mean"] for r in rows], None, row["wall_clock_s"]):
                    break
    except BaseException:
        try:  # an interrupted iteration keeps the stages it finished (a resume loads them)
            istore.flush()
        except Exception:  # noqa: BLE001 - the exception under way is the one to report
            pass
        raise
    finally:
        trainer.stop_rollouter()
        bar.close()
    return rows, trainer


def step_timing(metrics: dict, commit_s: float, checkpoint_s: float) -> dict:
    """The iteration's timing with its commit: ``timing_s/step`` (stages + commit) and the
    share of it outside the workers (the checkpoint's writing counts as worker time; the
    wait for stage snapshots still being written does not)."""
    step = metrics["timing_s/iteration"] + commit_s
    inside = metrics["perf/worker_time_s"] + checkpoint_s
    return {"timing_s/commit": commit_s, "timing_s/checkpoint": checkpoint_s, "timing_s/step": step,
            "perf/outside_workers_share": max(0.0, 1 - inside / step) if inside else 0.0}


def commit(cfg: RunConfig, workers, istore, trainer, iteration: int, metrics: dict, version: dict,
           this: IterationCommit) -> float:
    """End an iteration: the checkpoint of the state after it when one is due
    (``trainer.checkpoint_every``, the run's last iteration, or ``this.force_checkpoint``;
    ``this.started``: the one the workers began writing after the update stages), then
    its manifest (the iteration exists from that moment; ``weights`` says which checkpoint
    and which redo give its weights), then the optional MLflow export. Under a lease,
    the holder checks it still holds it right before each write (a holder that lost it
    raises ``LeaseLost`` and writes nothing); the manifest records the fencing token.
    Returns the seconds spent waiting for the checkpoint."""
    from rlhf_core.record import tracking
    from rlhf_core.runtime import probes
    from rlhf_core.record.iteration_store import iteration_manifest

    check, keeper = this.check, this.keeper
    step = trainer.state.global_step
    check()
    t0 = time.perf_counter()
    if this.started is not None and this.started_step == step:  # begun after the update stages
        checkpoint = this.started
        checksums = finish_checkpoint(workers, trainer.state, cfg, checkpoint)
        weights = {"checkpoint_step": step, "checkpoint": checkpoint, "redo": []}
    elif checkpoint_due(cfg, step) or this.force_checkpoint:
        checkpoint = this.new_checkpoint_uri(istore, step)  # its own prefix: nothing committed is overwritten
        checksums = save_checkpoint(workers, trainer.state, cfg, checkpoint)
        weights = {"checkpoint_step": step, "checkpoint": checkpoint, "redo": []}
    else:  # the weights after this iteration: the last checkpoint plus a redo of what followed it
        start, redo = weights_plan(istore, iteration)
        # no checkpoint of its own: "checkpoint" is null, "weights" says where its model comes from
        checkpoint, checksums = None, None
        weights = {"checkpoint_step": start, "checkpoint": weights_checkpoint(istore, iteration),
                   "redo": redo + [iteration]}
    checkpoint_s = 0.0 if weights["redo"] else time.perf_counter() - t0
    probes.reached(f"commit:{iteration}")
    manifest = iteration_manifest(cfg, trainer.state, metrics, version, checkpoint, checksums,
                                  snapshots={name: istore.stage_uri(iteration, name) for name in
                                             persisted_names(cfg, iteration) + gen_batch_snapshots(metrics)},
                                  computed_ahead=trainer.adopted)
    manifest["weights"] = weights
    manifest["model"] = trainer.starting_model_identity()
    if cfg.reward_model.enable:
        manifest["reward_model"] = trainer.reward_model_identity()
    multi = cfg.rollout.multi_turn
    if multi.enable and (multi.tool_config_path or multi.interaction_config_path):
        from rlhf_core.agent.interaction_config import interactions_identity
        from rlhf_core.agent.tool_config import tools_identity

        manifest["tools"] = tools_identity(multi.tool_config_path) if multi.tool_config_path else {}
        if multi.interaction_config_path:
            manifest["tools"]["interactions"] = interactions_identity(multi.interaction_config_path)
    if cfg.distillation.enabled:
        manifest["teacher"] = trainer.teacher_identity()
    if cfg.async_training.enable:  # rows may come from weights older than the step's
        manifest["weight_versions"] = list(trainer.weight_versions)
    if keeper is not None:
        manifest["lease"] = {"holder": keeper.lease.holder, "token": keeper.lease.token}
    check()
    istore.commit_iteration(iteration, manifest)
    if tracking.exports(cfg.trainer.logger):
        from rlhf_core.trainer.report import validation_samples

        tracking.export_iteration(istore.run_id, istore.read_manifest(iteration),
                                  validation_samples(istore, iteration, cfg.trainer.log_val_generations),
                                  cfg.trainer.logger, Path(cfg.trainer.output_dir) / istore.run_id)
    return checkpoint_s


def finish_outputs(cfg: RunConfig, run_dir: Path, rows: list[dict], istore, trainer, plot: bool = True) -> dict:
    curve = run_dir / "reward_curve.png"
    all_rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if all_rows and plot:  # a per-iteration controller leaves the curve to the report step
        write_curve(all_rows, curve)
    return {"run_id": istore.run_id, "metrics": str(run_dir / "metrics.jsonl"), "curve": str(curve),
            "rows": rows, "checkpoint": last_checkpoint(istore, trainer.state.global_step),
            "snapshots": istore.run_uri}


def last_checkpoint(istore, step: int) -> str:
    """The checkpoint the weights after ``step`` iterations come from (at step 0: the
    initial one); "" before there is one."""
    from rlhf_core.record.checkpoints import weights_checkpoint

    return weights_checkpoint(istore, step) or ""


def run_direct(cfg: RunConfig, iterations: int, run: RunRef, log=print, time_budget_s: float | None = None,
               stop_at_reward: float | None = None, on_stage=None) -> dict:
    """Run ``iterations`` PPO/GRPO iterations with worker groups owned by this process.

    Every stage's output is committed as a snapshot, each iteration ends with its
    MANIFEST.json (after a checkpoint when one is due, and always at the run's last
    iteration: the workers end with this run). A run id that
    already has committed iterations continues from the last one (same config required);
    an iteration that was interrupted resumes at its first uncommitted stage.
    ``time_budget_s`` / ``stop_at_reward`` (mean of the last 5) stop early (benchmarks).
    """
    run_id, istore = run.run_id, IterationStore(run)
    state = open_run(cfg, istore, log)
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    log(f"[rlhf] run {run_id}: config (hash {cfg.config_hash()[:12]}):\n{describe(cfg)}")
    # a direct run writes what a session's controller writes: under the same leases (a
    # controller of the run elsewhere, or a second direct run, waits its turn or is told)
    leases = IterationLeases(istore, CONTROLLER_TTL_S)
    leases.take_first(state.global_step)
    try:
        start_local_ray()
        t0 = time.perf_counter()
        workers = WorkerSet.build(cfg)
        log(f"[rlhf] worker groups ready in {time.perf_counter() - t0:.1f}s")
        try:
            rows, trainer = run_iterations(cfg, workers, istore, state, iterations, run_dir, on_stage=on_stage,
                                           stop=StopRule(time_budget_s, stop_at_reward, min_rewards=REWARD_WINDOW),
                                           checkpoint_last=True,
                                           leases=leases)
            # when the loop's clock started (its rows count from it): the closing lines' pace
            started = time.monotonic() - (rows[-1]["wall_clock_s"] if rows else 0.0)
        finally:
            workers.kill()
    finally:
        leases.close()
        from rlhf_core.record import tracking

        tracking.close()  # W&B and TensorBoard write their last records
    return {**finish_outputs(cfg, run_dir, rows, istore, trainer), "started": started}
