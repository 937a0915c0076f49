"""verl's other policy losses (issue 40, item 2), each against values worked out by hand
from verl's formula (``verl/trainer/ppo/core_algos.py``), gradients included: two
responses, the second one token shorter (its last position masked, with a -inf
log-prob there, as after a response's end)."""

import math

import pytest
import torch

from rlhf_core.algorithms import get_policy_loss_fn

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, float("-inf")]])
DELTA = [[0.1, -0.15, 0.3], [0.5, 0.05]]  # log pi - log pi_old on the response tokens
ADV = [1.0, 2.0]  # one advantage per response (outcome estimators broadcast it over tokens)
LOW, HIGH = 0.2, 0.28


def inputs():
    new = OLD.clone()
    for i, row in enumerate(DELTA):
        for t, d in enumerate(row):
            new[i, t] = OLD[i, t] + d
    log_prob = new.clone().requires_grad_(True)
    advantages = torch.tensor([[ADV[0]] * 3, [ADV[1]] * 3])
    return log_prob, advantages


def run(name: str, **kw):
    log_prob, advantages = inputs()
    out = get_policy_loss_fn(name)(OLD, log_prob, advantages, MASK, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                   clip_ratio_c=3.0, **kw)
    out["pg_loss"].backward()
    assert torch.isfinite(log_prob.grad).all() and log_prob.grad[1, 2] == 0  # nothing from the masked position
    return out, log_prob.grad


def test_gspo_clips_one_ratio_per_sequence():
    s = [math.exp(sum(row) / len(row)) for row in DELTA]  # 1.0689, 1.3165
    losses = [-ADV[i] * min(s[i], 1 + HIGH) if ADV[i] > 0 else None for i in range(2)]  # both advantages > 0
    out, grad = run("gspo", loss_agg_mode="token-mean")  # GSPO reduces per sequence whatever is asked
    assert out["pg_loss"].item() == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(2 / 5)  # the second sequence's tokens: s > 1 + high
    assert out["ppo_kl"].item() == pytest.approx(-sum(sum(row) for row in DELTA) / 5, rel=1e-6)
    # d/d log pi_t of sg[s] * pi_t / sg[pi_t] is s: a token of sequence 0 gets -A * s / |y| / B
    assert grad[0].tolist() == pytest.approx([-ADV[0] * s[0] / 3 / 2] * 3, rel=1e-6)
    assert grad[1, :2].tolist() == [0.0, 0.0]  # clipped: no gradient


def test_cispo_keeps_every_token_with_a_clipped_constant_weight():
    log_pi = [[OLD[i, t].item() + d for t, d in enumerate(row)] for i, row in enumerate(DELTA)]
    weights = [[min(max(math.exp(d), 1 - LOW), 1 + HIGH) for d in row] for row in DELTA]
    losses = [-weights[i][t] * ADV[i] * log_pi[i][t] for i in range(2) for t in range(len(DELTA[i]))]
    out, grad = run("cispo", loss_agg_mode="token-mean")
    assert out["pg_loss"].item() == pytest.approx(sum(losses) / 5, rel=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(2 / 5)  # 0.3 and 0.5 exceed log(1.28)
    expected = [[-weights[i][t] * ADV[i] / 5 for t in range(len(DELTA[i]))] for i in range(2)]
    assert grad[0].tolist() == pytest.approx(expected[0], rel=1e-6)
    assert grad[1, :2].tolist() == pytest.approx(expected[1], rel=1e-6)  # clipped tokens keep their gradient


def test_gpg_is_the_plain_policy_gradient():
    log_pi = [[OLD[i, t].item() + d for t, d in enumerate(row)] for i, row in enumerate(DELTA)]
    out, grad = run("gpg", loss_agg_mode="seq-mean-token-sum")
    per_seq = [sum(-ADV[i] * lp for lp in log_pi[i]) for i in range(2)]
    assert out["pg_loss"].item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([-ADV[0] / 2] * 3) and grad[1, :2].tolist() == pytest.approx(
        [-ADV[1] / 2] * 2)
    assert out["pg_clipfrac"].item() == 0.0


def test_geo_mean_clips_each_token_pessimistically_then_takes_the_geometric_mean():
    clipped = [[min(d, min(max(d, -LOW), HIGH)) for d in row] for row in DELTA]  # advantages > 0: min
    ratios = [math.exp(sum(row) / len(row)) for row in clipped]
    out, grad = run("geo_mean")
    assert out["pg_loss"].item() == pytest.approx(sum(-ADV[i] * ratios[i] for i in range(2)) / 2, rel=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(2 / 5) and out["pg_clipfrac_lower"].item() == 0.0
    # an unclipped token's gradient: -A * ratio / |y| / B; a clipped one's: 0
    assert grad[0].tolist() == pytest.approx([-ADV[0] * ratios[0] / 3 / 2] * 2 + [0.0], rel=1e-6)
    assert grad[1, :2].tolist() == pytest.approx([0.0, -ADV[1] * ratios[1] / 2 / 2], rel=1e-6)


def test_negative_advantages_clip_on_the_other_side_for_geo_mean():
    log_prob, advantages = inputs()
    out = get_policy_loss_fn("geo_mean")(OLD, log_prob, -advantages, MASK, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    clipped = [[max(d, min(max(d, -LOW), HIGH)) for d in row] for row in DELTA]  # sign -1: the larger
    ratios = [math.exp(sum(row) / len(row)) for row in clipped]
    assert out["pg_loss"].item() == pytest.approx(sum(ADV[i] * ratios[i] for i in range(2)) / 2, rel=1e-6)
    assert out["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("name", ["gspo", "cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov"])
def test_verls_loss_mode_names_select_them(name):
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), [f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"]).validate()
    assert cfg.actor.policy_loss == name


# ------------------------------------------------------------------ estimators (issue 40, item 2)

#: two prompts: three responses of the first (scores 1, 0, 0.5), two of the second (0, 0),
#: and one of a third (score 2); lengths 3, 2, 3, 1, 3, 2
SCORES = [1.0, 0.0, 0.5, 0.0, 0.0, 2.0]
UIDS = ["a", "a", "a", "b", "b", "c"]
LENGTHS = [3, 2, 3, 1, 3, 2]


def outcome():
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(3)] for n in LENGTHS])
    rewards = torch.zeros(6, 3)
    for i, (score, n) in enumerate(zip(SCORES, LENGTHS)):
        rewards[i, n - 1] = score  # the score sits on the last response token
    return rewards, mask


def estimate(name: str, **kw):
    from rlhf_core.algorithms import get_adv_estimator_fn

    rewards, mask = outcome()
    advantages, _ = get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=UIDS, **kw)
    assert (advantages * (1 - mask) == 0).all()
    return advantages, mask


def test_reinforce_plus_plus_baseline_centres_per_prompt_then_whitens_over_the_batch_tokens():
    centred = [1 - 0.5, 0 - 0.5, 0.5 - 0.5, 0.0, 0.0, 2.0]  # the lone response keeps its score
    tokens = [c for c, n in zip(centred, LENGTHS) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1))  # torch.var's unbiased
    advantages, mask = estimate("reinforce_plus_plus_baseline")
    for i, n in enumerate(LENGTHS):
        assert advantages[i, :n].tolist() == pytest.approx([(centred[i] - mean) / (std + 1e-8)] * n, rel=1e-5)


def test_grpo_passk_rewards_only_each_prompts_best_by_its_margin_over_the_second():
    with pytest.raises(ValueError, match="grpo_passk: expected at least 2 responses per prompt"):
        estimate("grpo_passk")  # prompt c has one response
    from rlhf_core.algorithms import get_adv_estimator_fn

    rewards, mask = outcome()
    advantages, _ = get_adv_estimator_fn("grpo_passk")(token_level_rewards=rewards[:5], response_mask=mask[:5],
                                                       index=UIDS[:5])
    std_a = torch.tensor([1.0, 0.0, 0.5]).std().item()
    assert advantages[0, :3].tolist() == pytest.approx([(1.0 - 0.5) / (std_a + 1e-6)] * 3, rel=1e-5)
    assert advantages[1:].abs().sum() == 0  # b's best equals its second: 0; the rest are not the best
    plain, _ = get_adv_estimator_fn("grpo_passk")(token_level_rewards=rewards[:5], response_mask=mask[:5],
                                                  index=UIDS[:5], norm_adv_by_std_in_grpo=False)
    assert plain[0, 0].item() == pytest.approx(0.5)


def test_opo_subtracts_the_length_weighted_group_mean():
    baseline_a = (3 * 1.0 + 2 * 0.0 + 3 * 0.5) / (3 + 2 + 3)
    expected = [1 - baseline_a, 0 - baseline_a, 0.5 - baseline_a, 0.0, 0.0, 2.0]
    advantages, _ = estimate("opo")
    assert [advantages[i, 0].item() for i in range(6)] == pytest.approx(expected, rel=1e-6)


def test_gpg_scales_the_centred_score_by_the_share_of_nonzero_rewards():
    alpha = 6 / 3  # three of six responses scored nonzero
    expected = [alpha * (1 - 0.5), alpha * (0 - 0.5), 0.0, 0.0, 0.0, alpha * 2.0]
    advantages, _ = estimate("gpg")
    assert [advantages[i, 0].item() for i in range(6)] == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ learning-rate schedules (issue 40, item 4)

def test_verls_constant_and_cosine_schedules_by_training_step():
    from rlhf_core.algorithms.schedules import lr_factor

    # constant with 4 warmup steps: 0, 1/4, 2/4, 3/4, then 1 (verl's get_constant_schedule_with_warmup)
    assert [lr_factor(t, 4, 20) for t in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    # cosine, 2 warmup steps of 12, floor 0.1, half a wave: 1 right after the warmup, the floor at the end
    expected = [0.0, 0.5] + [max(0.1, 0.45 * math.cos(math.pi * (t - 2) / 10) + 0.55) for t in range(2, 13)]
    assert [lr_factor(t, 2, 12, "cosine", 0.1) for t in range(13)] == pytest.approx(expected)
    assert lr_factor(12, 2, 12, "cosine", 0.1) == pytest.approx(0.1) and lr_factor(2, 2, 12, "cosine") == 1.0
    assert lr_factor(7, 2, 12, "cosine", 0.0, num_cycles=1.0) == pytest.approx(0.0, abs=1e-12)  # a whole wave: 0
    with pytest.raises(ValueError, match="lr_scheduler_type: expected one of"):
        lr_factor(0, 0, 1, "linear")


def test_verls_optim_keys_set_the_schedule_and_its_total_enters_the_config_hash():
    from rlhf_core.algorithms.schedules import warmup_steps
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), [
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.optim.min_lr_ratio=0.2", "critic.optim.lr_warmup_steps=3",
        "critic.optim.lr_scheduler_type=cosine", "critic.optim.num_cycles=1", "trainer.total_training_steps=50"]).validate()
    assert (cfg.actor.lr_scheduler_type, cfg.actor.min_lr_ratio, cfg.critic.num_cycles) == ("cosine", 0.2, 1.0)
    assert warmup_steps(cfg.actor, cfg.trainer.total_iterations) == 5 and warmup_steps(cfg.critic, 50) == 3
    # a schedule that depends on the run's total: another total is another run
    before = cfg.config_hash()
    assert apply_overrides(cfg, ["trainer.total_iterations=60"]).config_hash() != before
    plain = RunConfig().config_hash()
    assert apply_overrides(RunConfig(), ["trainer.total_iterations=61"]).config_hash() == plain


def test_sapo_gates_each_token_smoothly_with_its_advantages_temperature():
    from rlhf_core.algorithms import loss_settings

    tau_pos, tau_neg = 1.0, 1.05
    gate = lambda r, tau: 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))  # noqa: E731
    ratios = [[math.exp(d) for d in row] for row in DELTA]
    per_seq = [sum(-gate(r, tau_pos) * ADV[i] for r in ratios[i]) / len(ratios[i]) for i in range(2)]
    out, grad = run("sapo", tau_pos=tau_pos, tau_neg=tau_neg)
    assert out["pg_loss"].item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)
    assert out["pg_clipfrac"].item() == 0.0 and out["pg_clipfrac_lower"].item() == 0.0
    # d/dlog pi of -A * gate(r): -A * r * 4 * s(1-s) with s = sigmoid(tau (r - 1)); / |y| / B
    slope = lambda r, tau: 4 * r / (1 + math.exp(-tau * (r - 1))) * (1 - 1 / (1 + math.exp(-tau * (r - 1))))  # noqa
    assert grad[0].tolist() == pytest.approx([-ADV[0] * slope(r, tau_pos) / 3 / 2 for r in ratios[0]], rel=1e-5)
    negative = get_policy_loss_fn("sapo")(OLD, inputs()[0], -inputs()[1], MASK, tau_pos=tau_pos, tau_neg=tau_neg)
    per_seq = [sum(gate(r, tau_neg) * ADV[i] for r in ratios[i]) / len(ratios[i]) for i in range(2)]
    assert negative["pg_loss"].item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)
    # the actor hands a loss only the settings it names: vanilla is called as before
    assert loss_settings(get_policy_loss_fn("vanilla"), tau_pos=1.0) == {}
    assert loss_settings(get_policy_loss_fn("sapo"), tau_pos=2.0, tau_neg=3.0) == {"tau_pos": 2.0, "tau_neg": 3.0}


# Covariances of the valid tokens, centred over them (A: mean 1.4; log pi: mean -0.98):
# (0,0) -0.032, (0,1) 0.468, (0,2) -0.312, (1,0) -0.012, (1,1) 0.198.


def test_kl_cov_penalizes_the_largest_covariance_tokens_and_clips_nothing():
    out, grad = run("kl_cov", kl_cov_ratio=0.0002, ppo_kl_coef=0.1)  # 5 tokens: the one largest, (0,1)
    r = [[math.exp(d) for d in row] for row in DELTA]
    losses = [-r[0][0], -r[0][1] + 0.1 * 0.15, -r[0][2], -2 * r[1][0], -2 * r[1][1]]
    assert out["pg_loss"].item() == pytest.approx(sum(losses) / 5, abs=1e-6)
    expected = torch.tensor([[-r[0][0], -r[0][1] - 0.1, -r[0][2]], [-2 * r[1][0], -2 * r[1][1], 0.0]]) / 5
    assert torch.allclose(grad, expected, atol=1e-6)
    assert out["ppo_kl"].item() == pytest.approx(1.1 / 5) and out["pg_clipfrac"].item() == 0
    out, grad = run("kl_cov", kl_cov_ratio=0.4, ppo_kl_coef=0.1)  # two: (0,1) and (1,1)
    assert out["pg_loss"].item() == pytest.approx((sum(losses) + 0.1 * 0.05) / 5, abs=1e-6)
    assert grad[1, 1].item() == pytest.approx((-2 * r[1][1] + 0.1) / 5, abs=1e-6)


def test_clip_cov_drops_the_gradient_of_covariance_tokens_ppo_left_unclipped():
    r = [[math.exp(d) for d in row] for row in DELTA]
    # the defaults' window (1, 5) holds no token here: PPO's clipped loss, no dual clip
    out, _ = run("clip_cov", clip_cov_ratio=0.0002)
    assert out["pg_loss"].item() == pytest.approx((-r[0][0] - r[0][1] - 1.28 - 2 * 1.28 - 2 * r[1][1]) / 5, abs=1e-6)
    assert out["pg_clipfrac"].item() == 0
    # window (0.1, 5): (0,1) and (1,1) are candidates ((0,2) is clipped by PPO, and negative); a share 0.4 = both
    out, grad = run("clip_cov", clip_cov_ratio=0.4, clip_cov_lb=0.1, clip_cov_ub=5.0)
    assert out["pg_loss"].item() == pytest.approx((-r[0][0] - 1.28 - 2 * 1.28) / 5, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-r[0][0] / 5, 0, 0], [0, 0, 0]]), atol=1e-6)
    assert out["pg_clipfrac"].item() == pytest.approx(0.4) and out["ppo_kl"].item() == pytest.approx(-0.16)
    # one of the two: drawn, but the same draw each time (a replayed update drops the same token)
    picks = [run("clip_cov", clip_cov_ratio=0.0002, clip_cov_lb=0.1)[1] for _ in range(2)]
    assert torch.equal(picks[0], picks[1]) and int((picks[0][[0, 1], [1, 1]] == 0).sum()) == 1


def test_a_losss_own_settings_reach_it_and_enter_the_config_hash_only_with_it():
    from rlhf_core.config import RunConfig, apply_overrides

    base = RunConfig()
    changed = apply_overrides(RunConfig(), ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.5",
                                            "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0"])
    assert (changed.actor.clip_cov_ratio, changed.actor.ppo_kl_coef) == (0.5, 1.0)
    assert changed.config_hash() == base.config_hash()  # vanilla takes neither: nothing trained differs
    for loss in ("clip_cov", "kl_cov"):
        assert apply_overrides(RunConfig(), [f"actor.policy_loss={loss}"]).config_hash() != \
            apply_overrides(RunConfig(), [f"actor.policy_loss={loss}", "actor.clip_cov_ratio=0.5",
                                          "actor.kl_cov_ratio=0.5"]).config_hash()
