"""A whole fine-tune on Kubeflow: submit the per-iteration pipeline run after run.

The driver reads the run's committed iteration manifests (the store is the record, not
KFP's run states) to decide what comes next: the next iteration, a retry of a failed one
(the retry resumes at the stage where it stopped), or the end (the run's total reached,
the reward target met, the validation score reached, the wall-clock budget spent, or the driver told to stop). Only one
driver drives a run at a time: it holds the run's ``driver`` lease, like a controller
holds an iteration's.

Pipelined (``Plan.pipelined``, when only the count ends the fine-tune): once iteration n's
controller holds its lease and has announced the checkpoint it will write, the driver
submits n+1's run with that checkpoint as its parent and ``follows=n``; its pods start and
its controller connects while n runs, then waits for n's commit. If n is not committed as
announced (its run failed, a retry wrote another checkpoint), the run started ahead does
nothing and is submitted again; it is not counted as a failed attempt.

``client`` is anything with kfp.Client's ``run_pipeline(experiment_id, job_name,
pipeline_package_path, params, enable_caching, service_account)`` and ``get_run(run_id)``
(``.state``): the real client inside the cluster, or the local stand-in
(``pipelines.local.LocalKfpStandIn``) in tests.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from rlhf_core.trainer.progress import StopRule

FINAL_STATES = {"SUCCEEDED", "FAILED", "CANCELED", "SKIPPED", "CANCELLED", "ERROR"}


class DriveError(RuntimeError):
    """The fine-tune cannot go on (an iteration failed more times than allowed)."""


@dataclass
class Plan:
    """What to drive: a total (``iterations``) or a number ``more`` than the run has."""

    run_id: str
    store: str
    arguments: dict                     # the per-iteration pipeline's parameters
    iterations: int | None = None
    more: int | None = None
    stop_at_reward: float | None = None  # mean critic/score/mean of the last 5 iterations
    stop_at_val: float | None = None     # the latest validation's score (mean of its val-core/* means)
    budget_s: float | None = None
    max_retries: int = 2
    poll_s: float = 5.0
    pipelined: bool = True  # start iteration n+1's run while n's runs (``pipelines_ahead`` says when)
    prefetch_after_last: bool = False  # the session computes ahead after the last run too (it outlives the drive)

    @property
    def stop(self) -> StopRule:
        """The targets that end the fine-tune before its count: the rule direct runs use too."""
        return StopRule(self.budget_s, self.stop_at_reward, self.stop_at_val)


#: A pipeline parameter's "no target" (KFP floats have no None).
NO_TARGET = -1.0


def score_target(value: float) -> float | None:
    """A stop target from a pipeline parameter: ``NO_TARGET`` is none; any other value,
    negative ones too (DAPO's rewards run from -1 to 1), is a score to reach."""
    return None if value == NO_TARGET else float(value)


@dataclass
class Outcome:
    reason: str
    committed: list[int]
    runs: list[dict] = field(default_factory=list)   # iteration, attempt, kfp run id, state, seconds


def _recent_rewards(istore, committed: list[int]) -> list[float]:
    """The rewards of the newest committed iterations, as many as the rule averages over."""
    from rlhf_core.trainer.progress import REWARD_WINDOW

    rewards = [istore.read_manifest(n)["metrics"].get("critic/score/mean") for n in committed[-REWARD_WINDOW:]]
    return [r for r in rewards if r is not None]


def _latest_validation(istore, committed: list[int]) -> float | None:
    """The score of the newest committed validation (``progress.validation_score``)."""
    from rlhf_core.trainer.progress import validation_score

    for n in reversed(committed):
        score = validation_score(istore.read_manifest(n)["metrics"])
        if score is not None:
            return score
    return None


def pipelines_ahead(plan: Plan) -> bool:
    """Whether the driver starts iteration n+1's run while n's still runs (``Plan.pipelined``):
    only when the count alone ends the fine-tune (whether a reward, validation or time target
    is met is known only once n has committed: a run started ahead would train one iteration
    too many) and the cluster outlives each iteration run (policy ``keep``: another policy
    deletes it at the end of n's run, under n+1)."""
    return plan.pipelined and plan.stop.by_count_only and plan.arguments.get("cluster_policy", "keep") == "keep"


def drive(client, plan: Plan, package: str, experiment_id: str, log=print, stopping=lambda: False,
          service_account: str | None = None, on_commit=lambda iteration: None) -> Outcome:
    """Drive ``plan`` to its end (see the module's docstring); ``on_commit(n)`` is called
    once for each iteration committed while it drives, in order."""
    from rlhf_core.record.run_ids import validate_run_id, validate_store_uri
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.record.lease import CONTROLLER_TTL_S, LeaseKeeper, LeaseLog, holder_id
    from rlhf_core.record.checkpoints import announced_weights_checkpoint, weights_checkpoint

    validate_run_id(plan.run_id, "run_id")  # before the store is resolved: it may be a network lookup
    validate_store_uri(plan.store, "store")
    istore = IterationStore(RunRef(plan.store, plan.run_id))
    lease_log = LeaseLog(istore.run, -1, ttl_s=max(60.0, 6 * plan.poll_s), name="driver")
    lease = lease_log.acquire(holder_id())
    # this driver's attempts have tags of their own: a driver started again (its
    # pod retried) must not take over the lease of a child run the one before it left running
    instance = uuid.uuid4().hex[:8]
    if isinstance(lease, str):
        log(f"[driver] run {plan.run_id} is driven by {lease}; this trigger does nothing")
        return Outcome(f"driven by {lease}", istore.committed_iterations())
    keeper = LeaseKeeper(lease_log, lease)
    start = time.monotonic()
    first = shown = len(istore.committed_iterations())
    target = plan.iterations if plan.iterations is not None else first + (plan.more or 0)
    ahead_ok = pipelines_ahead(plan)
    runs: list[dict] = []
    attempts: dict[int, int] = {}
    inflight: dict[int, dict] = {}  # iteration -> the run submitted for it
    no_ahead: set[int] = set()  # iterations whose run started ahead failed before it began: none ahead again
    # what each submission carries (``attempt``) into its lease records: which of this driver's
    # runs a lease is, never who holds it (the holder is the run's KFP task, from KFP itself)
    tag_of = lambda n, attempt: f"driver:{plan.run_id}/{instance}/iteration-{n}/attempt-{attempt}"

    def submit(n: int, parent: str, follows: int) -> None:
        attempt = attempts.get(n, 0)
        name = f"{plan.run_id} iteration {n:06d}" + (f" retry {attempt}" if attempt else "")
        tag = tag_of(n, attempt)
        kwargs = {"service_account": service_account} if service_account else {}
        # the checkpoint it starts from (none before the run's initial one is written),
        # imported by the run (KFP lineage links the runs); the session computes the next
        # iteration ahead unless this is the last one
        params = {**plan.arguments, "attempt": tag, "parent_model": parent,
                  "prefetch_next": n + 1 < target or plan.prefetch_after_last,
                  **({"follows": follows} if follows >= 0 else {})}
        run = client.run_pipeline(experiment_id=experiment_id, job_name=name, pipeline_package_path=package,
                                  params=params, enable_caching=False, **kwargs)
        log(f"[driver] submitted {name}: {run.run_id}" + (f" (ahead: it waits for iteration {follows})"
                                                          if follows >= 0 else ""))
        inflight[n] = {"kfp_run_id": run.run_id, "name": name, "tag": tag, "attempt": attempt,
                       "t0": time.monotonic(), "ahead": follows >= 0}

    def reap(n: int, sub: dict, state: str) -> None:
        done = n in istore.committed_iterations()
        runs.append({"iteration": n, "attempt": sub["attempt"], "kfp_run_id": sub["kfp_run_id"], "name": sub["name"],
                     "state": state, "committed": done, "seconds": round(time.monotonic() - sub["t0"], 1)})
        if done:
            log(f"[driver] {sub['name']}: {state}")
            return
        iteration_lease = istore.lease_log(n, CONTROLLER_TTL_S)
        latest = iteration_lease.latest()
        if latest is not None and latest[1].get("attempt") != sub["tag"] and \
                not iteration_lease.is_free(latest[1], holder=""):
            log(f"[driver] {sub['name']}: {state}, nothing committed: {latest[1].get('holder')} runs the iteration; "
                f"waiting for it")  # not this attempt's failure: it is not counted
            return
        if sub["ahead"] and (latest is None or latest[1].get("attempt") != sub["tag"]):
            if state in ("FAILED", "ERROR"):  # before it began its iteration: no more runs ahead for it
                no_ahead.add(n)
                log(f"[driver] {sub['name']}: {state} before it began its iteration{_error_of(client, sub)}; it "
                    f"is submitted again once the iteration before it has committed")
            else:
                log(f"[driver] {sub['name']}: {state}, started ahead, it stood down or was cancelled before it "
                    f"began (the iteration before it was not committed as announced, or the driver stopped)")
            return  # it ran nothing of its iteration: not counted
        # the run is over (its state is final), so whatever lease it left is released for
        # it: the retry, a run of its own, takes the iteration at once
        iteration_lease.release_attempt(sub["tag"])
        attempts[n] = sub["attempt"] + 1
        then = "it will be retried" if attempts[n] <= plan.max_retries else "no retries left"
        log(f"[driver] {sub['name']}: {state}{_error_of(client, sub)} (not committed: {then})")

    try:
        while True:
            for n, sub in list(inflight.items()):
                state = _state(client, sub["kfp_run_id"])
                if state in FINAL_STATES:
                    del inflight[n]
                    reap(n, sub, state)
            committed = istore.committed_iterations()
            for k in committed[shown:]:
                on_commit(k)
            shown = len(committed)
            rewards = _recent_rewards(istore, committed) if plan.stop_at_reward is not None else []
            val = _latest_validation(istore, committed) if plan.stop_at_val is not None else None
            if len(committed) >= target:
                reason = f"{len(committed)} of {target} iterations committed"
            else:
                reason = plan.stop.reason(rewards, val, time.monotonic() - start) or ("stopped" if stopping() else None)
            if reason is not None and not inflight:  # (what is in flight ends first, as one run at a time did)
                log(f"[driver] run {plan.run_id}: done ({reason})")
                return Outcome(reason, committed, runs)
            if reason is not None:
                _cancel_waiting(client, istore, inflight, log)
            keeper.check()
            n = len(committed)
            if reason is None and n not in inflight:
                attempt = attempts.get(n, 0)
                if attempt > plan.max_retries:
                    raise DriveError(f"run {plan.run_id}: iteration {n} failed {attempt} times (max_retries="
                                     f"{plan.max_retries}); see its runs: "
                                     f"{[r['kfp_run_id'] for r in runs if r['iteration'] == n]}")
                if _wait_out(istore.lease_log(n, CONTROLLER_TTL_S), istore, n, keeper, plan.poll_s, log):
                    continue  # another controller (a child run of a driver before this one) had it
                submit(n, weights_checkpoint(istore, n) or "", follows=-1)
            elif reason is None and ahead_ok and n + 1 < target and n + 1 not in inflight \
                    and n + 1 not in no_ahead and attempts.get(n + 1, 0) <= plan.max_retries:
                parent = announced_weights_checkpoint(istore, n, CONTROLLER_TTL_S)
                if parent is not None:  # n's controller runs it and has said which checkpoint it will write
                    submit(n + 1, parent, follows=n)
            time.sleep(plan.poll_s)
    finally:
        keeper.close()


def _cancel_waiting(client, istore, inflight: dict, log) -> None:
    """The driver stops: runs started ahead that have not begun their iteration (it is not
    theirs yet) are terminated, so a stop ends with the iteration under way, as it did when
    one run ran at a time. One that has begun finishes it."""
    from rlhf_core.record.lease import CONTROLLER_TTL_S

    for n, sub in inflight.items():
        if not sub["ahead"] or sub.get("cancelled") or not hasattr(client, "terminate_run"):
            continue
        latest = istore.lease_log(n, CONTROLLER_TTL_S).latest()
        if latest is None or latest[1].get("attempt") != sub["tag"]:
            client.terminate_run(sub["kfp_run_id"])
            sub["cancelled"] = True
            log(f"[driver] {sub['name']}: started ahead and not begun; terminated (the driver stops)")


def _wait_out(iteration_lease, istore, n: int, keeper, poll_s: float, log) -> bool:
    """Before a submission: wait while another live controller holds iteration ``n`` (a
    child run a driver before this one left running). False when ``n`` is still to be
    submitted; True when the caller must look again (someone held it, or committed it
    since the caller looked: a holder commits, then releases, so a lease found free is
    checked against the commits once more)."""
    waited = False
    while n not in istore.committed_iterations():
        latest = iteration_lease.latest()
        if latest is None or iteration_lease.is_free(latest[1], holder=""):
            return waited or n in istore.committed_iterations()
        if not waited:
            log(f"[driver] iteration {n} is being run by {latest[1].get('holder')}; waiting for it to commit or end")
            waited = True
        keeper.check()
        time.sleep(poll_s)
    return True  # committed meanwhile: nothing to submit for it


def _error_of(client, sub: dict) -> str:
    """What the client says went wrong in a run, as ": <text>" (the local stand-in knows;
    a KFP server's reason is on its run page)."""
    error = getattr(client.get_run(sub["kfp_run_id"]), "error", None)
    return f": {error}" if error else ""


def _state(client, kfp_run_id: str) -> str:
    return str(getattr(client.get_run(kfp_run_id), "state", "") or "").upper()


def report_markdown(plan: Plan, outcome: Outcome, run_url=lambda kfp_run_id: "") -> str:
    """The fine-tune's report: why it ended, the reward curve, one line per iteration run."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.report import markdown_report

    lines = [f"# Fine-tune {plan.run_id}", "", f"Ended: {outcome.reason}. Committed iterations: "
             f"{len(outcome.committed)}.", "", markdown_report(IterationStore(RunRef(plan.store, plan.run_id))), "",
             "| iteration | attempt | KFP run | state | committed | seconds |", "|---|---|---|---|---|---|"]
    for r in outcome.runs:
        url = run_url(r["kfp_run_id"])
        link = f"[{r['kfp_run_id']}]({url})" if url else r["kfp_run_id"]
        lines.append(f"| {r['iteration']} | {r['attempt']} | {link} | {r['state']} | {r['committed']} | "
                     f"{r['seconds']} |")
    return "\n".join(lines) + "\n"
