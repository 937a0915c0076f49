"""verl's rollout correction, optimal token baseline, PF-PPO, prime reward manager and
SandboxFusion code rewards: each against hand-worked values, then end to end in a small
run (rlhf run --direct's code path)."""

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rlhf_core.algorithms import rollout_correction as rc
from rlhf_core.algorithms.core import compute_optimal_token_baseline_advantage, pf_ppo_weights
from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.record.run_layout import RunRef
from rlhf_core.trainer.run import run_direct
from rlhf_core.workers import reward_managers, sandbox_fusion
from rlhf_core.workers.reward_managers import ScoringRows

import reward_calls
from helpers import small_config
from json_http import JSONServer


# ------------------------------------------------------------------ rollout correction

def test_token_and_sequence_importance_weights_truncate_and_normalize():
    log_ratio = torch.tensor([[math.log(3.0), math.log(0.5), 0.0], [math.log(1.5), 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, metrics = rc.importance_weights(log_ratio, mask, "token", threshold=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]]))  # 3 -> 2 (upper only); masked 0
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0)  # before truncation, as verl
    w, _ = rc.importance_weights(log_ratio, mask, "sequence", threshold=2.0)
    # row 0: 3 * 0.5 * 1 = 1.5; row 1: 1.5 * 1 = 1.5 (the masked 5.0 never counts)
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [1.5, 1.5, 0.0]]))
    w, metrics = rc.importance_weights(log_ratio, mask, "token", threshold=2.0, batch_normalize=True)
    mean = (2.0 + 0.5 + 1.0 + 1.5 + 1.0) / 5
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]]) / mean)


def test_rejection_by_token_k1_bounds_and_sequence_max_k2():
    # pi_rollout / pi_train per token = exp(-log_ratio)
    log_ratio = torch.tensor([[0.0, -math.log(1.7), 0.0], [0.1, 2.3, 0.0]])
    mask = torch.ones(2, 3)
    options = rc.rejection_options("token_k1, seq_max_k2,token_k1")
    assert options == ["token_k1", "seq_max_k2"]
    bounds = rc.rejection_bounds(options, "0.6_1.6,2.5")
    kept, metrics = rc.rejection_mask(log_ratio, mask, options, bounds)
    # token 0,1: ratio 1.7 > 1.6 dropped; token 1,1: ratio e^-2.3 = 0.10 < 0.6 dropped; and
    # row 1's max k2 = 2.3^2 / 2 = 2.645 > 2.5: the whole row dropped
    assert kept.tolist() == [[1, 0, 1], [0, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    assert metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 6)
    assert rc.rejection_bounds(["token_k1"], "2") == [(math.log(0.5), math.log(2.0))]  # bare hi: lo = 1/hi


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.rollout_correction.rollout_rs=token_k4", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     "rollout_rs: expected a comma-separated list of token_k1"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs_threshold: expected a bound"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k2", "algorithm.rollout_correction.rollout_rs_threshold=1_2"],
     "rollout_rs_threshold: expected a positive number for seq_max_k2"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.bypass_mode=false",
      "actor.policy_loss=clip_cov"], "supported here for actor.policy_loss in vanilla"),
    (["algorithm.use_pf_ppo=true"], "algorithm.use_pf_ppo: PF-PPO resamples after GAE"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.bypass_mode=false",
      "rollout.name=vllm", "rollout.temperature=0.7"], "expected rollout.temperature=1 with rollout.name=vllm"),
    (["algorithm.adv_estimator=optimal_token_baseline"], "needs actor.calculate_sum_pi_squared=true"),
])
def test_bad_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        apply_overrides(RunConfig(), overrides).validate()
    assert "\n" not in str(refused.value)


def test_bypass_mode_correction_reads_the_rollouts_log_probs_even_with_one_mini_batch():
    """One epoch over one mini-batch is on-policy (old = the update's own forward) unless a
    rollout correction needs the engine's log-probs: then they are the old ones (verl)."""
    one = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    assert apply_overrides(RunConfig(), one).validate().old_log_prob_column is None
    cfg = apply_overrides(RunConfig(), one + ["algorithm.rollout_correction.rollout_is=token",
                                             "algorithm.rollout_correction.loss_type=reinforce"]).validate()
    assert cfg.old_log_prob_column == "rollout_log_probs"


def test_reinforce_loss_is_weighted_log_likelihood():
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = rc.reinforce_loss(log_prob, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 1.0]]),
                             torch.tensor([[2.0, 1.0]]), "token-mean")
    assert loss.item() == pytest.approx(-(0.5 * -1.0 * 2.0 + 0.5 * -2.0 * 1.0) / 2)
    loss.backward()
    assert log_prob.grad.tolist() == [[-0.5, -0.25]]


# ------------------------------------------------------------------ optimal token baseline, PF-PPO

def test_optimal_token_baseline_by_hand():
    # one group of two responses (outcome rewards 1 and 0), one lone response
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0]])
    mask = torch.ones(3, 2)
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 0.5]]))
    sum_pi2 = torch.tensor([[0.5, 0.5], [0.25, 0.5], [0.5, 0.5]])
    adv, returns = compute_optimal_token_baseline_advantage(rewards, mask, ["a", "a", "b"], old, sum_pi2)
    # w = 1 - 2 pi + sum pi^2: row 0 (0.5, 0.5), row 1 (0.75, 0.5); W = cumsum: (0.5, 1.0), (0.75, 1.25)
    b0 = (1 * 0.5 + 0 * 0.75) / (0.5 + 0.75)
    b1 = (1 * 1.0 + 0 * 1.25) / (1.0 + 1.25)
    assert torch.allclose(adv[:2], torch.tensor([[1 - b0, 1 - b1], [-b0, -b1]]), atol=1e-6)
    assert adv[2].tolist() == [3.0, 3.0] and returns[2].tolist() == [3.0, 3.0]  # a lone response: no baseline


def test_sum_pi_squared_is_the_softmax_sum_of_squares(tmp_path):
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers import modeling

    model = modeling.load_causal_lm(str(build_model_folder(tmp_path / "qwen2-tiny")))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ones, positions = torch.ones_like(ids), torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        log_probs, entropy, sum_pi2 = modeling.response_log_probs(model, ids, ones, positions, 3, 0.7, True,
                                                                  with_sum_pi_squared=True)
        chunked = modeling.response_log_probs(model, ids, ones, positions, 3, 0.7, True, chunk_tokens=2,
                                              with_sum_pi_squared=True)
        probs = torch.softmax(model(input_ids=ids).logits[:, 2:5].float() / 0.7, dim=-1)
    assert torch.allclose(sum_pi2, (probs ** 2).sum(-1), atol=1e-6)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip((log_probs, entropy, sum_pi2), chunked))


def test_pf_ppo_weights_by_method():
    scores = torch.tensor([2.0, -1.0, 0.0, 2.0])
    assert torch.allclose(pf_ppo_weights(scores, "pow", 2.0), torch.tensor([4.0, 1.0, 1e-8, 4.0]) + 1e-8)
    assert pf_ppo_weights(scores, "max_min", 2.0).round().tolist() == [1.0, 1.0, 0.0, 1.0]
    assert torch.allclose(pf_ppo_weights(scores, "max_random", 2.0), torch.tensor([0.4, 0.1, 0.1, 0.4]) + 1e-8)


# ------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("verl-algos")
    variants = {
        "otb": ["algorithm.adv_estimator=optimal_token_baseline", "actor.calculate_sum_pi_squared=true"],
        "bypass_reinforce": ["algorithm.rollout_correction.rollout_is=sequence",
                             "algorithm.rollout_correction.rollout_is_batch_normalize=true",
                             "algorithm.rollout_correction.loss_type=reinforce", "algorithm.adv_estimator=rloo"],
        "decoupled": ["algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.rollout_is=token",
                      "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2",
                      "algorithm.rollout_correction.rollout_rs_threshold=0.6_1.6,2.5"],
        "pf_ppo": ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true"],
        "prime": ["reward_model.reward_manager=prime"],
    }
    out = {}
    for name, extra in variants.items():
        cfg = apply_overrides(small_config(root / name / "out"), extra).validate()
        out[name] = run_direct(cfg, 2, RunRef(f"file://{root / name / 'store'}", "r"), log=lambda *a: None)
        out[name]["store"] = root / name / "store"
    return out


def _stage(run, iteration, stage):
    from rlhf_core.record.iteration_store import IterationStore

    return IterationStore(RunRef(f"file://{run['store']}", "r")).load(iteration, stage)


def test_optimal_token_baseline_runs_from_the_old_log_prob_stages_sum_pi_squared(ray_runs):
    run = ray_runs["otb"]
    batch = _stage(run, 1, "advantage")
    expected, _ = compute_optimal_token_baseline_advantage(
        batch.batch["token_level_scores"], batch.batch["response_mask"].float(), batch.non_tensor_batch["uid"],
        batch.batch["old_log_probs"], batch.batch["sum_pi_squared"])
    assert torch.equal(batch.batch["advantages"], expected) and batch.batch["sum_pi_squared"].abs().sum() > 0
    assert all(math.isfinite(r["actor/pg_loss"]) for r in run["rows"])


def test_bypass_reinforce_logs_its_weights_per_update(ray_runs):
    rows = ray_runs["bypass_reinforce"]["rows"]
    # computed per update micro-batch against the policy being trained (the actor's metrics)
    assert all(r["actor/rollout_corr/rollout_is_batch_norm_factor"] > 0 and math.isfinite(r["actor/pg_loss"])
               for r in rows)
    assert all(0 <= r["actor/rollout_corr/rollout_is_mean"] for r in rows)


def test_decoupled_correction_masks_and_weighs_before_the_advantage(ray_runs):
    batch = _stage(ray_runs["decoupled"], 1, "advantage")
    rollout = _stage(ray_runs["decoupled"], 1, "rollout")
    log_ratio = batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]
    cfg = apply_overrides(RunConfig(), ["algorithm.rollout_correction.rollout_is=token",
                                        "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2",
                                        "algorithm.rollout_correction.rollout_rs_threshold=0.6_1.6,2.5"])
    mask, weights, _ = rc.correct(log_ratio, rollout.batch["response_mask"].float(),
                                  cfg.algorithm.rollout_correction)
    assert torch.equal(batch.batch["response_mask"].float(), mask)
    assert torch.equal(batch.batch["rollout_is_weights"], weights)
    assert "rollout_corr/rollout_rs_masked_fraction" in ray_runs["decoupled"]["rows"][1]


def test_prime_scores_in_worker_processes_inside_a_run_as_naive_does(ray_runs):
    """prime's scores, from processes the reward worker started, are naive's in-process
    scores of the same responses."""
    import psutil

    from rlhf_core.workers.reward import configured_reward_fn

    prime = _stage(ray_runs["prime"], 1, "reward")
    nt = prime.non_tensor_batch
    fn, name = configured_reward_fn(RunConfig())
    rows = ScoringRows(nt["data_source"], list(nt["response_text"]), nt["ground_truth"], nt["extra_info"],
                       nt["uid"], [1] * len(prime))
    expected, _ = reward_managers.naive(fn, name, rows, RunConfig())
    assert prime.batch["token_level_scores"].sum(dim=-1).tolist() == expected and sum(expected) > 0
    assert list(prime.non_tensor_batch["reward_extra/prime_failed"]) == [0.0] * len(prime)
    def cmdline(process) -> str:  # a child that is exiting (a zombie, or gone) has no command line to read
        try:
            return " ".join(process.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            return ""

    workers = [p for p in psutil.Process().children(recursive=True) if "reward_functions" in cmdline(p)]
    assert workers == []  # none outlived its stage


def test_pf_ppo_draws_rows_again_by_score_and_replays(ray_runs):
    from rlhf_core.trainer.replay import replay

    batch = _stage(ray_runs["pf_ppo"], 1, "advantage")
    values = _stage(ray_runs["pf_ppo"], 1, "values")
    assert len(batch) == len(values)
    # the rows the run's seed and step draw, by pow weights of the scores (verl's default)
    pf = RunConfig().algorithm.pf_ppo
    weights = pf_ppo_weights(values.batch["token_level_scores"].sum(dim=-1), pf.reweight_method, pf.weight_pow)
    seed = small_config(Path("unused")).trainer.seed
    draw = torch.Generator().manual_seed(seed * 1_000_003 + batch.meta_info["global_step"])
    drawn = torch.multinomial(weights, len(values), replacement=True, generator=draw)
    assert len(set(drawn.tolist())) < len(values)  # with replacement: some rows twice, some not at all
    assert torch.equal(batch.batch["responses"], values.batch["responses"][drawn])
    assert batch.non_tensor_batch["uid"].tolist() == values.non_tensor_batch["uid"][drawn.numpy()].tolist()
    [result] = replay(f"file://{ray_runs['pf_ppo']['store']}/r/iter-000001", stages=["advantage"],
                      log=lambda *a: None)
    assert result.ok, [d for d in result.diffs if not d.equal]


# ------------------------------------------------------------------ prime, SandboxFusion

_score = reward_calls.score


def _our_processes() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_prime_scores_side_by_side_and_a_failing_or_hanging_call_scores_zero(monkeypatch):
    monkeypatch.setattr(reward_managers, "PRIME_TIMEOUT_S", 3.0)  # the hanging calls cost this
    texts = ["7", "raise", "hang", "dict", "8", "spin", "regex", "exit", "numpy"]
    n = len(texts)
    rows = ScoringRows(["d"] * n, texts, ["7"] * n, [None] * n, [f"u{i}" for i in range(n)], [1] * n)
    before = _our_processes()
    scores, extras = reward_managers.prime(_score, "score", rows, RunConfig())
    assert scores == [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.25]
    assert extras["prime_failed"] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert extras["acc"][3] is True and extras["acc"][8] is True
    assert _our_processes() <= before  # the spinning and hanging calls' processes are gone


def test_prime_kills_what_a_call_started(monkeypatch, tmp_path):
    import psutil

    monkeypatch.setattr(reward_managers, "PRIME_TIMEOUT_S", 3.0)
    pid_file = tmp_path / "pid"
    rows = ScoringRows(["d"], ["grandchild"], [str(pid_file)], [None], ["u"], [1])
    scores, extras = reward_managers.prime(_score, "score", rows, RunConfig())
    assert scores == [0.0] and extras["prime_failed"] == [1.0]
    grandchild = int(pid_file.read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_prime_refuses_a_function_no_process_can_rebuild():
    closure = (lambda offset: lambda data_source, solution_str, ground_truth, extra_info=None: offset)(0.25)
    rows = ScoringRows(["d"], ["7"], ["7"], [None], ["u"], [1])
    with pytest.raises(reward_managers.RewardFunctionError, match="prime.*closure, a lambda"):
        reward_managers.prime(closure, "closure", rows, RunConfig())


def test_prime_runs_a_reward_file_and_the_sandbox_router(tmp_path, monkeypatch):
    """A reward file's function (its module is not importable) and the SandboxFusion router
    (a closure) are rebuilt in each worker from their recipes and score as called directly."""
    from rlhf_core.config import SandboxFusionConfig
    from rlhf_core.workers.reward import load_reward_file

    monkeypatch.setattr(reward_managers, "PRIME_TIMEOUT_S", 60.0)
    path = tmp_path / "mine.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str == ground_truth)\n")
    fn, name = load_reward_file(str(path), "score")
    rows = ScoringRows(["d"] * 3, ["7", "8", "7"], ["7"] * 3, [None] * 3, list("abc"), [1] * 3)
    scores, extras = reward_managers.prime(fn, name, rows, RunConfig())
    assert scores == [1.0, 0.0, 1.0] and extras["prime_failed"] == [0.0] * 3
    from rlhf_core.workers.reward_functions import routed_to_sandbox

    routed = routed_to_sandbox(fn, SandboxFusionConfig(url="http://127.0.0.1:9/run_code"))
    assert reward_managers.prime(routed, "routed", rows, RunConfig())[0] == [1.0, 0.0, 1.0]


@pytest.fixture
def sandbox():
    """A stand-in for a SandboxFusion server: runs the posted Python with the posted stdin
    in a subprocess and answers in SandboxFusion's run_code shape."""
    def route(method, path, body):
        if path != "/run_code":
            return 404, {}
        done = subprocess.run([sys.executable, "-c", body["code"]], input=body["stdin"] or "", text=True,
                              capture_output=True, timeout=30)
        status = "Finished" if done.returncode == 0 else "Failed"
        return 200, {"status": "Success" if done.returncode == 0 else "Failed",
                     "run_result": {"status": status, "stdout": done.stdout, "stderr": done.stderr,
                                    "return_code": done.returncode}}

    server = JSONServer(route)
    yield server
    server.close()


def test_sandbox_fusion_scores_code_sources_and_leaves_the_rest(sandbox):
    from rlhf_core.workers.reward import configured_reward_fn

    cfg = apply_overrides(RunConfig(), [f"reward_model.sandbox_fusion.url={sandbox.url}/run_code",
                                        "reward.function=gsm8k"])
    fn, name = configured_reward_fn(cfg)
    cases = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3", "7", "11"]})
    good = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n```"
    assert fn("codecontests", good, cases) == pytest.approx(2 / 3)  # 5 + 5 != 11
    assert fn("apps", half, cases) == pytest.approx(2 / 3 - 0) and fn("taco", "no code at all", cases) == 0.0
    assert len(sandbox.requests) == 6 and sandbox.requests[0]["body"]["language"] == "python"
    assert sandbox.requests[0]["body"]["memory_limit_MB"] == 1024
    assert fn("openai/gsm8k", "#### 4", "4")["score"] == 1.0  # gsm8k's rows keep reward.function
    assert "sandbox_fusion" in name
    cut = "```python\na, b = map(int, input().split())\nprint(a + b)\n"  # cut off at the length limit
    assert fn("codeforces", cut, cases) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="call-style test cases"):
        fn("apps", good, json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"}))


# ---------------------------------------------------------------- rollout correction as verl computes it

def test_a_sequence_level_fraction_over_the_threshold_counts_sequences():
    """Lengths 3 and 1, log-ratios [.3, .3, .3] and [.1], threshold 2: the first sequence's
    weight exp(.9) = 2.46 is over, the second's exp(.1) = 1.105 is not: half the
    sequences (verl's count), not three quarters of the tokens."""
    from rlhf_core.algorithms.rollout_correction import importance_weights

    log_ratio = torch.tensor([[0.3, 0.3, 0.3], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, metrics = importance_weights(log_ratio, mask, "sequence", 2.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    _, metrics = importance_weights(log_ratio, mask, "token", 1.3)  # tokens: exp(.3) = 1.35 over, exp(.1) not
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.75


def _bypass_loss(overrides, log_prob, rollout_log_prob, mask, advantages):
    from types import SimpleNamespace

    from rlhf_core.algorithms import get_policy_loss_fn
    from rlhf_core.protocol import DataProto
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    cfg = apply_overrides(RunConfig(), ["algorithm.rollout_correction.bypass_mode=true", "actor.entropy_coeff=0",
                                        *overrides]).validate()
    leaf = torch.tensor(log_prob, requires_grad=True)
    actor = SimpleNamespace(config=cfg, policy=None, _log_probs=lambda model, batch, with_entropy: (leaf, None))
    batch = DataProto.from_dict({"response_mask": torch.tensor(mask), "advantages": torch.tensor(advantages),
                                 "old_log_probs": torch.tensor(rollout_log_prob)})  # the rollout's, renamed
    loss, parts = ActorRolloutRefWorker._policy_loss(actor, batch, get_policy_loss_fn(cfg.actor.policy_loss))
    loss.backward()
    return loss, parts, leaf.grad


def test_bypass_reinforce_without_weights_or_rejection_is_reinforce():
    """One token, A = 1, rollout log-prob -2, log pi -1: verl's -A log pi, loss 1.0 and
    gradient -1 (not PPO-clip's against the rollout's log-prob)."""
    loss, parts, grad = _bypass_loss(["algorithm.rollout_correction.loss_type=reinforce"], [[-1.0]], [[-2.0]],
                                     [[1]], [[1.0]])
    assert loss.item() == 1.0 and grad.tolist() == [[-1.0]]
    assert parts["ppo_kl"].item() == -1.0  # old - log pi


def test_bypass_reinforce_with_rejection_measures_ppo_kl_over_the_tokens_kept():
    """Token 2's ratio pi_rollout / pi = exp(-2) is outside token_k1's [1/1.5, 1.5]: it is
    rejected, and ppo_kl (old - log pi) is the mean over token 1 alone: 0, not -1."""
    loss, parts, grad = _bypass_loss(["algorithm.rollout_correction.loss_type=reinforce",
                                      "algorithm.rollout_correction.rollout_rs=token_k1",
                                      "algorithm.rollout_correction.rollout_rs_threshold=1.5"],
                                     [[-1.0, -1.0]], [[-1.0, -3.0]], [[1, 1]], [[1.0, 1.0]])
    assert parts["ppo_kl"].item() == 0.0
    assert loss.item() == 1.0 and grad.tolist() == [[-1.0, 0.0]]  # the rejected token has no gradient


def test_verls_vectorized_estimators_are_taken_and_names_not_here_refused_in_one_line():
    """grpo_vectorized with verl's edges: groups a = [1, 0] (mean .5, unbiased std .7071:
    +-.7071), b = [2] alone (mean 0, std 1: its score), c = [1, 1] (variance floored: 0);
    rloo_vectorized is RLOO; the multi-turn OTB and seq-mean-token-sum-norm are refused."""
    from rlhf_core.algorithms import get_adv_estimator_fn

    rewards = torch.zeros(5, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0])
    mask = torch.ones(5, 2)
    index = ["a", "a", "b", "c", "c"]
    adv, _ = get_adv_estimator_fn("grpo_vectorized")(token_level_rewards=rewards, response_mask=mask, index=index)
    expected = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 2.0 / (1 + 1e-6), 0.0, 0.0]
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-6)
    rloo, _ = get_adv_estimator_fn("rloo_vectorized")(token_level_rewards=rewards, response_mask=mask, index=index)
    assert rloo[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0, 0.0]
    apply_overrides(RunConfig(), ["algorithm.adv_estimator=grpo_vectorized"]).validate()
    for override, message in (
            ("algorithm.adv_estimator=tir_optimal_token_baseline",
             r"^algorithm.adv_estimator=tir_optimal_token_baseline: verl's multi-turn optimal token baseline"),
            ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
             r"^actor.loss_agg_mode=seq-mean-token-sum-norm: verl's seq-mean-token-sum-norm .* is not here")):
        with pytest.raises(ConfigError, match=message) as refused:
            apply_overrides(RunConfig(), [override], notes=[]).validate()
        assert "\n" not in str(refused.value)



def _dripping_server(body_bytes: int | None):
    """A loopback server that answers with headers, then its body a byte at a time forever
    (``None``) or ``body_bytes`` bytes at once."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        try:
            if body_bytes is not None:
                conn.sendall(b"[" + b"1," * (body_bytes // 2) + b"1]")
            while not stop.wait(0.05):
                conn.sendall(b" ")
        except OSError:
            pass
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/run_code", stop


@pytest.mark.parametrize("body", [None, 100_000])
def test_a_sandbox_reply_that_drips_or_swells_is_cut(monkeypatch, body):
    monkeypatch.setattr(sandbox_fusion, "REPLY_DEADLINE_S", 1.0)
    monkeypatch.setattr(sandbox_fusion, "MAX_REPLY_BYTES", 10_000)
    url, stop = _dripping_server(body)
    outcome = []
    caller = threading.Thread(target=lambda: outcome.append(sandbox_fusion.run_case(url, "print(1)", None, 64)))
    caller.start()
    caller.join(60)  # cut at 1 s; a reply read without bounds never ends
    stop.set()
    assert not caller.is_alive() and outcome == [None]
