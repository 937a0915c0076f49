"""DAPO's dynamic sampling (algorithm.filter_groups, data.gen_batch_size): groups whose
metric does not vary are dropped and more prompts generated until the batch is full; the
stage is a snapshot, resumes with the prompts it drew and replays exactly. Also a
scaled-down run with the keys of verl's DAPO recipe script."""

import os

import numpy as np
import pytest

from helpers import fingerprint, small_config
from rlhf_core.algorithms import varied_groups
from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef
from rlhf_core.trainer.run import run_direct

# a pass/fail column of the built-in task's partial credit: many groups pass or fail whole
DAPO = ["data.train_batch_size=4", "data.gen_batch_size=8", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=20",
        "custom_reward_function.name=score"]
PASS_FAIL = '''
from rlhf_core.data.builtin import reward_score


def score(data_source, solution_str, ground_truth, extra_info=None):
    s = reward_score(data_source, solution_str, ground_truth, extra_info)["score"]
    return {"score": s, "acc": float(s >= THRESHOLD)}
'''
CONSTANT = '''
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.0, "acc": 0.0}
'''


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))


def test_varied_groups_keeps_spread_or_lone_responses_in_order():
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    values = [1, 0, 1, 1, 0, 0.5, 0.5]
    assert varied_groups(uids, values) == ["a", "c"]


def test_dynamic_sampling_settings_are_checked():
    with pytest.raises(ConfigError, match="algorithm.filter_groups.metric: expected seq_reward"):
        apply_overrides(RunConfig(), ["algorithm.filter_groups.enable=true"]).validate()
    with pytest.raises(ConfigError, match="data.gen_batch_size: differs from data.train_batch_size only with"):
        apply_overrides(RunConfig(), ["data.gen_batch_size=512"]).validate()
    with pytest.raises(ConfigError, match="seq_final_reward: the KL penalty"):
        apply_overrides(RunConfig(), ["algorithm.filter_groups.enable=true", "algorithm.use_kl_in_reward=true",
                                      "algorithm.filter_groups.metric=seq_final_reward"]).validate()


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("dapo")
    (root / "pass_fail.py").write_text(PASS_FAIL.replace("THRESHOLD", "0.4"))
    cfg = apply_overrides(small_config(root / "out"), DAPO + [f"custom_reward_function.path={root / 'pass_fail.py'}"]
                          ).validate()
    result = run_direct(cfg, 2, RunRef(f"file://{root / 'store'}", "r"), log=lambda *a: None)
    return {"root": root, "cfg": cfg, **result}


def test_the_batch_holds_train_batch_size_varied_groups(dapo_run):
    istore = IterationStore(RunRef(f"file://{dapo_run['root'] / 'store'}", "r"))
    generations = [row["train/num_gen_batches"] for row in dapo_run["rows"]]
    assert all(g >= 1 for g in generations) and max(generations) > 1, generations  # it had to draw more
    for n in range(2):
        batch = istore.load(n, "filter_groups")
        uids = batch.non_tensor_batch["uid"].tolist()
        exact = [float(v) for v in batch.non_tensor_batch["reward_extra/acc"].tolist()]
        assert len(batch) == 4 * 4 and len(set(uids)) == 4
        groups = {}
        for uid, value in zip(uids, exact):
            groups.setdefault(uid, []).append(value)
        assert all(np.std(v) > 0 for v in groups.values()), groups
        assert len(istore.load(n, "reward")) == 8 * 4  # the first generation batch, as generated
    manifest = istore.read_manifest(1)
    # the data cursor moved past every prompt drawn: gen_batch_size per generation batch
    assert manifest["data_cursor"] == {"epoch": 0, "position": 8 * sum(generations)}
    # each further generation batch is committed whole, as scored, and listed with the iteration
    for n, count in enumerate(generations):
        listed = istore.read_manifest(n)["snapshots"]
        further = sorted(name for name in listed if name.startswith("filter_groups."))
        assert further == [f"filter_groups.gen_batch-{k}" for k in range(1, count)], (n, further)
        for k, name in enumerate(further, start=1):
            batch = istore.load(n, name, standalone=True)
            assert len(batch) == 8 * 4 and batch.meta_info["generation"] == k
            assert "reward_extra/acc" in batch.non_tensor_batch and "token_level_scores" in batch.batch.keys()


def test_a_run_interrupted_after_filter_groups_resumes_with_the_prompts_it_drew(dapo_run, tmp_path):
    class Crash(RuntimeError):
        pass

    def crash(iteration, name):
        if (iteration, name) == (1, "advantage"):
            raise Crash("injected")

    store = tmp_path / "store"
    with pytest.raises(Crash):
        run_direct(dapo_run["cfg"], 2, RunRef(f"file://{store}", "r"), log=lambda *a: None, on_stage=crash)
    assert (store / "r/iter-000001/filter_groups/SNAPSHOT.json").exists()
    run_direct(dapo_run["cfg"], 1, RunRef(f"file://{store}", "r"), log=lambda *a: None)
    a, b = fingerprint(dapo_run["root"] / "store", "r"), fingerprint(store, "r")
    assert sorted(a) == sorted(b) and not [k for k in a if a[k] != b[k]]
    assert IterationStore(RunRef(f"file://{store}", "r")).read_manifest(1)["data_cursor"] == \
        IterationStore(RunRef(f"file://{dapo_run['root'] / 'store'}", "r")).read_manifest(1)["data_cursor"]


def test_a_run_killed_inside_filter_groups_resumes_from_the_batches_it_committed(dapo_run, tmp_path, monkeypatch):
    """Killed after its further generation batches are committed, before the stage is:
    the resumed stage takes them from the store (nothing is generated or scored again: an
    agent's tools and a judge are not asked twice) and the run is bit-identical."""
    from rlhf_core.trainer.ppo import PPOTrainer

    generations = [row["train/num_gen_batches"] for row in dapo_run["rows"]]
    n = generations.index(max(generations))

    class Crash(RuntimeError):
        pass

    done = PPOTrainer._stage_done

    def crash_after(self, name):
        done(self, name)  # the snapshots handed over so far are committed
        if (self.state.global_step, name) == (n, "filter_groups"):
            raise Crash("injected")

    store = tmp_path / "store"
    monkeypatch.setattr(PPOTrainer, "_stage_done", crash_after)
    with pytest.raises(Crash):
        run_direct(dapo_run["cfg"], n + 1, RunRef(f"file://{store}", "r"), log=lambda *a: None)
    monkeypatch.setattr(PPOTrainer, "_stage_done", done)
    it = store / f"r/iter-{n:06d}"
    assert (it / f"filter_groups.gen_batch-{max(generations) - 1}/SNAPSHOT.json").exists()
    assert not (it / "filter_groups/SNAPSHOT.json").exists()

    def generated(self, step, generation):
        raise AssertionError(f"generation batch {generation} of iteration {step} was generated again")

    monkeypatch.setattr(PPOTrainer, "_generate_scored", generated)
    run_direct(dapo_run["cfg"], 2 - n, RunRef(f"file://{store}", "r"), log=lambda *a: None)
    a, b = fingerprint(dapo_run["root"] / "store", "r"), fingerprint(store, "r")
    assert sorted(a) == sorted(b) and not [k for k in a if a[k] != b[k]]


def test_filter_groups_replays_exactly_with_its_further_batches(dapo_run, tmp_path):
    import shutil

    from rlhf_core.snapshot import save_snapshot
    from rlhf_core.trainer.replay import replay

    generations = [row["train/num_gen_batches"] for row in dapo_run["rows"]]
    n = generations.index(max(generations))
    [result] = replay(f"file://{dapo_run['root'] / 'store'}/r/iter-{n:06d}", stages=["filter_groups"],
                      log=lambda *a: None, trust_reward_function=True)
    assert result.ok, [d for d in result.diffs if not d.equal]
    compared = {d.field.split("/", 1)[0] for d in result.diffs if d.field.startswith("gen_batch-")}
    assert compared == {f"gen_batch-{k}" for k in range(1, max(generations))}
    # a further batch recorded otherwise than it replays is a difference of that batch
    copy = tmp_path / "store"
    shutil.copytree(dapo_run["root"] / "store", copy)
    name = copy / f"r/iter-{n:06d}/filter_groups.gen_batch-1"
    from rlhf_core.snapshot import load_snapshot

    batch = load_snapshot(f"file://{name}")
    batch.batch["token_level_scores"] = batch.batch["token_level_scores"] + 1.0
    shutil.rmtree(name)
    save_snapshot(batch, f"file://{name}")
    [result] = replay(f"file://{copy}/r/iter-{n:06d}", stages=["filter_groups"], log=lambda *a: None,
                      trust_reward_function=True)
    assert [d.field for d in result.diffs if not d.equal] == ["gen_batch-1/token_level_scores"]


def test_too_many_generation_batches_stop_the_run_in_one_line(tmp_path, ray_local):
    reward = tmp_path / "constant.py"
    reward.write_text(CONSTANT)
    cfg = apply_overrides(small_config(tmp_path / "out"), [
        "data.train_batch_size=4", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=2", f"custom_reward_function.path={reward}",
        "custom_reward_function.name=score"]).validate()
    with pytest.raises(Exception, match=r"max_num_gen_batches=2: 0 of 4 groups with a varied acc after 2 generation"):
        run_direct(cfg, 1, RunRef(f"file://{tmp_path / 'store'}", "r"), log=lambda *a: None)


def test_verls_dapo_recipe_keys_scaled_down_run(tmp_path, ray_local):
    """verl's recipe/dapo test_dapo_7b.sh's algorithm keys (dynamic sampling on acc, the
    dapo reward manager's overlong buffer, clip-higher, token-mean, no KL), with its model,
    data and sizes scaled down to the built-in task."""
    from rlhf_core.data.builtin import make_rows

    verl_keys = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.clip_ratio_c=10.0", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
        "data.train_batch_size=4", "data.gen_batch_size=12", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
        "data.max_response_length=12", "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=1", "actor_rollout_ref.actor.optim.weight_decay=0.1",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "trainer.save_freq=-1", "trainer.total_epochs=1",
    ]
    reward = tmp_path / "acc.py"
    reward.write_text("from rlhf_core.data.builtin import reward_score\n\n"
                      "def acc(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    s = reward_score(data_source, solution_str, ground_truth, extra_info)\n"
                      "    return float(s['score'] >= 0.4)\n")  # pass/fail, as verl's math_dapo
    notes: list[str] = []
    cfg = apply_overrides(small_config(tmp_path / "out"), verl_keys + [
        f"custom_reward_function.path={reward}", "custom_reward_function.name=acc"], notes=notes).validate()
    assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.len == 4 and cfg.data.gen_batch_size == 12
    result = run_direct(cfg, 2, RunRef(f"file://{tmp_path / 'store'}", "r"), log=lambda *a: None)
    rows = result["rows"]
    assert [r["iteration"] for r in rows] == [0, 1] and all(r["train/num_gen_batches"] >= 1 for r in rows)
    # the dapo manager logs acc for a function returning a number: the filter's metric
    assert all("critic/reward_extra/acc/mean" in r for r in rows)


def test_an_iteration_that_needs_many_generation_batches_completes(tmp_path, ray_local):
    """Groups vary only for prompts whose answer starts with 0 or 1: an iteration draws three
    or more generation batches (each with its own meta and, for some, reward columns of its
    own) and still yields train_batch_size varied groups."""
    reward = tmp_path / "rare.py"
    reward.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if ground_truth[0] not in '01':\n"
        "        return {'score': 0.0, 'acc': 0.0}\n"
        "    return {'score': 0.5, 'acc': float(len(solution_str) % 2), 'eligible': 1.0}\n")
    cfg = apply_overrides(small_config(tmp_path / "out"), [
        "data.train_batch_size=4", "data.gen_batch_size=4", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc", f"custom_reward_function.path={reward}",
        "custom_reward_function.name=score"]).validate()
    rows = run_direct(cfg, 1, RunRef(f"file://{tmp_path / 'store'}", "r"), log=lambda *a: None)["rows"]
    assert rows[0]["train/num_gen_batches"] >= 3, rows[0]["train/num_gen_batches"]
    batch = IterationStore(RunRef(f"file://{tmp_path / 'store'}", "r")).load(0, "filter_groups")
    assert len(set(batch.non_tensor_batch["uid"].tolist())) == 4


def test_an_agents_further_generation_batches_replay_from_the_record_without_a_tool(tmp_path, ray_local, monkeypatch):
    """The calculator task's agent loop under dynamic sampling, its tool config a file of
    the user's: every further generation batch's trajectories (turns, calls, answers) are
    committed, and replaying filter_groups gives them again: no tool is built or asked,
    and no trust in the stored tool config is needed."""
    import shutil
    from pathlib import Path

    from rlhf_core.agent.tool_config import BUILT_IN_CONFIGS
    from rlhf_core.agent.tools.calculator import CalculatorTool
    from rlhf_core.cli import main
    from rlhf_core.trainer.replay import replay

    tools = tmp_path / "my_calculator.yaml"
    shutil.copy(BUILT_IN_CONFIGS["calculator"], tools)
    store = f"file://{tmp_path / 'store'}"
    assert main(["run", "--direct", "--config", str(Path(__file__).resolve().parents[1] / "examples" / "agent" /
                                                   "calculator.yaml"),
                 "--iterations", "1", "--run-id", "agent", "--store", store, "data.train_batch_size=8",
                 "actor.ppo_mini_batch_size=8", "rollout.n=2", f"rollout.multi_turn.tool_config_path={tools}",
                 "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
                 "trainer.progress=false", f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    istore = IterationStore(RunRef(store, "agent"))
    further = sorted(name for name in istore.read_manifest(0)["snapshots"] if name.startswith("filter_groups."))
    assert further, "the iteration drew no further generation batch"
    calls = [c for name in further
             for c in istore.load(0, name, standalone=True).non_tensor_batch["agent/tool_calls"].tolist()]
    assert any(c != "[]" for c in calls), "no trajectory of a further batch called the calculator"

    async def unreachable(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool was called again")

    def unbuilt(self, *args, **kwargs):
        raise RuntimeError("a tool was built in a replay")

    monkeypatch.setattr(CalculatorTool, "execute", unreachable)
    monkeypatch.setattr(CalculatorTool, "__init__", unbuilt)
    [result] = replay(f"{store}/agent/iter-000000", stages=["filter_groups"], log=lambda *a: None)
    assert result.ok, [d for d in result.diffs if not d.equal]
    assert {d.field.split("/", 1)[0] for d in result.diffs if d.field.startswith("gen_batch-")} == \
        {name.split(".", 1)[1] for name in further}


def test_a_replayed_further_batch_gets_its_recorded_tool_and_judge_answers_at_the_stages_that_ask():
    """The wiring a replay of filter_groups stands on, stage by stage: the rollout of a
    further generation batch gets its record's tool calls (by sample seed), the reward
    stage its record's judge calls (row-aligned); a batch past the record goes to the
    replay's hook first (which refuses it for tools the stored config chose)."""
    import torch

    from rlhf_core.protocol import DataProto
    from rlhf_core.trainer import stages as stage_table
    from rlhf_core.trainer.ppo import JUDGE_CALLS, RECORDED_TOOL_CALLS, PPOTrainer

    cfg = apply_overrides(RunConfig(), DAPO + ["rollout.multi_turn.enable=true"])
    trainer = object.__new__(PPOTrainer)
    seen = {}

    class Loader:
        def next_batch(self):
            return DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                        "responses": torch.zeros(2, 3, dtype=torch.long)})

    def stage(name):
        def run(batch):
            seen[name] = (dict(batch.meta_info), dict(batch.non_tensor_batch))
            return batch
        return run

    trainer.config, trainer.loader = cfg, Loader()
    trainer.stages = lambda: [stage_table.BY_NAME[n] for n in ("rollout", "reward", "filter_groups")]
    trainer.rollout, trainer.compute_reward = stage("rollout"), stage("reward")
    record = DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                  "responses": torch.zeros(2, 3, dtype=torch.long)}, non_tensors={
        "agent/seed": np.array([7, 8], dtype=object), "agent/tool_calls": np.array(['[{"a": 1}]', "[]"], dtype=object),
        JUDGE_CALLS: np.array(["j7", "j8"], dtype=object)})
    asked = []
    trainer.replayed_gen_batches, trainer.unrecorded_gen_batch = {1: record}, asked.append
    trainer._generate_scored(3, 1)
    assert seen["rollout"][0][RECORDED_TOOL_CALLS] == {7: '[{"a": 1}]', 8: "[]"}
    assert seen["reward"][1][JUDGE_CALLS].tolist() == ["j7", "j8"] and asked == []
    seen.clear()
    trainer._generate_scored(3, 2)  # past the record: the hook decides, nothing recorded is given
    assert asked == [2] and RECORDED_TOOL_CALLS not in seen["rollout"][0] and JUDGE_CALLS not in seen["reward"][1]
    # answers recorded to other responses are not given to these: one line, before the judge is asked
    record.batch["responses"][1, 2] = 5
    with pytest.raises(RuntimeError, match=r"^generation batch 1 of filter_groups: expected the responses its record"):
        trainer._generate_scored(3, 1)
