"""Validation (data.val_files, trainer.test_freq, trainer.val_before_train) and verl's
custom_reward_function: a reward loaded from a file scores; validation is a snapshot of
its own at the iterations it is due, logged under verl's names, replayable, shown in the
report, and never changes what is trained; the fine-tune driver stops at a val score."""

import json
import os
from pathlib import Path

import pytest

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.data.builtin import make_rows
from rlhf_core.trainer.replay import ReplayError, replay
from rlhf_core.trainer.run import run_direct
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef

from helpers import fingerprint, small_config

VAL = "val-core/builtin/digits_reverse/reward/mean@1"
REWARD_FILE = '''
from rlhf_core.data.builtin import reward_score


def my_score(data_source, solution_str, ground_truth, extra_info=None):
    return {**reward_score(data_source, solution_str, ground_truth, extra_info), "from_file": 1.0}
'''
def test_validation_settings_do_not_change_what_is_trained():
    base = RunConfig().config_hash()
    validation = ["data.val_files=v.jsonl", "trainer.test_freq=2", "trainer.val_before_train=false",
                  "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.7", "rollout.val_kwargs.n=3"]
    assert apply_overrides(RunConfig(), validation).validate().config_hash() == base  # it trains the same
    assert apply_overrides(RunConfig(), ["custom_reward_function.path=r.py"]).config_hash() != base


def test_validation_is_due_every_test_freq_and_before_train_when_asked():
    due = lambda *o: [n for n in range(7) if apply_overrides(RunConfig(), list(o)).validation_due(n)]
    assert due("trainer.test_freq=3") == []  # no data.val_files: never
    assert due("data.val_files=v.jsonl", "trainer.test_freq=3") == [0, 3, 6]
    assert due("data.val_files=v.jsonl", "trainer.test_freq=3", "trainer.val_before_train=false") == [3, 6]
    assert due("data.val_files=v.jsonl", "trainer.val_before_train=false") == []  # test_freq=-1


def test_validation_metrics_follow_verl():
    from rlhf_core.trainer.metrics import validation_metrics

    out = validation_metrics(["a", "a", "a", "a", "b"], ["p", "p", "q", "q", "r"],
                             {"reward": [1.0, 0.0, 1.0, 1.0, 0.25], "acc": [1, 0, 1, 1, 0]})
    assert out["val-core/a/acc/mean@2"] == 0.75 and out["val-aux/a/reward/mean@2"] == 0.75
    assert out["val-aux/a/reward/std@2"] == 0.25  # mean over prompts of each prompt's std (0.5, 0)
    assert out["val-core/b/acc/mean@1"] == 0.0 and "val-aux/b/reward/std@1" not in out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_local):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))
    root = tmp_path_factory.mktemp("validation")
    (root / "reward.py").write_text(REWARD_FILE)
    with open(root / "val.jsonl", "w") as f:
        for row in make_rows(6, seed=99):
            f.write(json.dumps(row) + "\n")
    custom = [f"custom_reward_function.path={root / 'reward.py'}", "custom_reward_function.name=my_score"]
    out = {}
    # W&B offline (no key, no mode, no folder of the user's), TensorBoard under the run
    patch = pytest.MonkeyPatch()
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "TENSORBOARD_DIR", "MLFLOW_TRACKING_URI"):
        patch.delenv(key, raising=False)
    for name, extra in (("plain", []), ("val", [f"data.val_files={root / 'val.jsonl'}", "trainer.test_freq=2",
                                                   "trainer.log_val_generations=3",
                                                   "trainer.logger=['console','wandb','tensorboard']"])):
        cfg = apply_overrides(small_config(root / name / "out"), custom + extra).validate()
        out[name] = run_direct(cfg, 3, RunRef(f"file://{root / name / 'store'}", "r"), log=lambda *a: None)
        out[name]["store"] = root / name / "store"
    patch.undo()
    return out


def test_a_reward_from_a_file_scores(runs):
    rows = runs["plain"]["rows"]
    assert [r["critic/reward_extra/from_file/mean"] for r in rows] == [1.0, 1.0, 1.0]
    assert not any(k.startswith("val-") for r in rows for k in r)  # no data.val_files: no validation


def test_validation_is_logged_before_train_and_every_test_freq(runs):
    rows = runs["val"]["rows"]
    assert [VAL in r for r in rows] == [True, False, True]
    assert all(0.0 <= rows[n][VAL] <= 1.0 for n in (0, 2))
    assert rows[0]["val-aux/builtin/digits_reverse/from_file/mean@1"] == 1.0  # scored by the run's reward
    manifests = [json.loads((runs["val"]["store"] / "r" / f"iter-{n:06d}" / "MANIFEST.json").read_text())
                 for n in range(3)]
    assert ["validate" in m["snapshots"] for m in manifests] == [True, False, True]
    assert manifests[2]["metrics"][VAL] == rows[2][VAL]  # what the report, KFP Metrics and the driver read
    assert (runs["val"]["store"] / "r" / "iter-000002" / "validate" / "SNAPSHOT.json").exists()


def test_validation_does_not_change_training(runs):
    with_val = fingerprint(runs["val"]["store"], "r")
    assert any("/validate" in k for k in with_val)
    assert {k: v for k, v in with_val.items() if "/validate" not in k} == fingerprint(runs["plain"]["store"], "r")
    train = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("val-", "timing", "perf", "wall"))}
                          for r in rows]
    assert train(runs["val"]["rows"]) == train(runs["plain"]["rows"])


def test_the_validation_snapshot_replays_and_its_reward_file_needs_trust(runs):
    uri = f"file://{runs['val']['store']}/r"
    with pytest.raises(ReplayError, match="custom_reward_function.path"):
        replay(uri, stages=["validate"], iteration=2, log=lambda *a: None)
    [result] = replay(uri, stages=["validate"], iteration=2, log=lambda *a: None, trust_reward_function=True)
    assert result.stage == "validate" and result.ok, [d for d in result.diffs if not d.equal]


def test_the_report_shows_the_validation_curve(runs):
    from rlhf_core.trainer.report import markdown_report, run_history, validation_curve

    rows = run_history(IterationStore(RunRef(f"file://{runs['val']['store']}", "r")))
    assert [n for n, _ in validation_curve(rows)[VAL]] == [0, 2]
    assert f"| {VAL} (iteration 2) |" in markdown_report(IterationStore(RunRef(f"file://{runs['val']['store']}", "r")), samples=0)


def test_log_val_generations_shows_verls_pick_in_the_report_and_mlflow(runs, tmp_path, monkeypatch):
    """trainer.log_val_generations=3: three samples of the last validation, picked as verl
    picks them (sorted by prompt, shuffled by RandomState(42)), in the report and as an
    MLflow artifact of the iteration."""
    import mlflow
    import numpy as np

    from rlhf_core.record import tracking
    from rlhf_core.snapshot import load_snapshot
    from rlhf_core.trainer.report import markdown_report, validation_samples

    istore = IterationStore(RunRef(f"file://{runs['val']['store']}", "r"))
    batch = load_snapshot(istore.stage_uri(2, "validate"))
    rows = sorted(zip(batch.non_tensor_batch["raw_prompt"].tolist(), batch.non_tensor_batch["response_text"].tolist(),
                      batch.batch["token_level_scores"].sum(dim=-1).tolist()), key=lambda r: str(r[0]))
    np.random.RandomState(42).shuffle(rows)
    samples = validation_samples(istore, 2, 3)
    assert [(s["input"], s["output"], s["score"]) for s in samples] == [(str(p), str(r), v) for p, r, v in rows[:3]]
    assert validation_samples(istore, 1, 3) == []  # iteration 1 did not validate
    report = markdown_report(istore, samples=0)
    assert "Validation samples, iteration 2 (3, trainer.log_val_generations)" in report
    assert sum(line.startswith("| ") and line.endswith(f"| {s['score']:.2f} |") for line in report.splitlines()
               for s in samples) >= 3
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow_run = tracking.export_iteration("r", istore.read_manifest(2), samples)["mlflow"]
    logged = mlflow.artifacts.load_dict(
        f"{mlflow.MlflowClient().get_run(mlflow_run).info.artifact_uri}/val_generations/iter-000002.json")
    assert logged == {"step": 2, "samples": samples}
    # the validation metrics themselves, '@' renamed as verl's MLflow logger does (MLflow refuses it)
    [point] = mlflow.MlflowClient().get_metric_history(mlflow_run, VAL.replace("@", "_at_"))
    assert point.step == 2 and point.value == istore.read_manifest(2)["metrics"][VAL]


def test_the_run_wrote_its_metrics_to_wandb_offline_and_tensorboard(runs):
    """trainer.logger=['console','wandb','tensorboard'] (verl's syntax): an offline W&B run
    folder and TensorBoard event files under the run's output folder, each holding every
    iteration's metrics at step = iteration and the validation samples."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from wandb_records import history

    rows = runs["val"]["rows"]
    out = Path(runs["val"]["metrics"]).parent
    [wandb_file] = out.glob("wandb/offline-run-*-rlhf-r/run-rlhf-r.wandb")
    logged = history(wandb_file)
    assert [h["_step"] for h in logged] == [0, 1, 2]
    assert [h["critic/score/mean"] for h in logged] == pytest.approx([r["critic/score/mean"] for r in rows])
    assert logged[2][VAL] == pytest.approx(rows[2][VAL])
    assert logged[2]["val/generations/_type"] == "table-file" and logged[2]["val/generations/nrows"] == 3
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("critic/score/mean")] == [0, 1, 2]
    assert [e.value for e in events.Scalars(VAL)] == pytest.approx([rows[0][VAL], rows[2][VAL]])
    assert [e.step for e in events.Tensors("val/generations/text_summary")] == [0, 2]


def test_a_logger_here_or_its_package_missing_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from rlhf_core.config import ConfigError
    from rlhf_core.trainer.preflight import PreflightError, check_loggers

    cfg = apply_overrides(RunConfig(), ["trainer.logger=['console','wandb']"]).validate()
    assert cfg.trainer.logger == "console,wandb"
    with pytest.raises(ConfigError, match=r"trainer.logger: expected a list of console, mlflow, wandb, "
                                          r"tensorboard; found 'swanlab'"):
        apply_overrides(RunConfig(), ["trainer.logger=[console,swanlab]"]).validate()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(PreflightError, match=r"^trainer.logger lists wandb: expected the wandb package \(pip install "
                                             r"'rlhf-core\[trackers\]'\); found none installed$"):
        check_loggers(cfg)


class _Validating:
    """A KFP client whose every run commits its iteration at once, with a validation
    score rising by 0.25 per iteration (at the even ones: trainer.test_freq=2)."""

    def __init__(self, store: str) -> None:
        from rlhf_core.record.iteration_store import IterationStore

        self.istore, self.submitted = IterationStore(RunRef(store, "r")), []

    def run_pipeline(self, experiment_id, job_name, pipeline_package_path, params, enable_caching, **_):
        from types import SimpleNamespace

        n = len(self.istore.committed_iterations())
        self.submitted.append(n)
        metrics = {"critic/score/mean": 0.1, **({VAL: 0.25 * n} if n % 2 == 0 else {})}
        self.istore.commit_iteration(n, {"config_hash": "h", "code_version": {}, "data_cursor": {}, "checkpoint": "",
                                         "global_step": n + 1, "kl_coef": 0, "metrics": metrics, "config": {},
                                         "snapshots": {}, "weights": {"checkpoint": "", "checkpoint_step": 0,
                                                                       "redo": []}})
        return SimpleNamespace(run_id=f"kfp-{n}")

    def get_run(self, run_id):
        from types import SimpleNamespace

        return SimpleNamespace(state="SUCCEEDED")


def test_the_driver_stops_at_a_validation_score(tmp_path):
    from components.driver import Plan, drive

    store = f"file://{tmp_path / 'store'}"
    client = _Validating(store)
    outcome = drive(client, Plan("r", store, {"run_id": "r", "store": store}, iterations=10, stop_at_val=0.5,
                                 poll_s=0.1), "", "e", log=lambda *a: None)
    # iteration 2 validated at 0.5 (iterations 0 and 1 at 0.0 and none): no iteration 3
    assert client.submitted == [0, 1, 2] and outcome.reason == "validation score 0.500 reached 0.5"


def test_submit_passes_stop_at_val_to_the_finetune_pipeline():
    from types import SimpleNamespace

    from pipelines.remote import finetune_arguments

    target = SimpleNamespace(host="h", namespace="", experiment="e", service_account="s")
    assert finetune_arguments({}, target, iterations=3, stop_at_val=0.8)["stop_at_val"] == 0.8
    assert finetune_arguments({}, target, iterations=3)["stop_at_val"] == -1.0  # never
    compiled = (__import__("pathlib").Path(__file__).parents[1] / "pipelines" / "finetune.yaml").read_text()
    assert "stop_at_val" in compiled


def test_best_worst_and_majority_at_k_are_verls_bootstrap():
    """verl's best@k / worst@k / maj@k: per prompt, 1000 draws of k responses with
    replacement (numpy's generator seeded 42 for every draw), the max / min / majority
    answer's value of each, mean and std over the draws, then the mean over prompts."""
    import numpy as np

    from rlhf_core.trainer.metrics import bootstrap_sizes, validation_metrics

    assert bootstrap_sizes(1) == [] and bootstrap_sizes(2) == [2] and bootstrap_sizes(6) == [2, 4, 6]
    assert bootstrap_sizes(8) == [2, 4, 8]
    out = validation_metrics(["a"] * 4, ["p", "p", "q", "q"],
                             {"acc": [1.0, 0.0, 1.0, 1.0], "pred": ["4", "5", "4", "4"]})
    draws = np.random.RandomState(42).choice(2, size=(1000, 2), replace=True)
    best_p, worst_p = (draws == 0).any(axis=1), (draws == 0).all(axis=1)  # response 0 is the right one
    assert out["val-core/a/acc/best@2/mean"] == pytest.approx((best_p.mean() + 1.0) / 2)
    assert out["val-core/a/acc/best@2/std"] == pytest.approx(best_p.std() / 2)  # q's std is 0
    assert out["val-aux/a/acc/worst@2/mean"] == pytest.approx((worst_p.mean() + 1.0) / 2)
    # maj: the majority answer's first response; a tie goes to the answer drawn first
    first_is_right = draws[:, 0] == 0
    maj_p = np.where(draws[:, 0] == draws[:, 1], draws[:, 0] == 0, first_is_right)
    assert out["val-core/a/acc/maj@2/mean"] == pytest.approx((maj_p.mean() + 1.0) / 2)
    assert out["val-core/a/acc/mean@2"] == 0.75 and "val-aux/a/pred/mean@2" not in out
    assert not any("/pred/" in key for key in out)  # answers are voted on, not averaged
