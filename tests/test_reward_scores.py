"""verl's default reward (reward.function=verl): each data_source scored by verl's rules,
checked against hand-worked answers of each kind; a data_source nothing here scores is
refused before any worker is placed."""

import pytest

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.data.reward_scores import UnscoredSource, default_compute_score, scorer_for


@pytest.mark.parametrize("response,truth,score", [
    ("... so she has 1,234 apples. #### 1,234", "1234", 1.0),   # commas dropped
    ("#### $18", "18", 0.0),                                      # verl's strict pattern: no "$" after "#### "
    ("#### 18.0", "18", 0.0),                                     # compared as written, not as numbers
    ("#### -3", "-3", 1.0),
    ("#### 7 then #### 8", "8", 1.0),                             # the last one
    ("the answer is 18", "18", 0.0),                              # no "#### "
    ("#### 18" + " " * 400, "18", 0.0),                           # outside the last 300 characters
])
def test_gsm8k_as_verl_scores_it(response, truth, score):
    assert default_compute_score("openai/gsm8k", response, truth) == score


@pytest.mark.parametrize("response,truth,score", [
    (r"so \boxed{\dfrac{1}{2}}", "0.5", 1.0),                     # dfrac -> frac, 0.5 -> \frac{1}{2}
    (r"\boxed{\frac12}", r"\frac{1}{2}", 1.0),                   # braces added
    (r"\boxed{3/4}", r"\frac34", 1.0),                            # a/b as a fraction
    (r"\boxed{x = 5}", "5", 1.0),                                 # a short left side dropped
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),                          # units
    (r"\boxed{\left( 3, 4 \right)}", "(3,4)", 1.0),
    (r"\boxed{2} and later \boxed{3}", "2", 0.0),                 # the last box
    (r"\boxed 7$ more", "7", 1.0),
    (r"\fbox{7}", "7", 0.0),                                      # an fbox is found, not unboxed (verl's)
    ("7", "7", 0.0),                                              # no box
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 0.0),                # no algebra
])
def test_math_as_verl_scores_it(response, truth, score):
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, response, truth) == score, source


def test_search_r1_exact_match_as_verl_scores_it():
    truth = {"target": ["Eiffel Tower", "la tour Eiffel"]}
    assert default_compute_score("searchR1_nq", "<answer> the Eiffel tower. </answer>", truth) == 1.0
    assert default_compute_score("searchR1_hotpotqa", "<answer>Louvre</answer><answer>La Tour Eiffel</answer>",
                                 truth) == 1.0
    assert default_compute_score("searchR1_nq", "<answer>tower</answer>", truth) == 0.0
    assert default_compute_score("searchR1_nq", "Eiffel Tower", truth) == 0.0       # no answer tags
    assert default_compute_score("searchR1_nq", "<answer>x</answer>" * 11 + "<answer>Eiffel Tower</answer>",
                                 truth) == 0.25                                       # tags repeated


def test_the_built_in_task_keeps_its_scorer():
    from rlhf_core.data.builtin import DATA_SOURCE, reward_score

    assert default_compute_score(DATA_SOURCE, "4321", "4321") == reward_score(DATA_SOURCE, "4321", "4321")
    assert default_compute_score(DATA_SOURCE, "4311", "4321") == reward_score(DATA_SOURCE, "4311", "4321")


@pytest.mark.parametrize("source,word", [("apps", "sandbox_fusion.url"), ("math_dapo", "math_dapo"),
                                         ("aime2024", "math_dapo"), ("hiyouga/geometry3k", "geometry3k"),
                                         ("numina_olympiads", "prime_math"), ("my/own", "no scorer")])
def test_a_source_nothing_here_scores_is_named_with_what_would(source, word):
    with pytest.raises(UnscoredSource, match=word) as caught:
        scorer_for(source)
    assert source in str(caught.value) and "\n" not in str(caught.value)
    if source == "apps":
        assert scorer_for(source, sandbox=True) is None  # the SandboxFusion router scores it


def test_verl_data_of_an_unscored_source_is_refused_before_any_worker_is_placed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.trainer.preflight import PreflightError, check_inputs

    path = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "aime2024", "prompt": "1+1?",
                                          "reward_model": {"ground_truth": "2"}}] * 8), path)
    cfg = apply_overrides(RunConfig(), [f"data.train_files={path}", "data.train_batch_size=4",
                                        "actor.ppo_mini_batch_size=4"]).validate()
    assert cfg.reward.function == "verl"
    with pytest.raises(PreflightError, match="reward.function=verl: data_source 'aime2024'"):
        check_inputs(cfg)
    mine = tmp_path / "mine.py"
    mine.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    check_inputs(apply_overrides(cfg, [f"custom_reward_function.path={mine}"]).validate())  # scores everything


def test_search_r1_ground_truths_reach_the_scorer_as_verl_writes_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.trainer.loaders import make_loader

    path = tmp_path / "nq.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "searchR1_nq", "prompt": "Where?",
                                          "reward_model": {"ground_truth": {"target": ["Paris", "paris france"]}}}] * 4),
                   path)
    cfg = apply_overrides(RunConfig(), [f"data.train_files={path}", "data.train_batch_size=4",
                                        "actor.ppo_mini_batch_size=4"]).validate()
    batch = make_loader(cfg).next_batch()
    truth = batch.non_tensor_batch["ground_truth"][0]
    assert truth == {"target": ["Paris", "paris france"]}
    assert default_compute_score("searchR1_nq", "<answer>paris</answer>", truth) == 1.0


def test_the_built_in_reward_refuses_rows_of_another_task():
    from rlhf_core.data.builtin import reward_score

    for source, truth in (("openai/gsm8k", "18"), ("builtin/digits_reverse", "")):
        with pytest.raises(ValueError, match="reward.function=builtin scores the built-in task's rows") as caught:
            reward_score(source, "#### 18", truth)
        assert "\n" not in str(caught.value)


def test_the_gpu_config_scores_its_gsm8k_rows_as_verl_does():
    from pathlib import Path

    from components.kuberay.spec import load_deployment

    root = Path(__file__).resolve().parents[1]
    cfg, _ = load_deployment(root / "manifests" / "configs" / "gpu.yaml")
    assert cfg.reward.function == "verl" and "gsm8k" in cfg.data.train_files
    assert scorer_for("openai/gsm8k") is not None
