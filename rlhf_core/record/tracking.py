"""Each committed iteration sent to the trackers ``trainer.logger`` lists (verl's names).

The store stays the record of truth: a tracker is a copy, and one that fails costs a
warning, never an iteration.

- ``console``: the progress line (printed by the run itself, listed or not);
- ``mlflow`` (when ``MLFLOW_TRACKING_URI`` is set): one MLflow run per rlhf run (found
  again by its ``rlhf.run_id`` tag, so each Kubeflow iteration's fresh controller process
  appends to it): the config as params, every numeric metric at ``step = iteration``, the
  iteration's lineage (parent, config hash, code version, checkpoint, data cursor,
  snapshots) as ``lineage/iter-NNNNNN.json``;
- ``wandb``: one W&B run per rlhf run (its id derived from the run id, resumed by each
  process): config, metrics at ``step = iteration``, validation samples as a table.
  Offline (a run folder ``wandb sync`` uploads later) unless ``WANDB_API_KEY`` or
  ``WANDB_MODE`` says otherwise; under ``$WANDB_DIR`` or the run's output folder;
- ``tensorboard``: event files under ``$TENSORBOARD_DIR`` or ``<run output>/tensorboard``:
  every metric as a scalar, validation samples as text.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import time
from pathlib import Path

from rlhf_core.config import LOGGERS, listed_loggers

#: The Python package each optional tracker needs (pip install 'rlhf-core[trackers]').
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}

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


def exports(logger: str) -> bool:
    """Whether ``logger`` lists a tracker that would receive an iteration here."""
    return any(name in ("wandb", "tensorboard") or name == "mlflow" and enabled() for name in listed_loggers(logger))


def missing_packages(logger: str) -> list[str]:
    """The trackers ``trainer.logger`` lists whose package is not installed (mlflow only
    counts when MLFLOW_TRACKING_URI asks for it)."""
    import importlib.util

    wanted = [name for name in listed_loggers(logger) if name in PACKAGES and (name != "mlflow" or enabled())]
    return [name for name in wanted if importlib.util.find_spec(PACKAGES[name]) is None]


def export_iteration(run_id: str, manifest: dict, val_generations: list[dict] | None = None,
                     logger: str = "console,mlflow", run_dir: Path | None = None) -> dict[str, str]:
    """Send one committed iteration (and its validation samples, trainer.log_val_generations)
    to every tracker ``logger`` lists; returns what each wrote to (its run id or folder)."""
    written = {}
    for name in listed_loggers(logger):
        if name == "mlflow" and not enabled() or name == "console":
            continue
        try:
            written[name] = EXPORTERS[name](run_id, manifest, val_generations or [], run_dir or Path("."))
        except Exception as exc:  # tracking is a copy; never fail training over it
            print(f"[rlhf] {name} export of iteration {manifest.get('iteration')} failed: {exc}", file=sys.stderr)
    return written


def _mlflow(run_id: str, manifest: dict, val_generations: list[dict], run_dir: Path) -> str:
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


_WANDB_RUNS: dict = {}


def _wandb(run_id: str, manifest: dict, val_generations: list[dict], run_dir: Path) -> str:
    import wandb

    run = _WANDB_RUNS.get(run_id)
    if run is None:
        trainer = manifest.get("config", {}).get("trainer", {})
        online = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else None)
        if online is None:
            print(f"[rlhf] wandb: offline (no WANDB_API_KEY or WANDB_MODE); `wandb sync` uploads the run folder "
                  f"later", file=sys.stderr)
        folder = Path(os.environ.get("WANDB_DIR") or run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=trainer.get("project_name") or "rlhf", name=trainer.get("experiment_name") or run_id,
                         id=wandb_id(run_id), resume="allow", dir=str(folder), config=manifest.get("config") or {},
                         mode=online or "offline", settings=wandb.Settings(silent=True))
        _WANDB_RUNS[run_id] = run
        atexit.register(run.finish)
    n = manifest["iteration"]
    data = {k: float(v) for k, v in manifest["metrics"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if val_generations:
        data["val/generations"] = wandb.Table(columns=["step", "input", "output", "score"],
                                              data=[[n, s["input"], s["output"], s["score"]] for s in val_generations])
    run.log(data, step=n)
    return run.dir


def wandb_id(run_id: str) -> str:
    """A W&B run id for an rlhf run id (W&B allows letters, digits, - and _)."""
    return "rlhf-" + re.sub(r"[^A-Za-z0-9_-]", "-", run_id)


_TENSORBOARD_WRITERS: dict = {}


def _tensorboard(run_id: str, manifest: dict, val_generations: list[dict], run_dir: Path) -> str:
    writer = _TENSORBOARD_WRITERS.get(run_id)
    if writer is None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=os.environ.get("TENSORBOARD_DIR") or str(Path(run_dir) / "tensorboard"))
        _TENSORBOARD_WRITERS[run_id] = writer
        atexit.register(writer.close)
    n = manifest["iteration"]
    for key, value in sorted(manifest["metrics"].items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(key, float(value), n)
    if val_generations:  # TensorBoard renders text as Markdown
        rows = [f"| {s['input']!r} | {s['output']!r} | {s['score']:.3f} |" for s in val_generations]
        writer.add_text("val/generations", "\n".join(["| input | output | score |", "|---|---|---|", *rows]), n)
    writer.flush()
    return writer.log_dir


def close() -> None:
    """Finish every W&B run and close every TensorBoard writer this process opened (each
    also closes at exit)."""
    while _WANDB_RUNS:
        _WANDB_RUNS.popitem()[1].finish()
    while _TENSORBOARD_WRITERS:
        _TENSORBOARD_WRITERS.popitem()[1].close()


#: trainer.logger's trackers that send an iteration somewhere (console: the progress line).
EXPORTERS = {"mlflow": _mlflow, "wandb": _wandb, "tensorboard": _tensorboard}
assert set(EXPORTERS) | {"console"} == set(LOGGERS)
