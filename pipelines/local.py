"""Run the per-iteration pipeline on this machine with the KFP local runner.

Each iteration is one pipeline run (components as subprocesses), against the run's
session on this project's own Ray head and a ``file://`` (or any) store. ``rlhf run``
pipelines them: the next iteration's run starts while the current one computes, in one
of two runner processes (``_Runner``), and waits for its commit (``follows``). The
fine-tune driver's stand-in of the KFP API (``LocalKfpStandIn``) starts each run as a
process of its own.
"""

import contextlib
import os
import shutil
import sys
from pathlib import Path

from rlhf_core.processes import kill_tree

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


class NothingCommitted(RuntimeError):
    """Pipeline runs ended without committing the iteration and nobody else holds it."""


class PipelineRunFailed(RuntimeError):
    """A pipeline run failed (its controller failed after the runner's retries)."""


def run_local_iterations(run_id: str, store: str, overrides: list, head_root: str, iterations: int,
                         pipeline_root: str, lease_holder: str = "", parent_model: str = "",
                         prefetch_next: bool = True, on_run=None, log_path: str | None = None,
                         wait_if_held: bool = False, lease_ttl_s: float | None = None,
                         pipelined: bool = False, follows: int = -1) -> list[dict]:
    """``iterations`` runs of the per-iteration pipeline, each given the checkpoint it
    continues from (``parent_model`` for the first when the caller knows it, else read from
    the store, as the fine-tune driver does). The session computes ahead after every run
    but the last, and after the last if ``prefetch_next``. ``on_run(k)`` is called once
    the k-th iteration (0-based) is committed. With ``log_path``, what the local runner
    prints (task logs, outputs) is appended to that file instead of the console; when a
    run fails, the end of it is shown.

    ``pipelined`` (``rlhf run``): run n+1 starts as soon as iteration n's controller holds
    its lease and has announced its checkpoint, so n+1's process start, imports and Ray
    connect overlap n's stages; its controller waits for n's commit (``follows``). The runs
    execute in two long-lived runner processes (``_Runner``), each of which imports the
    KFP local runner once.

    ``wait_if_held`` (``rlhf run``): a run that commits nothing because another live
    controller holds the iteration's lease is followed by a wait until that one commits or
    its lease frees, then a new run; ``NothingCommitted`` when a run commits nothing with
    nobody holding it (twice in a row). Without it (one run for the fine-tune driver,
    which decides itself) the runs are returned as they ended. ``follows``: the first run
    was started ahead of that iteration's commit (the driver's pipelined submissions)."""
    from rlhf_core.run_ids import validate_run_id, validate_store_uri
    from rlhf_core.trainer.iteration_store import IterationStore

    validate_run_id(run_id, "run_id")  # before the runner starts or the store is resolved
    validate_store_uri(store, "store")
    Path(pipeline_root).mkdir(parents=True, exist_ok=True)
    istore = IterationStore(store, run_id)
    params = {"run_id": run_id, "store": store, "config_overrides": list(overrides),
              "head_root": os.path.abspath(head_root), "lease_holder": lease_holder}
    if not pipelined:
        return _one_run_at_a_time(istore, params, iterations, pipeline_root, parent_model, prefetch_next, on_run,
                                  log_path, wait_if_held, lease_ttl_s, follows)
    return _pipelined_runs(istore, params, iterations, pipeline_root, parent_model, prefetch_next, on_run, log_path,
                           wait_if_held, lease_ttl_s)


def _one_run_at_a_time(istore, params, iterations, pipeline_root, parent_model, prefetch_next, on_run, log_path,
                       wait_if_held, lease_ttl_s, follows: int = -1) -> list[dict]:
    """Each run in this process, after the one before ended (the driver's single runs)."""
    from rlhf_core import probes

    local_init(pipeline_root)
    from pipelines.ppo_iteration import ppo_iteration_local as ppo_iteration

    runs, k, idle = [], 0, 0
    while k < iterations:
        before = len(istore.committed_iterations())
        os.environ["RLHF_PHASE_RUN"] = f"{os.getpid()}-{k}"  # the component inherits it
        probes.phase("run_start")  # benchmarks/orchestration.py's breakdown; no-op otherwise
        with _runner_output(log_path):
            task = ppo_iteration(**params, parent_model=parent_model if k == 0 and parent_model else
                                 _next_parent(istore), prefetch_next=prefetch_next or k + 1 < iterations,
                                 follows=follows if k == 0 else -1)
        probes.phase("run_end")
        runs.append({"outputs": {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}})
        prune_run_folders(pipeline_root)
        if len(istore.committed_iterations()) == before:
            if not wait_if_held:
                k += 1
                continue
            idle = _after_nothing_committed(istore, before, idle, lease_ttl_s, log_path or pipeline_root)
            continue
        idle = 0
        if on_run is not None:
            on_run(k)
        k += 1
    return runs


def _pipelined_runs(istore, params, iterations, pipeline_root, parent_model, prefetch_next, on_run, log_path,
                    wait_if_held, lease_ttl_s) -> list[dict]:
    """At most two runs in flight: the one of the next uncommitted iteration and, once its
    controller has announced its checkpoint, the one of the iteration after it."""
    import time

    from rlhf_core.trainer.lease import CONTROLLER_TTL_S
    from rlhf_core.trainer.restore import announced_weights_checkpoint

    ttl = lease_ttl_s or CONTROLLER_TTL_S
    first = len(istore.committed_iterations())
    target = first + iterations
    runners = [_Runner(pipeline_root, log_path) for _ in range(2)]
    inflight: dict[int, tuple[_Runner, bool]] = {}  # iteration -> (runner, started ahead)
    runs, idle, shown = [], 0, first
    try:
        while True:
            committed = len(istore.committed_iterations())  # committed in order: the count is the next one
            for _ in range(shown, min(committed, target)):
                if on_run is not None:
                    on_run(shown - first)
                shown += 1
            for iteration, (runner, ahead) in list(inflight.items()):
                result = runner.result()
                if result is None:
                    continue
                del inflight[iteration]
                runs.append(result)
                prune_run_folders(pipeline_root)
                if not result["ok"] and ahead and iteration not in istore.committed_iterations():
                    continue  # started ahead: started again, as a run of its own (which fails the loop if it fails)
                if not result["ok"]:
                    _show_tail(log_path)
                    raise PipelineRunFailed(f"the pipeline run of iteration {iteration} failed ({result['error']}); "
                                            f"see {log_path or pipeline_root}")
                if iteration in istore.committed_iterations():
                    idle = 0
                elif not ahead and wait_if_held:  # (a run started ahead that stood down is started again)
                    idle = _after_nothing_committed(istore, iteration, idle, ttl, log_path or pipeline_root)
                elif not ahead:
                    return runs  # the caller decides, as with a run at a time
            committed = len(istore.committed_iterations())
            if committed >= target and not inflight:
                return runs
            if all(r.proc.poll() is not None for r in runners):
                raise PipelineRunFailed(f"the runner processes ended; see {log_path or pipeline_root}")
            free = [r for r in runners if r.proc.poll() is None and all(r is not busy for busy, _ in inflight.values())]
            if free and committed < target and committed not in inflight:
                parent = parent_model if committed == first and parent_model else _next_parent(istore)
                inflight[committed] = (free[0].start(**params, parent_model=parent, follows=-1,
                                                     prefetch_next=prefetch_next or committed + 1 < target), False)
            elif free and committed in inflight and committed + 1 < target and committed + 1 not in inflight:
                parent = announced_weights_checkpoint(istore, committed, ttl)
                if parent is not None:  # its controller is running it and says what it will write
                    inflight[committed + 1] = (free[0].start(**params, parent_model=parent, follows=committed,
                                                             prefetch_next=prefetch_next or committed + 2 < target),
                                               True)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for runner in runners:  # they had the signal too: let them end their components' writes
            runner.close()
        raise
    finally:
        for runner in runners:
            runner.close(kill=True)  # no-op for a runner that has ended


def _show_tail(log_path: str | None, lines: int = 40) -> None:
    if log_path and os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
        sys.__stderr__.write(f"[rlhf] the pipeline run failed; the end of {log_path}:\n" + "".join(tail))


def _after_nothing_committed(istore, iteration: int, idle: int, ttl_s, where: str) -> int:
    """A run ended without committing ``iteration``: wait while another live controller
    holds it; two runs in a row that found nobody holding it raise ``NothingCommitted``."""
    from rlhf_core.trainer.lease import CONTROLLER_TTL_S

    if _wait_for_holder(istore, iteration, ttl_s or CONTROLLER_TTL_S):
        return idle
    if idle + 1 >= 2:
        raise NothingCommitted(f"run {istore.run_id}: iteration {iteration}: {idle + 1} pipeline runs in a row ended "
                               f"without committing it and nobody holds it; see {where}")
    return idle + 1


def local_init(pipeline_root: str) -> None:
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root, raise_on_error=True)


class _Runner:
    """A process that runs per-iteration pipeline runs on the KFP local runner, one at a
    time, for as long as its starter needs it: kfp is imported once, not once a run. Its
    output (the runner's and the components') goes to the log file; a line of JSON per
    run on a pipe of its own says how the run ended. In the starter's process group, so
    a Ctrl-C or a kill of the group reaches it and its components as before."""

    def __init__(self, pipeline_root: str, log_path: str | None) -> None:
        import queue
        import subprocess
        import threading

        self.log_path = log_path
        log = open(log_path, "ab") if log_path else None
        self.proc = subprocess.Popen([sys.executable, "-m", "pipelines.local", "--serve", "--root", pipeline_root],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1)
        if log is not None:
            log.close()
        self.results: "queue.Queue[dict]" = queue.Queue()
        self.waiting = False
        threading.Thread(target=self._read, name="runner-results", daemon=True).start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            if line.startswith("{"):
                self.results.put(json.loads(line))
        self.results.put({"ok": False, "error": f"the runner process ended (exit code {self.proc.wait()})"})

    def start(self, **params) -> "_Runner":
        import json

        self.waiting = True
        self.proc.stdin.write(json.dumps(params) + "\n")
        self.proc.stdin.flush()
        return self

    def result(self) -> dict | None:
        """How the run it is running ended, or None while it runs."""
        import queue

        try:
            out = self.results.get_nowait()
        except queue.Empty:
            return None
        self.waiting = False
        return out

    def close(self, kill: bool = False) -> None:
        """End the process: at once with everything it started when ``kill`` and a run is in
        flight (no longer wanted), else once it has read the end of its input."""
        import subprocess

        if self.proc.poll() is not None:
            return
        if kill and self.waiting:
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
    """The runner process's body: a run per line of JSON parameters on stdin."""
    import json
    import time

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the runner and the components print goes to the log, not the pipe
    sys.stdout = os.fdopen(1, "w", buffering=1)
    local_init(pipeline_root)
    from rlhf_core import probes

    from pipelines.ppo_iteration import ppo_iteration_local as ppo_iteration

    for line in sys.stdin:
        params = json.loads(line)
        os.environ["RLHF_PHASE_RUN"] = f"{os.getpid()}-{params.get('follows')}-{time.time()}"  # the components inherit it
        probes.phase("run_start")
        try:
            task = ppo_iteration(**params)
            out = {"ok": True, "outputs": {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}}
        except Exception as exc:  # noqa: BLE001 - reported to the starter, which stops the loop
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        probes.phase("run_end")
        sys.stdout.flush()
        proto.write(json.dumps(out) + "\n")
    return 0


def _wait_for_holder(istore, iteration: int, ttl_s: float, poll_s: float = 1.0) -> bool:
    """Wait while another live controller holds ``iteration``'s lease (one line says who);
    whether there was one."""
    import time

    log = istore.lease_log(iteration, ttl_s)
    waited = False
    while iteration not in istore.committed_iterations():
        latest = log.latest()
        if latest is None or log.is_free(latest[1], holder=""):
            break
        if not waited:
            print(f"[rlhf] iteration {iteration} of run {istore.run_id} is being run by {latest[1].get('holder')}; "
                  f"waiting for it to commit or end", flush=True)
            waited = True
        time.sleep(poll_s)
    return waited


@contextlib.contextmanager
def _runner_output(log_path: str | None):
    """The local runner's console output (it prints, and logs to the root logger) into
    ``log_path``; on failure the last lines are shown."""
    if log_path is None:
        yield
        return
    with open(log_path, "a", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            yield
        except KeyboardInterrupt:
            raise  # the user stopped it: the caller says what was kept, in one line
        except BaseException:
            log.flush()
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = f.readlines()[-40:]
            sys.__stderr__.write(f"[rlhf] the pipeline run failed; the end of {log_path}:\n" + "".join(tail))
            raise


def _next_parent(istore) -> str:
    from rlhf_core.trainer.restore import weights_checkpoint

    return weights_checkpoint(istore, len(istore.committed_iterations())) or ""


class LocalKfpStandIn:
    """A stand-in for the part of ``kfp.Client`` the fine-tune driver uses, answered on
    this machine: each submitted run executes the per-iteration pipeline with the KFP
    local runner in a process of its own (so the iterations really train, against the
    local head under ``head_root``). It is not a Kubeflow server: the pipeline package it
    is handed is ignored, the local per-iteration pipeline runs instead.

    ``fail`` maps the k-th submission (1-based) to a fault point (``RLHF_KILL_AT``, e.g.
    ``stage:reward``): that run's controller is SIGKILLed there, so the run fails mid-way.
    """

    def __init__(self, head_root: str, pipeline_root: str, fail: dict | None = None) -> None:
        self.head_root, self.pipeline_root = head_root, pipeline_root
        self.fail = dict(fail or {})
        self.runs: dict[str, object] = {}
        self.submitted: list[dict] = []
        self.terminated: set[str] = set()

    def run_pipeline(self, experiment_id: str, job_name: str, pipeline_package_path: str = "", params=None,
                     enable_caching: bool = False, **_):
        import subprocess
        import sys
        import uuid
        from types import SimpleNamespace

        from rlhf_core.run_ids import validate_run_id, validate_store_uri

        params = dict(params or {})
        # what the submitter handed over, checked before a process starts (as the components do)
        validate_run_id(params.get("run_id"), "params.run_id")
        validate_store_uri(params.get("store"), "params.store")
        kfp_run_id = uuid.uuid4().hex[:12]
        env = dict(os.environ)
        fault = self.fail.get(len(self.submitted) + 1)
        if fault:
            env["RLHF_KILL_AT"] = fault
        argv = [sys.executable, "-m", "pipelines.local", "--run-id", params["run_id"], "--store", params["store"],
                "--head-root", self.head_root, "--root", os.path.join(self.pipeline_root, kfp_run_id),
                "--lease-holder", params.get("lease_holder", ""), "--parent-model", params.get("parent_model", ""),
                *([] if params.get("prefetch_next", True) else ["--no-prefetch-next"]),
                "--follows", str(params.get("follows", -1)),
                *params.get("config_overrides", [])]
        log = open(os.path.join(self.pipeline_root, f"{kfp_run_id}.log"), "wb")
        self.runs[kfp_run_id] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.submitted.append({"name": job_name, "experiment_id": experiment_id, "params": params,
                               "kfp_run_id": kfp_run_id, "fault": fault})
        return SimpleNamespace(run_id=kfp_run_id)

    def get_run(self, run_id: str):
        from types import SimpleNamespace

        code = self.runs[run_id].poll()
        if code is not None and run_id in self.terminated:
            return SimpleNamespace(state="CANCELED")
        return SimpleNamespace(state="RUNNING" if code is None else ("SUCCEEDED" if code == 0 else "FAILED"))

    def terminate_run(self, run_id: str) -> None:
        """Terminate a run (kfp.Client's name): its process and what it started."""
        self.terminated.add(run_id)
        kill_tree(self.runs[run_id].pid)
        self.runs[run_id].wait()


def main(argv: list[str] | None = None) -> int:
    """One per-iteration pipeline run on the local runner (what the stand-in starts)."""
    import argparse

    from rlhf_core.cli_args import REQUIRED, add_run_arguments

    if argv is None and "--serve" in sys.argv[1:2]:  # a runner process of a pipelined `rlhf run`
        serving = argparse.ArgumentParser(prog="python -m pipelines.local --serve")
        serving.add_argument("--serve", action="store_true")
        serving.add_argument("--root", required=True)
        return _serve_runs(serving.parse_args().root)
    parser = argparse.ArgumentParser(prog="python -m pipelines.local")
    add_run_arguments(parser, store=REQUIRED, head_root=REQUIRED)
    parser.add_argument("--root", required=True)
    parser.add_argument("--lease-holder", default="")
    parser.add_argument("--parent-model", default="")
    parser.add_argument("--no-prefetch-next", dest="prefetch_next", action="store_false")
    parser.add_argument("--follows", type=int, default=-1, help="started ahead: wait for this iteration's commit")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    run_local_iterations(args.run_id, args.store, args.overrides, args.head_root, 1, args.root, args.lease_holder,
                         args.parent_model, args.prefetch_next, follows=args.follows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
