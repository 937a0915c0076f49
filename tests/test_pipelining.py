"""Pipelined iterations, the parts that need no Ray: the checkpoint a controller announces in
its lease, what a starter reads from it, and how a run started ahead waits for the commit
of the iteration before it (the commit and the wait run at the same time)."""

import json
import threading
import time

from components.driver import Plan, pipelines_ahead
from rlhf_core.config import RunConfig
from rlhf_core.session.iteration import wait_for_commit
from rlhf_core.record.lease import IterationLeases, LeaseLog
from rlhf_core.record.checkpoints import announced_weights_checkpoint, checkpoint_plan
from rlhf_core.trainer.run import IterationCommit
from rlhf_core.record.iteration_store import IterationStore
from rlhf_core.record.run_layout import RunRef

#: what a manifest that wrote checkpoint "x" says of its weights
OWN_CHECKPOINT = {"checkpoint": "x", "weights": {"checkpoint": "x", "checkpoint_step": 1, "redo": []}}


def _istore(tmp_path, run_id="r"):
    return IterationStore(RunRef(f"file://{tmp_path}/store", run_id))


def test_a_controller_announces_the_checkpoint_it_will_write_and_writes_it_there(tmp_path):
    istore = _istore(tmp_path)
    cfg = RunConfig()
    leases = IterationLeases(istore, 900.0, plan_for=checkpoint_plan(cfg, istore))
    keeper = leases.take(0)
    try:
        announced = announced_weights_checkpoint(istore, 0, 900.0)
        assert announced and "/checkpoints/step-000001-" in announced
        assert keeper.log.renew(keeper.lease)  # a renewal says it again
        assert announced_weights_checkpoint(istore, 0, 900.0) == announced
        # the commit writes the checkpoint under that prefix
        assert IterationCommit(keeper=keeper).new_checkpoint_uri(istore, 1) == announced
        assert IterationCommit(keeper=keeper).new_checkpoint_uri(istore, 2) != announced  # not this lease's step
    finally:
        keeper.close()
    assert announced_weights_checkpoint(istore, 0, 900.0) is None  # released: nobody runs it


def test_a_retry_announces_a_prefix_of_its_own_and_a_dead_holder_announces_nothing(tmp_path):
    istore = _istore(tmp_path)
    plan = checkpoint_plan(RunConfig(), istore)
    log = istore.lease_log(0, 900.0)
    first = log.acquire("kfp:run/task", plan=plan(0))
    again = log.acquire("kfp:run/task", plan=plan(0))  # a KFP retry of the same task takes over at once
    assert first.plan["checkpoint"] != again.plan["checkpoint"]  # never two writers under one prefix
    assert announced_weights_checkpoint(istore, 0, 900.0) == again.plan["checkpoint"]
    latest = log.latest()
    record = {**latest[1], "process": {**latest[1]["process"], "pid": 2 ** 22 + 7, "started": "1"}}
    (tmp_path / "store" / "r" / "leases" / "iter-000000" / f"{latest[0] + 1:08d}.json").write_text(json.dumps(record))
    assert announced_weights_checkpoint(istore, 0, 900.0) is None  # that process is gone here


def test_an_iteration_without_a_checkpoint_announces_the_one_it_started_from(tmp_path):
    istore = _istore(tmp_path)
    cfg = RunConfig()
    cfg.trainer.checkpoint_every = 4
    plan = checkpoint_plan(cfg, istore)
    assert plan(0) == {"checkpoint": None} and plan(3)["checkpoint"].split("/")[-1].startswith("step-000004-")
    istore.lease_log(0, 900.0).acquire("local:me", plan=plan(0))
    assert announced_weights_checkpoint(istore, 0, 900.0) == ""  # the run has no checkpoint yet
    old = LeaseLog(istore.run, 1, 900.0)
    old.acquire("local:old-controller")  # a controller of an older version: no announcement
    assert announced_weights_checkpoint(istore, 1, 900.0) is None


def test_a_run_started_ahead_waits_for_the_commit_made_meanwhile(tmp_path):
    istore = _istore(tmp_path)
    keeper = IterationLeases(istore, 900.0).take(0)  # iteration 0's controller, live (this process)
    waited: dict = {}

    def follower():
        waited["ok"] = wait_for_commit(istore, 0, log=lambda *a: None, grace_s=0.2)
        waited["returned"] = time.monotonic()

    thread = threading.Thread(target=follower)
    thread.start()
    time.sleep(0.6)  # longer than the grace: a live holder is waited for, however long
    assert thread.is_alive()
    committing = time.monotonic()
    istore.commit_iteration(0, {**OWN_CHECKPOINT, "metrics": {}})
    keeper.close()
    thread.join(120)
    assert waited["ok"] is True and waited["returned"] >= committing  # it returned for the commit, not before


def test_a_run_started_ahead_of_an_iteration_nobody_runs_gives_up_after_the_grace(tmp_path):
    istore = _istore(tmp_path)
    keeper = IterationLeases(istore, 900.0).take(0)
    keeper.close()  # its controller ended without committing (it failed)
    t0 = time.monotonic()
    assert wait_for_commit(istore, 0, log=lambda *a: None, grace_s=0.3) is False
    assert time.monotonic() - t0 >= 0.3  # it gave the iteration its grace (and then gave up: it returned)


def test_the_driver_pipelines_only_when_the_count_alone_ends_the_run():
    plan = lambda **kw: Plan("r", "file:///s", {"cluster_policy": kw.pop("policy", "keep")}, iterations=5, **kw)
    assert pipelines_ahead(plan())
    assert not pipelines_ahead(plan(pipelined=False))
    assert not pipelines_ahead(plan(stop_at_reward=0.9))  # known only once the iteration before committed
    assert not pipelines_ahead(plan(stop_at_val=0.5))
    assert not pipelines_ahead(plan(budget_s=60.0))
    assert not pipelines_ahead(plan(policy="delete"))  # the cluster would go under the run started ahead


def test_a_stopping_driver_terminates_runs_started_ahead_that_have_not_begun(tmp_path):
    """The driver stops (SIGTERM, a reward target): a run started ahead that has not taken
    its iteration's lease is terminated; one that has begun its iteration finishes it, as
    the run under way did when one run ran at a time."""
    from components.driver import _cancel_waiting

    istore = _istore(tmp_path)
    istore.lease_log(2, 900.0).acquire("kfp:begun/run-iteration",  # begun: its lease is taken
                                       plan={"attempt": "driver:r/x/iteration-2/attempt-0"})

    class Client:
        terminated: list = []

        def terminate_run(self, run_id):
            self.terminated.append(run_id)

    inflight = {1: {"ahead": True, "kfp_run_id": "waiting", "name": "r iteration 000001",
                    "tag": "driver:r/x/iteration-1/attempt-0"},
                2: {"ahead": True, "kfp_run_id": "begun", "name": "r iteration 000002",
                    "tag": "driver:r/x/iteration-2/attempt-0"},
                0: {"ahead": False, "kfp_run_id": "current", "name": "r iteration 000000", "tag": "h0"}}
    client = Client()
    _cancel_waiting(client, istore, inflight, log=lambda *a: None)
    _cancel_waiting(client, istore, inflight, log=lambda *a: None)  # once each
    assert client.terminated == ["waiting"]


def test_a_freeze_point_stops_the_process_there_until_it_is_killed(tmp_path):
    """``RLHF_FREEZE_AT`` (what the kill tests use to hold a controller short of its commit):
    the process stops at the first matching point and runs nothing after it."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    after = tmp_path / "after"
    code = ("from rlhf_core.runtime import probes; probes.reached('stage:reward'); probes.reached('stage:advantage'); "
            f"open({str(after)!r}, 'w').close()")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RLHF_FREEZE_AT": "stage:adv*"})
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
        time.sleep(0.3)
        assert not after.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and not after.exists()
