"""An iteration's stages, declared once.

The iteration loop, computing ahead, the redo of updates on restore and replay all run
stages through one loop (``PPOTrainer.run_stages``) over this table; resume (which stages
are loaded, which re-run), the iteration manifest (which snapshots it lists) and replay
(which stages it can replay, whose weights a stateful one changes) read it too. A stage's
``method`` names the ``PPOTrainer`` method that runs it.

    stateful   it changes worker state (weights, optimizer, engine): on resume it re-runs
               from the restored checkpoint instead of being loaded from its snapshot
    persisted  its output batch is committed as a snapshot, so it can be replayed
    draws_prompts  it takes further prompts from the data loader (DAPO's dynamic sampling):
               never computed ahead
    inference  it only reads worker state: the leading run of inference stages can be
               computed ahead (``prefetchable``) while no controller is attached
    side       its input and output are a batch of their own, not the iteration's (validation):
               it runs before the training stages, on the weights the iteration starts from,
               only at the iterations ``due`` names, and never touches the training batch,
               its random draws or the data cursor
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlhf_core.config import RunConfig


def _always(cfg: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    name: str
    method: str
    roles: tuple[str, ...]
    stateful: bool = False
    persisted: bool = True
    enabled: Callable[[RunConfig], bool] = _always
    side: bool = False
    due: Callable[[RunConfig, int], bool] | None = None  # side stages: the iterations that run it
    draws_prompts: bool = False  # it takes more prompts from the loader (never computed ahead)

    @property
    def inference(self) -> bool:
        return not self.stateful and bool(self.roles)


STAGES: tuple[Stage, ...] = (
    Stage("rollout", "rollout", ("actor",)),
    Stage("reward_baseline", "compute_reward_baseline", ("actor", "reward"),
          enabled=lambda cfg: cfg.estimator.needs_reward_baseline),
    Stage("rm_score", "compute_rm_score", ("reward_model",), enabled=lambda cfg: cfg.reward_model.enable and not cfg.judge_served),
    Stage("reward", "compute_reward", ("reward",)),
    Stage("filter_groups", "filter_groups", ("actor", "reward"), enabled=lambda cfg: cfg.algorithm.filter_groups.enable,
          draws_prompts=True),
    Stage("old_log_prob", "compute_old_log_prob", ("actor",), enabled=lambda cfg: cfg.runs_old_log_prob_stage),
    Stage("ref_log_prob", "compute_ref_log_prob", ("actor",), enabled=lambda cfg: cfg.use_reference),
    Stage("teacher_log_prob", "compute_teacher_log_prob", ("actor",), enabled=lambda cfg: cfg.distillation.enabled),
    Stage("values", "compute_values", ("critic",), enabled=lambda cfg: cfg.use_critic),
    Stage("advantage", "compute_advantage", ()),
    Stage("update_critic", "update_critic", ("critic",), stateful=True, enabled=lambda cfg: cfg.use_critic),
    Stage("update_actor", "update_actor", ("actor",), stateful=True),
    Stage("weight_sync", "weight_sync", ("actor",), stateful=True, persisted=False),
)

#: Side stages (see ``side`` above), in the order they run before the training stages.
SIDE_STAGES: tuple[Stage, ...] = (
    Stage("validate", "validate", ("actor", "reward_model", "reward"), side=True, enabled=lambda cfg: bool(cfg.data.val_files),
          due=lambda cfg, step: cfg.validation_due(step)),
)

BY_NAME = {stage.name: stage for stage in STAGES + SIDE_STAGES}
#: The stage whose snapshot holds the decoded responses and their scores (the report's samples
#: come from it).
SCORED = BY_NAME["reward"].name
#: The validation stage (its snapshot: the validation samples).
VALIDATE = BY_NAME["validate"].name


def gen_batch_snapshot(generation: int) -> str:
    """The snapshot of filter_groups' further generation batch ``generation`` (1, 2, ...:
    the iteration's own rollout is generation 0), scored, every row as generated: a killed
    filter_groups resumes from them and a replay gives their tools' and judge's answers
    again (standalone snapshots, listed in the iteration manifest)."""
    return f"{BY_NAME['filter_groups'].name}.gen_batch-{generation}"


def gen_batch_snapshots(metrics: dict) -> list[str]:
    """The further generation batches' snapshots of an iteration whose metrics are
    ``metrics`` (verl's ``train/num_gen_batches`` counts the first batch too)."""
    return [gen_batch_snapshot(k) for k in range(1, int(metrics.get("train/num_gen_batches", 1)))]


def plan(cfg: RunConfig) -> list[Stage]:
    """This run's stages, in order."""
    return [stage for stage in STAGES if stage.enabled(cfg)]


def side_plan(cfg: RunConfig, step: int) -> list[Stage]:
    """The side stages iteration ``step`` runs (validation every trainer.test_freq), in order."""
    return [stage for stage in SIDE_STAGES if stage.enabled(cfg) and stage.due(cfg, step)]


def persisted_names(cfg: RunConfig, step: int | None = None) -> list[str]:
    """The stages whose snapshots an iteration commits (with ``step``: its side stages too)."""
    side = side_plan(cfg, step) if step is not None else []
    return [stage.name for stage in side + plan(cfg) if stage.persisted]


def prefetchable(cfg: RunConfig) -> list[Stage]:
    """The leading inference stages (rollout through values): they depend only on the
    weights and the prompts, so the session can compute them for the next iteration
    right after this one's weight sync (``rlhf_core.session.prefetch``)."""
    stages = []
    for stage in plan(cfg):
        if not stage.inference or stage.draws_prompts:
            break
        stages.append(stage)
    return stages
