"""Audit and replay: every stage of a committed iteration re-runs from its saved input and
matches exactly on CPU; a what-if replay is saved apart from the original; lineage walks
back to the start; the store can be listed and a sample shown."""

import json
import os
import re

import pytest

from rlhf_core.cli import main
from rlhf_core.config import ConfigError, apply_overrides
from rlhf_core.record.lineage import LineageError, chain, format_lineage
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot import snapshot_info
from rlhf_core.trainer.replay import ReplayError, replay
from rlhf_core.trainer.run import run_direct
from rlhf_core.record.run_layout import RunRef

from helpers import small_config

pytestmark = pytest.mark.usefixtures("ray_local")
# PPO with a critic and a reference model: every replayable stage exists
PPO = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "algorithm.rollout_correction.bypass_mode=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))
    root = tmp_path_factory.mktemp("audit")
    cfg = apply_overrides(small_config(root / "out"), PPO)
    # every committed iteration is also exported to MLflow (a file store here)
    mlflow_env = {"MLFLOW_TRACKING_URI": f"file://{root / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in mlflow_env.items():
            patch.setenv(key, value)
        run_direct(cfg, 1, RunRef(f"file://{root / 'store'}", "audit"), log=lambda *a: None)
        run_direct(cfg, 1, RunRef(f"file://{root / 'store'}", "audit"), log=lambda *a: None)  # a second process would do the same
    RUN_ENV.update(mlflow_env)
    return f"file://{root / 'store'}/audit"


RUN_ENV: dict = {}


def test_iterations_are_exported_to_mlflow(run, monkeypatch):
    import mlflow

    for key, value in RUN_ENV.items():
        monkeypatch.setenv(key, value)
    client = mlflow.MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("rlhf").experiment_id],
                                  filter_string="tags.`rlhf.run_id` = 'audit'")
    history = client.get_metric_history(found.info.run_id, "critic/score/mean")
    assert [m.step for m in history] == [0, 1]  # both iterations, one MLflow run
    assert found.data.params["algorithm.adv_estimator"] == "gae"
    assert re.search(r"/checkpoints/step-000002-[0-9a-f]+$", found.data.tags["rlhf.last_checkpoint"])
    lineage = mlflow.artifacts.load_dict(f"{found.info.artifact_uri}/lineage/iter-000001.json")
    assert lineage["parent_iteration"] == 0 and lineage["config_hash"] == found.data.tags["rlhf.config_hash"]


def test_every_stage_replays_exactly(run):
    results = replay(f"{run}/iter-000001", log=lambda *a: None)
    # stateless stages first, then the updates
    assert [r.stage for r in results] == ["rollout", "reward", "old_log_prob", "ref_log_prob", "values",
                                          "advantage", "update_critic", "update_actor"]
    for r in results:
        assert r.ok, (r.stage, [d for d in r.diffs if not d.equal], r.weights)
        assert r.diffs and all(d.max_abs == 0 for d in r.diffs)
    weights = {r.stage: r.weights for r in results if r.weights}
    assert set(weights) == {"update_critic", "update_actor"}
    assert all(a == b for w in weights.values() for a, b in w.values())


def test_replay_with_an_override_is_saved_apart_and_differs(run, capsys):
    original = snapshot_info(f"{run}/iter-000001/update_actor")
    rc = main(["replay", f"{run}/iter-000001/update_actor", "--override", "actor.clip_ratio_high=0.01",
               "--override", "actor.clip_ratio_low=0.01"])
    out = capsys.readouterr().out
    assert rc == 0 and "DIFFERS" in out and "actor/__0_0.distcp" in out
    saved = out.split("saved as ")[1].split()[0]
    assert "/replays/iter-000001/update_actor-" in saved
    info = snapshot_info(saved)
    assert info.annotations["replay_of"].endswith("iter-000001/update_actor")
    assert info.annotations["overrides"] == ["actor.clip_ratio_high=0.01", "actor.clip_ratio_low=0.01"]
    assert snapshot_info(f"{run}/iter-000001/update_actor").manifest_sha256 == original.manifest_sha256


def test_replay_cli_exit_code_and_table(run, capsys):
    assert main(["replay", run, "--iteration", "0", "--stage", "reward", "--stage", "advantage"]) == 0
    out = capsys.readouterr().out
    assert "replayed 2 stage(s): 2 within tolerance" in out


def test_bad_replays_are_refused_with_the_reason(run):
    with pytest.raises(ReplayError, match=r"iteration 5 of run audit .* is not committed .*; committed: \[0, 1\]"):
        replay(f"{run}/iter-000005", log=lambda *a: None)
    with pytest.raises(ReplayError, match=r"stage 'weight_syncc' cannot be replayed .* its stages are \['rollout'"):
        replay(f"{run}/iter-000001", stages=["weight_syncc"], log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"another model layout; a replay cannot change model.dtype: 'float32' -> "
                                          r"'bfloat16'"):
        replay(f"{run}/iter-000001", stages=["reward"], overrides=["model.dtype=bfloat16", "model.train_in_16bit=true"],
               log=lambda *a: None)
    with pytest.raises(SystemExit, match="is not committed"):
        main(["replay", f"{run}/iter-000009"])


def test_lineage_walks_back_from_a_checkpoint(run, capsys):
    checkpoint = json.loads(sfs.read_bytes(sfs.resolve(f"{run}/iter-000001/MANIFEST.json")))["checkpoint"]
    assert re.search(r"/checkpoints/step-000002-[0-9a-f]+$", checkpoint)
    rows = chain(checkpoint)
    assert [r["iteration"] for r in rows] == [1, 0] and rows[0]["parent_iteration"] == 0
    assert rows[0]["config"]["algorithm"]["adv_estimator"] == "gae" and rows[0]["code_version"]["source_sha256"]
    assert [r["iteration"] for r in chain(f"{run}/iter-000001/advantage")] == [1, 0]
    assert "it1 -> it0 [label=parent]" in format_lineage(rows, "dot")
    assert json.loads(format_lineage(rows, "json"))[1]["iteration"] == 0
    assert main(["lineage", run]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["iter", "parent", "config"] and "step-000002" in table
    with pytest.raises(LineageError, match="starting checkpoint"):
        chain(f"{run}/checkpoints/step-000000")


def test_snapshots_ls_and_show(run, capsys):
    assert main(["snapshots", "ls", run]) == 0
    listing = capsys.readouterr().out
    assert "iter-000001/update_actor" in listing and "committed" in listing
    assert [line.split()[1] for line in listing.splitlines() if line.startswith("iter-00000") and
            len(line.split()) == 2] == ["committed", "committed"]  # the per-iteration lines
    assert main(["snapshots", "show", f"{run}/iter-000000/advantage"]) == 0
    shown = capsys.readouterr().out
    assert "prompts: '<bos>" in shown and "advantages: sum" in shown
    read, total = map(int, shown.split("read ")[1].split(" fields")[0].split(" of "))
    assert read < total  # only what it shows
    uid = shown.split("uid ")[1].split(",")[0]
    assert main(["snapshots", "show", f"{run}/iter-000000/rollout", "--uid", uid, "--fields", "responses"]) == 0
    one = capsys.readouterr().out
    assert f"uid {uid}, 4 row(s)" in one and "read 3 of" in one and "advantages" not in one
    with pytest.raises(SystemExit, match="has no field"):
        main(["snapshots", "show", f"{run}/iter-000000/reward", "--fields", "advantages"])


def test_a_record_that_does_not_reproduce_fails_with_the_worst_rows(run, tmp_path, capsys):
    import shutil

    from rlhf_core.snapshot import load_snapshot, save_snapshot

    src = run[len("file://"):]
    shutil.copytree(src, tmp_path / "audit")
    stage = tmp_path / "audit" / "iter-000001" / "reward"
    batch = load_snapshot(f"file://{stage}")
    batch.batch["token_level_scores"][3] += 0.5  # as if the reward had been computed differently
    shutil.rmtree(stage)
    save_snapshot(batch, f"file://{stage}")
    rc = main(["replay", f"file://{tmp_path / 'audit'}/iter-000001/reward"])
    out = capsys.readouterr().out
    assert rc == 1
    (row,) = [line for line in out.splitlines() if "token_level_scores" in line]
    assert "DIFFERS" in row and "0.5" in row and str(batch.non_tensor_batch["uid"][3]) in row
