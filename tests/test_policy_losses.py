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


@pytest.mark.parametrize("name", ["gspo", "cispo", "gpg", "geo_mean"])
def test_verls_loss_mode_names_select_them(name):
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), [f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"]).validate()
    assert cfg.actor.policy_loss == name
