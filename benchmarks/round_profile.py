"""Where one generation round's CPU goes: ours vs TRL's GRPOTrainer, stage by stage.

    .venv/bin/python benchmarks/round_profile.py [--rounds 6] [--skip-trl]

Ours: the default config's iteration (`PPOTrainer.run_iteration`) with the worker
objects called in this process instead of through Ray, so each stage's CPU-seconds
(`time.process_time`, every thread of the process) are the stage's own compute; the
Ray round trips, snapshots, checkpoint and manifest of a real run come on top (a direct
run's `timing_s/commit` and `perf/outside_workers_share` show them). TRL: the same
settings (`benchmarks/trl_grpo.py`'s) in .bench/trl, its methods wrapped with the same
clocks (generation, reward, log-probs without gradient, and the rest of the round:
the update). Both warm up 2 rounds, then average `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2


def profile_ours(rounds: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import torch

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.trainer.loaders import make_loader
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.reward import RewardWorker

    cfg = apply_overrides(RunConfig(), ["trainer.progress=false"]).validate()
    torch.set_num_threads(int(cfg.trainer.cpus_per_worker))  # what a worker of the pool gets
    actor, reward = ActorRolloutRefWorker(cfg), RewardWorker(cfg)
    actor.init_model()
    reward.init_model()

    class InProcess:
        """A one-rank group: the call runs here (a group returns one result per rank)."""

        def __init__(self, worker):
            self.worker = worker

        def __getattr__(self, name):
            method = getattr(self.worker, name)
            return (lambda *a: [method(*a)]) if name == "sync_weights" else method

    trainer = PPOTrainer(cfg, {"actor": InProcess(actor), "reward": InProcess(reward)},
                         make_loader(cfg, TrainerState()))
    cpu = defaultdict(float)
    wall = defaultdict(float)
    original = trainer.run_stages

    def timed_stages(batch, stages, notify=True):
        for stage in stages:
            c0, w0 = time.process_time(), time.perf_counter()
            for item in original(batch, [stage], notify):
                cpu[stage.name] += time.process_time() - c0
                wall[stage.name] += time.perf_counter() - w0
                batch = item[1]
                yield item

    trainer.run_stages = timed_stages
    for _ in range(WARMUP):
        trainer.run_iteration()
    cpu.clear(), wall.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        trainer.run_iteration()
    total_cpu, total_wall = time.process_time() - c0, time.perf_counter() - w0
    return {"cpu": {k: v / rounds for k, v in cpu.items()}, "wall": {k: v / rounds for k, v in wall.items()},
            "total_cpu": total_cpu / rounds, "total_wall": total_wall / rounds}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRL_CHILD = r'''
import json, sys, time, types
from collections import defaultdict
sys.argv = ["trl_grpo.py", MODEL, OUT, "1e9", "0"]
import trl
from trl import GRPOTrainer
cpu, wall, marks = defaultdict(float), defaultdict(float), []

def clocked(name, fn):
    def run(self, *a, **k):
        import torch
        label = name(torch) if callable(name) else name
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            cpu[label] += time.process_time() - c0
            wall[label] += time.perf_counter() - w0
    return run

GRPOTrainer._generate = clocked("generation", GRPOTrainer._generate)
GRPOTrainer._calculate_rewards = clocked("reward", GRPOTrainer._calculate_rewards)
GRPOTrainer._get_per_token_logps_and_entropies = clocked(
    lambda torch: "update (log-probs with gradient)" if torch.is_grad_enabled() else "log-probs (no gradient)",
    GRPOTrainer._get_per_token_logps_and_entropies)
from transformers import TrainerCallback
STEPS = STEPS_PER_ROUND
class Rounds(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step % STEPS == 0:
            marks.append((time.process_time(), time.perf_counter(), dict(cpu), dict(wall)))
            if len(marks) == WARMUP + ROUNDS + 1:
                control.should_training_stop = True
sys.path.insert(0, 'benchmarks')
import trl_grpo as bench
_orig = GRPOTrainer.__init__
def init(self, *a, callbacks=None, **k):
    _orig(self, *a, callbacks=(callbacks or []) + [Rounds()], **k)
GRPOTrainer.__init__ = init
bench.main()
(c0, w0, cpu0, wall0), (c1, w1, cpu1, wall1) = marks[WARMUP], marks[-1]
n = len(marks) - 1 - WARMUP
print(json.dumps({"cpu": {k: (v - cpu0.get(k, 0)) / n for k, v in cpu1.items()},
                  "wall": {k: (v - wall0.get(k, 0)) / n for k, v in wall1.items()},
                  "total_cpu": (c1 - c0) / n, "total_wall": (w1 - w0) / n}))
'''


def profile_trl(rounds: int, model_dir: str, work: Path) -> dict | None:
    python = ROOT / ".bench" / "trl" / "bin" / "python"
    if not python.exists():
        print(f"[bench] TRL environment missing ({python}); see benchmarks/learning.py")
        return None
    from rlhf_core.config import RunConfig

    cfg = RunConfig()
    steps = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs
    code = (TRL_CHILD.replace("MODEL", repr(model_dir)).replace("OUT", repr(str(work / "trl.jsonl")))
            .replace("STEPS_PER_ROUND", str(steps)).replace("WARMUP", str(WARMUP)).replace("ROUNDS", str(rounds)))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK")}  # ours' one-rank group, not TRL's
    out = subprocess.run([str(python), "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                              "WANDB_DISABLED": "true", "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"[bench] TRL's profile failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import tempfile

    from rlhf_core.models.builtin import builtin_model_path

    model_dir = builtin_model_path(seed=0)
    ours = profile_ours(args.rounds)
    trl = None if args.skip_trl else profile_trl(args.rounds, model_dir, Path(tempfile.mkdtemp(prefix="rlhf-prof-")))
    from rlhf_core.config import RunConfig

    cfg = RunConfig()
    print(f"\nOne round ({cfg.data.train_batch_size} prompts x {cfg.rollout.n} responses, the default config), mean "
          f"of {args.rounds} after {WARMUP} warm-up; CPU-seconds (wall seconds)\n")
    print("ours (stage compute, in-process workers)")
    for stage, seconds in ours["cpu"].items():
        print(f"  {stage:<34}{seconds:7.3f} ({ours['wall'][stage]:.3f})")
    print(f"  {'round total':<34}{ours['total_cpu']:7.3f} ({ours['total_wall']:.3f})")
    if trl:
        print("TRL GRPOTrainer")
        for stage, seconds in trl["cpu"].items():
            print(f"  {stage:<34}{seconds:7.3f} ({trl['wall'][stage]:.3f})")
        rest_cpu = trl["total_cpu"] - sum(trl["cpu"].values())
        rest_wall = trl["total_wall"] - sum(trl["wall"].values())
        print(f"  {'the rest (backward, optimizer, ...)':<34}{rest_cpu:7.3f} ({rest_wall:.3f})")
        print(f"  {'round total':<34}{trl['total_cpu']:7.3f} ({trl['total_wall']:.3f})")
        print(f"\nCPU-seconds per round, ours / TRL: {ours['total_cpu'] / trl['total_cpu']:.2f}x")


if __name__ == "__main__":
    main()
