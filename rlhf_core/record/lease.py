"""Who runs an iteration: a lease in the store that a retried task takes over at once,
renewed in the background, and checked as a fencing token before anything is written.

The scheme needs only the one primitive every store here honours: create-only writes
(``If-None-Match: *`` on S3, ``link()`` on disk). A lease is a log of numbered records::

    {run}/leases/iter-{N:06d}/{generation:08d}.json   {"holder", "token", "state", "at", "process",
                                                        "checkpoint"}

(the path grammar: ``rlhf_core.record.run_layout``).

Every change (acquire, take over, renew, release) is the creation of the next generation,
so two contenders for one change cannot both succeed: exactly one creates it, the other
finds it there and re-reads. The record with the highest generation is the lease. A
holder's *token* is the generation at which it acquired; it holds the lease while the
latest record names its holder and token and is not released. No read-modify-write, no
delete: it is correct on S3 (strongly consistent LIST and create-only PUT) and on disk.

A lease is free to take when its latest record is released, older than the TTL, held by
the same holder id and older than a renewal period (a KFP retry of the same task: the pod
before it stopped renewing; one still renewing keeps it, and the retry waits), or written
by a process that has certainly ended: each record names the process that wrote it (host,
boot, PID namespace, PID, start time), and a contender that can see that process table
(the same machine and container: a local ``rlhf run`` and its pipeline runs' controllers)
and finds no such process takes over at once instead of waiting out the TTL. Pods on a
cluster have their own hosts, so there the KFP task rule and the TTL decide.

A session's controller also says in its records which checkpoint it will write
(``checkpoint``: a fresh prefix chosen when it acquires, null when none is due): whoever
starts the next iteration's run before this one commits (pipelined runs) names that run's
parent from it. A holder that acquires again (a retry) chooses a new one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from rlhf_core.record import run_layout
from rlhf_core.runtime.processes import known_dead, this_process
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.errors import SnapshotExistsError
from rlhf_core.snapshot.fs import store_now


#: How long a controller's lease lasts without a renewal (it renews every third of it):
#: a controller that died where nobody can see its process is taken over after this.
CONTROLLER_TTL_S = 900.0

#: "Older than the TTL" means older than TTL + this margin. A record's age is the store's:
#: the time the store stamped on it (LastModified on S3, mtime on disk) against the
#: store's present time (``sfs.store_now``), so neither the writer's clock nor the
#: reader's enters it, and nothing a record says about its own time is believed. The
#: margin covers the stamps' granularity (1 s on S3) and a store whose servers' clocks
#: differ a little; docs/kubeflow.md, "Leases".
CLOCK_SKEW_MARGIN_S = 60.0
#: A holder renews its lease this many times per TTL (``LeaseKeeper``).
RENEWALS_PER_TTL = 3
#: The key ``LeaseLog.latest`` puts the store's stamp under (whatever the record held there).
STORED_AT = "stored_at"


class LeaseLost(RuntimeError):
    """This controller no longer holds the iteration's lease: it must not write."""


class LeaseHeld(Exception):
    """The iteration's lease belongs to another controller (``str(exc)``: who)."""


def local_holder() -> str:
    return f"local:{socket.gethostname()}:{os.getpid()}"


def holder_id(given: str = "") -> str:
    """Who holds a lease: ``given`` (the KFP task, from the run and task ids, the same for
    every retry of the task; or the driver's attempt), else this process."""
    return given or local_holder()


@dataclass
class Lease:
    iteration: int
    holder: str
    token: int  # the generation at which the holder acquired: the fencing token
    plan: dict = field(default_factory=dict)  # what the holder announces in every record (``checkpoint``)


class LeaseLog:
    """The lease of one iteration of a run (or, with ``name``, of another exclusive job
    of the run, e.g. its fine-tune driver)."""

    def __init__(self, run: sfs.Location, iteration: int, ttl_s: float, name: str | None = None) -> None:
        self.folder = run.child(*run_layout.lease_dir(iteration, name).split("/"))
        self.iteration, self.ttl_s = iteration, ttl_s

    def latest(self) -> tuple[int, dict] | None:
        fs = self.folder.fs
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(self.folder.path)
        try:
            listed = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info
                      for info in fs.ls(self.folder.path, detail=True)}
        except FileNotFoundError:
            return None
        generations = sorted(g for g in map(run_layout.generation_of_lease_record, listed) if g is not None)
        for generation in reversed(generations):
            raw = sfs.read_bytes(self.folder.child(run_layout.lease_record(generation)))
            if raw is None:
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if isinstance(record, dict):
                # the newest generation numbers the next write, whatever the records below it say;
                # the record's age is the store's stamp, never what its writer put in it
                return generations[-1], {**record, STORED_AT: sfs.stamp(listed[run_layout.lease_record(generation)])}
            print(f"rlhf: warning: {self.folder.uri}/{run_layout.lease_record(generation)}: expected a lease record "
                  f"(a JSON object); found {raw[:40]!r}; skipped", file=sys.stderr)
        return (generations[-1], {"state": "released"}) if generations else None

    def _write(self, generation: int, record: dict) -> bool:
        try:
            # gc removes a committed iteration's log once its release is written: that write's
            # folder may go under it
            sfs.put_create_only(self.folder.child(run_layout.lease_record(generation)), json.dumps(record).encode(),
                                folder_may_go=record.get("state") == "released")
            return True
        except SnapshotExistsError:
            return False  # someone else made this change first

    def is_free(self, record: dict, holder: str) -> bool:
        """Whether ``holder`` may take the lease whose latest record is ``record``."""
        if record.get("state") == "released":
            return True
        if record.get("holder") == holder and record.get("process") == this_process():
            return True  # this very process's own record: nobody else's to wait for
        stored = record.get(STORED_AT)
        if not isinstance(stored, float) or stored <= 0:
            return True  # no store time to age it by: it cannot hold anything
        age = store_now(self.folder) - stored
        # stamped later than the store's own clock: a record whose time was forged (a touched
        # file), not a live holder (it would hold the lease forever)
        if age >= self.ttl_s + CLOCK_SKEW_MARGIN_S or age < -CLOCK_SKEW_MARGIN_S:
            return True
        # the same holder is an earlier attempt of this task (a KFP retry's pod before it):
        # it is gone once it missed a renewal, not before (it may be cut off from KFP, not dead)
        if record.get("holder") == holder and age >= self.ttl_s / RENEWALS_PER_TTL + CLOCK_SKEW_MARGIN_S:
            return True
        return known_dead(record.get("process"))

    def acquire(self, holder: str, attempts: int = 20, plan: dict | None = None) -> Lease | str:
        """The lease, or who holds it now (a fresh lease of another holder). ``plan``: what
        the holder announces in its records (renewals repeat it)."""
        for _ in range(attempts):
            latest = self.latest()
            if latest is not None and not self.is_free(latest[1], holder):
                return str(latest[1].get("holder"))
            generation = 1 if latest is None else latest[0] + 1
            if self._write(generation, {"holder": holder, "token": generation, "state": "held", "at": time.time(),
                                        "process": this_process(), **(plan or {})}):
                return Lease(self.iteration, holder, generation, dict(plan or {}))
        return "another contender (lost the race repeatedly)"

    def holds(self, lease: Lease) -> bool:
        latest = self.latest()
        return (latest is not None and latest[1].get("state") == "held" and latest[1].get("holder") == lease.holder
                and latest[1].get("token") == lease.token)

    def renew(self, lease: Lease) -> bool:
        """Refresh the lease's time; False when it was lost (someone took it over)."""
        for _ in range(5):
            latest = self.latest()
            if latest is None or latest[1].get("holder") != lease.holder or latest[1].get("token") != lease.token \
                    or latest[1].get("state") != "held":
                return False
            if self._write(latest[0] + 1, {"holder": lease.holder, "token": lease.token, "state": "held",
                                           "at": time.time(), "process": this_process(), **lease.plan}):
                return True
        return False

    def release(self, lease: Lease) -> None:
        latest = self.latest()
        if latest is not None and latest[1].get("holder") == lease.holder and latest[1].get("token") == lease.token:
            # the plan again (its ``attempt`` says which submitted run this was, also once released)
            self._write(latest[0] + 1, {"holder": lease.holder, "token": lease.token, "state": "released",
                                        "at": time.time(), **lease.plan})


    def release_attempt(self, attempt: str) -> bool:
        """Release the lease held by the run tagged ``attempt`` (the ``attempt`` its records
        carry), on its holder's behalf: for whoever knows that run has ended (the fine-tune
        driver, once the run it submitted is in a final state)."""
        latest = self.latest()
        if latest is None or not attempt or latest[1].get("attempt") != attempt or latest[1].get("state") != "held":
            return False
        return self._write(latest[0] + 1, {"holder": latest[1].get("holder"), "token": latest[1].get("token"),
                                           "state": "released", "at": time.time(), "attempt": attempt})


class LeaseKeeper:
    """Holds an acquired lease for the length of an iteration: renews it in the
    background every ``ttl_s / 3`` (independent of how long a stage takes), and
    ``check()`` raises ``LeaseLost`` when it was lost (checked right before the checkpoint
    and the commit)."""

    def __init__(self, log: LeaseLog, lease: Lease) -> None:
        self.log, self.lease = log, lease
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.iteration}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = max(0.05, self.log.ttl_s / RENEWALS_PER_TTL)
        while not self._stop.wait(period):
            try:
                if not self.log.renew(self.lease):
                    self.lost.set()
                    return
            except Exception:  # a store hiccup: the next renewal (well within the TTL) retries
                continue

    def check(self) -> None:
        if self.lost.is_set() or not self.log.holds(self.lease):
            self.lost.set()
            raise LeaseLost(f"iteration {self.lease.iteration}: lease (holder {self.lease.holder}, token "
                            f"{self.lease.token}) was taken over; this controller stops without writing")

    def close(self, release: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if release and not self.lost.is_set():
            self.log.release(self.lease)


class IterationLeases:
    """The leases of this controller's iterations, one ``LeaseKeeper`` per iteration. The
    first is taken up front (``take_first``), before anything touches the workers: a
    controller that lost the race must not restore (reload) weights under the winner's
    running stages."""

    def __init__(self, istore, ttl_s: float, plan_for=None, holder: str = "", attempt: str = "") -> None:
        self.istore, self.ttl_s, self.me, self.plan_for = istore, ttl_s, holder_id(holder), plan_for
        self.attempt = attempt  # the submitter's tag for this run, carried in every record
        self._first: LeaseKeeper | None = None

    def take(self, iteration: int) -> LeaseKeeper:
        """The iteration's lease, or ``LeaseHeld`` naming who has it. ``plan_for(iteration)``:
        what the holder announces (a session's controller: the checkpoint it will write)."""
        log = self.istore.lease_log(iteration, self.ttl_s)
        plan = {**(self.plan_for(iteration) if self.plan_for else {}), **({"attempt": self.attempt}
                                                                         if self.attempt else {})}
        lease = log.acquire(self.me, plan=plan)
        while lease == self.me:  # an earlier attempt of this task holds it: until it ends or misses a renewal
            time.sleep(min(5.0, self.ttl_s / 30))
            lease = log.acquire(self.me, plan=plan)
        if isinstance(lease, str):
            raise LeaseHeld(lease)
        if iteration in self.istore.committed_iterations():  # a holder committed it, then released
            log.release(lease)
            raise LeaseHeld("nobody: it is committed already")
        return LeaseKeeper(log, lease)

    def take_first(self, iteration: int) -> None:
        self._first = self.take(iteration)

    def for_iteration(self, iteration: int) -> LeaseKeeper:
        """The loop's lease for ``iteration``: the one taken up front, then new ones."""
        first, self._first = self._first, None
        if first is not None and first.lease.iteration == iteration:
            return first
        if first is not None:  # taken for another iteration: give it back
            first.close()
        return self.take(iteration)

    def close(self) -> None:
        """Release the up-front lease if the loop never used it (attaching failed)."""
        if self._first is not None:
            self._first.close()
            self._first = None
