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
import time
import uuid
from pathlib import Path

from rlhf_core.config import RunConfig, describe


def worker_roles(cfg: RunConfig) -> dict:
    """The roles colocated in each worker process: actor/rollout/ref, reward, critic."""
    from rlhf_core.controller import RayClassWithInitArgs
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.critic import CriticWorker
    from rlhf_core.workers.reward import RewardWorker

    roles = {"actor": RayClassWithInitArgs(ActorRolloutRefWorker, cfg),
             "reward": RayClassWithInitArgs(RewardWorker, cfg)}
    if cfg.use_critic:
        roles["critic"] = RayClassWithInitArgs(CriticWorker, cfg)
    return roles


def build_workers(cfg: RunConfig, name_prefix: str = "rlhf_worker", pool_name: str = "global_pool",
                  detached: bool = False) -> dict:
    """One process per actor rank hosting every role (actor/rollout/ref, critic, reward);
    ``detached`` ones outlive this driver (the long-lived session's)."""
    import torch

    from rlhf_core.controller import RayResourcePool, RayWorkerGroup, create_colocated_worker_cls

    roles = worker_roles(cfg)
    pool = RayResourcePool([cfg.actor.world_size], use_gpu=torch.cuda.is_available(),
                           cpus_per_process=cfg.trainer.cpus_per_worker, name_prefix=pool_name,
                           max_colocate_count=1, detached=detached)
    group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix=name_prefix, detached=detached)
    workers = group.spawn(prefix_set=roles.keys())
    for role in roles:
        workers[role].init_model()
    workers["_group"], workers["_pool"] = group, pool
    return workers


def start_local_ray(run_dir: Path, num_cpus: int | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="rlhf-ray-"), log_to_driver=False,
             configure_logging=False,
             # Stage payloads of small models are a few hundred KB: passing them inline with
             # the call instead of through the object store saves a round trip per stage.
             _system_config={"max_direct_call_object_size": 4 * 1024 * 1024,
                             "task_rpc_inlined_bytes_limit": 16 * 1024 * 1024})


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


def save_checkpoint(workers: dict, trainer, cfg: RunConfig, uri: str, storage_options: dict | None = None) -> None:
    """Everything needed to continue exactly: the workers write weights, optimizer, LR
    schedule and their RNG; the controller writes its own state (global step, data
    cursor, KL coefficient) and the config hash, last."""
    import dataclasses

    import fsspec

    workers["actor"].save_checkpoint(uri, storage_options)
    if "critic" in workers:
        workers["critic"].save_checkpoint(uri, storage_options)
    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    state = {**dataclasses.asdict(trainer.state), "config_hash": cfg.config_hash(), "config": cfg.to_dict()}
    fs.pipe_file(f"{root}/trainer_state.json", json.dumps(state, indent=1).encode())


def load_checkpoint(workers: dict, uri: str, storage_options: dict | None = None) -> None:
    workers["actor"].load_checkpoint(uri, storage_options)
    if "critic" in workers:
        workers["critic"].load_checkpoint(uri, storage_options)


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _checkpoint_exists(uri: str) -> bool:
    from rlhf_core.snapshot import fs as sfs

    loc = sfs.resolve(uri + "/trainer_state.json")
    return sfs.read_bytes(loc) is not None


def open_run(cfg: RunConfig, store: str, run_id: str, log=print):
    """Read where the run stands: (IterationStore, TrainerState). A committed run must
    continue with the config it was trained with (the error lists the differences)."""
    from rlhf_core.config import ConfigError
    from rlhf_core.trainer.iteration_store import IterationStore
    from rlhf_core.trainer.ppo import TrainerState

    cfg.validate()
    istore = IterationStore(store, run_id)
    state = TrainerState(kl_coef=cfg.algorithm.kl_ctrl.kl_coef)
    committed = istore.committed_iterations()
    if committed:
        last = istore.read_manifest(committed[-1])
        if last["config_hash"] != cfg.config_hash():
            diff = _config_diff(last["config"], cfg.to_dict())
            raise ConfigError(f"run {run_id} was trained with another config; continuing it would mix "
                              f"them. Differences (committed -> now): {'; '.join(diff[:10])}. Use a new "
                              f"--run-id or the same overrides.")
        state = TrainerState(global_step=last["global_step"], cursor=last["data_cursor"], kl_coef=last["kl_coef"])
        log(f"[rlhf] run {run_id}: continuing after iteration {committed[-1]}")
    return istore, state


def make_loader(cfg: RunConfig, state):
    from rlhf_core.data.dataset import Cursor, PromptLoader, load_rows
    from rlhf_core.data.tokenizer import PromptTokenizer
    from rlhf_core.workers import modeling

    model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=cfg.trainer.progress)
    return PromptLoader(load_rows(cfg.data.train_files, cfg.trainer.seed), PromptTokenizer(model_path),
                        cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.seed,
                        cfg.data.shuffle, cursor=Cursor(**state.cursor))


def run_iterations(cfg: RunConfig, workers: dict, istore, state, iterations: int, run_dir: Path,
                   workers_at_step: int | None = None, on_stage=None, time_budget_s: float | None = None,
                   stop_at_reward: float | None = None, on_committed=None) -> tuple[list[dict], object]:
    """The iteration loop shared by direct runs and session-attached controllers.

    ``workers_at_step``: the step the workers' state is known to be at (a live session
    that committed it); otherwise the starting checkpoint is loaded (or, at step 0,
    written, so that iteration 0 can be resumed too). Each iteration: stages (resuming at
    the first uncommitted one), checkpoint, then the MANIFEST.json commit.
    """
    from tqdm import tqdm

    from rlhf_core import tracking
    from rlhf_core.testing import faults
    from rlhf_core.trainer.iteration_store import code_version
    from rlhf_core.trainer.ppo import PPOTrainer

    loader = make_loader(cfg, state)
    bar = tqdm(total=iterations, desc="iteration", disable=not cfg.trainer.progress, file=sys.stderr)

    def stage_hook(name: str) -> None:
        bar.set_description(f"stage {name:<13}")
        if on_stage is not None:
            on_stage(trainer.state.global_step, name)

    trainer = PPOTrainer(cfg, workers, loader, state, on_stage=stage_hook, stage_store=istore)
    start_ckpt = istore.checkpoint_uri(state.global_step)
    if workers_at_step != state.global_step:
        if _checkpoint_exists(start_ckpt):
            load_checkpoint(workers, start_ckpt)  # the exact state this iteration starts from
        elif state.global_step == 0:
            save_checkpoint(workers, trainer, cfg, start_ckpt)
        else:
            raise FileNotFoundError(f"run {istore.run_id}: step {state.global_step} is committed but its "
                                    f"checkpoint {start_ckpt} is missing")
    version = code_version()
    rows = []
    train_start = time.perf_counter()
    try:
        with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as out:
            for _ in range(iterations):
                iteration = trainer.state.global_step
                metrics = trainer.run_iteration()
                checkpoint = istore.checkpoint_uri(trainer.state.global_step)
                save_checkpoint(workers, trainer, cfg, checkpoint)
                faults.reached(f"commit:{iteration}")
                istore.commit_iteration(iteration, {
                    "config_hash": cfg.config_hash(), "config": cfg.to_dict(), "code_version": version,
                    "checkpoint": checkpoint, "data_cursor": trainer.state.cursor,
                    "kl_coef": trainer.state.kl_coef, "global_step": trainer.state.global_step,
                    "rng": {"trainer_seed": cfg.trainer.seed, "rollout_seed": cfg.rollout.seed,
                            "note": "every random draw is seeded from these and the global step"},
                    "stage_timings_s": {k[len("timing_s/"):]: v for k, v in metrics.items() if k.startswith("timing_s/")},
                    "metrics": {k: v for k, v in metrics.items() if not k.startswith(("timing", "perf"))},
                    "snapshots": {name: istore.stage_uri(iteration, name) for name, _ in trainer.stages()
                                  if name != "weight_sync"},
                })
                if tracking.enabled():
                    tracking.export_iteration(istore.run_id, istore.read_manifest(iteration))
                if on_committed is not None:
                    on_committed(trainer.state.global_step)
                row = {"iteration": iteration, "wall_clock_s": time.perf_counter() - train_start, **metrics}
                out.write(json.dumps(row) + "\n")
                out.flush()
                rows.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}",
                                s_per_it=f"{metrics['timing_s/iteration']:.2f}")
                recent = [r["critic/score/mean"] for r in rows[-5:]]
                if stop_at_reward is not None and len(recent) == 5 and sum(recent) / 5 >= stop_at_reward:
                    break
                if time_budget_s is not None and row["wall_clock_s"] >= time_budget_s:
                    break
    finally:
        bar.close()
    return rows, trainer


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
    start_local_ray(run_dir)
    t0 = time.perf_counter()
    workers = build_workers(cfg)
    log(f"[rlhf] worker groups ready in {time.perf_counter() - t0:.1f}s")
    try:
        rows, trainer = run_iterations(cfg, workers, istore, state, iterations, run_dir, on_stage=on_stage,
                                       time_budget_s=time_budget_s, stop_at_reward=stop_at_reward)
    finally:
        workers["_group"].kill()
        workers["_pool"].release()
    return _finish(cfg, run_dir, rows, istore, trainer)


def iterate(cfg: RunConfig, run_id: str, store: str, head, iterations: int = 1, log=print, on_stage=None,
            lease_ttl_s: float = 900.0) -> dict:
    """Run iterations against the run's long-lived session (this process must already be
    connected to the session's Ray cluster ``head``, in the run's namespace). The session
    is (re)started from the last committed checkpoint when it is not there.

    Overlapping triggers (a recurring run firing while the last one still runs) must not
    drive the same workers at once: the iteration is taken with a create-only lease in
    the store; a second trigger finding a fresh lease returns without doing anything."""
    from rlhf_core import session

    istore, state = open_run(cfg, store, run_id, log)
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = istore.take_lease(state.global_step, lease_ttl_s)
    if holder is not None:
        log(f"[rlhf] iteration {state.global_step} of run {run_id} is being run by {holder}; leaving it alone")
        return {"run_id": run_id, "rows": [], "lease_held_by": holder, "snapshots": istore.run_uri,
                "metrics": str(run_dir / "metrics.jsonl"), "session": None}
    def committed(step: int) -> None:
        record.update.remote(step=step)
        istore.release_lease(step - 1)
        if step < state_start + iterations:
            istore.take_lease(step, lease_ttl_s)

    def stage_started(step: int, name: str) -> None:
        istore.renew_lease(step)  # a live holder keeps its lease fresh
        record.update.remote(stage=name)  # and the session sees it is in use
        if on_stage is not None:
            on_stage(step, name)

    state_start = state.global_step
    try:
        workers = session.ensure(cfg, run_id, store, head)
        info = workers["_info"]
        log(f"[rlhf] session of run {run_id}: attached to generation {info['generation']} (job {info['job_id']})")
        at_step = info.get("step")
        record = workers["_record"]
        record.update.remote(step=None)  # dirty until this iteration commits
        rows, trainer = run_iterations(cfg, workers, istore, state, iterations, run_dir, workers_at_step=at_step,
                                       on_stage=stage_started, on_committed=committed)
    finally:
        istore.release_lease(state.global_step)
    result = {**_finish(cfg, run_dir, rows, istore, trainer, plot=False),
              "session": {k: info[k] for k in ("generation", "job_id")}}
    if rows:
        last = istore.read_manifest(rows[-1]["iteration"])
        result["lineage"] = {"run_id": run_id, "iteration": last["iteration"],
                             "parent_iteration": last["parent_iteration"], "config_hash": last["config_hash"],
                             "code_version": last["code_version"], "checkpoint": last["checkpoint"],
                             "iteration_uri": istore.iteration_uri(last["iteration"])}
    return result
