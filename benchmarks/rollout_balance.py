"""Balanced requests vs the static split: an iteration's generation time over two replicas.

    .venv/bin/python benchmarks/rollout_balance.py [--repeats 3]

Two rollout replicas, each a Ray actor process on one core with the HF engine over the
same randomly initialised Qwen2 (hidden 1024, 4 layers, ~64M parameters). Requests are
prompts x 4 samples; the first half may generate 64 new tokens, the second half 16
(response lengths differing 4x, as long and short answers do), with no end-of-sequence
token, so every response runs to its limit. Two sizes of batch:

- `large` (48 prompts, 192 requests): a decoding step costs in proportion to its rows
  (compute-bound, as a GPU engine with many sequences in flight), where balancing should pay;
- `small` (12 prompts, 48 requests): a step costs about the same at 6 rows as at 24 (reading
  the weights dominates), where cutting a replica's share into chunks multiplies its steps. The static split gives each replica its half in one call (today's `rollout.mode=sync`
over two ranks: the iteration waits for the replica holding the long half); the manager
(`rollout.mode=async`) hands out chunks of whole prompt groups to whichever replica is
free. Both give the same rows (checked). Each arrangement runs `--repeats` times,
alternating; the ratio of medians is printed with every run, and written to
docs/measured/rollout_balance.json with the commit and the machine.

Goal (issue [1/7]): balanced <= 0.8x static.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)
SAMPLES, LONG, SHORT = 4, 64, 16
SIZES = {"large": 48, "small": 12}


def _replica_class():
    import ray

    @ray.remote(num_cpus=1)
    class Replica:
        """One replica: the HF engine over a seeded random Qwen2, one thread."""

        def __init__(self) -> None:
            import torch

            from rlhf_core.models.qwen2 import qwen2_from_config
            from rlhf_core.rollout.engines.hf import HFEngine

            torch.set_num_threads(1)
            model = qwen2_from_config(0, **SHAPE).eval()
            tokenizer = type("T", (), {"pad_token_id": 0, "eos_token_id": None})()
            self.engine = HFEngine(model, tokenizer, config=None, seed=0)

        def generate_requests(self, requests, sampling, version):
            from rlhf_core.rollout.engine import GenerationRequest

            t0 = time.perf_counter()
            done = self.engine.generate([GenerationRequest(*r) for r in requests], sampling)
            return {"completions": [(c.request_id, c.token_ids, c.log_probs) for c in done], "version": 0,
                    "seconds": time.perf_counter() - t0, "pad_id": 0}

    return Replica


class Group:
    """What the manager's transport needs of a worker group, over plain Ray actors."""

    def __init__(self, actors) -> None:
        self.actors = actors

    def submit_to_rank(self, rank, method, *args):
        return getattr(self.actors[rank], method).remote(*args)


def requests(prompts: int):
    from rlhf_core.rollout import GenerationRequest

    return [GenerationRequest(f"{p}-{i}", tuple(range(3 + p % 40, 11 + p % 40)), 100 * p + i,
                              LONG if p < prompts // 2 else SHORT)
            for p in range(prompts) for i in range(SAMPLES)]


def static_split(group, reqs, sampling) -> tuple[float, list]:
    import ray

    half = len(reqs) // 2
    t0 = time.perf_counter()
    refs = [group.submit_to_rank(rank, "generate_requests",
                                 [(r.request_id, list(r.prompt_ids), r.seed, r.max_tokens) for r in part], sampling, 0)
            for rank, part in enumerate((reqs[:half], reqs[half:]))]
    answers = ray.get(refs)
    return time.perf_counter() - t0, [tuple(c[1]) for a in answers for c in a["completions"]]


def balanced(group, reqs, sampling) -> tuple[float, list]:
    from rlhf_core.rollout.manager import RayReplicaTransport, RolloutManager, replicas_of

    t0 = time.perf_counter()
    done, _, _ = RolloutManager(replicas_of(2, 1), RayReplicaTransport(group)).generate(reqs, sampling)
    return time.perf_counter() - t0, [tuple(c.token_ids) for c in done]


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cores": os.cpu_count(), "cpu": model}


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "rollout_balance.json"))
    args = parser.parse_args()
    import ray

    from rlhf_core.rollout import Sampling

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Replica = _replica_class()
        group = Group([Replica.remote(), Replica.remote()])
        sampling = Sampling(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=LONG)
        static_split(group, requests(4), sampling)  # warm-up: both processes loaded and compiled
        results = {}
        for size, prompts in SIZES.items():
            reqs = requests(prompts)
            times, rows = {"static": [], "balanced": []}, {}
            for run in range(args.repeats):
                for name, arrange in (("static", static_split), ("balanced", balanced)):
                    seconds, rows[name] = arrange(group, reqs, sampling)
                    times[name].append(seconds)
                    print(f"{size}: run {run + 1}/{args.repeats} {name:8s} {seconds:6.2f} s", flush=True)
            # HF seeds a call from its first request and the calls differ, so the rows differ in
            # their tokens; their lengths (what the time depends on) are the same either way
            assert sorted(len(r) for r in rows["static"]) == sorted(len(r) for r in rows["balanced"])
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = med["balanced"] / med["static"]
            spread = {k: [round(min(v), 3), round(max(v), 3)] for k, v in times.items()}
            print(f"{size} ({len(reqs)} requests): static median {med['static']:.2f} s (min-max {spread['static']}), "
                  f"balanced median {med['balanced']:.2f} s (min-max {spread['balanced']}): "
                  f"balanced / static {ratio:.2f}x (goal <= 0.8x: {'met' if ratio <= 0.8 else 'not met'})")
            results[size] = {"requests": len(reqs), "seconds": times, "median_s": med, "spread_s": spread,
                             "ratio_balanced_over_static": round(ratio, 3), "met": ratio <= 0.8}
    finally:
        ray.shutdown()
    result = {"benchmark": "benchmarks/rollout_balance.py", "commit": commit(), "machine": machine(),
              "repeats": args.repeats, "goal": "balanced / static <= 0.8", "results": results,
              "setup": {"replicas": 2, "samples_per_prompt": SAMPLES, "max_tokens": [LONG, SHORT], "model": SHAPE,
                        "engine": "hf", "measured": time.strftime("%Y-%m-%d")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
