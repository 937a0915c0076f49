"""Run the per-iteration pipeline on this machine with the KFP local runner.

Each iteration is one pipeline run (components as subprocesses of this Python), against
the run's session on this project's own Ray head and a ``file://`` (or any) store.
"""

import os
import shutil
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


def run_local_iterations(run_id: str, store: str, overrides: list, head_root: str, iterations: int,
                         pipeline_root: str) -> list[dict]:
    from kfp import local

    from pipelines.ppo_iteration import ppo_iteration

    Path(pipeline_root).mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root,
               raise_on_error=True)
    runs = []
    for _ in range(iterations):
        task = ppo_iteration(run_id=run_id, store=store, config_overrides=list(overrides),
                             head_root=os.path.abspath(head_root))
        runs.append({"outputs": {k: getattr(v, "uri", v) for k, v in (task.outputs or {}).items()}})
        prune_run_folders(pipeline_root)
    return runs
