"""Optional export of each committed iteration to MLflow, when ``MLFLOW_TRACKING_URI`` is set.

One MLflow run per rlhf run (found again by its ``rlhf.run_id`` tag, so each Kubeflow
iteration's fresh controller process appends to it): the config as params, every numeric
metric at ``step = iteration``, and the iteration's lineage (parent, config hash, code
version, checkpoint, data cursor, snapshots) as ``lineage/iter-NNNNNN.json``. The store
stays the record of truth; a tracking server that is down costs a warning, never an
iteration.
"""

from __future__ import annotations

import os
import sys
import time

#: MLflow's own variable for the active experiment: the default when trainer.project_name is unset
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def mlflow_name(metric: str) -> str:
    """A metric's name as MLflow accepts it: validation's ``mean@4`` becomes ``mean_at_4``
    (MLflow refuses '@'; verl's MLflow logger renames it the same way)."""
    return metric.replace("@", "_at_")


def enabled() -> bool:
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


def export_iteration(run_id: str, manifest: dict, val_generations: list[dict] | None = None) -> str | None:
    """Log one committed iteration (and its validation samples, trainer.log_val_generations);
    returns the MLflow run id (None when not configured)."""
    if not enabled():
        return None
    try:
        return _export(run_id, manifest, val_generations or [])
    except Exception as exc:  # tracking is a copy; never fail training over it
        print(f"[rlhf] MLflow export of iteration {manifest.get('iteration')} failed: {exc}", file=sys.stderr)
        return None


def _export(run_id: str, manifest: dict, val_generations: list[dict]) -> str:
    import mlflow
    from mlflow.entities import Metric, Param

    client = mlflow.MlflowClient()
    trainer = manifest.get("config", {}).get("trainer", {})  # verl's project / experiment names, when set
    name = trainer.get("project_name") or os.environ.get(EXPERIMENT_ENV, "rlhf")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    found = client.search_runs([experiment_id], filter_string=f"tags.`rlhf.run_id` = '{run_id}'", max_results=1)
    if found:
        mlflow_run = found[0].info.run_id
    else:
        mlflow_run = client.create_run(experiment_id, run_name=trainer.get("experiment_name") or run_id, tags={
            "rlhf.run_id": run_id, "rlhf.config_hash": manifest["config_hash"]}).info.run_id
        params = [Param(k, v[:500]) for k, v in sorted(_flat(manifest["config"]).items())]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(mlflow_run, params=params[i:i + 100])
    n, now = manifest["iteration"], int(time.time() * 1000)
    metrics = [Metric(mlflow_name(k), float(v), now, n) for k, v in sorted(manifest["metrics"].items())
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for i in range(0, len(metrics), 1000):
        client.log_batch(mlflow_run, metrics=metrics[i:i + 1000])
    lineage = {k: manifest.get(k) for k in ("iteration", "parent_iteration", "config_hash", "code_version",
                                            "checkpoint", "weights", "data_cursor", "global_step", "kl_coef",
                                            "snapshots")}
    from rlhf_core.record.run_layout import iteration_dir

    client.log_dict(mlflow_run, lineage, f"lineage/{iteration_dir(n)}.json")
    if val_generations:
        client.log_dict(mlflow_run, {"step": n, "samples": val_generations}, f"val_generations/{iteration_dir(n)}.json")
    client.set_tag(mlflow_run, "rlhf.last_iteration", str(n))
    # the checkpoint the weights come from; a redo of the iterations listed completes them
    client.set_tag(mlflow_run, "rlhf.last_checkpoint", manifest["weights"]["checkpoint"])
    client.set_tag(mlflow_run, "rlhf.last_checkpoint_redo", ",".join(str(i) for i in manifest["weights"]["redo"]))
    return mlflow_run
