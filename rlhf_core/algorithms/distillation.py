"""On-policy distillation as a per-token advantage: pure functions.

The policy samples, a teacher scores the sampled tokens, and the per-token reverse KL
estimate KL_t (``loss_mode``: an estimator of log pi_student - log pi_teacher at the sampled
token, the ones the reference's KL uses) becomes a training signal: ``A_t - lambda KL_t``
beside the task's advantages (slime's form, verl's ``use_task_rewards``), or ``-KL_t``
alone (distillation without rewards, verl's default). Tokens where the student is likelier
than the teacher are pushed down, and the reverse.
"""

from __future__ import annotations

import torch

from rlhf_core.algorithms.core import kl_penalty, masked_mean


def distillation_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor,
                    loss_mode: str = "k3", log_prob_min_clamp: float | None = None,
                    loss_max_clamp: float | None = None) -> torch.Tensor:
    """KL_t per response token (0 outside ``response_mask``): both log-probs clamped from
    below at ``log_prob_min_clamp`` first, the estimate clamped to +-``loss_max_clamp``."""
    student, teacher = student_log_probs.float(), teacher_log_probs.float()
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp(min=log_prob_min_clamp), teacher.clamp(min=log_prob_min_clamp)
    kl = kl_penalty(student, teacher, loss_mode)
    if loss_max_clamp is not None:
        kl = kl.clamp(min=-loss_max_clamp, max=loss_max_clamp)  # k1 can be negative
    return kl * response_mask


def distilled_advantages(advantages: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor,
                         use_task_rewards: bool, coef: float) -> torch.Tensor:
    """``advantages - coef x kl`` with the task's advantages, else ``-kl`` (verl's coefficient
    is 1 then: the KL is the only signal)."""
    if use_task_rewards:
        return (advantages - coef * kl) * response_mask
    return -kl * response_mask


def distillation_metrics(kl: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """verl's names: the mean KL over response tokens, its smallest and largest."""
    picked = kl[response_mask.bool()]
    if picked.numel() == 0:
        return {"distillation/loss": 0.0, "distillation/loss_min": 0.0, "distillation/loss_max": 0.0}
    return {"distillation/loss": float(masked_mean(kl, response_mask)), "distillation/loss_min": float(picked.min()),
            "distillation/loss_max": float(picked.max())}
