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


def build_workers(cfg: RunConfig) -> dict:
    """One process per actor rank hosting every role (actor/rollout/ref, critic, reward)."""
    import torch

    from rlhf_core.controller import (
        RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls,
    )
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.critic import CriticWorker
    from rlhf_core.workers.reward import RewardWorker

    roles = {"actor": RayClassWithInitArgs(ActorRolloutRefWorker, cfg),
             "reward": RayClassWithInitArgs(RewardWorker, cfg)}
    if cfg.use_critic:
        roles["critic"] = RayClassWithInitArgs(CriticWorker, cfg)
    pool = RayResourcePool([cfg.actor.world_size], use_gpu=torch.cuda.is_available(),
                           cpus_per_process=cfg.trainer.cpus_per_worker, name_prefix="global_pool",
                           max_colocate_count=1)
    group = RayWorkerGroup(pool, create_colocated_worker_cls(roles), name_prefix="rlhf_worker")
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


def run_direct(cfg: RunConfig, iterations: int, store: str, run_id: str | None = None,
               log=print, time_budget_s: float | None = None, stop_at_reward: float | None = None,
               on_stage=None) -> dict:
    """Run ``iterations`` PPO/GRPO iterations in this process's controller.

    Every stage's output is committed as a snapshot under ``{store}/{run_id}/iter-N/``,
    every iteration ends with a checkpoint and, last, its MANIFEST.json. A run id that
    already has committed iterations continues from the last one (same config required);
    an iteration that was interrupted resumes at its first uncommitted stage.
    ``time_budget_s`` / ``stop_at_reward`` (mean of the last 5) stop early (benchmarks).
    """
    from tqdm import tqdm

    from rlhf_core.config import ConfigError
    from rlhf_core.data.dataset import Cursor, PromptLoader, load_rows
    from rlhf_core.trainer.iteration_store import IterationStore, code_version
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.workers import modeling

    cfg.validate()
    run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
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
        log(f"[rlhf] continuing run {run_id} after iteration {committed[-1]}")
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    log(f"[rlhf] run {run_id}: config (hash {cfg.config_hash()[:12]}):\n{describe(cfg)}")

    model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=cfg.trainer.progress)
    tokenizer = modeling.load_tokenizer(model_path)
    loader = PromptLoader(load_rows(cfg.data.train_files, cfg.trainer.seed), tokenizer,
                          cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.seed,
                          cfg.data.shuffle, cursor=Cursor(**state.cursor))
    start_local_ray(run_dir)
    t0 = time.perf_counter()
    workers = build_workers(cfg)
    log(f"[rlhf] worker groups ready in {time.perf_counter() - t0:.1f}s")
    bar = tqdm(total=iterations, desc="iteration", disable=not cfg.trainer.progress, file=sys.stderr)

    def stage_hook(name: str) -> None:
        bar.set_description(f"stage {name:<13}")
        if on_stage is not None:
            on_stage(trainer.state.global_step, name)

    trainer = PPOTrainer(cfg, workers, loader, state, on_stage=stage_hook, stage_store=istore)
    start_ckpt = istore.checkpoint_uri(state.global_step)
    if _checkpoint_exists(start_ckpt):
        load_checkpoint(workers, start_ckpt)  # the exact state this iteration starts from
    elif state.global_step == 0:
        save_checkpoint(workers, trainer, cfg, start_ckpt)  # so iteration 0 can be resumed too
    else:
        raise FileNotFoundError(f"run {run_id}: iteration {state.global_step - 1} is committed but its "
                                f"checkpoint {start_ckpt} is missing")
    version = code_version()
    metrics_path = run_dir / "metrics.jsonl"
    rows = []
    train_start = time.perf_counter()
    try:
        with open(metrics_path, "a", encoding="utf-8") as out:
            for _ in range(iterations):
                iteration = trainer.state.global_step
                metrics = trainer.run_iteration()
                checkpoint = istore.checkpoint_uri(trainer.state.global_step)
                save_checkpoint(workers, trainer, cfg, checkpoint)
                istore.commit_iteration(iteration, {
                    "config_hash": cfg.config_hash(), "config": cfg.to_dict(), "code_version": version,
                    "checkpoint": checkpoint, "data_cursor": trainer.state.cursor,
                    "kl_coef": trainer.state.kl_coef, "global_step": trainer.state.global_step,
                    "rng": {"trainer_seed": cfg.trainer.seed, "rollout_seed": cfg.rollout.seed,
                            "note": "every random draw is seeded from these and the global step"},
                    "stage_timings_s": {k[len("timing_s/"):]: v for k, v in metrics.items() if k.startswith("timing_s/")},
                    "metrics": {k: v for k, v in metrics.items() if not k.startswith(("timing", "perf"))},
                    "snapshots": {name: istore.stage_uri(iteration, name) for name, _ in trainer.stages()
                                  if name not in ("weight_sync",)},
                })
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
        workers["_group"].kill()
        workers["_pool"].release()
    curve = run_dir / "reward_curve.png"
    if rows:
        plot_curve(rows, curve)
    return {"run_id": run_id, "metrics": str(metrics_path), "curve": str(curve), "rows": rows,
            "checkpoint": istore.checkpoint_uri(trainer.state.global_step), "snapshots": istore.run_uri}
