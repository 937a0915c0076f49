"""The fine-tune driver, end to end without a Kubeflow server (none can run here): it
drives iterations through `pipelines.local.LocalKfpStandIn`, an honestly named stand-in of
the KFP API that executes each submitted run with the KFP local runner, so the iterations
really train (on this project's own local Ray head)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import frozen_in_session, status_of

from components.driver import Plan, drive, report_markdown
from pipelines.local import LocalKfpStandIn
from rlhf_core.runtime import ray_head
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef
from rlhf_core.config import RunConfig, apply_overrides, handover

SMALL = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    os.environ.setdefault("RLHF_CACHE", str(root / "cache"))
    yield root
    ray_head.stop_head(ray_head.read_head(root / "head"), root / "head")


@pytest.fixture
def standin(place):
    """A stand-in per call (``fail``: its fault points); each one's runner processes end
    with the test (they would otherwise wait on their input for the rest of the session)."""
    made = []

    def make(**kwargs):
        made.append(LocalKfpStandIn(str(place / "head"), str(place / "kfp"), **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def stop_session(place, run_id):
    """Each run's session holds the local head's CPUs: end it before the next run needs them."""
    subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stop-session", "--run-id", run_id, "--head-root",
                    str(place / "head")], capture_output=True, timeout=120, cwd=ROOT)


def plan_for(place, run_id, **kw):
    overrides = [*SMALL, f"trainer.output_dir={place / 'out'}"]
    store = f"file://{place / 'store'}"
    cfg = apply_overrides(RunConfig(), overrides).validate()
    return Plan(run_id, store, {"run_id": run_id, "store": store, **handover(cfg)}, poll_s=0.5, **kw)


def test_three_iterations_with_a_failed_one_retried_and_resumed(place, standin):
    """Pipelined (the default): iteration n+1's run is submitted while n's runs, named after
    the checkpoint n's controller announced. The second submission's controller is killed
    in its reward stage: its iteration is retried (resuming at the stage where it stopped),
    and a run started ahead of it that found it committed with another checkpoint stands
    down and is submitted again, without counting as a failure."""
    plan = plan_for(place, "drive3", iterations=3)
    standin = standin(fail={2: "stage:reward"})
    os.makedirs(place / "kfp", exist_ok=True)
    outcome = drive(standin, plan, "", "local", log=lambda *a: None)
    assert outcome.committed == [0, 1, 2] and outcome.reason == "3 of 3 iterations committed"
    store = place / "store" / "drive3"
    manifest = lambda n: json.loads((store / f"iter-{n:06d}" / "MANIFEST.json").read_text())
    by_id = {s["kfp_run_id"]: s for s in standin.submitted}
    committing = {r["iteration"]: by_id[r["kfp_run_id"]] for r in outcome.runs if r["committed"]}
    assert sorted(committing) == [0, 1, 2]
    # each committing run imported the checkpoint it continued from (the run's component
    # refuses any other; the first has none: its first controller writes the initial one)
    assert [committing[n]["params"]["parent_model"] for n in (0, 1, 2)] == [
        "", manifest(0)["checkpoint"], manifest(1)["checkpoint"]]
    # the killed attempt counted, and its retry committed; nothing else failed
    assert [(r["iteration"], r["attempt"]) for r in outcome.runs if r["state"] == "FAILED"] == [(1, 0)]
    assert committing[1]["name"] == "drive3 iteration 000001 retry 1" and committing[1]["fault"] is None
    # runs were started ahead of the iteration before them, each following the iteration
    # just before its own (which ones depends on when the driver's polls saw an announcement)
    ahead = [s for s in standin.submitted if "follows" in s["params"]]
    assert ahead and all(s["params"]["follows"] == int(s["name"].split()[2]) - 1 for s in ahead)
    # the session computes ahead after every iteration but the last
    assert all(s["params"]["prefetch_next"] == (s["name"].split()[2] != "000002") for s in standin.submitted)
    # the retry resumed: iteration 1's rollout was committed by the killed controller, not redone
    it1 = store / "iter-000001"
    writer = lambda stage: json.loads((it1 / stage / "SNAPSHOT.json").read_text())["writer"]["pid"]
    assert writer("rollout") != writer("update_actor")
    report = report_markdown(plan, outcome)
    assert "| 1 | 0 |" in report and "FAILED" in report and "reward curve" in report
    # driving it again to the same total does nothing
    again = drive(standin, plan, "", "local", log=lambda *a: None)
    assert again.runs == [] and again.committed == [0, 1, 2]
    stop_session(place, "drive3")


def test_one_run_at_a_time_when_asked(place, standin):
    """``Plan(pipelined=False)``: a run is submitted only once the one before it ended, each
    with the committed checkpoint it continues from."""
    plan = plan_for(place, "seq2", iterations=2, pipelined=False)
    standin = standin()
    outcome = drive(standin, plan, "", "local", log=lambda *a: None)
    assert outcome.committed == [0, 1]
    assert [s["name"] for s in standin.submitted] == ["seq2 iteration 000000", "seq2 iteration 000001"]
    assert all("follows" not in s["params"] for s in standin.submitted)
    manifest0 = json.loads((place / "store" / "seq2" / "iter-000000" / "MANIFEST.json").read_text())
    assert standin.submitted[1]["params"]["parent_model"] == manifest0["checkpoint"]
    stop_session(place, "seq2")


def test_budget_and_reward_target_end_the_loop(place, standin):
    os.makedirs(place / "kfp", exist_ok=True)
    standin = standin()
    spent = drive(standin, plan_for(place, "budget", iterations=50, budget_s=1.0), "", "local", log=lambda *a: None)
    assert spent.committed == [0] and "budget" in spent.reason
    # the reward target is the mean of the recent iterations' rewards: met at exactly the
    # reward reached, missed just above it (then the zero budget ends the loop, no run)
    reward = IterationStore(RunRef(plan_for(place, "budget").store, "budget")).read_manifest(0)["metrics"]["critic/score/mean"]
    met = drive(standin, plan_for(place, "budget", iterations=50, stop_at_reward=reward), "", "local",
                log=lambda *a: None)
    assert met.runs == [] and met.reason == f"mean reward {reward:.3f} of the last iterations reached {reward}"
    missed = drive(standin, plan_for(place, "budget", iterations=50, stop_at_reward=reward + 1e-6, budget_s=0.0),
                   "", "local", log=lambda *a: None)
    assert missed.runs == [] and "budget" in missed.reason and "reached" not in missed.reason
    stop_session(place, "budget")


def test_a_killed_driver_started_again_continues_from_the_committed_iteration(place):
    store = f"file://{place / 'store'}"
    argv = [sys.executable, "-m", "pipelines.local_finetune", "--run-id", "killed", "--store", store,
            "--head-root", str(place / "head"), "--root", str(place / "kfp-killed"), "--iterations", "2",
            *SMALL, f"trainer.output_dir={place / 'out'}"]
    first = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    istore = IterationStore(RunRef(store, "killed"))
    deadline = time.monotonic() + 600
    while not istore.committed_iterations():
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)  # the driver's pod is gone, with what it was running
    first.wait()
    second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert istore.committed_iterations() == [0, 1]
    assert "2 of 2 iterations committed" in second.stdout
    stop_session(place, "killed")


def test_a_driver_started_again_waits_out_the_child_run_its_predecessor_left_running(place):
    """The driver's pod dies, its child pipeline run does not: the driver started again
    (its pod retried) tags its runs anew and its child runs are KFP runs of their own (lease
    holders of their own), so it cannot take over the live
    child's lease; it waits until the child commits and goes on from there. One
    controller ran each iteration: every iteration's lease was acquired once."""
    store = f"file://{place / 'store'}"
    argv = [sys.executable, "-m", "pipelines.local_finetune", "--run-id", "orphan", "--store", store,
            "--head-root", str(place / "head"), "--root", str(place / "kfp-orphan"), "--iterations", "2",
            *SMALL, f"trainer.output_dir={place / 'out'}"]
    # the child run's controller stops itself once iteration 0's rollout is committed: it
    # holds the lease, alive, until the second driver has said it waits for it. (The first
    # driver submits one run at a time: pipelined, it would have submitted iteration 1's
    # run ahead by then, and the second driver would have nothing left to run itself.)
    first = subprocess.Popen([*argv[:3], "--no-pipelining", *argv[3:]], cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "RLHF_FREEZE_AT": "snapshot:*/iter-000000/rollout"})
    leases = place / "store" / "orphan" / "leases"
    try:
        frozen = [p for p in frozen_in_session(first.pid, first) if status_of(p) == psutil.STATUS_STOPPED]
        os.kill(first.pid, signal.SIGKILL)  # the driver only: its child run goes on
        first.wait()
        second = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = []
        for line in second.stdout:
            said.append(line)
            if "iteration 0 is being run by kfp:" in line:  # the child run's KFP task holds it
                break
        for proc in frozen:
            proc.resume()
        rest, _ = second.communicate(timeout=900)
        output = "".join(said) + rest
        assert second.returncode == 0, output[-5000:]
        assert "iteration 0 is being run by kfp:" in output
        assert IterationStore(RunRef(store, "orphan")).committed_iterations() == [0, 1]
        for iteration in (0, 1):
            records = [json.loads(p.read_text()) for p in sorted(leases.glob(f"iter-{iteration:06d}/*.json"))]
            acquired = [r["holder"] for r in records if r["state"] == "held" and r["token"] == records.index(r) + 1]
            assert len(acquired) == 1, records
        tags = {json.loads(p.read_text()).get("attempt", "") for p in leases.glob("iter-*/*.json")}
        assert len({t.split("/")[1] for t in tags if t.startswith("driver:orphan/")}) == 2  # two driver instances
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except OSError:
            pass
        stop_session(place, "orphan")
