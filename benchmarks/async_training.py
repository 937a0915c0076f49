"""Asynchronous against synchronous training, side by side in one run of this script.

    .venv/bin/python benchmarks/async_training.py [--repeats 3] [--iterations 30]

The calculator task (examples/agent/calculator.yaml: the tool agent loop, generation about
as long as the update here) on this 2-core machine split as the issue asks: the trainer's
rank on one core and the rollout pool's replica on the other (``trainer.cpus_per_worker=1``,
one torch thread each), 32 prompts x 8 responses a step. Three modes, each a fresh
``rlhf run --direct`` process per repeat (seed = repeat):

- ``sync``: the same split, each side waiting for the other (``rollout.nnodes=1``);
- ``async-1``: one step of staleness, a sync every step (verl's one-step-off-policy);
- ``async-2``: two steps of staleness, a sync every step.

Printed and written to docs/measured/async_training.json (with the commit and machine),
each as the median over repeats with the spread and its ratio to ``sync`` measured in the
same run: seconds per trainer step (the median over a run's steps after the first, which
holds the start-up); the training wall time until the mean reward of 5 consecutive steps
first reaches 0.9, and at which step (what staleness costs per step shows there); the
async modes' mean staleness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout_balance import commit, machine  # noqa: E402

POOL = ["rollout.mode=async", "rollout.nnodes=1", "rollout.checkpoint_engine.backend=gloo"]
MODES = {
    "sync": POOL,
    "async-1": [*POOL, "async_training.enable=true", "async_training.trigger_parameter_sync_step=1",
                "async_training.staleness_threshold=1"],
    "async-2": [*POOL, "async_training.enable=true", "async_training.trigger_parameter_sync_step=1",
                "async_training.staleness_threshold=2"],
}


GOAL, WINDOW = 0.9, 5


def reached(rows: list[dict]) -> tuple[int | None, float | None]:
    """The first step whose last WINDOW steps' mean reward is >= GOAL, and the training
    wall time at its end (None, None: not reached)."""
    scores = [r["critic/score/mean"] for r in rows]
    for i in range(WINDOW - 1, len(rows)):
        if statistics.mean(scores[i - WINDOW + 1:i + 1]) >= GOAL:
            return i, rows[i]["wall_clock_s"]
    return None, None


def one_run(mode: str, seed: int, iterations: int, work: Path) -> dict:
    out = work / f"{mode}-{seed}"
    argv = [sys.executable, "-m", "rlhf_core.cli", "run", "--direct", "--iterations", str(iterations),
            "--config", str(ROOT / "examples" / "agent" / "calculator.yaml"),
            "--run-id", f"{mode}-{seed}", "--store", f"file://{work / 'store'}",
            "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.n=8",
            "trainer.cpus_per_worker=1", "trainer.progress=false", f"trainer.seed={seed}", f"rollout.seed={seed}",
            f"trainer.output_dir={out}", *MODES[mode]]
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / f"{mode}-{seed}" / "metrics.jsonl").read_text().splitlines()]
    at, to_goal = reached(rows)
    return {"step_s": statistics.median(r["timing_s/step"] for r in rows[1:]), "reached_at": at,
            "time_to_goal_s": to_goal, "rewards": [round(r["critic/score/mean"], 4) for r in rows],
            "staleness": statistics.mean(r.get("fully_async/staleness/mean", 0.0) for r in rows),
            "process_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "async_training.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):
            for mode in MODES:  # interleaved: a drift of the machine hits every mode alike
                runs[mode].append(one_run(mode, seed, args.iterations, Path(tmp)))
                print(f"{mode} seed {seed}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(r["step_s"] for r in runs["sync"])
    goal_base = median_reached([r["time_to_goal_s"] for r in runs["sync"]])
    result = {"commit": commit(), "machine": machine(), "measured": time.strftime("%Y-%m-%d"),
              "repeats": args.repeats, "iterations": args.iterations, "goal": f"{WINDOW}-step mean reward >= {GOAL}",
              "modes": {}}
    print(f"{'mode':<8} {'s/step [min, max]':<20} {'x sync':<7} {'s to goal [min, max]':<22} {'x sync':<7} "
          f"{'at step':<9} staleness")
    for mode, rs in runs.items():
        steps, to_goal = [r["step_s"] for r in rs], [r["time_to_goal_s"] for r in rs]
        goal = median_reached(to_goal)
        entry = {"runs": rs, "step_s_median": statistics.median(steps), "ratio_to_sync": statistics.median(steps) / base,
                 "time_to_goal_s_median": goal, "time_to_goal_ratio": goal / goal_base if goal and goal_base else None,
                 "reached_at": [r["reached_at"] for r in rs],
                 "staleness_mean": statistics.mean(r["staleness"] for r in rs)}
        result["modes"][mode] = entry
        print(f"{mode:<8} {entry['step_s_median']:.2f} [{min(steps):.2f}, {max(steps):.2f}]{'':<6} "
              f"{entry['ratio_to_sync']:<7.2f} {spread(to_goal):<22} "
              f"{entry['time_to_goal_ratio'] if entry['time_to_goal_ratio'] is None else round(entry['time_to_goal_ratio'], 2)!s:<7} "
              f"{','.join(str(r) for r in entry['reached_at']):<9} {entry['staleness_mean']:.2f}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")
    if args.out == parser.get_default("out"):
        write_doc_table(result)


def median_reached(values: list) -> float | None:
    """The median over runs, a run that never reached the goal counting as the slowest;
    None when half or more never reached it."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    middle = ordered[(len(ordered) - 1) // 2]
    return middle


def spread(values: list) -> str:
    """``median [min, max]`` of seconds, "never" for a run that did not reach the goal."""
    shown = ["never" if v is None else f"{v:.1f}" for v in sorted(values, key=lambda v: float("inf") if v is None
                                                                     else v)]
    return f"{shown[(len(shown) - 1) // 2]} [{shown[0]}, {shown[-1]}]"


def write_doc_table(result: dict) -> None:
    """The measured table into docs/async.md, between its markers."""
    doc = ROOT / "docs" / "async.md"
    begin, end = "<!-- async_training:begin -->", "<!-- async_training:end -->"
    text = doc.read_text()
    lines = [begin, "",
             f"`benchmarks/async_training.py` at commit {result['commit']}, {result['machine']['cores']} cores "
             f"({result['machine']['cpu']}), {result['measured']}: {result['repeats']} repeats of "
             f"up to {result['iterations']} steps per mode and seed, the calculator task, 32 prompts x 8 "
             f"responses a step; goal: {result['goal']}.", "",
             "| mode | s per step, median [min, max] | x sync | training s to the goal, median [min, max] | x sync "
             "| step reached, per seed | mean staleness |",
             "|---|---|---|---|---|---|---|"]
    for mode, e in result["modes"].items():
        steps = [r["step_s"] for r in e["runs"]]
        ratio = "-" if e["time_to_goal_ratio"] is None else f"{e['time_to_goal_ratio']:.2f}"
        lines.append(f"| {mode} | {e['step_s_median']:.2f} [{min(steps):.2f}, {max(steps):.2f}] | "
                     f"{e['ratio_to_sync']:.2f} | {spread([r['time_to_goal_s'] for r in e['runs']])} | {ratio} | "
                     f"{', '.join('never' if r is None else str(r) for r in e['reached_at'])} | "
                     f"{e['staleness_mean']:.2f} |")
    lines += ["", end]
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(head + "\n".join(lines) + tail)


if __name__ == "__main__":
    main()
