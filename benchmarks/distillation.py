"""On-policy distillation against GRPO on the built-in task, from the same start, in one run
of this script.

    .venv/bin/python benchmarks/distillation.py [--seeds 0,1,2] [--max-iterations 80]

Both arms start from the built-in warm start of the seed (``builtin:digits``, reward about
0.2) and run the README's main job settings, the same seeds:

- ``grpo``: the main job as it is (GRPO on the task's reward);
- ``distill``: the same, with the built-in teacher (``builtin:teacher``: a 4-layer model of
  the same vocabulary trained by the supervised phase until its sampled reward is about
  0.99, built and cached once per seed, its build not counted) scoring the student's
  samples; the settings are ``DISTILL`` below (the reverse KL as a per-token advantage);
- ``distill_topk``: the same teacher, verl's ``forward_kl_topk`` (the forward KL over the
  teacher's top-k tokens, a supervised loss): ``DISTILL_TOPK`` below.

Each arm runs in a process of its own, one after the other (2 cores), until the mean task
reward of 5 consecutive iterations reaches 0.9 or ``--max-iterations``. Printed and written
to docs/measured/distillation.json (with the commit and the machine): per arm the
iterations, the training wall seconds and the machine's busy CPU-seconds to that goal,
the median over seeds with the spread, and each distillation arm's ratios to grpo (goal:
<= 0.5x CPU-seconds); ``--plot`` draws the curves (docs/img/distillation.png).
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
from learning import CpuClock  # noqa: E402
from rollout_balance import commit, machine  # noqa: E402

GOAL, WINDOW = 0.9, 5
#: the teacher's per-token reverse KL alone (k1), clamped to [-1, 1]: unclamped, the student's
#: first samples (the teacher puts log-probs near -10 on them) got advantages near -8 and
#: the first update lost most of the warm start's reward
DISTILL = ["distillation.enabled=true", "distillation.teacher_model.model_path=builtin:teacher",
           "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.loss_max_clamp=1.0"]
#: the forward KL over the teacher's 8 likeliest tokens at each position, backpropagated
DISTILL_TOPK = ["distillation.enabled=true", "distillation.teacher_model.model_path=builtin:teacher",
                "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
                "distillation.distillation_loss.use_policy_gradient=false"]
ARMS = {"grpo": [], "distill": DISTILL, "distill_topk": DISTILL_TOPK}


def child(arm: str, seed: int, max_iterations: int, out_dir: str) -> None:
    """In the child process: one arm's run, stopped at the goal."""
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.record.run_ids import new_run_id
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.run import run_direct

    cfg = apply_overrides(RunConfig(), [f"trainer.seed={seed}", "trainer.progress=false",
                                        f"trainer.output_dir={out_dir}", *ARMS[arm]]).validate()
    result = run_direct(cfg, iterations=max_iterations, run=RunRef("file://" + str(Path(out_dir) / "store"),
                                                                   new_run_id()),
                        log=lambda *_: None, stop_at_reward=GOAL)
    rows = [{"iteration": r["iteration"], "wall_clock_s": r["wall_clock_s"], "reward": r["critic/score/mean"]}
            for r in result["rows"]]
    Path(out_dir, "rows.json").write_text(json.dumps({"started": result["started"], "rows": rows}))


def reached(rewards: list[float]) -> int | None:
    for i in range(WINDOW - 1, len(rewards)):
        if statistics.mean(rewards[i - WINDOW + 1:i + 1]) >= GOAL:
            return i
    return None


def one_run(arm: str, seed: int, max_iterations: int, work: Path) -> dict:
    out = work / f"{arm}-{seed}"
    out.mkdir(parents=True)
    with CpuClock() as clock, open(out / "log.txt", "w") as log:
        subprocess.run([sys.executable, __file__, "--child", arm, str(seed), str(max_iterations), str(out)],
                       cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    done = json.loads((out / "rows.json").read_text())
    rows = done["rows"]
    rewards = [r["reward"] for r in rows]
    at = reached(rewards)
    return {"seed": seed, "rewards": [round(r, 4) for r in rewards], "reached_at": at,
            "wall_to_goal_s": None if at is None else rows[at]["wall_clock_s"],
            "cpu_to_goal_s": None if at is None else clock.spent_until(done["started"] + rows[at]["wall_clock_s"])}


def median_or_none(values: list) -> float | None:
    """The median, a run that never reached the goal counting as the slowest."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    return ordered[(len(ordered) - 1) // 2]


def spread(values: list, fmt: str = "{:.0f}") -> str:
    shown = ["never" if v is None else fmt.format(v)
             for v in sorted(values, key=lambda v: float("inf") if v is None else v)]
    return f"{shown[(len(shown) - 1) // 2]} [{shown[0]}, {shown[-1]}]"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--max-iterations", type=int, default=80)
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "distillation.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "img" / "distillation.png"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    from rlhf_core.models.builtin import builtin_model_path

    for seed in seeds:  # the teachers (and warm starts) built before anything is timed
        builtin_model_path(seed, progress=False, teacher=True)
        builtin_model_path(seed, progress=False)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for arm in ARMS:  # interleaved: a drift of the machine hits both arms alike
                runs[arm].append(one_run(arm, seed, args.max_iterations, Path(tmp)))
                r = runs[arm][-1]
                print(f"{arm} seed {seed}: reached at {r['reached_at']}, {r['cpu_to_goal_s']} CPU-s", file=sys.stderr,
                      flush=True)
    result = {"commit": commit(), "machine": machine(), "measured": time.strftime("%Y-%m-%d"), "seeds": seeds,
              "goal": f"{WINDOW}-iteration mean task reward >= {GOAL}",
              "settings": {arm: settings for arm, settings in ARMS.items() if settings}, "arms": {}}
    for arm, rs in runs.items():
        result["arms"][arm] = {
            "runs": rs, "iterations_median": median_or_none([r["reached_at"] for r in rs]),
            "wall_to_goal_s_median": median_or_none([r["wall_to_goal_s"] for r in rs]),
            "cpu_to_goal_s_median": median_or_none([r["cpu_to_goal_s"] for r in rs])}
    base = result["arms"]["grpo"]
    result["ratios"] = {arm: {key: (ours[key] / base[key] if ours[key] is not None and base[key] else None)
                              for key in ("iterations_median", "wall_to_goal_s_median", "cpu_to_goal_s_median")}
                        for arm, ours in result["arms"].items() if arm != "grpo"}
    print(f"{'arm':<14} {'iterations to goal':<22} {'wall s to goal':<22} {'CPU-s to goal':<22}")
    for arm, e in result["arms"].items():
        print(f"{arm:<14} {spread([r['reached_at'] for r in e['runs']]):<22} "
              f"{spread([r['wall_to_goal_s'] for r in e['runs']]):<22} "
              f"{spread([r['cpu_to_goal_s'] for r in e['runs']]):<22}")
    for arm, ratios in result["ratios"].items():
        print(f"{arm} / grpo (medians): " + ", ".join(f"{k}: {'-' if v is None else f'{v:.2f}x'}"
                                                      for k, v in ratios.items()))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"-> {args.plot}")
    if args.out == parser.get_default("out"):
        write_doc_table(result)


def write_doc_table(result: dict) -> None:
    """The measured table into docs/distillation.md, between its markers."""
    doc = ROOT / "docs" / "distillation.md"
    begin, end = "<!-- distillation_benchmark:begin -->", "<!-- distillation_benchmark:end -->"
    lines = [begin, "",
             f"`benchmarks/distillation.py` at commit {result['commit']}, {result['machine']['cores']} cores "
             f"({result['machine']['cpu']}), {result['measured']}: seeds {', '.join(map(str, result['seeds']))}; "
             f"goal: {result['goal']}.", "",
             *(f"- {arm}: `{' '.join(settings)}`" for arm, settings in result["settings"].items()), "",
             "| arm | iterations to the goal, median [min, max] | training s | busy CPU-s |", "|---|---|---|---|"]
    for arm, e in result["arms"].items():
        runs = e["runs"]
        lines.append(f"| {arm} | {spread([r['reached_at'] for r in runs])} | "
                     f"{spread([r['wall_to_goal_s'] for r in runs])} | {spread([r['cpu_to_goal_s'] for r in runs])} |")
    lines.append("")
    for arm, ratios in result["ratios"].items():
        lines += [f"{arm} / grpo, medians: " + ", ".join(
            f"{name} {'-' if ratios[key] is None else f'{ratios[key]:.2f}x'}"
            for name, key in (("iterations", "iterations_median"), ("training s", "wall_to_goal_s_median"),
                              ("CPU-s", "cpu_to_goal_s_median"))) + " (the goal: <= 0.5x CPU-s).", ""]
    lines.append(end)
    text = doc.read_text()
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(head + "\n".join(lines) + tail)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, color in (("grpo", "tab:blue"), ("distill", "tab:orange"), ("distill_topk", "tab:green")):
        for i, r in enumerate(result["arms"][arm]["runs"]):
            ax.plot(r["rewards"], color=color, alpha=0.8, label=arm if i == 0 else None)
    ax.axhline(GOAL, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("task reward (mean of the batch)")
    ax.set_title(f"On-policy distillation vs GRPO, built-in task, seeds {result['seeds']} "
                 f"(commit {result['commit'][:8]})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
