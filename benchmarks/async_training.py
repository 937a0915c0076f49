"""Asynchronous against synchronous training, side by side in one run of this script.

    .venv/bin/python benchmarks/async_training.py [--repeats 3] [--iterations 8]

The built-in task on this 2-core machine split as the issue asks: the trainer's rank on
one core and the rollout pool's replica on the other (``trainer.cpus_per_worker=1``, one
torch thread each). Three modes, each a fresh ``rlhf run --direct`` process per repeat
(seed = repeat):

- ``sync``: the same split, each side waiting for the other (``rollout.nnodes=1``);
- ``async-1``: one step of staleness, a sync every step (verl's one-step-off-policy);
- ``async-2``: two steps of staleness, a sync every step.

Printed and written to docs/measured/async_training.json (with the commit and machine):
seconds per trainer step (the median over a run's steps after the first, which holds the
start-up), median over repeats with the spread, its ratio to ``sync`` measured in the
same run, the mean reward over the run's steps (what staleness costs per step), and the
async modes' mean staleness.

Not measured here yet: issue [3/7]'s wall time to a 5-iteration mean of 0.9 over 3 seeds
(runs of minutes each).
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


def one_run(mode: str, seed: int, iterations: int, work: Path) -> dict:
    out = work / f"{mode}-{seed}"
    argv = [sys.executable, "-m", "rlhf_core.cli", "run", "--direct", "--iterations", str(iterations),
            "--run-id", f"{mode}-{seed}", "--store", f"file://{work / 'store'}",
            "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.n=8", "actor.ppo_epochs=2",
            "trainer.cpus_per_worker=1", "trainer.progress=false", f"trainer.seed={seed}", f"rollout.seed={seed}",
            f"trainer.output_dir={out}", *MODES[mode]]
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / f"{mode}-{seed}" / "metrics.jsonl").read_text().splitlines()]
    return {"step_s": statistics.median(r["timing_s/step"] for r in rows[1:]),
            "reward": statistics.mean(r["critic/score/mean"] for r in rows),
            "staleness": statistics.mean(r.get("fully_async/staleness/mean", 0.0) for r in rows),
            "process_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "async_training.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):
            for mode in MODES:  # interleaved: a drift of the machine hits every mode alike
                runs[mode].append(one_run(mode, seed, args.iterations, Path(tmp)))
                print(f"{mode} seed {seed}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    base = statistics.median(r["step_s"] for r in runs["sync"])
    result = {"commit": commit(), "machine": machine(), "measured": time.strftime("%Y-%m-%d"),
              "repeats": args.repeats, "iterations": args.iterations, "modes": {}}
    print(f"{'mode':<8} {'s/step median [min, max]':<28} {'x sync':<7} {'reward/step':<12} staleness")
    for mode, rs in runs.items():
        steps = [r["step_s"] for r in rs]
        entry = {"step_s": steps, "step_s_median": statistics.median(steps),
                 "ratio_to_sync": statistics.median(steps) / base,
                 "reward_mean": statistics.mean(r["reward"] for r in rs),
                 "staleness_mean": statistics.mean(r["staleness"] for r in rs)}
        result["modes"][mode] = entry
        print(f"{mode:<8} {entry['step_s_median']:.2f} [{min(steps):.2f}, {max(steps):.2f}]{'':<10} "
              f"{entry['ratio_to_sync']:<7.2f} {entry['reward_mean']:<12.3f} {entry['staleness_mean']:.2f}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")
    if args.out == parser.get_default("out"):
        write_doc_table(result)


def write_doc_table(result: dict) -> None:
    """The measured table into docs/async.md, between its markers."""
    doc = ROOT / "docs" / "async.md"
    begin, end = "<!-- async_training:begin -->", "<!-- async_training:end -->"
    text = doc.read_text()
    lines = [begin, "",
             f"`benchmarks/async_training.py` at commit {result['commit']}, {result['machine']['cores']} cores "
             f"({result['machine']['cpu']}), {result['measured']}: {result['repeats']} repeats of "
             f"{result['iterations']} steps per mode, 32 prompts x 8 responses a step.", "",
             "| mode | s per step, median [min, max] | x sync | mean reward per step | mean staleness |",
             "|---|---|---|---|---|"]
    for mode, e in result["modes"].items():
        lines.append(f"| {mode} | {e['step_s_median']:.2f} [{min(e['step_s']):.2f}, {max(e['step_s']):.2f}] | "
                     f"{e['ratio_to_sync']:.2f} | {e['reward_mean']:.3f} | {e['staleness_mean']:.2f} |")
    lines += ["", end]
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(head + "\n".join(lines) + tail)


if __name__ == "__main__":
    main()
