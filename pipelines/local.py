"""Run the per-iteration pipeline on this machine with the KFP local runner.

Each iteration is one pipeline run (components as subprocesses), against the run's
session on this project's own Ray head and a ``file://`` (or any) store. What runs when
is the fine-tune driver's decision (``components.driver.drive``), for ``rlhf run``'s
pipeline runs as for a fine-tune on a cluster: here it submits them to
``LocalKfpStandIn``, a stand-in of the KFP API that executes each run in a long-lived
runner process (``_Runner``).
"""

import os
import shutil
import sys
from pathlib import Path

from rlhf_core.runtime.processes import kill_tree

#: Pipeline-run folders kept under the run's kfp/ folder (the store keeps every
#: iteration's record; these are the local runner's scratch outputs).
KEEP_RUN_FOLDERS = 5


def prune_run_folders(pipeline_root: str, keep: int = KEEP_RUN_FOLDERS) -> list[str]:
    """Remove all but the ``keep`` newest pipeline-run folders; returns what went."""
    folders = sorted((p for p in Path(pipeline_root).iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    gone = folders[:-keep] if keep else folders
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return [str(p) for p in gone]


def run_one_iteration(run_id: str, store: str, cfg, head_root: str, pipeline_root: str,
                      attempt: str = "", parent_model: str = "", prefetch_next: bool = True,
                      follows: int = -1) -> dict:
    """One run of the per-iteration pipeline on the local runner, in this process (what
    ``python -m pipelines.local`` does); returns its outputs. Which iteration it trains and
    from which checkpoint is the caller's choice: the fine-tune driver
    (``components.driver.drive``) schedules runs, on this machine through
    ``LocalKfpStandIn``."""
    from rlhf_core.config import handover
    from rlhf_core.record.run_ids import validate_run_id, validate_store_uri

    validate_run_id(run_id, "run_id")  # before the runner starts or the store is resolved
    validate_store_uri(store, "store")
    Path(pipeline_root).mkdir(parents=True, exist_ok=True)
    local_init(pipeline_root)
    from pipelines.ppo_iteration import ppo_iteration_local as ppo_iteration

    task = ppo_iteration(run_id=run_id, store=store, **handover(cfg),
                         head_root=os.path.abspath(head_root), attempt=attempt, parent_model=parent_model,
                         prefetch_next=prefetch_next, follows=follows)
    return {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}


def show_tail(log_path: str | None, lines: int = 40) -> None:
    """The end of the runs' log on the console (a run failed)."""
    if log_path and os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
        sys.__stderr__.write(f"[rlhf] the pipeline run failed; the end of {log_path}:\n" + "".join(tail))


def local_init(pipeline_root: str) -> None:
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root, raise_on_error=True)


class _Runner:
    """A process that runs per-iteration pipeline runs on the KFP local runner, one at a
    time, for as long as its starter needs it: kfp is imported once, not once a run. Its
    output (the runner's and the components') goes to the log file; a line of JSON per
    run on a pipe of its own says how the run ended. In the starter's process group, so
    a Ctrl-C or a kill of the group reaches it and its components as before."""

    def __init__(self, pipeline_root: str, log_path: str) -> None:
        import queue
        import subprocess
        import threading

        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipelines.local", "--serve", "--root", pipeline_root],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         bufsize=1)
        self.results: "queue.Queue[dict]" = queue.Queue()
        self.busy = False
        threading.Thread(target=self._read, name="runner-results", daemon=True).start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            if line.startswith("{"):
                self.results.put(json.loads(line))
        self.results.put({"ok": False, "error": f"the runner process ended (exit code {self.proc.wait()})"})

    @property
    def free(self) -> bool:
        return not self.busy and self.proc.poll() is None

    def start(self, params: dict, env: dict) -> None:
        """Run the pipeline with ``params``, the components seeing ``env`` as their
        ``RLHF_*`` settings (what a run of its own would have inherited at its submission)."""
        import json

        self.busy = True
        try:
            self.proc.stdin.write(json.dumps({"params": params, "env": env}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it ended meanwhile: the run fails, as a run whose pod died would
            self.results.put({"ok": False, "error": f"the runner process ended (exit code {self.proc.wait()})"})

    def result(self) -> dict | None:
        """How the run it is running ended, or None while it runs."""
        import queue

        try:
            out = self.results.get_nowait()
        except queue.Empty:
            return None
        self.busy = False
        return out

    def close(self, kill: bool = False) -> None:
        """End the process: at once with everything it started when ``kill`` and a run is in
        flight (no longer wanted), else once it has read the end of its input."""
        import subprocess

        if self.proc.poll() is not None:
            return
        if kill and self.busy:
            kill_tree(self.proc.pid)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()


def _serve_runs(pipeline_root: str) -> int:
    """The runner process's body: a run per line of JSON ({params, env}) on stdin."""
    import json
    import time

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the runner and the components print goes to the log, not the pipe
    sys.stdout = os.fdopen(1, "w", buffering=1)
    local_init(pipeline_root)
    from rlhf_core.runtime import probes

    from pipelines.ppo_iteration import ppo_iteration_local as ppo_iteration

    for line in sys.stdin:
        request = json.loads(line)
        params = request["params"]
        for name in [n for n in os.environ if n.startswith(RUN_ENV_PREFIX)]:
            del os.environ[name]
        os.environ.update(request["env"])
        os.environ["RLHF_PHASE_RUN"] = f"{os.getpid()}-{params.get('follows')}-{time.time()}"  # the components inherit it
        probes.phase("run_start")
        try:
            task = ppo_iteration(**params)
            out = {"ok": True, "outputs": {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}}
        except Exception as exc:  # noqa: BLE001 - reported to the starter, which decides
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        probes.phase("run_end")
        sys.stdout.flush()
        proto.write(json.dumps(out) + "\n")
    return 0


#: The settings a submitted run's components take from the submitter's environment.
RUN_ENV_PREFIX = "RLHF_"


class LocalKfpStandIn:
    """A stand-in for the part of ``kfp.Client`` the fine-tune driver uses, answered on
    this machine: each submitted run executes the per-iteration pipeline with the KFP
    local runner (so the iterations really train, against the local head under
    ``head_root``). It is not a Kubeflow server: the pipeline package it is handed is
    ignored, the local per-iteration pipeline runs instead. The runs execute in long-lived
    runner processes (``_Runner``: kfp imported once, as a cluster's warm nodes would have
    it), a new one whenever none is free; their output goes to ``log_path``.

    ``fail`` maps the k-th submission (1-based) to a fault point (``RLHF_KILL_AT``, e.g.
    ``stage:reward``): that run's controller is SIGKILLed there, so the run fails mid-way.
    """

    def __init__(self, head_root: str, pipeline_root: str, fail: dict | None = None,
                 log_path: str | None = None) -> None:
        self.head_root, self.pipeline_root = os.path.abspath(head_root), pipeline_root
        self.log_path = log_path or os.path.join(pipeline_root, "pipeline-runs.log")
        self.fail = dict(fail or {})
        self.runners: list[_Runner] = []
        self.runs: dict[str, dict] = {}  # kfp run id -> {"runner", "result"}
        self.submitted: list[dict] = []
        self.terminated: set[str] = set()

    def run_pipeline(self, experiment_id: str, job_name: str, pipeline_package_path: str = "", params=None,
                     enable_caching: bool = False, **_):
        import uuid
        from types import SimpleNamespace

        from rlhf_core.record.run_ids import validate_run_id, validate_store_uri

        params = dict(params or {})
        # what the submitter handed over, checked before a process starts (as the components do)
        validate_run_id(params.get("run_id"), "params.run_id")
        validate_store_uri(params.get("store"), "params.store")
        kfp_run_id = uuid.uuid4().hex[:12]
        env = {k: v for k, v in os.environ.items() if k.startswith(RUN_ENV_PREFIX)}
        fault = self.fail.get(len(self.submitted) + 1)
        if fault:
            env["RLHF_KILL_AT"] = fault
        runner = next((r for r in self.runners if r.free), None)
        if runner is None:
            os.makedirs(self.pipeline_root, exist_ok=True)
            runner = _Runner(self.pipeline_root, self.log_path)
            self.runners.append(runner)
        with open(self.log_path, "a", encoding="utf-8") as log:  # where each run's output starts
            log.write(f"=== run {kfp_run_id}: {job_name} ===\n")
        runner.start({"run_id": params["run_id"], "store": params["store"],
                      "config": params.get("config", ""), "config_hash": params.get("config_hash", ""),
                      "head_root": self.head_root,
                      "attempt": params.get("attempt", ""), "parent_model": params.get("parent_model", ""),
                      "prefetch_next": bool(params.get("prefetch_next", True)),
                      "follows": int(params.get("follows", -1))}, env)
        self.runs[kfp_run_id] = {"runner": runner, "result": None}
        self.submitted.append({"name": job_name, "experiment_id": experiment_id, "params": params,
                               "kfp_run_id": kfp_run_id, "fault": fault})
        return SimpleNamespace(run_id=kfp_run_id)

    def get_run(self, run_id: str):
        from types import SimpleNamespace

        run = self.runs[run_id]
        if run["result"] is None and run_id not in self.terminated:
            run["result"] = run["runner"].result()
            if run["result"] is not None:
                prune_run_folders(self.pipeline_root)
        if run_id in self.terminated:
            return SimpleNamespace(state="CANCELED")
        if run["result"] is None:
            return SimpleNamespace(state="RUNNING")
        return SimpleNamespace(state="SUCCEEDED" if run["result"]["ok"] else "FAILED",
                               error=run["result"].get("error"))

    def terminate_run(self, run_id: str) -> None:
        """Terminate a run (kfp.Client's name): its runner process and what it started."""
        if run_id in self.terminated:
            return
        self.terminated.add(run_id)
        runner = self.runs[run_id]["runner"]
        if self.runs[run_id]["result"] is None:
            kill_tree(runner.proc.pid)
            runner.proc.wait()
            self.runners.remove(runner)

    def close(self, wait: bool = False) -> None:
        """End the runner processes: ``wait`` lets a run in flight end its components'
        writes (they had the Ctrl-C too); else one in flight is killed with all it started."""
        for runner in self.runners:
            runner.close(kill=not wait)
            runner.close(kill=True)  # no-op for a runner that has ended
        self.runners = []


def main(argv: list[str] | None = None) -> int:
    """One per-iteration pipeline run on the local runner, or (``--serve``) a runner process."""
    import argparse

    from rlhf_core.cli_args import REQUIRED, add_run_arguments

    if argv is None and "--serve" in sys.argv[1:2]:  # a runner process of the stand-in
        serving = argparse.ArgumentParser(prog="python -m pipelines.local --serve")
        serving.add_argument("--serve", action="store_true")
        serving.add_argument("--root", required=True)
        return _serve_runs(serving.parse_args().root)
    parser = argparse.ArgumentParser(prog="python -m pipelines.local")
    add_run_arguments(parser, store=REQUIRED, head_root=REQUIRED)
    parser.add_argument("--root", required=True)
    parser.add_argument("--attempt", default="", help="the driver's tag for this run, kept in its lease records")
    parser.add_argument("--parent-model", default="")
    parser.add_argument("--no-prefetch-next", dest="prefetch_next", action="store_false")
    parser.add_argument("--follows", type=int, default=-1, help="started ahead: wait for this iteration's commit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), args.overrides).validate()
    run_one_iteration(args.run_id, args.store, cfg, args.head_root, args.root, args.attempt,
                      args.parent_model, args.prefetch_next, follows=args.follows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
