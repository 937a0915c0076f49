"""A controller's iterations against the run's long-lived session (``rlhf iterate``, the
Kubeflow controller component): take the iteration's lease, attach to the session's
workers (or have the session started), run the shared loop (``trainer.run``) under the
lease with a heartbeat that keeps the session in use, then have the session compute the
next iteration's inference stages ahead.

Overlapping triggers (a recurring run firing while the last one still runs) must not
drive the same workers at once: each iteration is taken with a create-only lease in the
store; a second trigger finding a fresh lease returns without doing anything.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rlhf_core.session import session
from rlhf_core.config import RunConfig
from rlhf_core.record.lease import CONTROLLER_TTL_S, IterationLeases, LeaseHeld
from rlhf_core.record.checkpoints import checkpoint_plan
from rlhf_core.trainer.restore import open_run
from rlhf_core.trainer.run import finish_outputs, run_iterations


class Heartbeat:
    """Marks the session as in use while this controller runs, however long a stage takes
    (an idle timeout shorter than a stage must not end the session under it)."""

    def __init__(self, record, timeout_s: float) -> None:
        self.record, self.period = record, max(0.2, min(30.0, timeout_s / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="session-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.record.update.remote()
            except Exception:  # the session is gone: the next worker call says so
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()


class SessionAttachment:
    """The session's side of the shared loop (``trainer.run.Attachment``)."""

    def __init__(self, attached: session.AttachedSession, prefetch, on_stage, claimed: dict) -> None:
        self.record, self.prefetch, self.on_stage = attached.record, prefetch, on_stage
        self.workers_at_step, self.claim = claimed.get("step"), claimed["claim"]

    def stage_started(self, step: int, name: str) -> None:
        self.record.update.remote(stage=name)  # the session sees it is in use
        if self.on_stage is not None:
            self.on_stage(step, name)

    def committed(self, step: int) -> None:
        import ray

        ray.get(self.record.committed.remote(self.claim, step))  # refused if another controller claimed since


def iterate(cfg: RunConfig, istore, head, iterations: int = 1, log=print, on_stage=None,
            lease_ttl_s: float = CONTROLLER_TTL_S, prefetch_next: bool | None = None,
            attached: session.AttachedSession | None = None, only_iteration: int | None = None,
            lease_holder: str = "", attempt: str = "") -> dict:
    """Run iterations of the run ``istore`` records against its long-lived session (this process must already be
    connected to the session's Ray cluster ``head``, in the run's namespace). The session
    is (re)started from the last committed checkpoint when it is not there.

    After its last commit the controller has the session compute the next iteration's
    inference stages ahead for the next controller to adopt, when ``trainer.prefetch`` is
    on and ``prefetch_next`` is not False (the driver says False for a fine-tune's last
    iteration). ``attached``: the session as ``attach_ahead`` found it (a run started
    ahead attaches while it waits); used when the session is still that generation.
    ``only_iteration``: run that iteration or nothing (a run submitted for one iteration
    must not train the next one when another run committed its own meanwhile).
    ``lease_holder``: who this controller is in the iterations' leases (the KFP task; ""
    for this process); ``attempt``: the submitter's tag, carried in its lease records."""
    import ray

    from rlhf_core.session.prefetch import SessionPrefetch

    if cfg.async_training.enable:
        from rlhf_core.config import ConfigError

        raise ConfigError("async_training.enable: expected a direct run (`rlhf run --direct`): a session's "
                          "iteration runs do not keep the rollout generating between them yet; found a "
                          "session-attached controller")
    run_id, state = istore.run_id, open_run(cfg, istore, log)
    run_dir = Path(cfg.trainer.output_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)

    def held_by(holder: str) -> dict:
        log(f"[rlhf] iteration {state.global_step} of run {run_id} is being run by {holder}; leaving it alone")
        return {"run_id": run_id, "rows": [], "lease_held_by": holder, "snapshots": istore.run_uri,
                "metrics": str(run_dir / "metrics.jsonl"), "session": None}

    # the lease says which checkpoint this controller will write: a run started ahead of
    # this one's end (pipelined) names its parent from it
    if only_iteration is not None and state.global_step != only_iteration:
        log(f"[rlhf] this run is for iteration {only_iteration} of run {run_id}, and the run is at iteration "
            f"{state.global_step}; it does nothing")
        return {"run_id": run_id, "rows": [], "snapshots": istore.run_uri, "metrics": str(run_dir / "metrics.jsonl"),
                "session": None, "moved_on": state.global_step}
    leases = IterationLeases(istore, lease_ttl_s, plan_for=checkpoint_plan(cfg, istore), holder=lease_holder,
                             attempt=attempt)
    try:
        leases.take_first(state.global_step)
    except LeaseHeld as held:
        return held_by(str(held))
    try:
        if attached is not None:
            try:  # still that generation (its handles are still the workers)?
                if ray.get(attached.record.get.remote(), timeout=30)["generation"] != attached.info["generation"]:
                    attached = None
            except Exception:  # noqa: BLE001 - the record is gone (the session restarted): ensure() finds out
                attached = None
        if attached is None:
            attached = session.ensure(cfg, istore.ref, head)
        info = attached.info
        log(f"[rlhf] session of run {run_id}: attached to generation {info['generation']} (job {info['job_id']})")
        # the workers are this controller's (dirty until it commits) before anything else,
        # so no computing ahead can start on them once it is on them, and a controller
        # before it can no longer mark them clean
        claimed = ray.get(attached.record.claim.remote(leases.me))
        # and the workers obey this controller alone: a controller before it (its lease lost,
        # its pod still running) has every later call refused by every rank
        attached.workers.fence(claimed["claim"])
        ahead = (SessionPrefetch(cfg, run_id, attached.prefetcher, claimed.get("step"), info["generation"], log,
                                 claimed["claim"]) if attached.prefetcher is not None else None)
        attachment = SessionAttachment(attached, ahead, on_stage, claimed)
        with Heartbeat(attached.record, info.get("idle_timeout_s") or cfg.trainer.session_idle_timeout_s):
            rows, trainer = run_iterations(cfg, attached.workers, istore, state, iterations, run_dir,
                                           attachment=attachment, leases=leases)
            if rows and ahead is not None and cfg.trainer.prefetch and prefetch_next is not False:
                ahead.start_next(trainer.state)
            if rows:  # a run started ahead waits for this: it then adopts what is being computed ahead
                ray.get(attached.record.update.remote(handed_over=trainer.state.global_step))
    except LeaseHeld as held:  # a later iteration's (this controller committed the ones before)
        return held_by(str(held))
    finally:
        leases.close()
    result = {**finish_outputs(cfg, run_dir, rows, istore, trainer, plot=False),
              "session": {k: info[k] for k in ("generation", "job_id")},
              "prefetch": ahead.notes if ahead is not None else []}
    if rows:
        last = istore.read_manifest(rows[-1]["iteration"])
        result["lineage"] = {"run_id": run_id, "iteration": last["iteration"],
                             "parent_iteration": last["parent_iteration"], "config_hash": last["config_hash"],
                             "code_version": last["code_version"], "checkpoint": last["weights"]["checkpoint"],
                             "checkpoint_step": last["weights"]["checkpoint_step"],
                             "redo": list(last["weights"]["redo"]),
                             "iteration_uri": istore.iteration_uri(last["iteration"])}
    return result


def attach_ahead(cfg: RunConfig, run_id: str) -> session.AttachedSession | None:
    """What a run started ahead does before its wait, off the critical path: import the
    loop's modules and attach to the session's workers (no claim: the running controller
    keeps them). None when there is no session to attach to yet."""
    import rlhf_core.trainer.ppo  # noqa: F401 - imported now rather than after the commit
    import rlhf_core.session.prefetch  # noqa: F401

    import ray

    try:  # only looking: asking for a rebuild or a session is iterate()'s, after the wait
        record = ray.get_actor(session.SESSION_ACTOR, namespace=session.namespace_of(run_id))
        info = ray.get(record.get.remote(), timeout=30)
        return session.attach_to(cfg, run_id, record, info) if info.get("status") == "ready" else None
    except Exception:  # noqa: BLE001 - iterate() attaches (or starts the session) itself
        return None


#: How long a run started ahead (pipelined) waits for the iteration before it to be taken
#: again once nobody holds it, before it gives up: longer than a retry's backoff and start.
FOLLOW_GRACE_S = 120.0
#: How long it waits, once that iteration is committed, for its controller to hand the
#: workers over (mark the record, start computing ahead) before it goes on without: that
#: controller may have died in between, where nobody can see its process (its lease then
#: looks held for the TTL). Going on is safe: its claim voids the old one, and it reloads
#: the committed checkpoint if the workers were not marked.
HANDOVER_GRACE_S = 10.0


def wait_for_commit(istore, iteration: int, log=print, grace_s: float = FOLLOW_GRACE_S,
                    lease_ttl_s: float = CONTROLLER_TTL_S, poll_s: float = 0.1,
                    handover_grace_s: float = HANDOVER_GRACE_S) -> bool:
    """For a run started before ``iteration`` committed (pipelined: its process start, imports
    and Ray connect overlap that iteration's last stages): wait until ``iteration`` is
    committed and its controller has handed the workers over on the session record
    (``handed_over``: marked at the committed step, computing ahead started), so this
    controller finds them at that step and adopts what is computed ahead; at most
    ``HANDOVER_GRACE_S`` after the commit.
    False when ``iteration`` stays uncommitted with nobody holding it for ``grace_s``
    (its run failed and nobody took it again): the caller does nothing, and whoever
    starts runs starts that iteration again. This process is connected to the session's
    cluster in the run's namespace; it reads the record and the store and writes nothing."""
    import time

    import ray

    record = None  # no session yet (or no cluster): the store alone says when
    if ray.is_initialized():
        try:
            record = ray.get_actor(session.SESSION_ACTOR, namespace=session.namespace_of(istore.run_id))
        except ValueError:
            pass
    lease = istore.lease_log(iteration, lease_ttl_s)
    t0 = time.monotonic()
    free_since, committed_at, next_store_look, said = None, None, 0.0, False
    while True:
        now = time.monotonic()
        if record is not None:
            try:
                if ray.get(record.get.remote(), timeout=30).get("handed_over") == iteration + 1:
                    return True  # committed, the workers marked at its step, computing ahead started
            except Exception:  # noqa: BLE001 - the session is gone: the store decides
                record = None
        if now >= next_store_look:
            next_store_look = now + (0.5 if record is not None else poll_s * 4)
            latest = lease.latest()
            held = latest is not None and not lease.is_free(latest[1], holder="")
            committed = iteration in istore.committed_iterations()
            committed_at = (committed_at or now) if committed else None
            if committed and (not held or now - committed_at >= handover_grace_s):
                return True  # its controller is done (or gone) without handing over
            if held or committed:
                free_since = None
            elif free_since is None:
                free_since = now
            elif now - free_since >= grace_s:
                log(f"[rlhf] iteration {iteration} of run {istore.run_id} was not committed and nobody has held it "
                    f"for {grace_s:.0f}s; this run, started ahead of it, does nothing")
                return False
            if not said and now - t0 > 1.0:
                log(f"[rlhf] waiting for iteration {iteration} of run {istore.run_id} to commit "
                    f"(this run was started ahead of it)")
                said = True
        time.sleep(poll_s)
