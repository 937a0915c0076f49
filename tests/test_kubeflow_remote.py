"""`rlhf submit` / `rlhf schedule` against a recording stand-in for the KFP API server.

This is a request-shape test: it checks what we send (the compiled pipeline, its
parameters, the schedule) against the documented v2beta1 REST API, not that a real
Kubeflow server runs it (none can run here).
"""

import json
from pathlib import Path

import pytest

from kfp_recorder import Recorder

from rlhf_core.cli import main
from rlhf_core.config import RunConfig, apply_overrides, config_from_handover

ROOT = Path(__file__).resolve().parents[1]


def posted(rec, path):
    bodies = [r["body"] for r in rec.find("POST", path)]
    assert len(bodies) == 1, f"expected one POST {path}, got {len(bodies)}"
    return bodies[0]


def test_submit_posts_one_run_of_the_compiled_pipeline(capsys):
    with Recorder() as rec:
        assert main(["submit", "--host", rec.url, "--run-id", "nightly", "--store", "s3://models/runs",
                     "actor.lr=1e-5", "rollout.n=4"]) == 0
        experiment = posted(rec, "/apis/v2beta1/experiments")
        run = posted(rec, "/apis/v2beta1/runs")
    assert experiment["display_name"] == "rlhf"
    assert run["experiment_id"] == "exp-1" and run["display_name"] == "nightly-iteration"
    params = run["runtime_config"]["parameters"]
    assert {k: params[k] for k in ("run_id", "store", "cluster_policy")} == {
        "run_id": "nightly", "store": "s3://models/runs", "cluster_policy": "keep"}
    # the resolved config travels as data with its hash; the component rebuilds exactly it
    resolved = config_from_handover(params["config"], params["config_hash"])
    assert resolved.actor.lr == 1e-5 and resolved.rollout.n == 4
    assert resolved.config_hash() == apply_overrides(RunConfig(), ["actor.lr=1e-5", "rollout.n=4"]).config_hash()
    assert params["kube_spec"]["namespace"] == "rlhf" and params["kube_spec"]["object_store_secret"]
    assert run["service_account"] == "rlhf-pipeline"
    spec = run["pipeline_spec"]
    assert spec["pipeline_spec"]["pipelineInfo"]["name"] == "rlhf-ppo-iteration-kuberay"
    assert set(spec["pipeline_spec"]["root"]["dag"]["tasks"]) == {"exit-handler-1", "teardown-cluster"}
    assert "rlhf-object-store" in json.dumps(spec["platform_spec"])  # credentials from the secret
    assert "submitted: run run-1 (experiment exp-1)" in capsys.readouterr().out


def test_schedule_posts_a_recurring_run_that_never_overlaps(capsys):
    with Recorder() as rec:
        assert main(["schedule", "--host", rec.url, "--cron", "30 */6 * * *", "--run-id", "nightly",
                     "--store", "s3://models/runs", "--experiment", "fine-tunes", "--deployment",
                     str(ROOT / "manifests" / "configs" / "gpu.yaml"), "--cluster-policy", "delete-on-success"]) == 0
        job = posted(rec, "/apis/v2beta1/recurringruns")
    assert job["trigger"] == {"cron_schedule": {"cron": "0 30 */6 * * *"}}  # KFP cron has seconds first
    assert job["max_concurrency"] in (1, "1") and job["no_catchup"] is True and job["mode"] == "ENABLE"
    params = job["runtime_config"]["parameters"]
    assert params["run_id"] == "nightly" and params["cluster_policy"] == "delete-on-success"
    assert params["kube_spec"]["node_gpus"] == 8  # from the deployment file
    assert job["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "rlhf-ppo-iteration-kuberay"
    assert job["service_account"] == "rlhf-pipeline"
    assert "recurring run rr-1" in capsys.readouterr().out


@pytest.mark.parametrize("cron, message", [("*/5 * *", "expected 5 fields .* found 3"),
                                           ("0 2 * * mon;rm", "not cron syntax")])
def test_bad_cron_is_refused_before_any_request(cron, message):
    with Recorder() as rec:
        with pytest.raises(SystemExit, match=f"--cron: .*{message}"):
            main(["schedule", "--host", rec.url, "--cron", cron, "--run-id", "r", "--store", "s3://b/r"])
        assert not rec.find("POST", "/apis/v2beta1/recurringruns")


def test_bad_override_is_refused_before_any_request():
    with Recorder() as rec:
        with pytest.raises(SystemExit, match="actor.lrr"):
            main(["submit", "--host", rec.url, "--run-id", "r", "--store", "s3://b/r", "actor.lrr=1"])
        assert not rec.requests


def test_bad_run_id_and_pool_shape_are_refused_before_any_request(tmp_path):
    with Recorder() as rec:
        with pytest.raises(SystemExit, match="--run-id: expected 1-128 ASCII letters"):
            main(["submit", "--host", rec.url, "--run-id", "///", "--store", "s3://b/r"])
        with pytest.raises(SystemExit, match="unknown setting kubernetes.node_gpu"):
            bad = tmp_path / "d.yaml"
            bad.write_text("kubernetes: {node_gpu: 8}\n")
            main(["submit", "--host", rec.url, "--run-id", "r", "--store", "s3://b/r", "--deployment", str(bad)])
        assert not rec.requests


def test_submit_with_iterations_starts_the_fine_tune_driver(capsys):
    with Recorder() as rec:
        assert main(["submit", "--host", rec.url, "--run-id", "qwen", "--store", "s3://models/runs",
                     "--iterations", "300", "--stop-at-reward", "0.9", "actor.lr=1e-5"]) == 0
        run = posted(rec, "/apis/v2beta1/runs")
    assert run["display_name"] == "qwen fine-tune"
    assert run["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "rlhf-finetune"
    params = run["runtime_config"]["parameters"]
    assert params["iterations"] == 300 and params["more"] == 0 and params["stop_at_reward"] == 0.9
    assert config_from_handover(params["config"], params["config_hash"]).actor.lr == 1e-5
    assert params["kfp_host"] == rec.url
    assert "up to 300 iterations in all" in capsys.readouterr().out


def test_schedule_with_iterations_per_trigger_runs_the_driver_for_n_more(capsys):
    with Recorder() as rec:
        assert main(["schedule", "--host", rec.url, "--cron", "0 2 * * *", "--run-id", "nightly",
                     "--store", "s3://models/runs", "--iterations-per-trigger", "20"]) == 0
        job = posted(rec, "/apis/v2beta1/recurringruns")
    params = job["runtime_config"]["parameters"]
    assert params["more"] == 20 and params["iterations"] == 0
    assert job["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "rlhf-finetune"
    assert job["max_concurrency"] in (1, "1") and job["no_catchup"] is True
    assert "each trigger trains 20 more iteration(s)" in capsys.readouterr().out
    with Recorder() as rec:
        with pytest.raises(SystemExit, match="--iterations-per-trigger: expected a whole number >= 1"):
            main(["schedule", "--host", rec.url, "--cron", "0 2 * * *", "--run-id", "n", "--store", "s3://b/r",
                  "--iterations-per-trigger", "0"])
        assert not rec.requests
