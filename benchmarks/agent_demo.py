"""Does the tool demo learn on every seed, and what is it worth without the tool?

    .venv/bin/python benchmarks/agent_demo.py [--seeds 0,1,2] [--plot docs/img/agent_demo.png]

The built-in tool task (multiply two 3-digit numbers; examples/agent/calculator.yaml):
per seed, one `rlhf run --direct --config examples/agent/calculator.yaml trainer.seed=S`
with the calculator tool (the agent loop), and the same run without it
(`rollout.multi_turn.enable=false`: one generation, the model must answer alone: the
ceiling without the tool). One run at a time (the machine has two cores); each seed's
first run builds its warm-started model (in its wall time; the second finds it cached).
Prints per run the reward at the first and last iteration, the first iteration whose
5-iteration mean is >= 0.9 and the wall time to it, and writes
docs/measured/agent_demo.json with the commit and the machine.

Goal (issue [2/7]): accuracy from <= 0.3 to >= 0.9 within 15 minutes on 2 cores, on every
seed of 3, beside the same run without tools.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from rollout_balance import commit, machine  # noqa: E402
from seeds import first_reaching  # noqa: E402

CONFIG = ROOT / "examples" / "agent" / "calculator.yaml"
WITHOUT_TOOLS = ["rollout.multi_turn.enable=false", "rollout.multi_turn.tool_config_path="]


def run(seed: int, tools: bool, work: Path) -> dict:
    name = f"seed-{seed}-{'tools' if tools else 'alone'}"
    out = work / name
    cmd = [str(ROOT / ".venv" / "bin" / "rlhf"), "run", "--direct", "--config", str(CONFIG), "--run-id", name,
           "--store", "file://" + str(out / "store"), f"trainer.seed={seed}", f"trainer.output_dir={out}",
           "trainer.progress=false", *([] if tools else WITHOUT_TOOLS)]
    t0 = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    wall = time.monotonic() - t0
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["critic/score/mean"] for r in rows]
    reached = first_reaching(rewards)
    started = wall - rows[-1]["wall_clock_s"]  # start-up (and the warm start) before iteration 0
    return {"seed": seed, "tools": tools, "wall_s": round(wall, 1), "first": round(rewards[0], 3),
            "last5": round(sum(rewards[-5:]) / 5, 3), "reached_at": reached,
            "time_to_0.9_s": round(started + rows[reached]["wall_clock_s"], 1) if reached is not None else None,
            "tool_calls_last": rows[-1].get("agent/tool_calls/mean"), "rewards": [round(r, 4) for r in rewards]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "img" / "agent_demo.png"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "agent_demo.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="agent-demo-") as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for tools in (True, False):
                result = run(seed, tools, Path(tmp))
                results.append(result)
                print(f"seed {seed} {'with the tool ' if tools else 'without it   '}: reward {result['first']:.3f} -> "
                      f"{result['last5']:.3f} (last 5), >= 0.9 at iteration {result['reached_at']} after "
                      f"{result['time_to_0.9_s']} s, wall {result['wall_s']:.0f} s", flush=True)
    record = {"benchmark": "benchmarks/agent_demo.py", "commit": commit(), "machine": machine(),
              "config": str(CONFIG.relative_to(ROOT)), "runs": results,
              "every_seed_reached_0.9_with_tools": all(r["reached_at"] is not None for r in results if r["tools"]),
              "slowest_time_to_0.9_s": max((r["time_to_0.9_s"] or float("inf")) for r in results if r["tools"])}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results:
            ax.plot(r["rewards"], color="tab:blue" if r["tools"] else "tab:gray", alpha=0.8,
                    label=f"seed {r['seed']} {'with the calculator' if r['tools'] else 'without it'}")
        ax.axhline(0.9, linestyle=":", color="black")
        ax.set_xlabel("iteration")
        ax.set_ylabel("accuracy (reward mean)")
        ax.set_title(f"3-digit multiplication, 2-layer model, {machine()['cores']} cores ({record['commit']})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
