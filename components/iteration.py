"""Kubeflow components for one PPO iteration: thin, typed wrappers over rlhf_core.

``run_iteration`` is the controller of one pipeline run: it checks the parent checkpoint it
was given, takes the lease holder's name from the KFP run and task, connects to the
session's cluster, runs the iteration (``rlhf_core.session.iteration.iterate``) and writes
the report and the output artifacts. Artifacts carry URIs and lineage metadata (run id,
iteration, config hash, code version, parent), never bytes.
"""


import os

from kfp import dsl

from components.kuberay.spec import DEFAULT_IMAGE

IMAGE = os.environ.get("RLHF_IMAGE", DEFAULT_IMAGE)
#: Every component says ``install_kfp_package=False``: the image has kfp at the version the
#: pipelines were compiled with (pyproject.toml pins it), so no pod runs ``pip install kfp``
#: before it starts (~0.9 s of CPU and 1.5 s of every pod start here, more where pip
#: reaches for an index).


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def run_iteration(run_id: str, store: str, config: str, config_hash: str, head_root: str, ray_address: str,
                  snapshots: dsl.Output[dsl.Dataset], model: dsl.Output[dsl.Model],
                  metrics: dsl.Output[dsl.Metrics], summary: dsl.Output[dsl.Markdown],
                  dashboard_url: str = "", kfp_run_id: str = "",
                  kfp_task: str = "", attempt: str = "", prefetch_next: bool = True, follows: int = -1,
                  parent: dsl.Input[dsl.Model] = None) -> int:
    """One iteration against the session; resumes at the first uncommitted stage, so a
    retry after a failure is safe. Returns the iteration number (-1: another trigger
    holds the iteration's lease). The lease holder is the KFP run and task, as KFP
    resolves them (no run parameter names it: a cloned run is another holder); a KFP retry
    of this task, another pod, takes the lease over once the pod before it is known dead
    or missed a renewal. ``attempt``: the fine-tune driver's tag for this run, carried in
    its lease records (the driver releases a run's lease by it once the run is over). ``parent``: the checkpoint this iteration starts
    from (imported, so KFP's lineage links the runs); a run that has moved on since the
    submitter looked is refused. ``prefetch_next``: have the session compute the next
    iteration's inference stages ahead (the driver says False for a fine-tune's last).
    ``follows`` (>= 0: a run started ahead, pipelined): this process starts, imports and
    connects while iteration ``follows`` still runs, then waits for its commit; ``parent``
    is what that iteration's controller announced, checked after the wait. When that
    iteration ends uncommitted, or was committed by another attempt with another
    checkpoint, this run does nothing (returns -1) and its starter starts it again.
    ``summary``: the run so far for the Kubeflow UI (reward curve, metrics, sampled
    responses), written here rather than by a pod of its own: one process start less
    per iteration, and this process has the libraries loaded already."""

    from rlhf_core.runtime import probes
    from rlhf_core.record.run_ids import validate_run_id, validate_store_uri

    # the parameters are whatever the submitter typed: checked before the store is touched
    validate_run_id(run_id, "run_id")
    validate_store_uri(store, "store")
    probes.phase("process_start")  # benchmarks/orchestration.py's breakdown; no-op otherwise
    probes.phase("body_start")
    from rlhf_core.runtime import ray_head
    from rlhf_core.session import session
    from rlhf_core.config import config_from_handover
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.report import markdown_report
    from rlhf_core.session.iteration import attach_ahead, iterate, wait_for_commit

    probes.phase("imported")
    probes.pod_started()  # no-op unless a benchmark simulates pod scheduling

    istore = IterationStore(RunRef(store, run_id))
    expected: dict = {}  # the iteration the parent check found next: the one this run may run

    def parent_differs(step: int | None = None) -> str:
        """Why ``parent`` is not the checkpoint iteration ``step`` (default: the next one)
        starts from, or ""."""
        from rlhf_core.record.checkpoints import weights_checkpoint

        expected["iteration"] = len(istore.committed_iterations()) if step is None else step
        starts_from = weights_checkpoint(istore, expected["iteration"])
        if parent is None or parent.uri.rstrip("/") == (starts_from or ""):
            return ""
        return (f"parent_model: expected the checkpoint run {run_id} continues from, "
                f"{starts_from or 'none yet (its initial checkpoint is not written)'}; found {parent.uri}")

    if follows < 0 and parent_differs():  # refused before anything else: the submitter looked at a stale store
        raise ValueError(parent_differs())

    lease_holder = ""  # this process, when KFP resolved no placeholders (a run outside KFP)
    if kfp_run_id and kfp_task and "{{" not in kfp_run_id + kfp_task:
        lease_holder = f"kfp:{kfp_run_id}/{kfp_task}"

    cfg = config_from_handover(config, config_hash)
    cfg.trainer.progress = False  # no progress bars in a pod's log (not part of the hash)
    # with a dashboard URL the cluster is a remote one (KubeRay); else this machine's head
    info = ray_head.resolve_head(head_root, ray_address if dashboard_url else "", dashboard_url)
    ray_head.connect(info, session.namespace_of(run_id))
    probes.phase("connected")
    result, attached = {"rows": []}, None
    if follows >= 0:
        attached = attach_ahead(cfg, run_id)
    if follows >= 0 and not wait_for_commit(istore, follows, log=print):
        pass  # the iteration before never committed: its starter starts both again
    elif follows >= 0 and parent_differs(follows + 1):  # another attempt committed it, with another checkpoint
        print(f"{parent_differs(follows + 1)}: iteration {follows} was committed by another attempt than the one "
              f"this run was started after; this run does nothing")
    else:
        probes.phase("waited")
        result = iterate(cfg, istore, info, 1, log=print, prefetch_next=prefetch_next, attached=attached,
                         only_iteration=follows + 1 if follows >= 0 else
                         expected.get("iteration") if parent is not None else None, lease_holder=lease_holder,
                         attempt=attempt)
    probes.phase("iterated")
    ray_head.disconnect()  # now, not at interpreter exit: a second or so sooner
    probes.phase("disconnected")
    if result.get("lease_held_by"):
        print(f"iteration is being run by {result['lease_held_by']}; this trigger does nothing")
    with open(summary.path, "w", encoding="utf-8") as f:
        f.write(markdown_report(istore))
    probes.phase("reported")
    from components.process import exit_without_teardown

    exit_without_teardown()
    if not result["rows"]:
        return -1
    lineage = result["lineage"]
    snapshots.uri = lineage["iteration_uri"]
    # the checkpoint the iteration's weights come from: its own, or an earlier one plus a
    # redo of the committed updates after it (trainer.checkpoint_every > 1), said in metadata
    model.uri = lineage["checkpoint"]
    for artifact in (snapshots, model):
        artifact.metadata.update({k: lineage[k] for k in ("run_id", "iteration", "config_hash", "parent_iteration")})
        artifact.metadata["code_version"] = lineage["code_version"]["source_sha256"]
    model.metadata.update({"checkpoint_step": lineage["checkpoint_step"], "redo_iterations": lineage["redo"]})
    for key, value in result["rows"][-1].items():
        if isinstance(value, (int, float)) and not key.startswith(("timing_worker", "perf/worker")):
            metrics.log_metric(key.replace("/", "."), float(value))
    return int(lineage["iteration"])
