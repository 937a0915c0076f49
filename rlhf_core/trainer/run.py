"""Direct mode: start a local Ray, place the worker groups, run N iterations, report.

Writes ``{output_dir}/{run_id}/metrics.jsonl`` (one JSON object per iteration),
``reward_curve.png``, the resolved config, and a checkpoint per run under
``{store}/{run_id}/checkpoints/``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rlhf_core.config import RunConfig, describe
from rlhf_core.trainer.restore import (
    checkpoint_due, finish_checkpoint, make_loader, open_run, restore_or_init, save_checkpoint, weights_plan,
)
from rlhf_core.trainer.progress import ProgressLine
from rlhf_core.trainer.stages import persisted_names
from rlhf_core.workers.worker_set import WorkerSet


def start_local_ray(num_cpus: int | None = None) -> None:
    """A Ray of this process's own (direct runs, replay): loopback only, token auth."""
    from rlhf_core.ray_head import RAY_SYSTEM_CONFIG, local_ray_env

    local_ray_env()
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="rlhf-ray-"), log_to_driver=False,
             configure_logging=False, _system_config=RAY_SYSTEM_CONFIG)


def plot_curve(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(it, [r["critic/score/mean"] for r in rows], label="mean reward (critic/score/mean)")
    if rows and "critic/reward_extra/exact/mean" in rows[0]:
        ax.plot(it, [r.get("critic/reward_extra/exact/mean", 0) for r in rows], label="exact match", alpha=0.7)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class LeaseHeld(Exception):
    """The next iteration's lease belongs to another controller (``str(exc)``: who)."""


def run_iterations(cfg: RunConfig, workers, istore, state, iterations: int, run_dir: Path,
                   workers_at_step: int | None = None, on_stage=None, time_budget_s: float | None = None,
                   stop_at_reward: float | None = None, on_committed=None, take_lease=None,
                   prefetch=None, checkpoint_last: bool = False) -> tuple[list[dict], object]:
    """The iteration loop shared by direct runs and session-attached controllers:
    restore (or initialize) the workers, then per iteration the stages (resuming at the
    first uncommitted one) and the commit (checkpoint, then MANIFEST.json).

    ``workers_at_step``: the step the workers' state is known to be at (a live session
    that committed it); otherwise the starting checkpoint is loaded. ``take_lease``:
    ``iteration -> LeaseKeeper`` (raises ``LeaseHeld``); each iteration then runs under
    its lease, checked right before the checkpoint and the commit. ``prefetch``: the
    session's computed-ahead stages (``rlhf_core.trainer.prefetch.SessionPrefetch``).
    ``checkpoint_last``: the last iteration writes a checkpoint even between
    ``trainer.checkpoint_every`` steps (a direct run: its workers end with it).
    """
    from tqdm import tqdm

    from rlhf_core.trainer.iteration_store import code_version
    from rlhf_core.trainer.ppo import PPOTrainer

    bar = tqdm(total=iterations, desc="iteration", disable=not cfg.trainer.progress, file=sys.stderr, leave=False)
    progress = ProgressLine(iterations)

    def stage_hook(name: str) -> None:
        bar.set_description(f"stage {name:<13}")
        if on_stage is not None:
            on_stage(trainer.state.global_step, name)

    trainer = PPOTrainer(cfg, workers, make_loader(cfg, state), state, on_stage=stage_hook, stage_store=istore,
                         prefetch=prefetch)
    restore_or_init(workers, istore, state, cfg, workers_at_step, trainer)
    version = code_version()
    rows = []
    train_start = trainer.started_at = time.monotonic()
    this = {}  # the iteration under way: its lease keeper, whether it must checkpoint, what it started

    def start_checkpoint() -> None:
        """After the last update stage: a due checkpoint starts writing in the background
        (weight sync and the controller's bookkeeping overlap it; the commit waits)."""
        step = trainer.state.global_step + 1
        if checkpoint_due(cfg, step) or this["force"]:
            if this["keeper"] is not None:
                this["keeper"].check()  # nothing is written without the lease
            workers.start_checkpoint(istore.checkpoint_uri(step))
            this["started"] = istore.checkpoint_uri(step)

    trainer.on_updated = start_checkpoint
    try:
        with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as out:
            for k in range(iterations):
                iteration = trainer.state.global_step
                keeper = take_lease(iteration) if take_lease is not None else None
                this.update(keeper=keeper, force=checkpoint_last and k == iterations - 1, started=None)
                try:
                    metrics = trainer.run_iteration()
                    t_commit = time.perf_counter()
                    checkpoint_s = commit(cfg, workers, istore, trainer, iteration, metrics, version, keeper,
                                          force_checkpoint=this["force"], started=this["started"])
                    metrics.update(step_timing(metrics, time.perf_counter() - t_commit, checkpoint_s))
                finally:
                    if keeper is not None:
                        keeper.close()
                if on_committed is not None:
                    on_committed(trainer.state.global_step)
                row = {"iteration": iteration, "wall_clock_s": time.monotonic() - train_start, **metrics}
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
                bar.update(1)
                if cfg.trainer.progress:
                    bar.write(progress.line(iteration, metrics["critic/score/mean"]), file=sys.stderr)
                recent = [r["critic/score/mean"] for r in rows[-5:]]
                if stop_at_reward is not None and len(recent) == 5 and sum(recent) / 5 >= stop_at_reward:
                    break
                if time_budget_s is not None and row["wall_clock_s"] >= time_budget_s:
                    break
    except BaseException:
        try:  # an interrupted iteration keeps the stages it finished (a resume loads them)
            istore.flush()
        except Exception:  # noqa: BLE001 - the exception under way is the one to report
            pass
        raise
    finally:
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
           keeper=None, force_checkpoint: bool = False, started: str | None = None) -> float:
    """End an iteration: the checkpoint of the state after it when one is due
    (``trainer.checkpoint_every``, the run's last iteration, or ``force_checkpoint``;
    ``started``: the one the workers began writing after the update stages), then
    its manifest (the iteration exists from that moment; ``weights`` says which checkpoint
    and which redo give its weights), then the optional MLflow export. Under a lease,
    the holder checks it still holds it right before each write (a holder that lost it
    raises ``LeaseLost`` and writes nothing); the manifest records the fencing token.
    Returns the seconds spent waiting for the checkpoint."""
    from rlhf_core import tracking
    from rlhf_core import probes
    from rlhf_core.trainer.iteration_store import iteration_manifest

    check = keeper.check if keeper is not None else (lambda: None)
    step = trainer.state.global_step
    checkpoint = istore.checkpoint_uri(step)
    check()
    t0 = time.perf_counter()
    if started == checkpoint:  # begun in the background after the update stages
        checksums = finish_checkpoint(workers, trainer.state, cfg, checkpoint)
        weights = {"checkpoint_step": step, "checkpoint": checkpoint, "redo": []}
    elif checkpoint_due(cfg, step) or force_checkpoint:
        checksums = save_checkpoint(workers, trainer.state, cfg, checkpoint)
        weights = {"checkpoint_step": step, "checkpoint": checkpoint, "redo": []}
    else:  # the weights after this iteration: the last checkpoint plus a redo of what followed it
        start, redo = weights_plan(istore, iteration)
        checksums = {}
        weights = {"checkpoint_step": start, "checkpoint": istore.checkpoint_uri(start), "redo": redo + [iteration]}
    checkpoint_s = 0.0 if weights["redo"] else time.perf_counter() - t0
    probes.reached(f"commit:{iteration}")
    manifest = iteration_manifest(cfg, trainer.state, metrics, version, checkpoint, checksums,
                                  snapshots={name: istore.stage_uri(iteration, name) for name in persisted_names(cfg)},
                                  computed_ahead=trainer.adopted)
    manifest["weights"] = weights
    if keeper is not None:
        manifest["lease"] = {"holder": keeper.lease.holder, "token": keeper.lease.token}
    check()
    istore.commit_iteration(iteration, manifest)
    if tracking.enabled():
        tracking.export_iteration(istore.run_id, istore.read_manifest(iteration))
    return checkpoint_s


def _finish(cfg: RunConfig, run_dir: Path, rows: list[dict], istore, trainer, plot: bool = True) -> dict:
    curve = run_dir / "reward_curve.png"
    all_rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if all_rows and plot:  # a per-iteration controller leaves the curve to the report step
        plot_curve(all_rows, curve)
    return {"run_id": istore.run_id, "metrics": str(run_dir / "metrics.jsonl"), "curve": str(curve),
            "rows": rows, "checkpoint": istore.checkpoint_uri(trainer.state.global_step),
            "snapshots": istore.run_uri}


def run_direct(cfg: RunConfig, iterations: int, store: str, run_id: str | None = None,
               log=print, time_budget_s: float | None = None, stop_at_reward: float | None = None,
               on_stage=None) -> dict:
    """Run ``iterations`` PPO/GRPO iterations with worker groups owned by this process.

    Every stage's output is committed as a snapshot under ``{store}/{run_id}/iter-N/``,
    every iteration ends with a checkpoint and, last, its MANIFEST.json. A run id that
    already has committed iterations continues from the last one (same config required);
    an iteration that was interrupted resumes at its first uncommitted stage.
    ``time_budget_s`` / ``stop_at_reward`` (mean of the last 5) stop early (benchmarks).
    """
    run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    istore, state = open_run(cfg, store, run_id, log)
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    log(f"[rlhf] run {run_id}: config (hash {cfg.config_hash()[:12]}):\n{describe(cfg)}")
    start_local_ray()
    t0 = time.perf_counter()
    workers = WorkerSet.build(cfg)
    log(f"[rlhf] worker groups ready in {time.perf_counter() - t0:.1f}s")
    try:
        rows, trainer = run_iterations(cfg, workers, istore, state, iterations, run_dir, on_stage=on_stage,
                                       time_budget_s=time_budget_s, stop_at_reward=stop_at_reward,
                                       checkpoint_last=True)
    finally:
        workers.kill()
    return {**_finish(cfg, run_dir, rows, istore, trainer), "started": trainer.started_at}


def iterate(cfg: RunConfig, run_id: str, store: str, head, iterations: int = 1, log=print, on_stage=None,
            lease_ttl_s: float = 900.0, prefetch_next: bool | None = None) -> dict:
    """Run iterations against the run's long-lived session (this process must already be
    connected to the session's Ray cluster ``head``, in the run's namespace). The session
    is (re)started from the last committed checkpoint when it is not there.

    Overlapping triggers (a recurring run firing while the last one still runs) must not
    drive the same workers at once: the iteration is taken with a create-only lease in
    the store; a second trigger finding a fresh lease returns without doing anything.

    After its last commit the controller has the session compute the next iteration's
    inference stages ahead for the next controller to adopt, when ``trainer.prefetch`` is
    on and ``prefetch_next`` is not False (the driver says False for a fine-tune's last
    iteration)."""
    from rlhf_core import session

    from rlhf_core.trainer.lease import LeaseKeeper, holder_id
    from rlhf_core.trainer.prefetch import SessionPrefetch

    istore, state = open_run(cfg, store, run_id, log)
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    me = holder_id()

    def take_lease(iteration: int):
        log_ = istore.lease_log(iteration, lease_ttl_s)
        lease = log_.acquire(me)
        if isinstance(lease, str):
            raise LeaseHeld(lease)
        if iteration in istore.committed_iterations():  # a holder committed it, then released
            log_.release(lease)
            raise LeaseHeld("nobody: it is committed already")
        return LeaseKeeper(log_, lease)

    def stage_started(step: int, name: str) -> None:
        record.update.remote(stage=name)  # the session sees it is in use
        if on_stage is not None:
            on_stage(step, name)

    # the first iteration's lease before anything touches the workers: a controller that
    # lost the race must not restore (reload) weights under the winner's running stages
    def held_by(holder: str) -> dict:
        log(f"[rlhf] iteration {state.global_step} of run {run_id} is being run by {holder}; leaving it alone")
        return {"run_id": run_id, "rows": [], "lease_held_by": holder, "snapshots": istore.run_uri,
                "metrics": str(run_dir / "metrics.jsonl"), "session": None}

    try:
        pending = [take_lease(state.global_step)]
    except LeaseHeld as held:
        return held_by(str(held))

    def lease_for(iteration: int):
        return pending.pop() if pending else take_lease(iteration)

    try:
        attached = session.ensure(cfg, run_id, store, head)
    except BaseException:
        pending.pop().close()
        raise
    info, record = attached.info, attached.record
    log(f"[rlhf] session of run {run_id}: attached to generation {info['generation']} (job {info['job_id']})")
    import ray

    # dirty until this iteration commits; confirmed before anything else, so no computing
    # ahead can start on the workers once this controller is on them
    ray.get(record.update.remote(step=None))
    ahead = (SessionPrefetch(cfg, run_id, attached.prefetcher, info.get("step"), info["generation"], log)
             if attached.prefetcher is not None else None)
    # the session counts as in use while this controller runs, however long a stage takes
    # (an idle timeout shorter than a stage must not end the session under it)
    stop_beat = threading.Event()

    def heartbeat() -> None:
        timeout = info.get("idle_timeout_s") or cfg.trainer.session_idle_timeout_s  # the session's own
        while not stop_beat.wait(max(0.2, min(30.0, timeout / 4))):
            try:
                record.update.remote()
            except Exception:  # the session is gone: the next worker call says so
                return

    threading.Thread(target=heartbeat, name="session-heartbeat", daemon=True).start()
    try:
        rows, trainer = run_iterations(cfg, attached.workers, istore, state, iterations, run_dir,
                                       workers_at_step=info.get("step"), on_stage=stage_started,
                                       on_committed=lambda step: ray.get(record.update.remote(step=step)),
                                       take_lease=lease_for, prefetch=ahead)
        if rows and ahead is not None and cfg.trainer.prefetch and prefetch_next is not False:
            ahead.start_next(trainer.state)
    except LeaseHeld as held:  # a later iteration's (this controller committed the ones before)
        return held_by(str(held))
    finally:
        stop_beat.set()
        for keeper in pending:  # the loop never started (restoring the workers failed)
            keeper.close()
    result = {**_finish(cfg, run_dir, rows, istore, trainer, plot=False),
              "session": {k: info[k] for k in ("generation", "job_id")},
              "prefetch": ahead.notes if ahead is not None else []}
    if rows:
        last = istore.read_manifest(rows[-1]["iteration"])
        result["lineage"] = {"run_id": run_id, "iteration": last["iteration"],
                             "parent_iteration": last["parent_iteration"], "config_hash": last["config_hash"],
                             "code_version": last["code_version"], "checkpoint": last["checkpoint"],
                             "iteration_uri": istore.iteration_uri(last["iteration"])}
    return result
