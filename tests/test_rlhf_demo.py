"""The RLHF demo on the built-in task (``rlhf rlhf-demo``): the simulated annotator's
preferences, and the three phases end to end at a tiny size."""

import json

import pytest

from rlhf_core.data.builtin import DATA_SOURCE, reward_score


@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_the_annotator_prefers_the_response_closer_to_the_answer_but_for_its_noise(tmp_path, noise):
    from rlhf_core.data.builtin import make_rows
    from rlhf_core.data.preferences import load_pairs
    from rlhf_core.demo import simulated_preferences
    from rlhf_core.models.builtin import builtin_model_path

    rows, counts = simulated_preferences(builtin_model_path(seed=0, progress=False), 400, seed=0, noise=noise)
    assert counts["pairs"] == len(rows) and counts["pairs"] + counts["ties_skipped"] + counts["empty_skipped"] == 400
    truth = {r["prompt"]: r["ground_truth"] for r in make_rows(400, seed=500)}
    right = sum(reward_score(DATA_SOURCE, r["chosen"], truth[r["prompt"]])["score"] >
                reward_score(DATA_SOURCE, r["rejected"], truth[r["prompt"]])["score"] for r in rows)
    assert right == len(rows) - counts["flipped"]
    assert (counts["flipped"] == 0) if noise == 0 else (0.35 < counts["flipped"] / len(rows) < 0.65)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_pairs(str(path))[0]) == len(rows)  # every pair is one the trainer takes


def test_the_demo_runs_its_three_phases_and_logs_the_tasks_score_beside_the_models(tmp_path, ray_local):
    from rlhf_core.cli import main
    from rlhf_core.record.lineage import chain, format_lineage

    store = f"file://{tmp_path / 'store'}"
    assert main(["rlhf-demo", "--prompts", "200", "--rm-epochs", "1", "--out", str(tmp_path / "demo"), "--direct",
                 "--iterations", "2", "--run-id", "demo", "--store", store, "data.train_batch_size=16",
                 "actor.ppo_mini_batch_size=16", "trainer.progress=false",
                 f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("critic/reward_extra/function_score/mean" in r for r in rows)
    # each score on its own scale, recomputed from the reward stage's record: the reward
    # model's (its logit at the last token) and the task's own check of the same responses
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef

    for iteration, row in enumerate(rows):
        reward = IterationStore(RunRef(store, "demo")).load(iteration, "reward")
        nt = reward.non_tensor_batch
        task = [reward_score(DATA_SOURCE, text, truth)["score"] for text, truth in zip(nt["response_text"],
                                                                                       nt["ground_truth"])]
        assert row["critic/reward_extra/function_score/mean"] == pytest.approx(sum(task) / len(task))
        assert row["critic/score/mean"] == pytest.approx(float(reward.batch["rm_scores"].sum(-1).mean()), abs=1e-6)
        assert 0 <= min(task) and max(task) <= 1
    lines = format_lineage(chain(f"{store}/demo")).splitlines()
    assert lines[-1].startswith(f"  trained from preferences {tmp_path / 'demo' / 'preferences.jsonl'} (sha256 ")


def test_iterated_rounds_ask_about_the_policys_own_responses_and_continue_from_its_last_checkpoint(
        tmp_path, ray_local):
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.lineage import chain_across_runs, format_runs
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.workers.reward_model import PROVENANCE

    demo, store = tmp_path / "demo", f"file://{tmp_path / 'store'}"
    argv = ["rlhf-demo", "--prompts", "200", "--rm-epochs", "1", "--rounds", "2", "--round-prompts", "150",
            "--out", str(demo), "--direct", "--iterations", "4", "--run-id", "it", "--store", store,
            "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.progress=false",
            f"trainer.output_dir={tmp_path / 'out'}"]
    assert main(argv) == 0
    first, second = (IterationStore(RunRef(store, f"it-round{r}")) for r in (0, 1))
    assert first.committed_iterations() == [0, 1] and second.committed_iterations() == [0, 1]
    # round 1 starts from round 0's last checkpoint, exported, and is scored by the continued reward model
    export = json.loads((demo / "policy-round1" / "EXPORT.json").read_text())
    assert export["checkpoint_uri"] == first.read_manifest(1)["checkpoint"]
    # the run records the weights it started from: the exported ones
    assert second.read_manifest(0)["model"]["weights_sha256"] == export["weights_sha256"]
    config = second.read_manifest(0)["config"]
    assert config["model"]["path"] == str(demo / "policy-round1")
    assert config["reward_model"]["model"]["path"] == str(demo / "reward-model-round1")
    provenance = json.loads((demo / "reward-model-round1" / PROVENANCE).read_text())
    assert json.dumps(provenance).count(str(demo / "reward-model")) >= 1  # trained on from round 0's model
    # every pair so far: round 0's, then those of the round's policy
    earlier = (demo / "preferences.jsonl").read_text()
    pairs = (demo / "preferences-round1.jsonl").read_text()
    assert pairs.startswith(earlier) and len(pairs.splitlines()) > len(earlier.splitlines())
    # the policy traced back through both rounds: each round's reward model and preferences
    text = format_runs(chain_across_runs(f"{store}/it-round1"))
    assert text.index("run it-round1:") < text.index(f"policy started from {demo / 'policy-round1'}: exported "
                                                      f"from {export['checkpoint_uri']} (step 2, ") < \
        text.index("run it-round0:")
    assert f"  trained from preferences {demo / 'preferences-round1.jsonl'} (sha256 " in text
    assert f"  trained from preferences {demo / 'preferences.jsonl'} (sha256 " in text
    rows = json.loads(format_runs(chain_across_runs(f"{store}/it-round1"), "json"))
    assert [(r["run_id"], r["iteration"]) for r in rows] == [("it-round1", 1), ("it-round1", 0),
                                                             ("it-round0", 1), ("it-round0", 0)]
    assert rows[1]["started_from"]["checkpoint"] == export["checkpoint_uri"]
    dot = format_runs(chain_across_runs(f"{store}/it-round1"), "dot")
    assert "it0 -> r1_ck" in dot and "r1_it1 -> r1_it0 [label=parent]" in dot
    rounds = [json.loads(line) for line in (demo / "rounds.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["round"], r["round_iteration"]) for r in rounds] == [(0, 0, 0), (1, 0, 1),
                                                                                     (2, 1, 0), (3, 1, 1)]
    assert rounds[2]["critic/score/mean"] == second.read_manifest(0)["metrics"]["critic/score/mean"]
    assert (demo / "rounds.png").read_bytes()[:4] == b"\x89PNG"
    # the same command again redoes nothing: every round's output is there
    stamp = (demo / "reward-model-round1" / PROVENANCE).stat().st_mtime_ns
    assert main(argv) == 0
    assert (demo / "reward-model-round1" / PROVENANCE).stat().st_mtime_ns == stamp
    assert second.committed_iterations() == [0, 1]


def test_rounds_must_share_the_iterations_equally(tmp_path):
    from rlhf_core.cli import main

    with pytest.raises(SystemExit, match=r"--iterations: expected a multiple of --rounds \(3\); found 4"):
        main(["rlhf-demo", "--rounds", "3", "--iterations", "4", "--out", str(tmp_path / "demo")])
    with pytest.raises(SystemExit, match="--rounds: expected at least 1; found 0"):
        main(["rlhf-demo", "--rounds", "0", "--out", str(tmp_path / "demo")])


def test_a_policy_folders_export_record_is_read_as_data_and_refused_in_one_line_when_malformed(tmp_path):
    from rlhf_core.record.lineage import LineageError, started_from

    folder = tmp_path / "policy"
    folder.mkdir()
    rows = [{"config": {"model": {"path": str(folder)}}}]
    assert started_from(rows) is None  # a plain model folder: the chain ends there
    assert started_from([{"config": {"model": {"path": "builtin:digits"}}}]) is None
    assert started_from([{"config": {"model": {"path": "s3://bucket/model"}}}]) is None
    (folder / "EXPORT.json").write_text("{not json")
    with pytest.raises(LineageError, match=r"EXPORT.json: expected the JSON record `rlhf export` writes; found"):
        started_from(rows)
    (folder / "EXPORT.json").write_text(json.dumps({"checkpoint_uri": 7}))
    with pytest.raises(LineageError, match="EXPORT.json: expected a checkpoint_uri string; found"):
        started_from(rows)
    (folder / "EXPORT.json").write_text(json.dumps({"checkpoint_uri": "file:///r/run/checkpoints/step-000002-ab",
                                                    "global_step": 2, "weights_sha256": "f" * 64}))
    assert started_from(rows) == {"model": str(folder), "checkpoint": "file:///r/run/checkpoints/step-000002-ab",
                                  "global_step": 2, "weights_sha256": "f" * 64}
    # the run's manifest hashed the weights it loaded: the same export is traced ...
    rows[-1]["model"] = {"path": str(folder), "sha256": "0" * 64, "weights_sha256": "f" * 64}
    assert started_from(rows)["checkpoint"] == "file:///r/run/checkpoints/step-000002-ab"
    # ... a folder overwritten since (another export) is not
    rows[-1]["model"]["weights_sha256"] = "a" * 64
    with pytest.raises(LineageError, match=r"EXPORT.json names weights ffffffffffffffff\.\.\. but run .* started "
                                           r"from weights aaaaaaaaaaaaaaaa\.\.\. \(the folder was overwritten"):
        started_from(rows)


def test_a_run_whose_policy_names_its_own_later_checkpoint_is_refused_not_walked_forever(tmp_path, monkeypatch):
    from rlhf_core.record import lineage

    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "EXPORT.json").write_text(json.dumps({"checkpoint_uri": "file:///s/a/checkpoints/step-000002-ab"}))
    monkeypatch.setattr(lineage, "chain", lambda uri: [{"run_id": "a", "iteration": 1, "config": {}},
                                                       {"run_id": "a", "iteration": 0,
                                                        "config": {"model": {"path": str(folder)}}}])
    with pytest.raises(lineage.LineageError, match=r"names run a, already on the chain \(runs \['a'\]\)"):
        lineage.chain_across_runs("file:///s/a")
