"""Learning-rate schedules, as verl's FSDP workers step them: once per update of the role
(a training step, not an optimizer step), from 0 at the role's first update. Pure
functions of that count, so a resumed or redone update gets the rate it had the first
time, whatever the process did before."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def warmup_steps(section, total: int) -> int:
    """The role's warmup length: ``lr_warmup_steps`` when >= 0, else
    ``lr_warmup_steps_ratio`` of the run's total training steps (verl's -1 rule)."""
    if section.lr_warmup_steps >= 0:
        return int(section.lr_warmup_steps)
    return int(section.lr_warmup_steps_ratio * total)


def lr_factor(step: int, warmup: int, total: int, kind: str = "constant", min_lr_ratio: float = 0.0,
              num_cycles: float = 0.5) -> float:
    """The fraction of the configured rate at the role's ``step``-th update (0-based):
    a linear warmup from 0 over ``warmup`` updates, then constant, or a cosine from 1
    down to ``min_lr_ratio`` over the rest of ``total`` (``num_cycles`` waves; 0.5: half
    a wave, 1 to the floor). verl's ``get_constant_schedule_with_warmup`` and
    ``get_cosine_schedule_with_warmup`` (init_lr_ratio 0)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type: expected one of {list(SCHEDULES)}; found {kind!r}")
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    wave = math.cos(math.pi * num_cycles * 2.0 * progress)
    return max(min_lr_ratio, wave * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def uses_total(section) -> bool:
    """Whether the role's schedule depends on the run's total training steps."""
    return section.lr_scheduler_type == "cosine" or (section.lr_warmup_steps < 0 and section.lr_warmup_steps_ratio > 0)
