"""Iteration leases under the failures pods have: contenders run at the same time (threads
that start together), on local disk and on a real S3 server. In every case exactly one
controller commits, and the commit names the lease token it held."""

import json
import threading
import time
import uuid

import pytest

from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.trainer.lease import Lease, LeaseKeeper, LeaseLog, LeaseLost


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


def test_a_holder_that_died_on_another_host_is_taken_over_after_the_ttl(run):
    dead = LeaseLog(run, 0, ttl_s=900).acquire("local:another-host:4242")  # it never renews: that host is gone
    assert isinstance(dead, Lease)
    assert LeaseLog(run, 0, ttl_s=900).acquire("local:this-host-b:1") == "local:another-host:4242"  # fresh: not yet
    time.sleep(1.2)  # older than a 1 s TTL from now on (ages only grow)
    outcome = race(run, ["kfp:a/run-iteration", "kfp:b/run-iteration"], ttl_s=1.0)
    assert sorted(outcome.values())[0] in ("already committed", "committed") and \
        list(outcome.values()).count("committed") == 1, outcome
    assert committed(run)["token"] > dead.token


def test_a_retried_task_takes_over_at_once_and_the_old_pod_cannot_commit(run):
    """KFP retries a task in a new pod with the same run and task ids: it takes the lease
    at once (no waiting for the TTL); the old pod, if it still runs, finds it lost."""
    log = LeaseLog(run, 0, ttl_s=900)
    old = log.acquire("kfp:run-7/run-iteration")
    old_keeper = LeaseKeeper(log, old)
    retry = log.acquire("kfp:run-7/run-iteration")
    assert isinstance(retry, Lease) and retry.token > old.token
    with pytest.raises(LeaseLost, match="taken over"):
        old_keeper.check()
    old_keeper.close()
    # the old pod's release does not free the retry's lease
    assert log.holds(retry)
    assert log.acquire("kfp:other/run-iteration") == "kfp:run-7/run-iteration"


def test_a_retry_racing_its_still_running_predecessor_commits_once(run):
    """Both pods of one task run at the same time (the first was partitioned away, not
    dead) and go for the commit together, several rounds: whatever the interleaving,
    exactly one commits, under a token it still held; the other finds its lease lost or
    the iteration committed."""
    for round_ in range(4):
        where = run.child(f"round-{round_}")
        log = LeaseLog(where, 0, ttl_s=900)
        first = log.acquire("kfp:run-8/run-iteration")
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
            lease = log.acquire("kfp:run-8/run-iteration")  # the same task: taken over at once
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
