"""Iteration leases under the failures pods have: contenders run at the same time (threads
that start together), on local disk and on a real S3 server. In every case exactly one
controller commits, and the commit names the lease token it held."""

import json
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.record import lease as lease_module
from rlhf_core.record.lease import CLOCK_SKEW_MARGIN_S, Lease, LeaseKeeper, LeaseLog, LeaseLost
from rlhf_core.record.run_layout import RunRef


@pytest.fixture(params=["local", "s3"])
def run(request, tmp_path):
    if request.param == "local":
        return sfs.resolve(str(tmp_path / "run"))
    server = request.getfixturevalue("s3_server")
    return sfs.resolve(f"s3://{server.bucket}/{uuid.uuid4().hex}/run", server.storage_options)


def controller(run, holder: str, ttl_s: float, work_s: float, barrier, outcome: dict) -> None:
    """What a controller does with an iteration: lease, work, check, commit."""
    log = LeaseLog(run, 0, ttl_s)
    barrier.wait()
    lease = log.acquire(holder)
    if not isinstance(lease, Lease):
        outcome[holder] = f"held by {lease}"
        return
    if sfs.read_bytes(run.child("iter-000000", "MANIFEST.json")) is not None:
        outcome[holder] = "already committed"  # the lease was released after a commit: nothing to do
        log.release(lease)
        return
    keeper = LeaseKeeper(log, lease)
    try:
        time.sleep(work_s)
        keeper.check()  # before the checkpoint ...
        keeper.check()  # ... and before the commit
        sfs.put_create_only(run.child("iter-000000", "MANIFEST.json"),
                            json.dumps({"holder": holder, "token": lease.token}).encode())
        outcome[holder] = "committed"
    except (LeaseLost, SnapshotExistsError) as exc:
        outcome[holder] = type(exc).__name__
    finally:
        keeper.close()


def race(run, holders, ttl_s=30.0, work_s=0.2):
    barrier = threading.Barrier(len(holders))
    outcome: dict = {}
    threads = [threading.Thread(target=controller, args=(run, h, ttl_s, work_s, barrier, outcome)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a contender did not finish"
    assert sorted(outcome) == sorted(holders), outcome  # every contender reported how it ended
    return outcome


def committed(run) -> dict:
    return json.loads(sfs.read_bytes(run.child("iter-000000", "MANIFEST.json")))


def test_controllers_racing_for_one_iteration_commit_once(run):
    holders = [f"kfp:run-{i}/run-iteration" for i in range(6)]
    outcome = race(run, holders)
    winners = [h for h, o in outcome.items() if o == "committed"]
    assert len(winners) == 1, outcome
    assert all(o.startswith("held by") or o == "already committed" for h, o in outcome.items()
               if h not in winners), outcome
    assert committed(run)["holder"] == winners[0]


def test_a_live_holder_slower_than_the_ttl_keeps_its_lease(run):
    """Renewal runs in the background, independent of how long the work takes: the
    holder keeps the lease through three renewals (more than a TTL of "work"), and a
    contender asking right after each renewal is refused."""
    ttl = 3.0
    log = LeaseLog(run, 0, ttl)
    slow = log.acquire("kfp:slow/run-iteration")
    keeper = LeaseKeeper(log, slow)
    try:
        generation, started = log.latest()[0], time.monotonic()
        for _ in range(3):
            deadline = time.monotonic() + 60
            while log.latest()[0] == generation and time.monotonic() < deadline:
                time.sleep(0.05)
            assert log.latest()[0] > generation, "the keeper did not renew"
            generation = log.latest()[0]
            assert log.acquire("kfp:eager/run-iteration") == "kfp:slow/run-iteration"
        assert time.monotonic() - started > ttl  # the work outlived one TTL
        keeper.check()
    finally:
        keeper.close()


def _ahead_while_latest_is(log, token: int, seconds: float):
    """``store_now`` for the lease module: ``seconds`` ahead of the store's clock while the
    log's newest record is generation ``token`` (a dead holder's), the store's own after:
    the dead record is that old, every record written since is fresh."""
    real = lease_module.store_now

    def now(folder):
        latest = log.latest()
        return real(folder) + (seconds if latest is not None and latest[0] == token else 0.0)
    return now


def test_a_holder_that_died_on_another_host_is_taken_over_after_the_ttl(run, monkeypatch):
    monkeypatch.setattr(lease_module, "CLOCK_SKEW_MARGIN_S", 0.0)  # the margin has its own test below
    dead = LeaseLog(run, 0, ttl_s=900).acquire("local:another-host:4242")  # it never renews: that host is gone
    assert isinstance(dead, Lease)
    assert LeaseLog(run, 0, ttl_s=900).acquire("local:this-host-b:1") == "local:another-host:4242"  # fresh: not yet
    # the contenders come when the dead record is 1000 s old by the store's clock (no sleep)
    monkeypatch.setattr(lease_module, "store_now", _ahead_while_latest_is(LeaseLog(run, 0, 900), dead.token, 1000.0))
    outcome = race(run, ["kfp:a/run-iteration", "kfp:b/run-iteration"], ttl_s=900)
    assert sorted(outcome.values())[0] in ("already committed", "committed") and \
        list(outcome.values()).count("committed") == 1, outcome
    assert committed(run)["token"] > dead.token


def test_lease_ages_are_the_stores_and_no_clock_of_a_writer_counts(run, monkeypatch):
    """Issue 39 item 10: a record's age is the store's stamp against the store's clock. A
    holder whose own clock is hours behind (or ahead) keeps its lease, and what a record
    says of its own time ("at") is not believed either way."""
    ttl, real = 30.0, time.time
    monkeypatch.setattr(lease_module, "time", SimpleNamespace(time=lambda: real() - 10 * 3600))
    behind = LeaseLog(run, 0, ttl).acquire("kfp:behind/run-iteration")
    monkeypatch.setattr(lease_module, "time", SimpleNamespace(time=lambda: real() + 10 * 3600))
    assert isinstance(behind, Lease)
    assert LeaseLog(run, 0, ttl).acquire("kfp:ahead/run-iteration") == "kfp:behind/run-iteration"
    monkeypatch.setattr(lease_module, "time", time)
    log = LeaseLog(run, 1, ttl)
    for generation, at in ((1, 0.0), (2, real() + 10 * 365 * 86400)):  # dated 1970, then ten years ahead
        sfs.put_create_only(log.folder.child(lease_module.run_layout.lease_record(generation)),
                            json.dumps({"holder": "kfp:live/x", "token": 1, "state": "held", "at": at,
                                        "process": None}).encode())
        assert log.acquire("kfp:other/run-iteration") == "kfp:live/x"  # just written: live, whatever it says
    # a record the store stamped longer ago than TTL + margin is stale
    monkeypatch.setattr(lease_module, "store_now", _ahead_while_latest_is(log, 2, ttl + CLOCK_SKEW_MARGIN_S + 1))
    taken = log.acquire("kfp:other/run-iteration")
    assert isinstance(taken, Lease) and taken.token == 3


def _elsewhere(monkeypatch):
    """This process's records as a pod on another host would write them (its process
    cannot be seen from here: only its renewals tell whether it lives)."""
    real = lease_module.this_process
    monkeypatch.setattr(lease_module, "this_process", lambda: {**real(), "host": "pod-elsewhere"})
    return lambda: monkeypatch.setattr(lease_module, "this_process", real)


def test_a_retried_task_takes_over_only_from_a_pod_that_missed_its_renewal(run, monkeypatch):
    """KFP retries a task in a new pod with the same run and task ids (the same holder).
    Issue 39 item 6: while the pod before it renews, it keeps the lease (it may be cut off
    from KFP, not dead); once it missed a renewal, the retry takes over at once (no waiting
    for the TTL), and the old pod, if it still runs, finds its lease lost."""
    log = LeaseLog(run, 0, ttl_s=900)
    back = _elsewhere(monkeypatch)
    old = log.acquire("kfp:run-7/run-iteration")
    back()
    old_keeper = LeaseKeeper(log, old)
    assert log.acquire("kfp:run-7/run-iteration") == "kfp:run-7/run-iteration"  # renewing: still its
    missed = 900 / lease_module.RENEWALS_PER_TTL + CLOCK_SKEW_MARGIN_S + 1
    monkeypatch.setattr(lease_module, "store_now", _ahead_while_latest_is(log, old.token, missed))
    retry = log.acquire("kfp:run-7/run-iteration")
    assert isinstance(retry, Lease) and retry.token > old.token
    with pytest.raises(LeaseLost, match="taken over"):
        old_keeper.check()
    old_keeper.close()
    # the old pod's release does not free the retry's lease
    assert log.holds(retry)
    assert log.acquire("kfp:other/run-iteration") == "kfp:run-7/run-iteration"


def test_a_retried_task_takes_over_at_once_from_a_pod_known_dead(run):
    """On one machine (a local pipeline run's retry) the process before is known to have
    ended: no renewal period is waited for."""
    import subprocess
    import sys

    code = ("import sys; from rlhf_core.snapshot import fs as sfs; from rlhf_core.record.lease import LeaseLog; "
            "run = sfs.resolve(sys.argv[1], __import__('json').loads(sys.argv[2]));"
            "print(LeaseLog(run, 0, ttl_s=900).acquire('kfp:run-9/run-iteration').token)")
    done = subprocess.run([sys.executable, "-c", code, run.uri, json.dumps(run.storage_options or {})],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    retry = LeaseLog(run, 0, ttl_s=900).acquire("kfp:run-9/run-iteration")
    assert isinstance(retry, Lease) and retry.token == int(done.stdout.split()[-1]) + 1


def test_a_retry_racing_its_still_running_predecessor_commits_once(run, monkeypatch):
    """Both pods of one task run at the same time (the first was partitioned away, not
    dead) and go for the commit together, several rounds: whatever the interleaving,
    exactly one commits, under a token it still held; the other finds its lease lost or
    the iteration committed."""
    for round_ in range(4):
        where = run.child(f"round-{round_}")
        log = LeaseLog(where, 0, ttl_s=900)
        back = _elsewhere(monkeypatch)
        first = log.acquire("kfp:run-8/run-iteration")
        back()
        # its renewals stopped reaching the store (partitioned away) a renewal period ago: every
        # record is judged that much later (not only while the first is the newest: the old
        # pod's release may land while the retry is judging the first record)
        missed = 900 / lease_module.RENEWALS_PER_TTL + CLOCK_SKEW_MARGIN_S + 1
        monkeypatch.setattr(lease_module, "store_now", lambda folder: sfs.store_now(folder) + missed)
        barrier = threading.Barrier(2)
        outcome = {}

        def commit(name: str, keeper: LeaseKeeper) -> None:
            try:
                keeper.check()
                sfs.put_create_only(where.child("iter-000000", "MANIFEST.json"),
                                    json.dumps({"token": keeper.lease.token}).encode())
                outcome[name] = "committed"
            except LeaseLost:
                outcome[name] = "lost"
            except SnapshotExistsError:
                outcome[name] = "already committed"
            finally:
                keeper.close()

        def old_pod():
            keeper = LeaseKeeper(log, first)
            barrier.wait()
            commit("old", keeper)

        def retry_pod():
            barrier.wait()
            lease = log.acquire("kfp:run-8/run-iteration")  # the same task, its renewal missed: taken over
            assert isinstance(lease, Lease) and lease.token > first.token
            if sfs.read_bytes(where.child("iter-000000", "MANIFEST.json")) is not None:
                outcome["retry"] = "already committed"
                log.release(lease)
                return
            commit("retry", LeaseKeeper(log, lease))

        threads = [threading.Thread(target=old_pod), threading.Thread(target=retry_pod)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and set(outcome) == {"old", "retry"}, outcome
        assert list(outcome.values()).count("committed") == 1, outcome
        token = json.loads(sfs.read_bytes(where.child("iter-000000", "MANIFEST.json")))["token"]
        assert token == (first.token if outcome["old"] == "committed" else first.token + 1), (outcome, token)


HOLD = """
import sys, time
from rlhf_core.snapshot import fs as sfs
from rlhf_core.record.lease import LeaseKeeper, LeaseLog
log = LeaseLog(sfs.resolve(sys.argv[1]), 0, ttl_s=900)
keeper = LeaseKeeper(log, log.acquire("kfp:run-1/run-iteration"))
print("held", flush=True)
time.sleep(600)
"""


def test_a_holder_process_that_died_on_this_host_is_taken_over_at_once(tmp_path):
    """A local `rlhf run` killed with its pipeline run's controller: the next controller,
    another holder on the same machine, finds that the process that wrote the lease is
    gone and takes over without waiting out the TTL; while it lives, it keeps its lease."""
    import signal
    import subprocess
    import sys

    run = sfs.resolve(str(tmp_path / "run"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        log = LeaseLog(run, 0, ttl_s=900)
        assert log.latest()[1]["process"]["pid"] == holder.pid
        assert log.acquire("kfp:run-2/run-iteration") == "kfp:run-1/run-iteration"  # alive: it keeps it
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    lease = LeaseLog(run, 0, ttl_s=900).acquire("kfp:run-2/run-iteration")
    assert isinstance(lease, Lease) and lease.holder == "kfp:run-2/run-iteration"


def _record_from(run, process: dict) -> LeaseLog:
    log = LeaseLog(run, 0, ttl_s=900)
    sfs.put_create_only(log.folder.child("00000001.json"), json.dumps(
        {"holder": "kfp:old/run-iteration", "token": 1, "state": "held", "at": time.time(),
         "process": process}).encode())
    return log


def test_only_a_process_that_can_see_the_holder_declares_it_dead(tmp_path):
    """The same PID on another host, after a reboot or in another PID namespace (another
    container with the same host name) says nothing about the holder: only the TTL frees
    it. A PID that now names a process started at another time (reused) is a dead holder."""
    import os

    from rlhf_core.runtime.processes import this_process

    dead_pid = 2 ** 22 + 17  # beyond pid_max: no process has it
    here = this_process()
    for n, elsewhere in enumerate([{"host": "another-host"}, {"boot": "another-boot"}, {"pid_ns": "pid:[1]"}]):
        log = _record_from(sfs.resolve(str(tmp_path / f"far-{n}")), {**here, "pid": dead_pid, **elsewhere})
        assert log.acquire("kfp:new/run-iteration") == "kfp:old/run-iteration", elsewhere
    log = _record_from(sfs.resolve(str(tmp_path / "gone")), {**here, "pid": dead_pid})
    assert isinstance(log.acquire("kfp:new/run-iteration"), Lease)
    log = _record_from(sfs.resolve(str(tmp_path / "reused")), {**here, "pid": os.getpid(), "started": "1"})
    assert isinstance(log.acquire("kfp:new/run-iteration"), Lease)
    log = _record_from(sfs.resolve(str(tmp_path / "alive")), here)
    assert log.acquire("kfp:new/run-iteration") == "kfp:old/run-iteration"


class _Contended:
    """A KFP client whose every run finds iteration 0 taken by another live controller
    (it wins the race between the driver's look and the run's start), which commits a
    once the driver has said who runs it (``said``); the run itself ends SUCCEEDED having
    done nothing (the component's -1)."""

    def __init__(self, run) -> None:
        self.run, self.submitted, self.said = run, [], threading.Event()

    def run_pipeline(self, experiment_id, job_name, pipeline_package_path, params, enable_caching, **_):
        from types import SimpleNamespace

        self.submitted.append(params["attempt"])
        if len(self.submitted) == 1:
            log = LeaseLog(self.run, 0, ttl_s=900)
            other = log.acquire("kfp:other/run-iteration")

            def commit_later():
                self.said.wait(timeout=300)
                sfs.put_create_only(self.run.child("iter-000000", "MANIFEST.json"), b"{}")
                log.release(other)

            threading.Thread(target=commit_later).start()
        return SimpleNamespace(run_id=f"kfp-{len(self.submitted)}")

    def get_run(self, run_id):
        from types import SimpleNamespace

        return SimpleNamespace(state="SUCCEEDED")


def test_a_run_that_found_its_iteration_held_is_not_a_failed_attempt(tmp_path):
    """The driver's run found the iteration's lease with another live controller: that is
    not a failure of the iteration (no retry is spent, no DriveError); the driver waits
    for the other controller and goes on from what it committed."""
    from components.driver import Plan, drive

    store = f"file://{tmp_path / 'store'}"
    client = _Contended(sfs.resolve(str(tmp_path / "store" / "r")))
    lines = []

    def log(line: str) -> None:
        lines.append(line)
        if "kfp:other/run-iteration runs the iteration" in line:
            client.said.set()

    outcome = drive(client, Plan("r", store, {"run_id": "r", "store": store}, iterations=1, max_retries=0,
                                 poll_s=0.1), "", "e", log=log)
    assert outcome.committed == [0] and outcome.reason == "1 of 1 iterations committed", lines
    assert len(client.submitted) == 1 and any("kfp:other/run-iteration runs the iteration" in line
                                              for line in lines), (client.submitted, lines)


def test_the_driver_never_submits_an_iteration_committed_while_it_looked(tmp_path):
    """The interleaving the contended test above can hit under load: the driver finds
    iteration 0 uncommitted, then its holder commits and releases, then the driver reads
    the lease (free). It must look again, not submit a run for a committed iteration."""
    from components.driver import _wait_out
    from rlhf_core.record.iteration_store import IterationStore

    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "r"))
    lease = istore.lease_log(0, 900.0)
    other = lease.acquire("kfp:other/run-iteration")
    real_latest = lease.latest

    def the_holder_commits_and_releases_first():
        if 0 not in istore.committed_iterations():
            sfs.put_create_only(istore.run.child("iter-000000", "MANIFEST.json"), b"{}")
            lease.release(other)
        return real_latest()

    lease.latest = the_holder_commits_and_releases_first
    keeper = SimpleNamespace(check=lambda: None)
    assert _wait_out(lease, istore, 0, keeper, 0.01, lambda *a: None) is True
    # an iteration nobody holds and nobody committed is the driver's to submit
    assert _wait_out(istore.lease_log(1, 900.0), istore, 1, keeper, 0.01, lambda *a: None) is False


def test_every_attempt_of_every_driver_has_a_tag_of_its_own(tmp_path):
    """A retried attempt, and a driver started again, never share a tag with an attempt
    before them (the driver releases a finished run's lease by its tag). The holder is the
    run's KFP task, never a parameter: each submission is a KFP run of its own. A failed
    attempt's lease is released for it, so the retry starts at once."""
    from types import SimpleNamespace

    from components.driver import DriveError, Plan, drive

    store = f"file://{tmp_path / 'store'}"
    run = sfs.resolve(str(tmp_path / "store" / "r"))

    class Failing:  # every run takes the lease and dies without committing or releasing
        submitted: list = []

        def run_pipeline(self, experiment_id, job_name, pipeline_package_path, params, enable_caching, **_):
            assert "lease_holder" not in params  # no run parameter names a holder
            self.submitted.append(params["attempt"])
            kfp_run_id = f"kfp-run-{len(self.submitted)}"
            assert isinstance(LeaseLog(run, 0, ttl_s=900).acquire(f"kfp:{kfp_run_id}/run-iteration",
                                                                  plan={"attempt": params["attempt"]}), Lease)
            return SimpleNamespace(run_id=kfp_run_id)

        def get_run(self, run_id):
            return SimpleNamespace(state="FAILED")

    client = Failing()
    for _ in range(2):  # a driver, then one started again
        with pytest.raises(DriveError, match="iteration 0 failed 2 times"):
            drive(client, Plan("r", store, {"run_id": "r", "store": store}, iterations=1, max_retries=1, poll_s=0.1),
                  "", "e", log=lambda *a: None)
    assert len(client.submitted) == 4 and len(set(client.submitted)) == 4, client.submitted


def test_a_direct_run_takes_the_iterations_lease_and_leaves_a_held_one_alone(tmp_path, capsys):
    """`rlhf run --direct` writes what a session's controller writes, so it runs under the
    same leases: while another live controller holds the next iteration it ends in one
    line and writes nothing."""
    from rlhf_core.cli import main

    run = sfs.resolve(str(tmp_path / "store" / "r"))
    other = LeaseLog(run, 0, ttl_s=900).acquire("kfp:other/run-iteration")
    assert isinstance(other, Lease)
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--direct", "--run-id", "r", "--store", f"file://{tmp_path / 'store'}", "--iterations", "1",
              f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress=false"])
    assert str(stopped.value).startswith("rlhf: iteration 0 of run r is being run by kfp:other/run-iteration; "
                                         "nothing was written")
    assert not (tmp_path / "store" / "r" / "iter-000000").exists()
    assert not list((tmp_path / "store" / "r").glob("checkpoints/*"))


def test_a_record_stamped_in_the_future_or_unreadable_holds_nothing(tmp_path):
    """A record the store stamped later than its own clock's margin (a file whose time was
    touched forward: it would keep a dead holder's lease forever) is stale; a record that
    is not a JSON object is skipped with a one-line warning, and the next write numbers
    itself above it. (On disk: an S3 server stamps its objects itself.)"""
    import os

    run = sfs.resolve(str(tmp_path / "run"))
    log = LeaseLog(run, 0, ttl_s=30)
    forged = log.folder.child(lease_module.run_layout.lease_record(1))
    sfs.put_create_only(forged, json.dumps({"holder": "kfp:forged/x", "token": 1, "state": "held",
                                            "at": time.time(), "process": None}).encode())
    ahead = time.time() + 10 * 365 * 86400
    os.utime(forged.path, (ahead, ahead))
    taken = log.acquire("kfp:b/run-iteration")
    assert isinstance(taken, Lease) and taken.token == 2
    sfs.put_create_only(log.folder.child(lease_module.run_layout.lease_record(3)), b"not json")
    assert log.holds(taken)  # the unreadable record is skipped: the holder's own is the newest readable
    other = LeaseLog(run, 0, ttl_s=30).acquire("kfp:c/run-iteration")
    assert other == "kfp:b/run-iteration"  # b's lease is live
    log.release(taken)
    assert isinstance(LeaseLog(run, 0, ttl_s=30).acquire("kfp:c/run-iteration"), Lease)
