"""The per-iteration Kubeflow pipeline: compiled YAML is current; a local run trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_yaml_matches_a_fresh_compile(tmp_path):
    sys.path.insert(0, str(ROOT))
    from pipelines.ppo_iteration import COMPILED, compile_pipeline

    fresh = compile_pipeline(tmp_path / "fresh.yaml").read_text()
    assert COMPILED.read_text() == fresh, "pipelines/ppo_iteration.yaml is stale: run `rlhf compile`"
    pipeline_spec, platform_spec = list(yaml.safe_load_all(fresh))  # KFP IR + kubernetes settings
    assert set(pipeline_spec["root"]["dag"]["tasks"]) == {"ensure-session", "run-iteration", "report"}
    assert "rlhf-object-store" in json.dumps(platform_spec)
    assert "rlhf-object-store" in fresh and "AWS_SECRET_ACCESS_KEY" in fresh
    assert "maxRetryCount: 2" in fresh and "nodeSelector" in fresh and "tolerations" in fresh


def test_rlhf_run_runs_iterations_as_local_pipeline_runs(tmp_path):
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rlhf_core.cli", "run", "--iterations", "2", "--run-id", "kfp",
             "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false",
             f"trainer.output_dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"snapshots: file://{out}/store/kfp" in proc.stdout
        store = out / "store" / "kfp"
        assert (store / "iter-000000" / "MANIFEST.json").exists() and (store / "iter-000001" / "MANIFEST.json").exists()
        manifest = json.loads((store / "iter-000001" / "MANIFEST.json").read_text())
        assert manifest["parent_iteration"] == 0 and manifest["checkpoint"].endswith("step-000002")
        reports = list((out / "kfp" / "kfp").rglob("summary"))
        assert reports and "reward curve" in reports[-1].read_text()
        assert (out / "kfp" / "reward_curve.png").stat().st_size > 0
        assert not (out / "head" / "ray-head.json").exists()  # the head it started is gone again
    finally:
        subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(out / "head")],
                       capture_output=True, timeout=120)
