"""On-policy distillation as a per-token advantage: pure functions.

The policy samples, a teacher scores the sampled tokens, and the per-token reverse KL
estimate KL_t (``loss_mode``: an estimator of log pi_student - log pi_teacher at the sampled
token, the ones the reference's KL uses) becomes a training signal: ``A_t - lambda KL_t``
beside the task's advantages (slime's form, verl's ``use_task_rewards``), or ``-KL_t``
alone (distillation without rewards, verl's default). Tokens where the student is likelier
than the teacher are pushed down, and the reverse.

Or (``loss_mode=forward_kl_topk``) the forward KL over the teacher's k likeliest tokens at
each position, ``sum_k p_T(k) (log p_T(k) - log p_S(k))``, backpropagated as a supervised
loss (verl's ``use_policy_gradient=false``): the student is pulled towards the teacher's
distribution, not only pushed off its own samples.
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


#: The loss modes over the teacher's top-k log-probs (the teacher stage keeps k per token).
TOPK_LOSS_MODES = ("forward_kl_topk",)


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    response_mask: torch.Tensor, log_prob_min_clamp: float | None = None,
                    loss_max_clamp: float | None = None) -> torch.Tensor:
    """Per response token (0 outside ``response_mask``), over the teacher's top k ids
    ([rows, response_length, k] log-probs of the same ids under each model):
    ``sum_k p_T (log p_T - log p_S)``, both log-probs clamped from below at
    ``log_prob_min_clamp`` first. Over k tokens the masses need not sum to one and the sum
    can fall below zero: it is clamped at 0 (verl's rule), then at ``loss_max_clamp``."""
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float()
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp(min=log_prob_min_clamp), teacher.clamp(min=log_prob_min_clamp)
    kl = (teacher.exp() * (teacher - student)).sum(dim=-1).clamp(min=0.0)
    if loss_max_clamp is not None:
        kl = kl.clamp(max=loss_max_clamp)
    return kl * response_mask


def topk_masses(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's diagnostics: the probability mass each model puts on the teacher's top k,
    averaged over response tokens."""
    return {"distillation/student_mass": masked_mean(student_topk_log_probs.float().exp().sum(dim=-1), response_mask),
            "distillation/teacher_mass": masked_mean(teacher_topk_log_probs.float().exp().sum(dim=-1), response_mask)}


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
