"""The math of PPO/GRPO as pure functions, registered by name.

Every function takes tensors shaped ``(batch, response_len)`` with a ``response_mask``
(1 for generated tokens, 0 for padding) and returns tensors; nothing here knows about
workers, Ray or DataProto. Names match the metrics they feed (``pg_loss``, ``pg_clipfrac``,
``ppo_kl``, ``vf_loss``, ...).

Registries, so that users add their own without touching the trainer::

    @register_adv_est("my_estimator")
    def my_estimator(token_level_rewards, response_mask, index=None, **kw):
        ...
        return advantages, returns
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# --------------------------------------------------------------------- registries

ADV_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}
KL_ESTIMATORS: dict[str, Callable] = {}


@dataclass(frozen=True)
class AdvEstimatorSpec:
    """What an advantage estimator needs; the trainer provides exactly that.

    Every estimator is called with the same named inputs (``token_level_rewards``,
    ``response_mask``, ``values``, ``index``, ``reward_baselines``, ``gamma``, ``lam``,
    ``norm_adv_by_std_in_grpo``; absent ones are None) and returns (advantages, returns).
    """

    name: str
    needs_critic: bool = False           # a value model: the ``values`` input
    needs_reward_baseline: bool = False  # a greedy response per prompt: ``reward_baselines``
    needs_group: bool = False            # several responses per prompt (rollout.n >= 2)
    needs_sum_pi_squared: bool = False   # the old policy's log-probs and sum pi^2 per token


ADV_ESTIMATOR_SPECS: dict[str, AdvEstimatorSpec] = {}


def _registrar(table: dict, kind: str):
    def register(name: str):
        def decorator(fn):
            if name in table and table[name] is not fn:
                raise ValueError(f"{kind} {name!r} is already registered")
            table[name] = fn
            return fn
        return decorator
    return register


def register_adv_est(name: str, *, needs_critic: bool = False, needs_reward_baseline: bool = False,
                     needs_group: bool = False, needs_sum_pi_squared: bool = False):
    """Register an advantage estimator under ``name`` and declare what it needs."""
    spec = AdvEstimatorSpec(name, needs_critic, needs_reward_baseline, needs_group, needs_sum_pi_squared)

    def decorator(fn):
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name], ADV_ESTIMATOR_SPECS[name] = fn, spec
        return fn
    return decorator


register_policy_loss = _registrar(POLICY_LOSSES, "policy loss")
register_kl_estimator = _registrar(KL_ESTIMATORS, "KL estimator")


def _lookup(table: dict, name: str, kind: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)}")
    return table[name]


def get_adv_estimator_fn(name: str) -> Callable:
    return _lookup(ADV_ESTIMATORS, name, "advantage estimator")


def get_adv_estimator_spec(name: str) -> AdvEstimatorSpec:
    """The estimator's declared needs (a function registered straight into
    ``ADV_ESTIMATORS``, verl style, needs nothing extra)."""
    get_adv_estimator_fn(name)
    return ADV_ESTIMATOR_SPECS.get(name, AdvEstimatorSpec(name))


def get_policy_loss_fn(name: str) -> Callable:
    return _lookup(POLICY_LOSSES, name, "policy loss")


def loss_settings(fn: Callable, **settings) -> dict:
    """Those of ``settings`` that ``fn`` takes by name (a loss's own knobs, such as sapo's
    temperatures, reach the losses that declare them; a loss without them is called as
    before)."""
    import inspect

    params = inspect.signature(fn).parameters  # by name only: a ``**_`` would take anything
    return {k: v for k, v in settings.items() if k in params}


def get_kl_estimator_fn(name: str) -> Callable:
    return _lookup(KL_ESTIMATORS, name, "KL estimator")


# --------------------------------------------------------------------- masked statistics


def masked_only(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is nonzero, 0 elsewhere: what a masked position holds (a
    -inf log-prob after a response's end) never reaches a product (``-inf * 0`` is NaN)."""
    return torch.where(mask != 0, values, values.new_zeros(()))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    weighted = masked_only(values, mask) * mask
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Each row's index of its last nonzero mask entry (0 for a row without one): with
    ``response_mask``, the last token the policy generated, where an outcome reward or a
    reward model's score goes (in a multi-turn row, tokens others inserted may follow it)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values.clamp(min=0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over positions where mask is 1 (0 when the mask is empty)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std over masked positions; keeps the mean when not shift_mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a token-level loss: ``token-mean`` (every token weighs the same),
    ``seq-mean-token-sum`` (sum per sequence, mean over sequences) or
    ``seq-mean-token-mean`` (mean per sequence, then over sequences)."""
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    seq_has_tokens = (loss_mask.sum(dim=-1) > 0).float()
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, loss_mask, dim=-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, loss_mask, dim=-1)
    else:
        raise ValueError(f"loss_agg_mode must be token-mean, seq-mean-token-sum or "
                         f"seq-mean-token-mean; found {loss_agg_mode!r}")
    return (per_seq * seq_has_tokens).sum() / seq_has_tokens.sum().clamp(min=1)


# --------------------------------------------------------------------- advantages


def _groups(index) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's group (the rows sharing an ``index`` value, numbered) and each group's
    size: per-group sums are then one ``index_add_`` instead of a Python loop per group."""
    _, group, size = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    return torch.from_numpy(group.reshape(-1)).long(), torch.from_numpy(size).long()


def _group_sum(values: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    return torch.zeros(groups, dtype=values.dtype).index_add_(0, group, values)


@register_adv_est("gae", needs_critic=True)
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor,
                                 response_mask: torch.Tensor, gamma: float = 1.0,
                                 lam: float = 1.0, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), whitened over the batch.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lam * A_{t+1}``;
    padding positions neither contribute nor receive credit.
    """
    with torch.no_grad():
        mask = response_mask.float()
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            # padding keeps the carried values from the next real token
            next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
            last_gae = gae * mask[:, t] + last_gae * (1 - mask[:, t])
            advantages[:, t] = gae * mask[:, t]
        returns = advantages + values * mask
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    return token_level_rewards.sum(dim=-1)


@register_adv_est("grpo", needs_group=True)
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index, norm_adv_by_std_in_grpo: bool = True,
                                   epsilon: float = 1e-6, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): each response's score minus its group's mean (the
    responses sharing a ``uid``), divided by the group's std when
    ``norm_adv_by_std_in_grpo`` (Dr. GRPO drops the division). Broadcast over tokens."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        count = size.to(scores.dtype)
        centred = scores - (_group_sum(scores, group, len(size)) / count)[group]
        normalized = centred
        if norm_adv_by_std_in_grpo:  # the unbiased std, as torch.std
            std = (_group_sum(centred ** 2, group, len(size)) / (count - 1).clamp(min=1)).sqrt()
            normalized = centred / (std[group] + epsilon)
        # a lone response has no baseline: advantage 0
        normalized = torch.where(size[group] > 1, normalized, torch.zeros_like(normalized))
        advantages = normalized.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo", needs_group=True)
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                   index, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the other
    responses of the same prompt, ``n/(n-1) * (r - mean)``."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        n = size.to(scores.dtype)[group]
        mean = (_group_sum(scores, group, len(size)) / size.to(scores.dtype))[group]
        out = torch.where(n > 1, scores * n / (n - 1).clamp(min=1) - mean * n / (n - 1).clamp(min=1),
                          torch.zeros_like(scores))
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_vectorized", needs_group=True)
def compute_grpo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                              index, norm_adv_by_std_in_grpo: bool = True,
                                              epsilon: float = 1e-6, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized GRPO, with its own edges: the group's unbiased variance floored at
    ``epsilon`` before the square root, and a lone response measured against mean 0, std 1
    (its advantage is its score, where ``grpo`` gives it none)."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        count = size.to(scores.dtype)
        total = _group_sum(scores, group, len(size))
        mean = total / count
        var = (_group_sum(scores * scores, group, len(size)) - total * total / count) / (count - 1).clamp(min=1)
        std = var.clamp(min=epsilon).sqrt()
        lone = size == 1
        mean, std = torch.where(lone, torch.zeros_like(mean), mean), torch.where(lone, torch.ones_like(std), std)
        centred = scores - mean[group]
        normalized = centred / (std[group] + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = normalized.unsqueeze(-1) * response_mask
    return advantages, advantages


#: verl's vectorized RLOO is the same estimator (a lone response: 0)
register_adv_est("rloo_vectorized", needs_group=True)(compute_rloo_outcome_advantage)

#: verl's names for things not built here, refused naming what they are
NOT_HERE = {
    "tir_optimal_token_baseline": "verl's multi-turn optimal token baseline (tool-interleaved trajectories) is not "
                                  "here: optimal_token_baseline is its single-turn form",
    "seq-mean-token-sum-norm": "verl's seq-mean-token-sum-norm (each response's token sum over a fixed length, "
                               "Dr. GRPO) is not here: token-mean, seq-mean-token-sum and seq-mean-token-mean are",
}


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor,
                                                  response_mask: torch.Tensor, gamma: float = 1.0,
                                                  **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the batch."""
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * response_mask[:, t]
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index,
                                                           **_) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a baseline (Hu 2025): each response's score minus its group's mean
    (a lone response keeps its score), broadcast over its tokens, then whitened over the
    batch's tokens."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        mean = _group_sum(scores, group, len(size)) / size.to(scores.dtype)
        centred = torch.where(size[group] > 1, scores - mean[group], scores)
        advantages = masked_whiten(centred.unsqueeze(-1) * response_mask, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk", needs_group=True)
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         index, norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
                                         **_) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, verl's ``grpo_passk``): only each group's best
    response gets an advantage, its score minus the group's second best (divided by the
    group's unbiased std with ``norm_adv_by_std_in_grpo``); the others get 0. Of equal
    best scores the first in the batch is the best."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        if (size < 2).any():
            raise ValueError(f"grpo_passk: expected at least 2 responses per prompt (rollout.n >= 2); found a "
                             f"prompt with {int(size.min())}")
        out = torch.zeros_like(scores)
        for g in range(len(size)):
            rows = torch.nonzero(group == g).flatten()
            top = torch.topk(scores[rows], 2, sorted=True)
            best = rows[int(torch.argmax(scores[rows]))]
            gap = top.values[0] - top.values[1]
            out[best] = gap / (scores[rows].std() + epsilon) if norm_adv_by_std_in_grpo else gap
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  **_) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): score minus the group's length-weighted mean score, the
    optimal baseline for a sequence-level reward (a lone response: baseline 0)."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        group, size = _groups(index)
        baseline = _group_sum(lengths * scores, group, len(size)) / _group_sum(lengths, group, len(size)).clamp(
            min=1e-12)
        out = scores - torch.where(size[group] > 1, baseline[group], torch.zeros_like(scores))
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index,
                                  f_norm: float = 1.0, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG's advantage (Chu et al. 2025): score minus the group's mean, scaled by
    ``alpha = batch size / responses with a nonzero score`` (so a batch of mostly zero
    rewards still moves the policy), over ``f_norm``."""
    with torch.no_grad():
        scores = _outcome_scores(token_level_rewards)
        group, size = _groups(index)
        alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
        mean = _group_sum(scores, group, len(size)) / size.to(scores.dtype)
        centred = scores - torch.where(size[group] > 1, mean[group], torch.zeros_like(scores))
        advantages = (alpha * centred / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("remax", needs_reward_baseline=True)
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor,
                                    response_mask: torch.Tensor, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the reward of the prompt's greedy
    response (``reward_baselines``, one per row; the trainer's ``reward_baseline`` stage
    decodes it greedily and scores it with the run's reward function)."""
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns


@register_adv_est("optimal_token_baseline", needs_sum_pi_squared=True)
def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                             index, old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             epsilon: float = 1e-8, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (verl's ``optimal_token_baseline``): per position t, the
    group's returns-to-go averaged with weights W = the cumulative sum, up to t, of
    ``||onehot(y) - pi||^2 = 1 - 2 pi(y) + sum pi^2`` (times the squared rollout importance
    weight, when there is one): the baseline that minimises the policy gradient's variance
    token by token. ``A = G - B`` (no normalisation); a lone response's baseline is 0."""
    with torch.no_grad():
        mask = response_mask.float()
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        weight = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
        if rollout_is_weights is not None:
            weight = weight * rollout_is_weights ** 2
        cumulative = torch.cumsum(weight * mask, dim=-1)
        group, size = _groups(index)
        per_group = torch.zeros(len(size), mask.shape[1], dtype=returns.dtype)
        weighted = per_group.index_add(0, group, returns * cumulative * mask)
        total = per_group.index_add(0, group, cumulative * mask)
        baseline = (weighted / (total + epsilon))[group]
        baseline = torch.where((size[group] > 1).unsqueeze(-1), baseline, torch.zeros_like(baseline))
        advantages = (returns - baseline) * mask
    return advantages, returns


def varied_groups(uids, values) -> list[str]:
    """DAPO's dynamic sampling: the groups (``uids``, in order of first appearance) whose
    responses' ``values`` differ (population std > 0), or that hold one response."""
    members: dict = {}
    for uid, value in zip(uids, values):
        members.setdefault(uid, []).append(float(value))
    return [uid for uid, group in members.items() if len(group) == 1 or float(np.std(group)) > 0]


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """PF-PPO's (Zhu et al. 2024) sampling weight of each response from its score:
    ``pow`` |s|^p, ``max_min`` 1 for the batch's best and worst (else 0), ``max_random``
    0.4 for the best, 0.1 for the rest; never below 1e-8 (every row stays drawable)."""
    if method == "pow":
        weights = scores.abs() ** weight_pow
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), torch.tensor(0.4, dtype=scores.dtype),
                              torch.tensor(0.1, dtype=scores.dtype))
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method: expected pow, max_min or max_random; found {method!r}")
    return torch.clamp(weights + 1e-8, min=1e-8)


# --------------------------------------------------------------------- policy / value losses


@register_policy_loss("vanilla")
def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                        response_mask: torch.Tensor, clip_ratio_low: float = 0.2,
                        clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                        loss_agg_mode: str = "token-mean") -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017) with an asymmetric clip range
    ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (DAPO's clip-higher) and dual clip
    (Ye et al. 2020): for negative advantages the loss is capped at ``-A * clip_ratio_c``.

    Returns ``pg_loss``, ``pg_clipfrac`` (upper/lower clip active), ``ppo_kl``
    (mean ``old - new`` log-prob) and ``pg_clipfrac_lower`` (dual clip active).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip; found {clip_ratio_c}")
    # masked positions are 0 before anything is computed from them: a -inf there would make
    # NaN in the forward and, through exp, in the gradient (masking the loss is too late)
    negative_approx_kl = torch.clamp(masked_only(log_prob - old_log_prob, response_mask), min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    dual = torch.minimum(-advantages * clip_ratio_c, clip_loss)
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_loss, -advantages * clip_ratio_c) & (advantages < 0)).float(), response_mask)
    pg_losses = torch.where(advantages < 0, dual, clip_loss)
    return {"pg_loss": agg_loss(pg_losses, response_mask, loss_agg_mode), "pg_clipfrac": pg_clipfrac,
            "ppo_kl": ppo_kl, "pg_clipfrac_lower": pg_clipfrac_lower}


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
               response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi with its masked positions 0, log pi - log pi_old clamped to [-20, 20], the
    importance ratio): what most losses start from."""
    log_prob, old_log_prob = masked_only(log_prob, response_mask), masked_only(old_log_prob, response_mask)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    return log_prob, negative_approx_kl, torch.exp(negative_approx_kl)


def _clip_metrics(ppo_kl: torch.Tensor, clipfrac: torch.Tensor, clipfrac_lower=None) -> dict[str, torch.Tensor]:
    return {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl,
            "pg_clipfrac_lower": torch.zeros_like(ppo_kl) if clipfrac_lower is None else clipfrac_lower}


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                             loss_agg_mode: str = "seq-mean-token-mean", **_) -> dict[str, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, the geometric mean of
    its tokens' ratios ``s_i = exp(mean_t(log pi - log pi_old))``, clipped as PPO's. Each
    token carries ``s_i`` as its value and its own ``log pi`` as its gradient path
    (``sg[s_i] * pi / sg[pi]``). Reduced per sequence then over sequences whatever
    ``loss_agg_mode`` says (verl does the same: the ratio is a sequence's)."""
    log_prob, old_log_prob = masked_only(log_prob, response_mask), masked_only(old_log_prob, response_mask)
    negative_approx_kl = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (negative_approx_kl * response_mask).sum(dim=-1) / lengths
    log_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    return {"pg_loss": agg_loss(losses, response_mask, "seq-mean-token-mean"),
            **_clip_metrics(masked_mean(-negative_approx_kl, response_mask),
                            masked_mean(torch.gt(clipped, unclipped).float(), response_mask))}


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05,
                             **_) -> dict[str, torch.Tensor]:
    """SAPO (Gao et al. 2025): a smooth gate instead of a hard clip, ``-A *
    sigmoid(tau * (r - 1)) * 4 / tau`` per token (``tau_pos`` where A > 0, ``tau_neg``
    elsewhere; at r = 1 its slope is 1, as PPO's), reduced per sequence then over
    sequences as verl does. Nothing is clipped: both clip fractions are 0."""
    log_prob, negative_approx_kl, ratio = _log_ratio(old_log_prob, log_prob, response_mask)
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype),
                      torch.as_tensor(tau_neg, dtype=advantages.dtype))
    losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    zero = torch.zeros((), dtype=log_prob.dtype)
    return {"pg_loss": agg_loss(losses, response_mask, "seq-mean-token-mean"),
            **_clip_metrics(masked_mean(-negative_approx_kl, response_mask), zero, zero)}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                              response_mask: torch.Tensor, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                              loss_agg_mode: str = "token-mean", **_) -> dict[str, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped importance ratio, the
    weight held constant: ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi``. Every token
    keeps a gradient (PPO's clip drops the clipped ones)."""
    log_prob, negative_approx_kl, ratio = _log_ratio(old_log_prob, log_prob, response_mask)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = -weight.detach() * advantages * log_prob
    return {"pg_loss": agg_loss(losses, response_mask, loss_agg_mode),
            **_clip_metrics(masked_mean(-negative_approx_kl, response_mask),
                            masked_mean(torch.ne(ratio, weight).float(), response_mask))}


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                            **_) -> dict[str, torch.Tensor]:
    """GPG (Chu et al. 2025): the plain policy gradient, ``-A * log pi``: no ratio, no
    clip (so no clip fraction; ``ppo_kl`` still reports how far the policy moved)."""
    log_prob, old_log_prob = masked_only(log_prob, response_mask), masked_only(old_log_prob, response_mask)
    losses = -log_prob * advantages
    return {"pg_loss": agg_loss(losses, response_mask, loss_agg_mode),
            **_clip_metrics(masked_mean(old_log_prob - log_prob, response_mask).detach(),
                            torch.zeros((), dtype=log_prob.dtype))}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, clip_ratio_low: float = 0.2,
                                 clip_ratio_high: float = 0.2, **_) -> dict[str, torch.Tensor]:
    """GMPO (Zhao et al. 2025): the geometric mean of the tokens' ratios, each token's log
    ratio first clipped to ``[-low, high]`` on the side its advantage's sign makes
    pessimistic; the loss is ``-mean_i(A_i * exp(mean_t(clipped log ratio)))`` with
    ``A_i`` the sequence's mean advantage, a plain mean over sequences (verl's; its
    ``loss_agg_mode`` is not used)."""
    log_prob, old_log_prob = masked_only(log_prob, response_mask), masked_only(old_log_prob, response_mask)
    negative_approx_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * negative_approx_kl, sign * clamped)
    lengths = response_mask.sum(dim=-1)
    ratio = torch.exp((pessimistic * response_mask).sum(dim=-1) / (lengths + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    clipped = torch.ne(negative_approx_kl, clamped)
    return {"pg_loss": torch.mean(-advantage * ratio),
            **_clip_metrics(masked_mean(-negative_approx_kl, response_mask),
                            masked_mean((clipped & (advantages > 0)).float(), response_mask),
                            masked_mean((clipped & (advantages < 0)).float(), response_mask))}


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each valid token's centred ``A * log pi`` product (Cui et al. 2025, "The Entropy
    Mechanism of RL for Reasoning LMs"): the tokens whose updates drive entropy down the
    most have the largest. Means over the valid tokens; no gradient."""
    advantages, log_prob = advantages.detach(), log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, clip_ratio_low: float = 0.2,
                                 clip_ratio_high: float = 0.2, loss_agg_mode: str = "token-mean",
                                 clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                                 **_) -> dict[str, torch.Tensor]:
    """Clip-Cov (Cui et al. 2025): PPO's clipped loss (no dual clip, as verl's), except that
    a share ``clip_cov_ratio`` of the valid tokens (at least one) whose covariance lies in
    ``(clip_cov_lb, clip_cov_ub)`` and that PPO's clip left alone lose their gradient. The
    tokens are drawn among those candidates as verl draws them, but from a generator of a
    fixed seed, so that a replayed update picks the same ones. ``pg_clipfrac`` is the share
    of tokens dropped."""
    if clip_cov_ratio <= 0:
        raise ValueError(f"actor.clip_cov_ratio: expected > 0; found {clip_cov_ratio}")
    log_prob, negative_approx_kl, ratio = _log_ratio(old_log_prob, log_prob, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    valid = response_mask > 0
    covariance = _token_covariance(advantages, log_prob, response_mask)
    candidates = torch.nonzero(valid & ~(clipped > unclipped) & (covariance > clip_cov_lb) & (covariance < clip_cov_ub))
    count = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates), generator=torch.Generator().manual_seed(0))[:count]]
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    losses = torch.maximum(unclipped, clipped) * keep
    return {"pg_loss": agg_loss(losses, response_mask, loss_agg_mode),
            **_clip_metrics(masked_mean(-negative_approx_kl, response_mask),
                            masked_mean((keep == 0).float(), response_mask))}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                               kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1,
                               **_) -> dict[str, torch.Tensor]:
    """KL-Cov (Cui et al. 2025): the unclipped importance-weighted loss ``-A * r``, plus
    ``ppo_kl_coef * |log pi - log pi_old|`` on the ``kl_cov_ratio`` share of valid tokens
    (at least one) with the largest covariance. ``ppo_kl`` is the mean absolute log
    ratio, as verl reports it; nothing is clipped."""
    if kl_cov_ratio <= 0:
        raise ValueError(f"actor.kl_cov_ratio: expected > 0; found {kl_cov_ratio}")
    log_prob, negative_approx_kl, ratio = _log_ratio(old_log_prob, log_prob, response_mask)
    losses = -advantages * ratio
    valid = torch.nonzero(response_mask > 0)
    covariance = _token_covariance(advantages, log_prob, response_mask)[valid[:, 0], valid[:, 1]]
    if len(valid):
        top = valid[torch.topk(covariance, max(1, int(len(valid) * kl_cov_ratio))).indices]
        penalty = torch.zeros_like(losses)
        penalty[top[:, 0], top[:, 1]] = 1.0
        losses = losses + penalty * ppo_kl_coef * negative_approx_kl.abs()
    zero = torch.zeros((), dtype=log_prob.dtype)
    return {"pg_loss": agg_loss(losses, response_mask, loss_agg_mode),
            **_clip_metrics(masked_mean(negative_approx_kl.abs(), response_mask), zero, zero)}


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float = 0.5,
                       loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2)``.
    Returns ``(vf_loss, vf_clipfrac)``."""
    clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected - margin) over pairs: the negative
    log-likelihood of the preferences under the Bradley-Terry model (Ouyang et al. 2022;
    ``margin``, Llama 2's, asks for a larger gap where the annotator was surer)."""
    gap = chosen - rejected if margin is None else chosen - rejected - margin
    return -torch.nn.functional.logsigmoid(gap).mean()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution given by ``logits``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# --------------------------------------------------------------------- KL


@register_kl_estimator("k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``log p - log q``: unbiased, high variance (Schulman's k1)."""
    return logprob - ref_logprob


@register_kl_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@register_kl_estimator("k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log p - log q)^2``: biased, low variance (k2; "mse" in verl)."""
    return 0.5 * (logprob - ref_logprob).square()


@register_kl_estimator("k3")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """``exp(q - p) - (q - p) - 1``: unbiased and non-negative (k3, "low_var_kl"),
    clamped to [-10, 10] as is common practice."""
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


KL_ESTIMATORS["low_var_kl"] = kl_k3
KL_ESTIMATORS["mse"] = kl_k2


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "k1") -> torch.Tensor:
    return get_kl_estimator_fn(kl_penalty)(logprob, ref_logprob)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): nudges ``value`` so the measured KL
    tracks ``target_kl`` over ``horizon`` samples (proportional error clipped to +-0.2)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor,
                     ref_log_prob: torch.Tensor, response_mask: torch.Tensor, kl_coef: float,
                     kl_penalty_name: str = "k1") -> tuple[torch.Tensor, float]:
    """KL in the reward: ``r_t = score_t - beta * KL_t``; returns rewards and the batch's
    mean per-sequence KL (what a KL controller updates on)."""
    kld = masked_only(kl_penalty(old_log_prob, ref_log_prob, kl_penalty_name), response_mask) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    return rewards, current_kl
