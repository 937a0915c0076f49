"""Run the per-iteration pipeline on this machine with the KFP local runner.

Each iteration is one pipeline run (components as subprocesses of this Python), against
the run's session on this project's own Ray head and a ``file://`` (or any) store.
"""

import os
from pathlib import Path


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
    return runs
