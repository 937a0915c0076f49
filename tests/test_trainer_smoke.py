"""A short learning smoke test: real workers, real vLLM, a few iterations of each flavour.

It asserts the shape of what an iteration produces (metrics, advantages, masking), not
speed or final reward: those are the learning benchmark's job.
"""

import math
import os

import pytest

from rlhf_core.testing.stage_store import LastBatch
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.data.dataset import PromptLoader, load_rows
from rlhf_core.data.tokenizer import PromptTokenizer
from rlhf_core.trainer.ppo import PPOTrainer
from rlhf_core.workers.worker_set import WorkerSet
from rlhf_core.workers import modeling

#: The update's old log-probs recomputed by the old_log_prob stage (bypass mode off).
RECOMPUTE = "algorithm.rollout_correction.bypass_mode=false"

EXPECTED_METRICS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
    "response_length/mean", "timing_s/rollout", "timing_s/reward", "timing_s/old_log_prob",
    "timing_s/advantage", "timing_s/update_actor", "timing_s/weight_sync", "perf/throughput",
    "perf/outside_workers_share",
]


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))


def run_iterations(overrides, iterations=2, after=None):
    cfg = apply_overrides(RunConfig(), ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
                                        "rollout.n=4", "trainer.progress=false", *overrides]).validate()
    path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed)
    loader = PromptLoader(load_rows(cfg.data.train_files, cfg.trainer.seed), PromptTokenizer(path),
                          cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.seed)
    workers = WorkerSet.build(cfg)
    try:
        trainer = PPOTrainer(cfg, workers, loader, stage_store=LastBatch())
        metrics = [trainer.run_iteration() for _ in range(iterations)]
        if after is not None:
            after(cfg, trainer, workers)
        return cfg, trainer, metrics
    finally:
        workers.kill()


def check_metric_values(metrics: dict, roles=("actor",)) -> None:
    """Not only the names: every metric is a finite number (a NaN loss fails), the
    updates moved something, no step was skipped for a non-finite gradient, and the
    scores, clip fractions and shares lie in their ranges."""
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
    assert not bad, bad
    for role in roles:
        assert metrics[f"{role}/grad_norm"] > 0 and metrics[f"{role}/nonfinite_grad_steps"] == 0, role
    assert 0.0 <= metrics["critic/score/mean"] <= 1.0
    assert 0.0 <= metrics["actor/pg_clipfrac"] <= 1.0 and metrics["actor/entropy"] > 0
    assert 0.0 <= metrics["perf/outside_workers_share"] < 1.0 and metrics["perf/throughput"] > 0
    assert 0 < metrics["response_length/mean"] <= 8


def check_batch(cfg, batch):
    n_rows = cfg.data.train_batch_size * cfg.rollout.n
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    assert responses.shape == (n_rows, cfg.rollout.response_length)
    for key in ("advantages", "returns", "old_log_probs", "token_level_scores", "rollout_log_probs"):
        assert batch.batch[key].shape == responses.shape, key
    assert torch.all(batch.batch["advantages"][mask == 0] == 0), "padding must carry no advantage"
    # each response's mask is a prefix that ends at its first EOS (kept) or at the length
    # limit, and the tokens after it are padding
    eos, pad = 2, 0  # the built-in tokenizer's
    for row, row_mask in zip(responses.tolist(), mask.tolist()):
        k = sum(row_mask)
        assert row_mask == [1] * k + [0] * (len(row) - k), row_mask
        assert eos not in row[:k - 1] and (row[k - 1] == eos or k == len(row)), (row, row_mask)
        assert all(t == pad for t in row[k:]), row
    assert torch.all(batch.batch["rollout_log_probs"][mask == 0] == 0)
    assert torch.all(batch.batch["old_log_probs"][mask == 1] <= 0)
    # every uid appears n times, on consecutive rows
    uids = batch.non_tensor_batch["uid"].tolist()
    assert all(len(set(uids[i:i + cfg.rollout.n])) == 1 for i in range(0, n_rows, cfg.rollout.n))
    # the rollout engine's log-probs and the actor's agree (same weights, same temperature)
    diff = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask == 1]
    assert diff.max().item() < 1e-3, diff.max().item()


def checkpoint_roundtrip(tmp_path):
    """Save, train one more iteration (weights move), load: log-probs are back exactly."""
    from rlhf_core.trainer.ppo import SEQUENCE_KEYS
    from rlhf_core.trainer.restore import save_checkpoint

    def check(cfg, trainer, workers):
        uri = "file://" + str(tmp_path / "ckpt")
        probe = trainer.stage_store.batch.select(SEQUENCE_KEYS, [])
        before = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
        digests = save_checkpoint(workers, trainer.state, cfg, uri)
        trainer.run_iteration()
        moved = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
        assert not torch.equal(before, moved), "an update must change the policy"
        workers.load_checkpoint(uri, expected=digests)  # only bytes checked against what was written
        after = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
        assert torch.equal(before, after)
        state = __import__("json").loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
        assert state["global_step"] == 2 and state["config_hash"] == cfg.config_hash()
        assert set(state["cursor"]) == {"epoch", "position"}

    return check


def test_grpo_with_vllm(ray_local, tmp_path):
    cfg, trainer, metrics = run_iterations(["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "rollout.name=vllm",
                                            RECOMPUTE], after=checkpoint_roundtrip(tmp_path))
    for m in metrics:
        missing = [k for k in EXPECTED_METRICS + ["actor/kl_loss", "timing_s/ref_log_prob"] if k not in m]
        assert not missing, missing
        check_metric_values(m)
        assert m["actor/kl_loss"] >= 0  # low_var_kl is non-negative
    batch = trainer.stage_store.batch
    check_batch(cfg, batch)
    # GRPO: within a group the (per-sequence) advantages sum to ~0
    seq_adv = batch.batch["advantages"][:, 0].reshape(-1, cfg.rollout.n)
    assert torch.allclose(seq_adv.sum(dim=1), torch.zeros(seq_adv.shape[0]), atol=1e-4)
    assert trainer.state.global_step == 3  # two iterations + the one inside the checkpoint check


def test_ppo_gae_with_critic_and_hf_rollout(ray_local):
    cfg, trainer, metrics = run_iterations(["algorithm.adv_estimator=gae", "rollout.name=hf",
                                            "algorithm.use_kl_in_reward=true", RECOMPUTE])
    for m in metrics:
        missing = [k for k in EXPECTED_METRICS + ["critic/vf_loss", "critic/values/mean",
                                                  "actor/reward_kl_penalty"] if k not in m]
        assert not missing, missing
        check_metric_values(m, roles=("actor", "critic"))
        assert m["critic/vf_loss"] > 0
    check_batch(cfg, trainer.stage_store.batch)
    assert "values" in trainer.stage_store.batch.batch.keys()


def test_one_mini_batch_one_epoch_update_skips_the_old_log_prob_stage(ray_local):
    """On-policy (the whole batch is one mini-batch, one epoch): the old log-probs are the
    update's own forward, so no old_log_prob stage runs and the ratio is exactly 1."""
    from rlhf_core.trainer import stages

    cfg, trainer, metrics = run_iterations(["actor.ppo_mini_batch_size=8", "rollout.name=hf"])
    assert cfg.on_policy_update and "old_log_prob" not in [s.name for s in stages.plan(cfg)]
    for m in metrics:
        assert "timing_s/old_log_prob" not in m
        assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0
        assert m["actor/entropy"] > 0 and m["actor/grad_norm"] > 0
    assert "old_log_probs" not in trainer.stage_store.batch.batch.keys()
    # a KL penalty in the reward needs the old log-probs before the update: the stage
    # stays, or (bypass mode) the rollout's log-probs serve
    kl = apply_overrides(cfg, ["algorithm.use_kl_in_reward=true", RECOMPUTE]).validate()
    assert not kl.on_policy_update and "old_log_prob" in [s.name for s in stages.plan(kl)]
    bypass = apply_overrides(cfg, ["algorithm.use_kl_in_reward=true",
                                   "algorithm.rollout_correction.bypass_mode=true"]).validate()
    assert bypass.old_log_prob_column == "rollout_log_probs" and "old_log_prob" not in [s.name for s in stages.plan(bypass)]


def test_bypass_mode_trains_as_the_recomputed_old_log_probs_do(ray_local):
    """Bypass mode (the default): the update takes the rollout engine's log-probs as the
    old ones and no old_log_prob stage runs. With HF generate on the trained model those
    are the same numbers up to float rounding, so the policy after two iterations equals
    the one trained with the recomputed log-probs up to that rounding."""
    from rlhf_core.trainer import stages
    from rlhf_core.trainer.ppo import SEQUENCE_KEYS

    probes = {}

    def probe(name):
        def after(cfg, trainer, workers):
            probes[name] = workers["actor"].compute_log_prob(trainer.stage_store.batch.select(SEQUENCE_KEYS, []))
        return after

    cfg, trainer, metrics = run_iterations(["rollout.name=hf"], after=probe("bypass"))
    assert cfg.old_log_prob_column == "rollout_log_probs"
    assert "old_log_prob" not in [s.name for s in stages.plan(cfg)]
    assert "old_log_probs" not in trainer.stage_store.batch.batch.keys()
    for m in metrics:
        assert "timing_s/old_log_prob" not in m
        check_metric_values(m)
    _, recomputed, _ = run_iterations(["rollout.name=hf", RECOMPUTE], after=probe("recompute"))
    assert torch.equal(trainer.stage_store.batch.batch["responses"], recomputed.stage_store.batch.batch["responses"])
    mask = trainer.stage_store.batch.batch["response_mask"] == 1
    after_bypass, after_recompute = probes["bypass"].batch["old_log_probs"], probes["recompute"].batch["old_log_probs"]
    # float rounding, which Adam's normalisation amplifies a little, against what one
    # iteration's update moves (the last batch was sampled before it)
    rounding = (after_bypass - after_recompute).abs()[mask].max().item()
    moved = (after_bypass - trainer.stage_store.batch.batch["rollout_log_probs"]).abs()[mask].max().item()
    assert rounding < 1e-3 and moved > 20 * rounding, (rounding, moved)


def test_remax_baseline_is_the_greedy_response_reward(ray_local):
    """ReMax end to end: the ``reward_baseline`` stage decodes each prompt greedily and
    scores it; every row of the prompt carries that score, and the advantage is the
    return minus it."""
    cfg, trainer, _ = run_iterations(["algorithm.adv_estimator=remax", "rollout.name=hf"], iterations=1)
    batch = trainer.stage_store.batch
    baselines = batch.batch["reward_baselines"]
    assert baselines.shape == (len(batch),)
    per_prompt = baselines.reshape(-1, cfg.rollout.n)
    assert torch.all(per_prompt == per_prompt[:, :1]), "one baseline per prompt"
    assert torch.all((baselines >= 0) & (baselines <= 1))  # the digits task scores in [0, 1]
    mask = batch.batch["response_mask"].float()
    returns = (batch.batch["token_level_rewards"] * mask).flip(-1).cumsum(-1).flip(-1)
    expected = (returns - baselines.unsqueeze(-1)) * mask
    assert torch.allclose(batch.batch["advantages"], expected)
