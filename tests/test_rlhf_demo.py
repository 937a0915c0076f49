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
    assert rows[0]["critic/score/mean"] != rows[0]["critic/reward_extra/function_score/mean"]
    lines = format_lineage(chain(f"{store}/demo")).splitlines()
    assert lines[-1].startswith(f"  trained from preferences {tmp_path / 'demo' / 'preferences.jsonl'} (sha256 ")
