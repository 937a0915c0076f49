"""K iterations as Kubeflow pipeline runs (KFP local runner, long-lived session) vs the
same K iterations run directly by one controller process. Same run config, same machine.

    .venv/bin/python benchmarks/orchestration.py [--iterations 5]

Both are timed end to end as a user runs them (`rlhf run` vs `rlhf run --direct`),
start-up included; the difference divided by K is the per-iteration overhead of running
each iteration as its own pipeline run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_run(mode: list[str], iterations: int, out: Path) -> float:
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-m", "rlhf_core.cli", "run", *mode, "--iterations", str(iterations), "--run-id", "bench",
            "trainer.progress=false", f"trainer.output_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return elapsed


def steady_state(out: Path) -> tuple[float, float]:
    """(seconds per pipeline run, seconds of training per iteration) after the first
    iteration: pipeline runs from the start times the KFP local runner puts in each
    run's folder name, training from metrics.jsonl."""
    import datetime as dt
    import json

    starts = sorted(dt.datetime.strptime(p.name[-26:], "%Y-%m-%d-%H-%M-%S-%f")
                    for p in (out / "bench" / "kfp").iterdir() if p.name.startswith("rlhf-ppo-iteration-"))
    rows = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    per_run = (starts[-1] - starts[1]).total_seconds() / (len(starts) - 2)
    return per_run, sum(r["timing_s/iteration"] for r in rows[1:-1]) / (len(rows) - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    k = args.iterations
    if k < 3:
        parser.error("--iterations: at least 3 (steady state is measured between runs 2 and K)")
    work = Path(tempfile.mkdtemp(prefix="rlhf-orch-"))
    direct = timed_run(["--direct"], k, work / "direct")
    pipeline = timed_run([], k, work / "pipeline")  # starts and stops its own head
    print(f"\n{k} iterations, default config, start-up included")
    print(f"{'mode':<34}{'wall s':>9}")
    print(f"{'direct (one controller process)':<34}{direct:>9.1f}")
    print(f"{'KFP local pipeline runs':<34}{pipeline:>9.1f}")
    print(f"ratio pipeline/direct: {pipeline / direct:.2f}x (goal <= 1.10x); per-iteration overhead: "
          f"{(pipeline - direct) / k:.1f} s")
    per_run, training = steady_state(work / "pipeline")
    print(f"steady state (runs 2..{k}): {per_run:.1f} s per pipeline run for {training:.1f} s of training "
          f"({per_run - training:.1f} s of orchestration per iteration)")


if __name__ == "__main__":
    main()
