"""The controller: one PPO/GRPO iteration as named stages over WorkerGroups.

Read ``run_iteration`` top to bottom: each stage calls a WorkerGroup (or a pure function
from ``rlhf_core.algorithms``) and extends the batch. Everything heavy happens inside the
workers; the controller holds the order of things and the small state (KL controller,
data cursor, global step).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from rlhf_core.algorithms import (
    AdaptiveKLController, FixedKLController, apply_kl_penalty, get_adv_estimator_fn,
)
from rlhf_core.config import RunConfig
from rlhf_core.protocol import DataProto
from rlhf_core.trainer.metrics import compute_data_metrics, reduce_metrics

#: What a model forward needs; stages send workers only the columns they read.
SEQUENCE_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]

STAGES = ("rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage",
          "update_critic", "update_actor", "weight_sync")


@dataclass
class TrainerState:
    """Everything the controller needs to continue a run exactly."""

    global_step: int = 0
    cursor: dict = field(default_factory=lambda: {"epoch": 0, "position": 0})
    kl_coef: float = 0.0
    rng: dict = field(default_factory=dict)


class PPOTrainer:
    """Drives PPO/GRPO iterations over worker groups placed on a local or remote Ray."""

    def __init__(self, config: RunConfig, workers: dict, loader, state: TrainerState | None = None,
                 on_stage=None) -> None:
        self.config = config
        self.actor, self.reward = workers["actor"], workers["reward"]
        self.critic = workers.get("critic")
        self.loader = loader
        self.state = state or TrainerState(kl_coef=config.algorithm.kl_ctrl.kl_coef)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(self.state.kl_coef, kl.target_kl, kl.horizon)
                        if kl.type == "adaptive" else FixedKLController(self.state.kl_coef))
        self.on_stage = on_stage or (lambda name: None)

    @contextlib.contextmanager
    def _stage(self, name: str, timing: dict):
        self.on_stage(name)
        t0 = time.perf_counter()
        yield
        timing[name] = time.perf_counter() - t0

    def _take(self, out: DataProto, worker_time: dict, name: str) -> DataProto:
        """Strip the workers' self-reported compute time (kept as a metric, never data)."""
        metrics = out.meta_info.get("metrics") or {}
        spent = metrics.pop("timing_worker_s", None)
        if spent:
            worker_time[name] = max(spent) if isinstance(spent, list) else spent
        if not metrics:
            out.meta_info.pop("metrics", None)
        return out

    def run_iteration(self) -> dict:
        cfg, step = self.config, self.state.global_step
        timing, worker_time, metrics = {}, {}, {}
        t_start = time.perf_counter()
        batch = self.loader.next_batch()
        batch.meta_info.update(global_step=step, temperature=cfg.rollout.temperature)

        with self._stage("rollout", timing):
            batch = batch.repeat(cfg.rollout.n, interleave=True)  # n responses share a uid
            seeds = cfg.rollout.seed + step * 1_000_003 + torch.arange(len(batch), dtype=torch.long)
            batch.batch["sample_seed"] = seeds
            prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids", "sample_seed"])
            batch.union(self._take(self.actor.generate_sequences(prompts), worker_time, "rollout"))

        with self._stage("reward", timing):
            needed = batch.select(["responses", "response_mask"],
                                  ["uid", "data_source", "ground_truth", "extra_info"])
            batch.union(self._take(self.reward.compute_reward(needed), worker_time, "reward"))

        with self._stage("old_log_prob", timing):
            old = self._take(self.actor.compute_log_prob(batch.select(SEQUENCE_KEYS, [])),
                             worker_time, "old_log_prob")
            entropys = old.pop(batch_keys=["entropys"]).batch["entropys"]
            batch.union(old)

        if cfg.use_reference:
            with self._stage("ref_log_prob", timing):
                ref = self.actor.compute_ref_log_prob(batch.select(SEQUENCE_KEYS, []))
                batch.union(self._take(ref, worker_time, "ref_log_prob"))

        if cfg.use_critic:
            with self._stage("values", timing):
                values = self.critic.compute_values(batch.select(SEQUENCE_KEYS + ["response_mask"], []))
                batch.union(self._take(values, worker_time, "values"))

        with self._stage("advantage", timing):
            mask = batch.batch["response_mask"].float()
            scores = batch.batch["token_level_scores"]
            if cfg.algorithm.use_kl_in_reward:
                rewards, current_kl = apply_kl_penalty(scores, batch.batch["old_log_probs"],
                                                       batch.batch["ref_log_prob"], mask,
                                                       self.kl_ctrl.value, cfg.algorithm.kl_penalty)
                self.kl_ctrl.update(current_kl, n_steps=len(batch))
                metrics.update({"actor/reward_kl_penalty": current_kl,
                                "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
            else:
                rewards = scores
            batch.batch["token_level_rewards"] = rewards
            estimator = get_adv_estimator_fn(cfg.algorithm.adv_estimator)
            advantages, returns = estimator(
                token_level_rewards=rewards, response_mask=mask, values=batch.batch.get("values", None),
                index=batch.non_tensor_batch["uid"], gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
            batch.batch["advantages"], batch.batch["returns"] = advantages, returns

        if cfg.use_critic:
            with self._stage("update_critic", timing):
                needed = batch.select(SEQUENCE_KEYS + ["response_mask", "values", "returns"], [])
                out = self._take(self.critic.update_critic(needed), worker_time, "update_critic")
                metrics.update(reduce_metrics(out.meta_info["metrics"]))

        with self._stage("update_actor", timing):
            keys = SEQUENCE_KEYS + ["response_mask", "old_log_probs", "advantages"]
            keys += ["ref_log_prob"] if cfg.actor.use_kl_loss else []
            out = self._take(self.actor.update_actor(batch.select(keys, [])), worker_time, "update_actor")
            metrics.update(reduce_metrics(out.meta_info["metrics"]))

        with self._stage("weight_sync", timing):
            worker_time["weight_sync"] = max(self.actor.sync_weights())

        self.state.global_step += 1
        self.state.cursor = self.loader.cursor.to_dict()
        self.state.kl_coef = self.kl_ctrl.value
        total = time.perf_counter() - t_start
        metrics.update(compute_data_metrics(batch, entropys, use_critic=cfg.use_critic))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics.update({f"timing_worker_s/{k}": v for k, v in worker_time.items()})
        metrics["timing_s/iteration"] = total
        inside = sum(worker_time.values())
        metrics["perf/worker_time_s"] = inside
        metrics["perf/outside_workers_share"] = max(0.0, 1 - inside / total)
        tokens = int(batch.batch["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / total
        metrics["training/global_step"] = self.state.global_step
        self.last_batch = batch
        return metrics


def capture_rng() -> dict:
    return {"python": repr(random.getstate()), "numpy_seed_hint": int(np.random.get_state()[1][0]),
            "torch_initial_seed": int(torch.initial_seed())}
