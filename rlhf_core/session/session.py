"""The long-lived training session: the run's worker groups, alive across iterations.

The session is a Ray job (``rlhf serve``, submitted through the Ray Jobs API, the API
KubeRay's RayJob uses). It places the run's WorkerGroups as named, detached actors in the
Ray namespace ``rlhf-{run_id}``, restores them from the last committed checkpoint, and
then keeps them: models, optimizers and the vLLM engine stay loaded while each
iteration's controller (a CLI call or a Kubeflow component) attaches, runs one iteration
and exits. It ends when stopped (``rlhf stop-session``: the job is stopped, the actors
killed) or when no controller has used it for ``trainer.session_idle_timeout_s``.

A tiny detached ``session`` actor (``SessionRecord``) is the meeting point: the serve
loop publishes what it holds (config hash, worker names, the step the weights are at, a
generation counter that grows on every rebuild); controllers read it and mark the
weights dirty while they change them. A controller that finds a worker dead asks the
serve loop to rebuild; one that finds no session at all submits a new serve job. Either
way the workers come back from the last committed checkpoint.

A second detached actor, ``prefetch``, computes the next iteration's inference stages on
the workers between two controllers (``rlhf_core.session.prefetch``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from rlhf_core.config import RunConfig
from rlhf_core.session.prefetch import PREFETCH_ACTOR, Prefetcher
from rlhf_core.checkpoint.layout import checkpoint_exists
from rlhf_core.record.run_layout import RunRef
from rlhf_core.workers.worker_set import WorkerSet

SESSION_ACTOR = "session"
WORKER_PREFIX = "rlhf_worker"
READY_LINE = "[rlhf] session ready"
_LIVE_JOB = ("PENDING", "RUNNING")


def namespace_of(run_id: str) -> str:
    return f"rlhf-{run_id}"


@dataclass
class AttachedSession:
    """What a controller holds while it drives the session's workers."""

    workers: WorkerSet
    record: object        # the SessionRecord actor handle
    info: dict            # the record's published state when attached
    prefetcher: object = None  # the Prefetcher actor handle (rlhf_core.session.prefetch)


class SessionRecord:
    """Detached actor: the session's bookkeeping (tiny; never holds tensors)."""

    def __init__(self, info: dict) -> None:
        self.info = dict(info)
        self.last_used = time.time()
        self.rebuild_requested = False

    def get(self) -> dict:
        self.last_used = time.time()
        return dict(self.info)

    def update(self, **changes) -> None:
        self.info.update(changes)
        self.last_used = time.time()

    def claim(self, holder: str) -> dict:
        """A controller takes the workers: one step, so nothing can come between the
        step it reads and its dirty mark. Returns the info as it was (``step``: where the
        workers' weights were) with the new ``claim`` number; every claim before it is
        void from now on (``committed`` and ``weights_at`` of an older claim are refused)."""
        self.last_used = time.time()
        before = dict(self.info)
        claim = int(self.info.get("claim", 0)) + 1
        self.info.update(step=None, claim=claim, controller=holder)
        return {**before, "claim": claim}

    def committed(self, claim: int, step: int) -> bool:
        """The controller of ``claim`` committed: the weights are at ``step``. A controller
        whose claim another one has replaced since changes nothing (that one's dirty mark
        stands)."""
        self.last_used = time.time()
        if self.info.get("claim", 0) != claim:
            return False
        self.info["step"] = step
        return True

    def weights_at(self, step: int | None, generation: int, claim: int | None = None) -> bool:
        """Whether the workers are ready with weights at ``step`` (no controller marked
        them dirty since) and, with ``claim``, no controller claimed them after the one
        asking: the prefetcher asks before it starts computing ahead."""
        return (step is not None and self.info.get("status") == "ready" and self.info.get("step") == step
                and self.info.get("generation") == generation
                and (claim is None or self.info.get("claim", 0) == claim))

    def request_rebuild(self) -> None:
        self.rebuild_requested = True
        self.last_used = time.time()

    def poll(self) -> dict:
        """For the serve loop: the control state, without counting as use."""
        return {"idle_s": time.time() - self.last_used, "rebuild": self.rebuild_requested,
                "info": dict(self.info)}

    def rebuilt(self, **changes) -> None:
        self.rebuild_requested = False
        self.info.update(changes)


# --------------------------------------------------------------------- the serve job


def serve(cfg: RunConfig, run: RunRef, log=print, poll_s: float = 0.5) -> str:
    """The session job's body (this process is connected to the cluster, in the run's
    namespace). Returns why it ended: "idle" or "stopped"."""
    import ray

    run_id = run.run_id

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("stopped"))  # `ray job stop`
    stop(run_id)  # the remains of an earlier session (its job died), if any
    job_id = os.environ.get("RLHF_SESSION_JOB") or ray.get_runtime_context().get_job_id()
    record = ray.remote(SessionRecord).options(name=SESSION_ACTOR, namespace=namespace_of(run_id),
                                               lifetime="detached", num_cpus=0).remote(
        {"run_id": run_id, "config_hash": cfg.config_hash(), "status": "starting", "job_id": job_id,
         "generation": 0, "step": None, "worker_names": [],
         "idle_timeout_s": cfg.trainer.session_idle_timeout_s})
    prefetcher = ray.remote(Prefetcher).options(name=PREFETCH_ACTOR, namespace=namespace_of(run_id),
                                                lifetime="detached", num_cpus=0, max_concurrency=4).remote(
        cfg, namespace_of(run_id), WORKER_PREFIX, SESSION_ACTOR)
    generation, workers, reason = 0, None, None
    try:
        while reason is None:
            generation += 1
            t0 = time.perf_counter()
            workers = _place(cfg, run_id)
            step = _restore(cfg, run, workers, log)
            ray.get(prefetcher.reset.remote(workers.worker_names, generation))
            ray.get(record.rebuilt.remote(status="ready", generation=generation, step=step,
                                          worker_names=workers.worker_names, started_at=time.time()))
            log(f"{READY_LINE}: run {run_id}, generation {generation}, weights at step {step}, "
                f"{time.perf_counter() - t0:.1f}s", flush=True)
            while reason is None:
                time.sleep(poll_s)
                state = ray.get(record.poll.remote())
                if stopping:
                    reason = "stopped"
                elif state["idle_s"] > cfg.trainer.session_idle_timeout_s:
                    reason = "idle"
                elif state["rebuild"]:
                    log("[rlhf] a controller found a worker dead: rebuilding from the last checkpoint", flush=True)
                    ray.get(record.update.remote(status="rebuilding"))
                    workers.kill()
                    break
    finally:
        try:
            if workers is not None:
                workers.kill()
            ray.kill(prefetcher, no_restart=True)
            ray.kill(record, no_restart=True)
        except Exception:  # already gone: `rlhf stop-session` kills them too
            pass
        log(f"[rlhf] session of run {run_id} ended ({reason or 'error'})", flush=True)
    return reason


def pool_name_of(run_id: str) -> str:
    """The name prefix of the session's pools (their detached placement groups)."""
    return f"{run_id}_pool"


def _place(cfg: RunConfig, run_id: str) -> WorkerSet:
    from rlhf_core.trainer.preflight import check_inputs

    check_inputs(cfg)  # a session on a cluster would otherwise hold its GPUs before it refuses a prompt
    return WorkerSet.build(cfg, name_prefix=f"{WORKER_PREFIX}_{run_id}", pool_name=pool_name_of(run_id),
                           detached=True)


def _restore(cfg: RunConfig, run: RunRef, workers: WorkerSet, log) -> int | None:
    """Load the last committed checkpoint; the step the weights are at (None: fresh,
    the controller writes step 0's checkpoint itself)."""
    from rlhf_core.record.checkpoints import weights_checkpoint, weights_plan
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.trainer.restore import load_checkpoint, open_run

    istore = IterationStore(run)
    state = open_run(cfg, istore, log=lambda *a: None)
    if state.global_step == 0 or weights_plan(istore, state.global_step)[1]:
        return None  # fresh, or a checkpoint plus a redo (the controller has the trainer for it)
    uri = weights_checkpoint(istore, state.global_step)
    if not checkpoint_exists(uri):
        return None
    load_checkpoint(workers, istore, state.global_step)
    log(f"[rlhf] restored {uri}", flush=True)
    return state.global_step


# ------------------------------------------------------------ submitting the serve job


def find_job(client, run_id: str):
    """The run's live session job (PENDING/RUNNING), or None."""
    for job in client.list_jobs():
        meta = job.metadata or {}
        if meta.get("rlhf_run_id") == run_id and meta.get("kind") == "session" and str(job.status) in _LIVE_JOB:
            return job
    return None


#: Settings the session job needs from the submitter's environment (none of them secret).
FORWARDED_ENV = ("RLHF_CACHE", "PYTHONPATH", "HF_HOME", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
#: Secrets never travel in the job's runtime_env (Ray logs it and the Jobs API returns it).
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def session_entrypoint(run: RunRef) -> str:
    """The serve job's command line; Ray runs it with a shell, so every argument (checked
    when ``run`` was made) is quoted."""
    import shlex

    argv = [sys.executable, "-m", "rlhf_core.cli", "serve", "--foreground", "--run-id", run.run_id, "--store", run.store]
    return " ".join(shlex.quote(a) for a in argv)


def write_credentials_file(directory: str) -> str | None:
    """The object-store secrets of this environment in a file only this user can read
    (``directory`` is the local head's folder; one file per submission, which its serve
    job removes once read, and stopping the head removes what is left); None when there
    are none. On KubeRay the Ray pods get them from the Kubernetes secret instead."""
    from rlhf_core.runtime.ray_head import CREDENTIALS_GLOB, write_private

    secrets = {k: os.environ[k] for k in SECRET_ENV if os.environ.get(k)}
    if not secrets:
        return None
    path = os.path.join(directory, CREDENTIALS_GLOB.replace("*", uuid.uuid4().hex[:12]))
    write_private(path, json.dumps(secrets))
    return path


def load_credentials_file(path: str | None) -> None:
    """In the serve job: take the secrets the submitter left (never overriding what the
    pod's own environment already has), and remove the file: they live in this process now."""
    if not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        for key, value in json.load(f).items():
            if key in SECRET_ENV:
                os.environ.setdefault(key, value)
    os.unlink(path)


def submit_job(client, cfg: RunConfig, run: RunRef, head=None) -> str:
    """Submit ``rlhf serve`` for the run unless one is live; returns its submission id.
    Submission ids are create-only in the Jobs API, so two racing submitters end up
    with one job. ``head``: the local head (its folder holds the credentials file)."""
    run_id, entrypoint = run.run_id, session_entrypoint(run)
    job = find_job(client, run_id)
    if job is not None:
        return job.submission_id
    previous = sum(1 for j in client.list_jobs() if (j.metadata or {}).get("rlhf_run_id") == run_id)
    submission_id = f"rlhf-session-{run_id}-{previous + 1}"
    env = {"RLHF_SESSION_CONFIG": json.dumps(cfg.to_dict()), "RLHF_SESSION_JOB": submission_id,
           "PYTHONUNBUFFERED": "1"}
    env.update({name: os.environ[name] for name in FORWARDED_ENV if name in os.environ})
    if head is not None and getattr(head, "token_path", ""):
        credentials = write_credentials_file(os.path.dirname(head.token_path))
        if credentials:
            env["RLHF_CREDENTIALS_FILE"] = credentials
    try:
        client.submit_job(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                          metadata={"rlhf_run_id": run_id, "kind": "session", "config_hash": cfg.config_hash()})
    except RuntimeError:
        job = find_job(client, run_id)  # another submitter won the race
        if job is None:
            raise
        return job.submission_id
    return submission_id


def wait_job_ready(client, submission_id: str, timeout_s: float = 900.0) -> None:
    """Block until the serve job says it is ready (read from its logs: no Ray connection
    needed, so a Kubeflow component can do this cheaply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(submission_id))
        if status not in _LIVE_JOB:
            raise RuntimeError(f"session job {submission_id} ended ({status}):\n"
                               f"{client.get_job_logs(submission_id)[-3000:]}")
        if status == "RUNNING" and READY_LINE in client.get_job_logs(submission_id):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"session job {submission_id} not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


# ------------------------------------------------------------- the controller's side


def attach_to(cfg: RunConfig, run_id: str, record, info: dict) -> AttachedSession | None:
    """Handles on the workers ``info`` (the record's state) names, or None when one of them
    is gone; refuses a session of another config."""
    if info["config_hash"] != cfg.config_hash():
        raise RuntimeError(f"session of run {run_id} runs another config (hash {info['config_hash'][:12]}, "
                           f"now {cfg.config_hash()[:12]}); stop it first (rlhf stop-session)")
    import ray

    workers = WorkerSet.attach(cfg, info["worker_names"], namespace=namespace_of(run_id), role=WORKER_PREFIX)
    if workers is None:
        return None
    try:
        prefetcher = ray.get_actor(PREFETCH_ACTOR, namespace=namespace_of(run_id))
    except ValueError:  # a session of an older version: no computing ahead
        prefetcher = None
    return AttachedSession(workers, record, info, prefetcher)


def ensure(cfg: RunConfig, run: RunRef, head, timeout_s: float = 900.0) -> AttachedSession:
    """The session's worker groups for this controller (connected to the cluster in the
    run's namespace): attach to the live session, or have it rebuilt / started from the
    last committed checkpoint and then attach. ``head``: the cluster (``HeadInfo``)."""
    import ray

    from rlhf_core.runtime.ray_head import jobs_client

    run_id = run.run_id
    deadline = time.monotonic() + timeout_s
    asked_rebuild_of, submitted = None, None
    while time.monotonic() < deadline:
        try:
            record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
            info = ray.get(record.get.remote(), timeout=30)
        except Exception:
            record, info = None, None
        if info is not None and info["status"] == "ready":
            attached = attach_to(cfg, run_id, record, info)
            if attached is not None:
                return attached
            if asked_rebuild_of != info["generation"]:
                ray.get(record.request_rebuild.remote())
                asked_rebuild_of = info["generation"]
            elif not _job_live(head, info["job_id"]):
                stop(run_id)  # its serve job is gone, nobody will rebuild: clear the remains
        elif info is None:
            client = jobs_client(head)
            if submitted is None:
                submitted = submit_job(client, cfg, run, head)
            elif str(client.get_job_status(submitted)) not in _LIVE_JOB:
                raise RuntimeError(f"session job {submitted} ended ({client.get_job_status(submitted)}):\n"
                                   f"{client.get_job_logs(submitted)[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"no session for run {run_id} after {timeout_s:.0f}s (see `ray job logs` on the head)")


def _job_live(head, submission_id: str) -> bool:
    from rlhf_core.runtime.ray_head import jobs_client

    try:
        return str(jobs_client(head).get_job_status(submission_id)) in _LIVE_JOB
    except RuntimeError:  # the Jobs API does not know it
        return False


@dataclass
class Stopped:
    """What ``stop`` ended (true when anything was there to end)."""

    job: bool = False
    workers: int = 0
    placement_groups: int = 0
    record: bool = False
    errors: list = field(default_factory=list)  # what could not be ended, and why

    def __bool__(self) -> bool:
        return self.job or self.record or bool(self.workers or self.placement_groups)

    def __str__(self) -> str:
        return (f"job {'stopped' if self.job else 'not running'}, {self.workers} worker(s) killed, "
                f"{self.placement_groups} placement group(s) removed"
                + "".join(f"; not removed: {error}" for error in self.errors))


def stop(run_id: str, head=None) -> Stopped:
    """End the run's session: stop its job (when ``head`` is given), kill its actors and
    remove every placement group of its pools (every pool, every node), also when the
    session's record is already gone (a serve job that died leaves its groups behind)."""
    import ray

    from rlhf_core.controller.resource_pool import placement_groups_named, remove_placement_groups
    from rlhf_core.runtime.ray_head import jobs_client
    from rlhf_core.workers.worker_set import pool_prefixes

    stopped = Stopped()
    if head is not None:
        client = jobs_client(head)
        job = find_job(client, run_id)
        if job is not None:
            client.stop_job(job.submission_id)
            stopped.job = True
    try:
        record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
        info = ray.get(record.get.remote(), timeout=30)
    except Exception:
        record, info = None, {}
    for name in info.get("worker_names", []):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace_of(run_id)), no_restart=True)
            stopped.workers += 1
        except Exception:
            pass
    try:
        ray.kill(ray.get_actor(PREFETCH_ACTOR, namespace=namespace_of(run_id)), no_restart=True)
    except Exception:
        pass
    if record is not None:
        ray.kill(record, no_restart=True)
        stopped.record = True
    try:
        groups = placement_groups_named(pool_prefixes(pool_name_of(run_id)))
    except Exception as exc:  # noqa: BLE001 - the cluster's table could not be read: say so, go on
        stopped.errors.append(f"listing placement groups: {type(exc).__name__}: {exc}")
        groups = []
    stopped.errors += remove_placement_groups(groups)
    stopped.placement_groups = len(groups) - len(stopped.errors)
    return stopped
