"""The per-iteration Kubeflow pipeline: compiled YAML is current; a local run trains."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import frozen_in_session, in_session, names_nothing, still_alive, uris_naming_nothing

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_yaml_matches_a_fresh_compile(tmp_path):
    from pipelines.ppo_iteration import COMPILED, COMPILED_FINETUNE, COMPILED_KUBERAY, COMPILED_RM_FINETUNE, compile_all

    compile_all(tmp_path)
    for driver_pipeline in (COMPILED_FINETUNE, COMPILED_RM_FINETUNE):
        assert (tmp_path / driver_pipeline.name).read_text() == driver_pipeline.read_text(), \
            f"pipelines/{driver_pipeline.name} is stale: run `rlhf compile`"
    driver = list(yaml.safe_load_all(COMPILED_FINETUNE.read_text()))[0]
    assert set(driver["root"]["dag"]["tasks"]) == {"drive-finetune"}
    assert {"iterations", "more", "stop_at_reward", "budget_s", "kube_spec"} <= set(
        driver["root"]["inputDefinitions"]["parameters"])
    for checked_in in (COMPILED, COMPILED_KUBERAY):
        fresh = (tmp_path / checked_in.name).read_text()
        assert checked_in.read_text() == fresh, f"pipelines/{checked_in.name} is stale: run `rlhf compile`"
        pipeline_spec, platform_spec = list(yaml.safe_load_all(fresh))  # KFP IR + kubernetes settings
        assert "rlhf-object-store" in json.dumps(platform_spec) and "AWS_SECRET_ACCESS_KEY" in fresh
        assert "maxRetryCount: 2" in fresh and "nodeSelector" in fresh and "tolerations" in fresh
        assert "resourceMemoryLimit: 16G" in fresh  # the controller's limit
    local = yaml.safe_load_all(COMPILED.read_text()).__next__()
    assert set(local["root"]["dag"]["tasks"]) == {"condition-branches-1"}  # the controller writes the report
    branches = {name: set(c["dag"]["tasks"]) for name, c in local["components"].items() if "dag" in c}
    # with a parent checkpoint the run imports it (KFP lineage links it to the run that
    # wrote it); without one (a run started by hand) the controller runs alone
    assert branches["comp-condition-2"] == {"importer", "run-iteration"}
    assert branches["comp-condition-3"] == {"run-iteration-2"}
    importer = local["deploymentSpec"]["executors"]["exec-importer"]["importer"]
    assert importer["typeSchema"]["schemaTitle"] == "system.Model" and not importer.get("reimport")
    assert importer["artifactUri"] == {"runtimeParameter": "uri"}
    assert {"parent_model", "prefetch_next"} <= set(local["root"]["inputDefinitions"]["parameters"])


def test_a_parent_model_the_run_has_moved_past_is_refused(tmp_path):
    """The iteration run's parent checkpoint must be the one the run continues from: a
    submitter that looked at the store before another iteration committed gets a one-line
    error naming the field, and nothing is trained."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.local", "--run-id", "r", "--store",
                           f"file://{tmp_path / 'store'}", "--head-root", str(tmp_path / "no-head"), "--root",
                           str(tmp_path / "kfp"), "--parent-model", f"file://{tmp_path}/store/r/checkpoints/step-000007"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    expected = f"parent_model: expected the checkpoint run r continues from, none yet (its initial checkpoint " \
               f"is not written); found file://{tmp_path}/store/r/checkpoints/step-000007"
    assert expected in proc.stdout + proc.stderr
    assert not (tmp_path / "store" / "r" / "iter-000000").exists()


def test_kuberay_pipeline_launches_per_run_and_tears_down_in_an_exit_handler():
    from pipelines.ppo_iteration import COMPILED_KUBERAY

    text = COMPILED_KUBERAY.read_text()
    spec, platform = list(yaml.safe_load_all(text))
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "teardown-cluster"}
    assert root["teardown-cluster"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(inner) == {"launch-cluster", "condition-branches-2"}
    assert set(spec["components"]["comp-condition-3"]["dag"]["tasks"]) == {"importer", "run-iteration"}
    # the cluster name is computed from the run-time run_id inside the components, never
    # fixed at compile time (two runs of this YAML with different run ids get two clusters)
    launch = inner["launch-cluster"]["inputs"]["parameters"]
    assert launch["run_id"] == {"componentInputParameter": "pipelinechannel--run_id"}
    assert "rlhf-demo" not in text and "cluster_name(run_id)" in text
    # the controllers read their run's own token, from the secret launch_cluster names
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tokens = [s for e in executors.values() for s in e.get("secretAsEnv", [])
              if any(k["envVar"] == "RAY_AUTH_TOKEN" for k in s["keyToEnv"])]
    assert tokens and all(s["secretNameParameter"] == {"componentInputParameter":
                                                       "pipelinechannel--launch-cluster-token_secret"} for s in tokens)
    assert "rlhf-ray-token" not in json.dumps(platform)


def test_rlhf_run_runs_iterations_as_local_pipeline_runs(tmp_path):
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "rlhf_core.cli", "run", "--iterations", "3", "--run-id", "kfp",
             "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false",
             "trainer.checkpoint_every=2", f"trainer.output_dir={out}"], cwd=tmp_path, capture_output=True, text=True,
            timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"snapshots: file://{out}/store/kfp" in proc.stdout
        store = out / "store" / "kfp"
        manifests = [json.loads((store / f"iter-00000{n}" / "MANIFEST.json").read_text()) for n in range(3)]
        # checkpoint_every=2: iteration 1 writes step 2's checkpoint; 0 and 2 write none and say so
        assert manifests[1]["parent_iteration"] == 0 and "/checkpoints/step-000002-" in manifests[1]["checkpoint"]
        assert manifests[0]["checkpoint"] is None and manifests[2]["checkpoint"] is None
        assert manifests[2]["weights"] == {"checkpoint": manifests[1]["checkpoint"], "checkpoint_step": 2, "redo": [2]}
        # pipelined: each run after the first started before the one before it committed,
        # with the checkpoint that one's controller announced (and then wrote) as its parent
        import datetime

        started = sorted(datetime.datetime.strptime(p.name[len("rlhf-ppo-iteration-"):], "%Y-%m-%d-%H-%M-%S-%f")
                         .timestamp() for p in (out / "kfp" / "kfp").iterdir() if p.is_dir())
        assert len(started) == 3 and started[1] < (store / "iter-000000" / "MANIFEST.json").stat().st_mtime
        announced = json.loads(sorted((store / "leases" / "iter-000001").iterdir())[0].read_text())["checkpoint"]
        assert announced == manifests[1]["checkpoint"]
        # every URI the manifests, the lineage and the runs' Model artifacts name is there;
        # each Model artifact names the checkpoint its iteration's weights come from
        assert not uris_naming_nothing(f"file://{out}/store", "kfp")
        models = {}
        for output in (out / "kfp" / "kfp").rglob("executor_output.json"):
            for artifact in json.loads(output.read_text()).get("artifacts", {}).get("model", {}).get("artifacts", []):
                models[int(artifact["metadata"]["iteration"])] = artifact
        assert sorted(models) == [0, 1, 2], models
        for n, artifact in models.items():
            assert artifact["uri"] == manifests[n]["weights"]["checkpoint"] and not names_nothing(artifact["uri"])
            assert artifact["metadata"]["redo_iterations"] == manifests[n]["weights"]["redo"]
        reports = list((out / "kfp" / "kfp").rglob("summary"))
        assert reports and "reward curve" in reports[-1].read_text()
        assert (out / "kfp" / "reward_curve.png").stat().st_size > 0
        assert not (out / "head" / "ray-head.json").exists()  # the head it started is gone again
    finally:
        subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(out / "head")],
                       capture_output=True, timeout=120)


def _pipeline_run(out: Path, run_id: str, env: dict, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "rlhf_core.cli", "run", "--iterations", "2", "--run-id", run_id, *SMALL,
         f"trainer.output_dir={out}"], cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, **popen)


def _rollout_committed(out: Path, proc, timeout_s: float = 600) -> bool:
    """Wait until iteration 0's rollout snapshot of run r is committed (or ``proc`` ends)."""
    import time

    rollout = out / "store" / "r" / "iter-000000" / "rollout" / "SNAPSHOT.json"
    deadline = time.monotonic() + timeout_s
    while not rollout.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return rollout.exists()


SMALL = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false"]


def test_a_pipeline_mode_run_killed_in_its_first_iteration_resumes_at_once_and_bit_identical(tmp_path):
    """`rlhf run` SIGKILLed with its whole process group while iteration 0's controller runs
    (a stage committed, the lease held by the dead controller): the same command again
    takes the dead controller's lease over at once (it can see the process is gone: no
    waiting out the TTL), resumes at the next stage and ends with the same bytes as a run
    nobody interrupted."""
    import signal

    from tests.helpers import fingerprint

    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run([sys.executable, "-m", "rlhf_core.cli", "run", "--direct", "--iterations", "2", "--run-id", "r",
                    *SMALL, f"trainer.output_dir={ref}"], cwd=tmp_path, env=env, check=True, capture_output=True,
                   timeout=600)
    # iteration 0's controller freezes once its rollout and reward are committed: however
    # fast the rest of the iteration would run, the kill lands before its commit
    first = _pipeline_run(out, "r", {**env, "RLHF_FREEZE_AT": "stage:advantage"}, start_new_session=True)
    try:
        started = frozen_in_session(first.pid, first)
        os.killpg(first.pid, signal.SIGKILL)  # the command, the local runner and the controller
        assert still_alive(started) == []  # all of them dead before the command runs again
        assert not (out / "store" / "r" / "iter-000000" / "MANIFEST.json").exists()
        again = _pipeline_run(out, "r", env)
        stdout, stderr = again.communicate(timeout=900)
        assert again.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "being run by" not in stdout + stderr  # nobody waited for the dead controller
        assert fingerprint(out / "store", "r") == fingerprint(ref / "store", "r")
    finally:
        for root in (out / "head", ref / "head"):
            subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(root)],
                           capture_output=True, timeout=120)


@pytest.mark.parametrize("mode", ["pipelined", "one-at-a-time", "direct"])
def test_sigterm_to_the_command_alone_ends_everything_it_started(tmp_path, mode):
    """``kill PID`` (SIGTERM to `rlhf run` only, as a container stop or a scheduler sends it):
    the command ends with exit code 143 and the one line that says how to continue, and no
    process it started lives on: not the runners, not the components, not a controller
    frozen short of its commit (it would hold the iteration's lease), not its Ray head nor
    a direct run's own Ray. The same command then finishes the run without waiting for
    anybody."""
    import signal

    import psutil

    from rlhf_core.runtime import ray_head

    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "out"
    extra = {"pipelined": [], "one-at-a-time": ["--no-pipelining"], "direct": ["--direct"]}[mode]
    # a pipeline run's controller is frozen short of its commit; a direct run is the process
    # signalled, so it runs on (and may commit iteration 0 before the signal lands)
    freeze = {} if mode == "direct" else {"RLHF_FREEZE_AT": "stage:advantage"}
    first = subprocess.Popen(
        [sys.executable, "-m", "rlhf_core.cli", "run", *extra, "--iterations", "2", "--run-id", "r", *SMALL,
         f"trainer.output_dir={out}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env, **freeze}, start_new_session=True)
    try:
        if mode == "direct":
            assert _rollout_committed(out, first), first.communicate(timeout=60)
        else:
            frozen_in_session(first.pid, first)
        started = [p for p in psutil.process_iter() if in_session(p, first.pid) and p.pid != first.pid]
        assert started  # the runner(s) and the component, or the direct run's Ray
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=120)
        assert first.returncode == 143, stdout[-2000:] + stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        kept = "[01]" if mode == "direct" else "0"
        assert re.match(rf"rlhf: terminated; run r keeps {kept} committed iteration\(s\)", last), last
        if mode != "direct":
            assert "and iteration 0's finished stages (rollout" in last, last
        assert "Traceback" not in stdout + stderr
        assert still_alive(started) == []
        assert ray_head.read_head(out / "head") is None  # the head it started is stopped
        again = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "run", *extra, "--iterations", "2",
                                "--run-id", "r", *SMALL, f"trainer.output_dir={out}"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        assert "being run by" not in again.stdout + again.stderr
        assert (out / "store" / "r" / "iter-000001" / "MANIFEST.json").exists()
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except OSError:
            pass
        subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(out / "head")],
                       capture_output=True, timeout=120)


def test_ctrl_c_in_the_first_iteration_ends_in_one_line_that_says_how_to_continue(tmp_path):
    """SIGINT to the foreground group (Ctrl-C) while iteration 0 runs: `rlhf run` ends with
    exit code 130 and one line saying what the store kept and the command that continues;
    no traceback, no dump of the runner's output. That command finishes the run."""
    import shlex
    import signal

    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "out"
    # iteration 0's controller stops itself short of its commit; the Ctrl-C reaches every
    # process of the group, the frozen one as it goes on
    # SIGINT as a terminal's foreground job has it: a test run in the background (CI, `&`)
    # starts with SIGINT ignored, which its children would inherit (and then Python never
    # raises KeyboardInterrupt)
    first = _pipeline_run(out, "r", {**env, "RLHF_FREEZE_AT": "stage:advantage"}, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        started = frozen_in_session(first.pid, first)
        os.killpg(first.pid, signal.SIGINT)
        os.killpg(first.pid, signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=300)
        assert first.returncode == 130, stdout[-2000:] + stderr[-3000:]
        assert "Traceback" not in stdout + stderr and "the pipeline run failed" not in stdout + stderr
        last = stderr.strip().splitlines()[-1]
        assert re.match(r"rlhf: interrupted; run r keeps 0 committed iteration\(s\) and iteration 0's "
                        r"finished stages \(rollout, reward[a-z_, ]*\); continue with: rlhf run ", last), last
        assert still_alive(started) == []
        command = last.split("continue with: ", 1)[1]
        argv = shlex.split(command)
        assert argv[:6] == ["rlhf", "run", "--run-id", "r", "--iterations", "2"], command
        again = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *argv[1:]], cwd=out.parent, env=env,
                               capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        assert (out / "store" / "r" / "iter-000001" / "MANIFEST.json").exists()
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except OSError:
            pass
        subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(out / "head")],
                       capture_output=True, timeout=120)


def test_a_failed_pipeline_run_ends_rlhf_run_in_one_line_and_the_same_command_resumes_it(tmp_path):
    """rlhf run's pipeline runs are scheduled by the fine-tune driver with one attempt per
    iteration: a run whose controller dies mid-iteration ends the command (exit code 1, one
    line naming the iteration and the log, the log's end shown); the same command then
    resumes the iteration at the stage where it stopped and commits it."""
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "rlhf_core.cli", "run", "--iterations", "1", "--run-id", "r", *SMALL,
            f"trainer.output_dir={out}"]
    try:
        failed = subprocess.run(argv, cwd=tmp_path, env={**env, "RLHF_KILL_AT": "stage:reward"}, capture_output=True,
                                text=True, timeout=900)
        assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-3000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert re.match(r"rlhf: run r: iteration 0 failed 1 times \(max_retries=0\); see its runs: .*; see "
                        rf"{re.escape(str(out))}/r/pipeline-runs.log$", last), last
        assert "the end of" in failed.stderr and "Traceback" not in last
        rollout = out / "store" / "r" / "iter-000000" / "rollout" / "SNAPSHOT.json"
        assert rollout.exists() and not (out / "store" / "r" / "iter-000000" / "MANIFEST.json").exists()
        again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        manifest = json.loads((out / "store" / "r" / "iter-000000" / "MANIFEST.json").read_text())
        assert json.loads(rollout.read_text())["writer"]["pid"] != json.loads(
            (out / "store" / "r" / "iter-000000" / "update_actor" / "SNAPSHOT.json").read_text())["writer"]["pid"]
        assert manifest["iteration"] == 0  # resumed: the rollout the failed run committed was kept
    finally:
        subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(out / "head")],
                       capture_output=True, timeout=120)
