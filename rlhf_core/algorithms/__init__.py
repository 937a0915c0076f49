"""Pure functions for PPO/GRPO: advantage estimators, losses, KL control (registries)."""

from rlhf_core.algorithms.core import (  # noqa: F401  (the package's public API)
    ADV_ESTIMATOR_SPECS, ADV_ESTIMATORS, KL_ESTIMATORS, AdvEstimatorSpec, POLICY_LOSSES, AdaptiveKLController, FixedKLController,
    agg_loss, apply_kl_penalty, bradley_terry_loss, compute_gae_advantage_return, compute_grpo_outcome_advantage,
    compute_policy_loss, compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage, compute_rloo_outcome_advantage, compute_value_loss,
    entropy_from_logits, get_adv_estimator_fn, get_adv_estimator_spec, get_kl_estimator_fn, get_policy_loss_fn, kl_penalty,
    last_token_index, loss_settings, pf_ppo_weights, varied_groups,
    masked_mean, masked_sum, masked_var, masked_whiten, register_adv_est, register_kl_estimator,
    register_policy_loss,
)
from rlhf_core.algorithms.distillation import TOPK_LOSS_MODES  # noqa: F401,E402
