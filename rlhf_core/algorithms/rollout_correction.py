"""Rollout correction (verl's ``algorithm.rollout_correction``): the rollout engine samples
with its own numerics, so its policy (``rollout_log_probs``) is not exactly the trained one.

Two tools, both pure functions of ``log_ratio = log pi_train - log pi_rollout`` per token:

- importance weights (``rollout_is``: ``token`` or ``sequence``), truncated above at
  ``rollout_is_threshold`` and, optionally, divided by their mean (``batch_normalize``);
- rejection (``rollout_rs``: a comma-separated list of ``token_k1/k2/k3``,
  ``seq_sum_k1/k2/k3``, ``seq_mean_k1/k2/k3``, ``seq_max_k2/k3``): tokens or whole
  sequences whose divergence statistic falls outside its bound leave the loss mask.

With k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio (Schulman's
estimators, the rollout policy in the numerator of k1). A ``*_k1`` bound is ``"lo_hi"`` (a
bare ``hi``: lo = 1/hi) on the ratio pi_rollout / pi_train; the others take one upper
bound. The trainer decides where they apply (``ppo.compute_advantage`` before the
advantages without bypass mode, the actor's loss per micro-batch with it).
"""

from __future__ import annotations

import math

import torch

from rlhf_core.algorithms.core import masked_mean, masked_sum

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = tuple(f"{kind}_{k}" for kind in ("token", "seq_sum", "seq_mean") for k in ("k1", "k2", "k3")) + (
    "seq_max_k2", "seq_max_k3")
#: Policy losses whose per-token loss scales with the advantage (a weight w >= 0 on a token's
#: loss is w on its advantage): the ones importance weights apply to without bypass mode.
WEIGHABLE_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "cispo")
_CLAMP = 20.0


def rejection_options(spec: str | None) -> list[str]:
    """``rollout_rs``'s options, in order, each once; ValueError naming the unknown one."""
    options: list[str] = []
    for option in (part.strip() for part in (spec or "").split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs: expected a comma-separated list of "
                             f"{', '.join(RS_OPTIONS)}; found {option!r}")
        if option not in options:
            options.append(option)
    return options


def rejection_bounds(options: list[str], spec) -> list[tuple[float, float]]:
    """Each option's (lower, upper) bound on its statistic, k1's in log space; ValueError
    naming what is wrong with ``rollout_rs_threshold``."""
    field = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None or str(spec).strip() in ("", "null", "None"):
        raise ValueError(f"{field}: expected a bound for rollout_rs={','.join(options)}; found none")
    parts = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"{field}: expected 1 bound or one per option ({len(options)}); found {len(parts)}")
    parts = parts * len(options) if len(parts) == 1 else parts
    bounds = []
    for option, part in zip(options, parts):
        try:
            if option.endswith("k1"):
                lo, hi = (float(x) for x in part.split("_", 1)) if "_" in part else (1 / float(part), float(part))
                if lo <= 0 or hi <= 0:
                    raise ValueError
                bounds.append((math.log(lo), math.log(hi)))
            else:
                if "_" in part or float(part) <= 0:
                    raise ValueError
                bounds.append((-math.inf, float(part)))
        except (ValueError, ZeroDivisionError):
            wanted = "lo_hi or a positive number" if option.endswith("k1") else "a positive number"
            raise ValueError(f"{field}: expected {wanted} for {option}; found {part!r}") from None
    return bounds


def _statistic(log_ratio: torch.Tensor, k: str) -> torch.Tensor:
    if k == "k1":
        return -log_ratio
    if k == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(log_ratio) - 1 - log_ratio


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: list[str],
                   bounds: list[tuple[float, float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` with the rejected tokens (or sequences) zeroed: every option must keep a
    token. Metrics: each option's and the overall masked fraction of tokens and sequences."""
    log_ratio = torch.clamp(log_ratio, -_CLAMP, _CLAMP)
    mask = mask.float()
    keep = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    sequences = (mask.sum(dim=-1) > 0).float()
    for option, (lo, hi) in zip(options, bounds):
        kind, k = option.rsplit("_", 1)
        stat = _statistic(log_ratio, k)
        if kind == "token":
            kept = (stat >= lo) & (stat <= hi)
        else:
            if kind == "seq_sum":
                per_seq = masked_sum(stat, mask, dim=-1)
            elif kind == "seq_mean":
                per_seq = masked_mean(stat, mask, dim=-1)
            else:  # seq_max: an empty row's max is 0
                per_seq = torch.where(mask.bool(), stat, torch.zeros_like(stat)).amax(dim=-1)
            kept = ((per_seq >= lo) & (per_seq <= hi)).unsqueeze(-1).expand_as(mask)
        kept = kept.float()
        keep = keep * kept
        metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] = _fraction_out(kept, mask)
        metrics[f"rollout_corr/rollout_rs_{option}_seq_masked_fraction"] = _sequences_out(kept, mask, sequences)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = _fraction_out(keep, mask)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = _sequences_out(keep, mask, sequences)
    return mask * keep, metrics


def _fraction_out(kept: torch.Tensor, mask: torch.Tensor) -> float:
    return float(1 - masked_mean(kept, mask))


def _sequences_out(kept: torch.Tensor, mask: torch.Tensor, sequences: torch.Tensor) -> float:
    """The share of sequences (with tokens) that lost any token."""
    lost = ((1 - kept) * mask).sum(dim=-1) > 0
    return float((lost.float() * sequences).sum() / sequences.sum().clamp(min=1))


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
                       batch_normalize: bool = False, mean_of=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights pi_train / pi_rollout per token (``sequence``: the
    sequence's product on each of its tokens), 0 where masked, detached. ``batch_normalize``
    divides by their mean (over tokens, or over sequences' mean weights); ``mean_of``
    (sum, count) -> (sum, count) reduces that mean across ranks (None: this batch alone)."""
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is: expected token or sequence; found {level!r}")
    mask = mask.float()
    log_ratio = log_ratio.detach()
    if level == "token":
        weights = torch.exp(torch.clamp(log_ratio, -_CLAMP, _CLAMP))
    else:
        per_seq = torch.clamp(masked_sum(log_ratio, mask, dim=-1), -_CLAMP, _CLAMP)
        weights = torch.exp(per_seq).unsqueeze(-1).expand_as(mask).clone()
    weights = weights * mask
    over = (weights > threshold).float()
    if level == "sequence":  # verl counts sequences over the threshold, not their tokens
        has = mask.sum(dim=-1) > 0
        high = float(over.amax(dim=-1)[has].mean()) if has.any() else 0.0
    else:
        high = float(masked_mean(over, mask))
    metrics = {"rollout_corr/rollout_is_mean": float(masked_mean(weights, mask)),
               "rollout_corr/rollout_is_max": float(torch.where(mask.bool(), weights, -torch.inf).max())
               if mask.any() else 0.0,
               "rollout_corr/rollout_is_ratio_fraction_high": high}
    weights = torch.clamp(weights, max=threshold)
    if batch_normalize:
        if level == "token":
            total, count = (weights * mask).sum(), mask.sum()
        else:
            has = mask.sum(dim=-1) > 0
            total, count = masked_mean(weights, mask, dim=-1)[has].sum(), has.sum().to(weights.dtype)
        if mean_of is not None:
            total, count = mean_of(total, count)
        mean = float(total / count.clamp(min=1))
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return weights.detach(), metrics


def divergence_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout policy is from the trained one on these tokens."""
    log_ratio = torch.clamp(log_ratio.detach(), -_CLAMP, _CLAMP)
    return {"rollout_corr/kl": float(masked_mean(-log_ratio, mask.float())),
            "rollout_corr/k3_kl": float(masked_mean(_statistic(log_ratio, "k3"), mask.float()))}


def correct(log_ratio: torch.Tensor, mask: torch.Tensor, config, mean_of=None
            ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """``config``'s rollout correction (an ``algorithm.rollout_correction`` section) of one
    batch: (the loss mask after rejection, the importance weights or None, metrics). The
    weights are computed on the mask before rejection, as verl does."""
    metrics = divergence_metrics(log_ratio, mask)
    weights = None
    if config.rollout_is:
        weights, is_metrics = importance_weights(log_ratio, mask, config.rollout_is, config.rollout_is_threshold,
                                                 config.rollout_is_batch_normalize, mean_of)
        metrics.update(is_metrics)
    options = rejection_options(config.rollout_rs)
    if options:
        mask, rs_metrics = rejection_mask(log_ratio, mask, options, rejection_bounds(options,
                                                                                     config.rollout_rs_threshold))
        metrics.update(rs_metrics)
    return mask.float(), weights, metrics


def reinforce_loss(log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   weights: torch.Tensor | None, loss_agg_mode: str) -> torch.Tensor:
    """verl's bypass-mode ``loss_type=reinforce``: ``-A * log pi * w`` (no ratio, no clip)."""
    from rlhf_core.algorithms.core import agg_loss

    losses = -advantages * log_prob * (weights if weights is not None else 1.0)
    return agg_loss(losses, mask, loss_agg_mode)
