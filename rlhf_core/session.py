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
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from rlhf_core.config import RunConfig

SESSION_ACTOR = "session"
WORKER_PREFIX = "rlhf_worker"
READY_LINE = "[rlhf] session ready"
_LIVE_JOB = ("PENDING", "RUNNING")


def namespace_of(run_id: str) -> str:
    return f"rlhf-{run_id}"


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


def serve(cfg: RunConfig, run_id: str, store: str, log=print, poll_s: float = 0.5) -> str:
    """The session job's body (this process is connected to the cluster, in the run's
    namespace). Returns why it ended: "idle" or "stopped"."""
    import ray

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("stopped"))  # `ray job stop`
    stop(run_id)  # the remains of an earlier session (its job died), if any
    job_id = os.environ.get("RLHF_SESSION_JOB") or ray.get_runtime_context().get_job_id()
    record = ray.remote(SessionRecord).options(name=SESSION_ACTOR, namespace=namespace_of(run_id),
                                               lifetime="detached", num_cpus=0).remote(
        {"run_id": run_id, "config_hash": cfg.config_hash(), "status": "starting", "job_id": job_id,
         "generation": 0, "step": None, "worker_names": []})
    generation, workers, reason = 0, None, None
    try:
        while reason is None:
            generation += 1
            t0 = time.perf_counter()
            workers = _place(cfg, run_id)
            step = _restore(cfg, store, run_id, workers, log)
            ray.get(record.rebuilt.remote(status="ready", generation=generation, step=step,
                                          worker_names=workers["_group"].worker_names, started_at=time.time()))
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
                    _kill_workers(workers)
                    break
    finally:
        try:
            if workers is not None:
                _kill_workers(workers)
            ray.kill(record, no_restart=True)
        except Exception:  # already gone: `rlhf stop-session` kills them too
            pass
        log(f"[rlhf] session of run {run_id} ended ({reason or 'error'})", flush=True)
    return reason


def _place(cfg: RunConfig, run_id: str) -> dict:
    from rlhf_core.trainer.run import build_workers

    return build_workers(cfg, name_prefix=f"{WORKER_PREFIX}_{run_id}", pool_name=f"{run_id}_pool", detached=True)


def _restore(cfg: RunConfig, store: str, run_id: str, workers: dict, log) -> int | None:
    """Load the last committed checkpoint; the step the weights are at (None: fresh,
    the controller writes step 0's checkpoint itself)."""
    from rlhf_core.trainer.run import _checkpoint_exists, load_checkpoint, open_run

    istore, state = open_run(cfg, store, run_id, log=lambda *a: None)
    uri = istore.checkpoint_uri(state.global_step)
    if state.global_step == 0 or not _checkpoint_exists(uri):
        return None
    load_checkpoint(workers, uri)
    log(f"[rlhf] restored {uri}", flush=True)
    return state.global_step


def _kill_workers(workers: dict) -> None:
    workers["_group"].kill()
    workers["_pool"].release()


# ------------------------------------------------------------ submitting the serve job


def find_job(client, run_id: str):
    """The run's live session job (PENDING/RUNNING), or None."""
    for job in client.list_jobs():
        meta = job.metadata or {}
        if meta.get("rlhf_run_id") == run_id and meta.get("kind") == "session" and str(job.status) in _LIVE_JOB:
            return job
    return None


def submit_job(client, cfg: RunConfig, run_id: str, store: str) -> str:
    """Submit ``rlhf serve`` for the run unless one is live; returns its submission id.
    Submission ids are create-only in the Jobs API, so two racing submitters end up
    with one job."""
    job = find_job(client, run_id)
    if job is not None:
        return job.submission_id
    previous = sum(1 for j in client.list_jobs() if (j.metadata or {}).get("rlhf_run_id") == run_id)
    submission_id = f"rlhf-session-{run_id}-{previous + 1}"
    env = {"RLHF_SESSION_CONFIG": json.dumps(cfg.to_dict()), "RLHF_SESSION_JOB": submission_id,
           "PYTHONUNBUFFERED": "1"}
    for name in ("RLHF_CACHE", "PYTHONPATH", "HF_HOME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_ENDPOINT_URL"):
        if name in os.environ:
            env[name] = os.environ[name]
    try:
        client.submit_job(entrypoint=f"{sys.executable} -m rlhf_core.cli serve --foreground --run-id {run_id} "
                                     f"--store {store}",
                          submission_id=submission_id, runtime_env={"env_vars": env},
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


def _alive(group) -> bool:
    import ray

    try:
        ray.get([w.__ray_ready__.remote() for w in group.workers], timeout=30)
        return True
    except Exception:
        return False


def _attach(cfg: RunConfig, run_id: str, record, info: dict) -> dict | None:
    from rlhf_core.controller import RayWorkerGroup, create_colocated_worker_cls
    from rlhf_core.trainer.run import worker_roles

    if info["config_hash"] != cfg.config_hash():
        raise RuntimeError(f"session of run {run_id} runs another config (hash {info['config_hash'][:12]}, "
                           f"now {cfg.config_hash()[:12]}); stop it first (rlhf stop-session)")
    roles = worker_roles(cfg)
    try:
        group = RayWorkerGroup.from_detached(info["worker_names"], create_colocated_worker_cls(roles),
                                             namespace=namespace_of(run_id), role=WORKER_PREFIX)
    except ValueError:
        return None
    if not _alive(group):
        return None
    workers = group.spawn(prefix_set=roles.keys())
    workers.update(_group=group, _record=record, _info=info)
    return workers


def ensure(cfg: RunConfig, run_id: str, store: str, head, timeout_s: float = 900.0) -> dict:
    """The session's worker groups for this controller (connected to the cluster in the
    run's namespace): attach to the live session, or have it rebuilt / started from the
    last committed checkpoint and then attach. ``head``: the cluster (``HeadInfo``)."""
    import ray

    from rlhf_core.ray_head import jobs_client

    deadline = time.monotonic() + timeout_s
    asked_rebuild_of, submitted = None, None
    while time.monotonic() < deadline:
        try:
            record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
            info = ray.get(record.get.remote(), timeout=30)
        except Exception:
            record, info = None, None
        if info is not None and info["status"] == "ready":
            workers = _attach(cfg, run_id, record, info)
            if workers is not None:
                return workers
            if asked_rebuild_of != info["generation"]:
                ray.get(record.request_rebuild.remote())
                asked_rebuild_of = info["generation"]
            elif not _job_live(head, info["job_id"]):
                stop(run_id)  # its serve job is gone, nobody will rebuild: clear the remains
        elif info is None:
            client = jobs_client(head)
            if submitted is None:
                submitted = submit_job(client, cfg, run_id, store)
            elif str(client.get_job_status(submitted)) not in _LIVE_JOB:
                raise RuntimeError(f"session job {submitted} ended ({client.get_job_status(submitted)}):\n"
                                   f"{client.get_job_logs(submitted)[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"no session for run {run_id} after {timeout_s:.0f}s (see `ray job logs` on the head)")


def _job_live(head, submission_id: str) -> bool:
    from rlhf_core.ray_head import jobs_client

    try:
        return str(jobs_client(head).get_job_status(submission_id)) in _LIVE_JOB
    except RuntimeError:  # the Jobs API does not know it
        return False


def stop(run_id: str, head=None) -> bool:
    """End the run's session: stop its job (when ``head`` is given) and kill its actors."""
    import ray

    from rlhf_core.ray_head import jobs_client

    stopped = False
    if head is not None:
        client = jobs_client(head)
        job = find_job(client, run_id)
        if job is not None:
            client.stop_job(job.submission_id)
            stopped = True
    try:
        record = ray.get_actor(SESSION_ACTOR, namespace=namespace_of(run_id))
        info = ray.get(record.get.remote(), timeout=30)
    except Exception:
        return stopped
    for name in info.get("worker_names", []):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace_of(run_id)), no_restart=True)
        except Exception:
            pass
    ray.kill(record, no_restart=True)
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(f"{run_id}_pool_pg0"))
    except Exception:
        pass
    return True
