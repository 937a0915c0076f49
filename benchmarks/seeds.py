"""Does the main job learn on every seed? One `rlhf run --direct` per seed, then a table.

    .venv/bin/python benchmarks/seeds.py [--seeds 0,1,2,3,4] [--iterations 60] [key=value ...]

Each seed runs in a process of its own (`rlhf run --direct trainer.seed=S`, the same
iterations as the README's first command, bit for bit) with the given overrides, one
after the other (the machine has two cores). With `--fresh-cache` each seed also builds
its model from an empty cache (the warm-start included in its wall time). Prints, per
seed: the mean reward at a few iterations, the first iteration whose mean over the last
5 is >= 0.9, the mean of the last 5 (the model a user keeps), exact matches and entropy
at the end, and the wall time; `--plot FILE` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 5      # the README's "mean of the last 5" (rlhf_core.trainer.progress.REWARD_WINDOW)
TARGET = 0.9


def first_reaching(rewards: list[float], target: float = TARGET) -> int | None:
    """The first iteration at which the mean of the last WINDOW rewards is >= target."""
    for i in range(WINDOW - 1, len(rewards)):
        if sum(rewards[i - WINDOW + 1:i + 1]) / WINDOW >= target:
            return i
    return None


def run_seed(seed: int, iterations: int, overrides: list[str], work: Path, fresh_cache: bool) -> dict:
    out = work / f"seed-{seed}"
    env = dict(os.environ)
    if fresh_cache:
        env["RLHF_CACHE"] = str(work / f"cache-{seed}")
    cmd = [str(ROOT / ".venv" / "bin" / "rlhf"), "run", "--direct", "--iterations", str(iterations),
           "--store", "file://" + str(out / "store"), f"trainer.seed={seed}", f"trainer.output_dir={out}",
           "trainer.progress=false", *overrides]
    t0 = time.monotonic()
    with open(work / f"seed-{seed}.log", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    metrics = next(out.glob("run-*/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"seed": seed, "wall_s": wall, "rows": rows}


def table(results: list[dict]) -> str:
    n = len(results[0]["rows"])
    marks = sorted({0, n // 3, 2 * n // 3, n - 1})
    head = ["seed", *(f"@{m}" for m in marks), "first >= 0.9", "last 5", "exact", "entropy", "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        rewards = [row["critic/score/mean"] for row in r["rows"]]
        first = first_reaching(rewards)
        last = r["rows"][-1]
        cells = [str(r["seed"]), *(f"{rewards[m]:.3f}" for m in marks), "never" if first is None else str(first),
                 f"{sum(rewards[-WINDOW:]) / WINDOW:.3f}", f"{last.get('critic/reward_extra/exact/mean', float('nan')):.2f}",
                 f"{last.get('actor/entropy', float('nan')):.2f}", f"{r['wall_s'] / 60:.1f} min"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in results:
        ax.plot([row["critic/score/mean"] for row in r["rows"]], label=f"seed {r['seed']}", lw=1.2)
    ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--iterations", type=int, default=None, help="default: trainer.total_iterations")
    parser.add_argument("--fresh-cache", action="store_true", help="each seed builds its model in an empty cache")
    parser.add_argument("--plot", default=None, help="write the reward curves to this PNG")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (printed)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from rlhf_core.config import RunConfig, apply_overrides

    cfg = apply_overrides(RunConfig(), args.overrides).validate()  # refuse a bad override before any run
    iterations = args.iterations or cfg.trainer.total_iterations
    work = Path(tempfile.mkdtemp(prefix="rlhf-seeds-"))
    results = []
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run_seed(seed, iterations, args.overrides, work, args.fresh_cache)
            rewards = [row["critic/score/mean"] for row in r["rows"]]
            print(f"[seeds] seed {seed}: {len(rewards)} iterations in {r['wall_s']:.0f} s, first >= {TARGET} at "
                  f"{first_reaching(rewards)}, last {WINDOW} {sum(rewards[-WINDOW:]) / WINDOW:.3f}", flush=True)
            results.append(r)
    finally:
        if args.keep:
            print(f"[seeds] runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n`rlhf run --direct` x {len(results)} seeds, {iterations} iterations, overrides: "
          f"{' '.join(args.overrides) or '(none)'}\n")
    print(table(results))
    if args.plot:
        plot(results, args.plot, f"{iterations} iterations, {' '.join(args.overrides) or 'defaults'}")
        print(f"\ncurves: {args.plot}")


if __name__ == "__main__":
    main()
