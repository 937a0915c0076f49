"""The PPO/GRPO math against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from rlhf_core.algorithms import (
    ADV_ESTIMATOR_SPECS,
    ADV_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_policy_loss,
    compute_value_loss,
    get_adv_estimator_fn,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_whiten,
    register_adv_est,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_and_whiten():
    values, mask = t([[1, 2, 3], [4, 100, 0]]), t([[1, 1, 1], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.5)
    w = masked_whiten(values, mask)
    kept = w[mask.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    # unbiased var of [1,2,3,4] = 5/3
    assert w[0, 0].item() == pytest.approx((1 - 2.5) / math.sqrt(5 / 3), rel=1e-5)


def test_agg_loss_modes():
    loss, mask = t([[1, 2, 3], [4, 0, 0]]), t([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(loss, mask, "sum")


def test_gae_by_hand():
    # one sequence, 3 tokens, gamma=1, lam=0.5; r = [0, 0, 1], V = [0.5, 0.6, 0.7]
    rewards, values, mask = t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    # deltas: d2 = 1 - 0.7 = 0.3; d1 = 0 + 0.7 - 0.6 = 0.1; d0 = 0 + 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.5*0.3 = 0.25; A0 = 0.1 + 0.5*0.25 = 0.225
    adv, ret = get_adv_estimator_fn("gae")(rewards, values, mask, gamma=1.0, lam=0.5)
    assert ret.tolist()[0] == pytest.approx([0.725, 0.85, 1.0])
    raw = torch.tensor([0.225, 0.25, 0.3])
    expected = (raw - raw.mean()) / raw.std()
    assert adv[0].tolist() == pytest.approx(expected.tolist(), rel=1e-4)


def test_gae_ignores_padding():
    rewards, values, mask = t([[0, 1, 0]]), t([[0.5, 0.5, 9.0]]), t([[1, 1, 0]])
    adv, ret = get_adv_estimator_fn("gae")(rewards, values, mask, gamma=1.0, lam=1.0)
    # A1 = 1 - 0.5 = 0.5; A0 = 0 + 0.5 - 0.5 + 0.5 = 0.5; padding value 9.0 never enters
    assert ret[0, :2].tolist() == pytest.approx([1.0, 1.0])
    assert adv[0, 2].item() == 0.0 and ret[0, 2].item() == 0.0


def test_grpo_with_and_without_std():
    rewards = t([[0, 1.0], [0, 0.0], [0, 0.5], [0, 0.5]])
    mask = t([[1, 1]] * 4)
    index = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = get_adv_estimator_fn("grpo")(rewards, mask, index, norm_adv_by_std_in_grpo=True)
    # group a: scores [1, 0], mean .5, std (unbiased) .7071 -> +-0.7071; group b: equal -> 0
    assert adv[:, 0].tolist() == pytest.approx([0.70710, -0.70710, 0.0, 0.0], abs=1e-4)
    adv2, _ = get_adv_estimator_fn("grpo")(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv2[:, 1].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_grpo_masks_padding_and_rloo_by_hand():
    rewards = t([[1.0, 0], [0.0, 0], [2.0, 0]])
    mask = t([[1, 0], [1, 1], [1, 0]])
    index = np.array(["g"] * 3, dtype=object)
    adv, _ = get_adv_estimator_fn("grpo")(rewards, mask, index)
    assert adv[0, 1].item() == 0.0 and adv[2, 1].item() == 0.0
    rloo, _ = get_adv_estimator_fn("rloo")(rewards, mask, index)
    # r - mean(others): 1 - (0+2)/2 = 0; 0 - 1.5 = -1.5; 2 - 0.5 = 1.5
    assert rloo[:, 0].tolist() == pytest.approx([0.0, -1.5, 1.5])


def test_reinforce_plus_plus_and_remax():
    rewards, mask = t([[0, 0, 1], [0, 2, 0]]), t([[1, 1, 1], [1, 1, 0]])
    _, returns = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    assert returns.flatten().tolist() == pytest.approx([0.25, 0.5, 1.0, 1.0, 2.0, 0.0])
    adv, ret = get_adv_estimator_fn("remax")(rewards, t([0.5, 1.0]), mask)
    assert ret.flatten().tolist() == pytest.approx([1, 1, 1, 2, 2, 0])
    assert adv.flatten().tolist() == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0, 0.0])


def test_registry_accepts_user_estimators():
    @register_adv_est("constant_one_for_test")
    def constant(token_level_rewards, response_mask, **_):
        return response_mask, response_mask

    try:
        assert "constant_one_for_test" in ADV_ESTIMATORS
        with pytest.raises(KeyError, match="unknown advantage estimator 'nope'; registered: \\["):
            get_adv_estimator_fn("nope")
    finally:  # leave the registry as the other tests expect it
        ADV_ESTIMATORS.pop("constant_one_for_test")
        ADV_ESTIMATOR_SPECS.pop("constant_one_for_test", None)


def test_policy_loss_asymmetric_clip_by_hand():
    mask = t([[1, 1]])
    old = t([[0.0, 0.0]])
    new = torch.log(t([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    out = compute_policy_loss(old, new, t([[1.0, -1.0]]), mask, clip_ratio_low=0.2, clip_ratio_high=0.3)
    # A=+1, ratio 1.5 -> clipped at 1.3 -> loss -1.3; A=-1, ratio .5 -> max(.5, .8) -> .8
    assert out["pg_loss"].item() == pytest.approx((-1.3 + 0.8) / 2, rel=1e-5)
    assert out["pg_clipfrac"].item() == pytest.approx(1.0)
    assert out["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 2, rel=1e-5)


def test_dual_clip_caps_negative_advantage_loss():
    mask = t([[1.0]])
    out = compute_policy_loss(t([[0.0]]), torch.log(t([[10.0]])), t([[-1.0]]), mask, clip_ratio_c=3.0)
    # unclipped loss = 10, clip loss = max(10, 1.2) = 10, dual clip = min(3, 10) = 3
    assert out["pg_loss"].item() == pytest.approx(3.0)
    assert out["pg_clipfrac_lower"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), mask, clip_ratio_c=1.0)


def test_value_loss_clipping_by_hand():
    vf, clipfrac = compute_value_loss(vpreds=t([[2.0]]), returns=t([[0.0]]), values=t([[1.0]]),
                                      response_mask=t([[1.0]]), cliprange_value=0.5)
    # unclipped (2-0)^2 = 4; clipped value 1.5 -> 2.25; max = 4; 0.5 * 4 = 2
    assert vf.item() == pytest.approx(2.0) and clipfrac.item() == 0.0
    vf, clipfrac = compute_value_loss(t([[0.0]]), t([[1.0]]), t([[1.0]]), t([[1.0]]), 0.5)
    # unclipped 1; clipped value 0.5 -> 0.25; max 1 -> 0.5
    assert vf.item() == pytest.approx(0.5)


@pytest.mark.parametrize("name, expected", [
    ("k1", math.log(2)),
    ("abs", math.log(2)),
    ("k2", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 - math.log(0.5) - 1),  # exp(q-p) - (q-p) - 1 with q-p = -log 2
    ("low_var_kl", 0.5 - math.log(0.5) - 1),
])
def test_kl_estimators_by_hand(name, expected):
    logp, ref = torch.log(t([0.5])), torch.log(t([0.25]))
    assert kl_penalty(logp, ref, name).item() == pytest.approx(expected, rel=1e-5)


def test_kl_controllers_and_kl_in_reward():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    adaptive = AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    adaptive.update(current_kl=2.0, n_steps=50)  # error clipped to +0.2 -> x1.1
    assert adaptive.value == pytest.approx(0.11)
    scores, mask = t([[0, 1.0]]), t([[1, 1]])
    rewards, kl = apply_kl_penalty(scores, t([[0.0, -1.0]]), t([[-1.0, -1.0]]), mask, kl_coef=0.5)
    assert rewards.flatten().tolist() == pytest.approx([-0.5, 1.0])
    assert kl == pytest.approx(0.5)


def test_what_masked_positions_hold_never_reaches_a_value_or_a_gradient():
    """After a response's end a log-prob may be -inf (HF's scores for the padding): masked
    statistics, the policy loss, its gradient and the KL in the reward stay finite, and
    equal what zeros in those positions give."""
    mask = t([[1, 1, 0, 0], [1, 1, 1, 0]])
    ninf = float("-inf")
    old = t([[-1.0, -2.0, ninf, ninf], [-0.5, -1.5, -0.7, ninf]])
    adv = t([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    for value in (masked_sum(old, mask), masked_mean(old, mask), masked_mean(old, mask, dim=-1)):
        assert torch.isfinite(value).all()
    assert masked_sum(old, mask) == masked_sum(torch.where(mask.bool(), old, 0.0), mask)

    def loss_and_grad(new_masked, old_masked, mode):
        new = torch.tensor([[-1.1, -1.9, new_masked, new_masked], [-0.4, -1.6, -0.9, new_masked]], requires_grad=True)
        old_ = torch.where(mask.bool(), old, torch.full_like(old, old_masked))
        out = compute_policy_loss(old_, new, adv, mask, loss_agg_mode=mode)
        out["pg_loss"].backward()
        return out, new.grad

    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        out, grad = loss_and_grad(ninf, ninf, mode)
        clean, clean_grad = loss_and_grad(0.0, 0.0, mode)
        assert all(torch.isfinite(v).all() for v in out.values()) and torch.isfinite(grad).all(), mode
        assert torch.equal(out["pg_loss"], clean["pg_loss"]) and torch.equal(grad, clean_grad), mode
        assert torch.equal(out["ppo_kl"], clean["ppo_kl"])
    rewards, kl = apply_kl_penalty(torch.zeros(2, 4), old, torch.where(mask.bool(), old - 0.1, old), mask, 0.1)
    assert torch.isfinite(rewards).all() and math.isfinite(kl)


def test_rollout_log_probs_after_a_responses_end_are_zero_not_minus_infinity():
    from rlhf_core.protocol import DataProto
    from rlhf_core.rollout import responses_from_tensors as _finish_tensors

    prompts = DataProto.from_dict({"input_ids": torch.tensor([[5, 6], [7, 8]]),
                                   "attention_mask": torch.ones(2, 2, dtype=torch.long)})
    lp = torch.tensor([[-0.5, -1.0, float("-inf")], [-0.2, float("-inf"), float("-inf")]])
    out = _finish_tensors(prompts, torch.tensor([[9, 2, 0], [2, 0, 0]]), lp, torch.tensor([2, 1]))
    assert torch.equal(out.batch["rollout_log_probs"], torch.tensor([[-0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]]))
