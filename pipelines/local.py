"""Run the per-iteration pipeline on this machine with the KFP local runner.

Each iteration is one pipeline run (components as subprocesses of this Python), against
the run's session on this project's own Ray head and a ``file://`` (or any) store.
"""

import contextlib
import os
import shutil
import sys
from pathlib import Path

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


def run_local_iterations(run_id: str, store: str, overrides: list, head_root: str, iterations: int,
                         pipeline_root: str, lease_holder: str = "", parent_model: str = "",
                         prefetch_next: bool = True, on_run=None, log_path: str | None = None,
                         wait_if_held: bool = False, lease_ttl_s: float | None = None) -> list[dict]:
    """``iterations`` runs of the per-iteration pipeline, one after the other, each given
    the checkpoint it continues from (``parent_model`` for the first when the caller
    knows it, else read from the store, as the fine-tune driver does). The session
    computes ahead after every run but the last, and after the last if ``prefetch_next``.
    ``on_run(k)`` is called after the k-th run (0-based) finished. With ``log_path``, what
    the local runner prints (task logs, outputs) is appended to that file instead of the
    console; when a run fails, the end of it is shown.

    ``wait_if_held`` (``rlhf run``): a run that commits nothing because another live
    controller holds the iteration's lease is followed by a wait until that one commits or
    its lease frees, then a new run; ``NothingCommitted`` when a run commits nothing with
    nobody holding it (twice in a row). Without it (one run for the fine-tune driver,
    which decides itself) the runs are returned as they ended."""
    from rlhf_core.run_ids import validate_run_id, validate_store_uri
    from rlhf_core.trainer.iteration_store import IterationStore
    from rlhf_core.trainer.lease import CONTROLLER_TTL_S

    validate_run_id(run_id, "run_id")  # before the runner starts or the store is resolved
    validate_store_uri(store, "store")
    from kfp import local

    from pipelines.ppo_iteration import ppo_iteration_local as ppo_iteration

    Path(pipeline_root).mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root,
               raise_on_error=True)
    from rlhf_core import probes

    runs, istore = [], IterationStore(store, run_id)
    k, idle = 0, 0
    while k < iterations:
        before = len(istore.committed_iterations())
        probes.phase("run_start")  # benchmarks/orchestration.py's breakdown; no-op otherwise
        with _runner_output(log_path):
            task = ppo_iteration(run_id=run_id, store=store, config_overrides=list(overrides),
                                 head_root=os.path.abspath(head_root), lease_holder=lease_holder,
                                 parent_model=parent_model if k == 0 and parent_model else _next_parent(istore),
                                 prefetch_next=prefetch_next or k + 1 < iterations)
        probes.phase("run_end")
        runs.append({"outputs": {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}})
        prune_run_folders(pipeline_root)
        if wait_if_held and len(istore.committed_iterations()) == before:
            if not _wait_for_holder(istore, before, lease_ttl_s or CONTROLLER_TTL_S):
                idle += 1
                if idle >= 2:
                    raise NothingCommitted(f"run {run_id}: iteration {before}: {idle} pipeline runs in a row ended "
                                           f"without committing it and nobody holds it; see {log_path or pipeline_root}")
            continue
        idle = 0
        if on_run is not None:
            on_run(k)
        k += 1
    return runs


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
                *params.get("config_overrides", [])]
        log = open(os.path.join(self.pipeline_root, f"{kfp_run_id}.log"), "wb")
        self.runs[kfp_run_id] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.submitted.append({"name": job_name, "experiment_id": experiment_id, "params": params,
                               "kfp_run_id": kfp_run_id, "fault": fault})
        return SimpleNamespace(run_id=kfp_run_id)

    def get_run(self, run_id: str):
        from types import SimpleNamespace

        code = self.runs[run_id].poll()
        return SimpleNamespace(state="RUNNING" if code is None else ("SUCCEEDED" if code == 0 else "FAILED"))


def main(argv: list[str] | None = None) -> int:
    """One per-iteration pipeline run on the local runner (what the stand-in starts)."""
    import argparse

    from rlhf_core.cli_args import REQUIRED, add_run_arguments

    parser = argparse.ArgumentParser(prog="python -m pipelines.local")
    add_run_arguments(parser, store=REQUIRED, head_root=REQUIRED)
    parser.add_argument("--root", required=True)
    parser.add_argument("--lease-holder", default="")
    parser.add_argument("--parent-model", default="")
    parser.add_argument("--no-prefetch-next", dest="prefetch_next", action="store_false")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    run_local_iterations(args.run_id, args.store, args.overrides, args.head_root, 1, args.root, args.lease_holder,
                         args.parent_model, args.prefetch_next)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
