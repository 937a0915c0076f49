"""What running each iteration as its own Kubeflow pipeline run costs. Two measurements:

    .venv/bin/python benchmarks/orchestration.py overhead [--iterations 5]
    .venv/bin/python benchmarks/orchestration.py idle [--runs 10] [--latencies 5,20]

``overhead``: the default run (``rlhf run``: its default iterations, or ``--iterations``) as
KFP local pipeline runs (long-lived session) vs the same run directly by one controller
process, start-up included; then where one pipeline run's time goes in steady state
(phase marks the components write under ``RLHF_PHASE_LOG``: executor start, imports, Ray
connect, the iteration, disconnect, report, exit), and its fixed cost (all but the stages).

``idle``: the session workers' idle share between iterations, 1 - worker busy time / wall
time over ``--runs`` pipeline runs, with each component's start delayed by a simulated
pod start (``RLHF_SIMULATED_POD_START_S``: pod scheduling and image start, which the
local runner does not have), with and without the session computing the next
iteration's inference stages ahead (``trainer.prefetch``). The config is sized so an
iteration takes >= 30 s of worker time, most of it in the inference stages.
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


def timed_run(mode: list[str], iterations: int | None, out: Path, env_extra: dict | None = None) -> float:
    env = {**os.environ, **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    count = ["--iterations", str(iterations)] if iterations else []  # else the run's default total
    args = [sys.executable, "-m", "rlhf_core.cli", "run", *mode, *count, "--run-id", "bench",
            "trainer.progress=false", f"trainer.output_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return elapsed


#: (label, from phase, to phase) of one pipeline run; see rlhf_core.probes.phase
PHASES = (("local runner: task set-up, process spawn", "run_start", "process_start"),
          ("executor start (python, kfp, executor)", "process_start", "body_start"),
          ("imports (rlhf_core, torch, ray)", "body_start", "imported"),
          ("Ray connect", "imported", "connected"),
          ("iterate (attach, lease, stages, commit)", "connected", "iterated"),
          ("Ray disconnect", "iterated", "disconnected"),
          ("report (curve, samples)", "disconnected", "reported"),
          ("exit, outputs, runner wrap-up", "reported", "run_end"))


def breakdown(phase_log: Path, rows: list[dict]) -> list[dict]:
    """Per pipeline run: each phase's seconds, and of ``iterate`` the stages and the commit."""
    import json

    events = [json.loads(line) for line in phase_log.read_text().splitlines() if line.strip()]
    runs, current = [], None
    for event in events:
        if event["phase"] == "run_start":
            current = {"run_start": event["t"]}
        elif current is not None:
            current.setdefault(event["phase"], event["t"])
            if event["phase"] == "run_end":
                runs.append(current)
                current = None
    out = []
    for marks, row in zip(runs, rows):
        if not all(p in marks for _, a, b in PHASES for p in (a, b)):
            continue  # a run that did no iteration (lease held): not a sample
        phases = {label: marks[b] - marks[a] for label, a, b in PHASES}
        phases["total"] = marks["run_end"] - marks["run_start"]
        phases["stages"] = row["timing_s/iteration"]
        phases["commit"] = row.get("timing_s/commit", 0.0)
        phases["fixed"] = phases["total"] - phases["stages"]
        out.append(phases)
    return out


def overhead(args, parser) -> None:
    import json

    k = args.iterations
    if k is not None and k < 3:
        parser.error("--iterations: at least 3 (steady state is measured between runs 2 and K)")
    work = Path(tempfile.mkdtemp(prefix="rlhf-orch-"))
    print("[bench] direct run ...", flush=True)
    direct = timed_run(["--direct"], k, work / "direct")
    print("[bench] the same run as pipeline runs ...", flush=True)
    phase_log = work / "phases.jsonl"
    pipeline = timed_run([], k, work / "pipeline", {"RLHF_PHASE_LOG": str(phase_log)})  # its own head
    rows = [json.loads(line) for line in (work / "pipeline" / "bench" / "metrics.jsonl").read_text().splitlines()]
    n = len(rows)
    print(f"\n{n} iterations (the default run{'' if k is None else ' with --iterations'}), start-up included")
    print(f"{'mode':<34}{'wall s':>9}")
    print(f"{'direct (one controller process)':<34}{direct:>9.1f}")
    print(f"{'KFP local pipeline runs':<34}{pipeline:>9.1f}")
    print(f"ratio pipeline/direct: {pipeline / direct:.2f}x (goal <= 1.25x); per-iteration overhead: "
          f"{(pipeline - direct) / n:.2f} s")
    runs = breakdown(phase_log, rows)[1:]  # the first run starts the session: not steady state
    if not runs:
        return
    mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
    print(f"\none pipeline run in steady state (mean of runs 2..{len(runs) + 1}), seconds")
    for label, _, _ in PHASES:
        print(f"  {label:<44}{mean[label]:>7.2f}")
        if label.startswith("iterate"):
            print(f"    {'of which the stages (work)':<42}{mean['stages']:>7.2f}")
            print(f"    {'of which the commit':<42}{mean['commit']:>7.2f}")
    print(f"  {'total':<44}{mean['total']:>7.2f}")
    print(f"fixed cost of one pipeline run (total - stages): {mean['fixed']:.2f} s (goal <= 3 s)")


#: An iteration of >= 30 s of worker time on this machine's 2 cores, over half of it in
#: the inference stages (rollout of 6144 responses, reward, old and reference log-probs).
HEAVY = ["data.train_batch_size=384", "rollout.n=16", "actor.ppo_mini_batch_size=384", "actor.use_kl_loss=true"]
INFERENCE = ("rollout", "reward", "old_log_prob", "ref_log_prob", "values")


def pipeline_runs(run_id: str, work: Path, head_root: Path, overrides: list[str], runs: int, latency_s: float,
                  last_prefetches: bool = True) -> float:
    """``runs`` per-iteration pipeline runs one after another, each a process of its own (as
    the fine-tune driver's stand-in starts them); returns the wall time."""
    env = {**os.environ, "RLHF_SIMULATED_POD_START_S": str(latency_s)}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    for k in range(runs):
        argv = [sys.executable, "-m", "pipelines.local", "--run-id", run_id, "--store", f"file://{work / 'store'}",
                "--head-root", str(head_root), "--root", str(work / "kfp" / run_id / str(k))]
        if not last_prefetches and k == runs - 1:
            argv.append("--no-prefetch-next")
        proc = subprocess.run([*argv, *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{run_id} run {k}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def idle(args, parser) -> None:
    import json

    from rlhf_core import ray_head

    latencies = [float(x) for x in args.latencies.split(",")]
    work = Path(tempfile.mkdtemp(prefix="rlhf-idle-"))
    head_root = work / "head"
    ray_head.start_head(head_root)
    results = []
    try:
        for latency in latencies:
            for prefetch in (False, True):
                run_id = f"lat{int(latency)}-{'prefetch' if prefetch else 'plain'}"
                overrides = [*HEAVY, *args.overrides, f"trainer.prefetch={str(prefetch).lower()}",
                             "trainer.progress=false", f"trainer.output_dir={work / 'out'}"]
                # the session starts and the models load in a first run, not timed
                pipeline_runs(run_id, work, head_root, overrides, 1, 0.0)
                wall = pipeline_runs(run_id, work, head_root, overrides, args.runs, latency, last_prefetches=False)
                subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stop-session", "--run-id", run_id,
                                "--head-root", str(head_root)], cwd=ROOT, capture_output=True)
                rows = [json.loads(line) for line in
                        (work / "out" / run_id / "metrics.jsonl").read_text().splitlines()][1:]
                busy = sum(r["perf/worker_time_s"] for r in rows)
                inference = sum(r.get(f"timing_worker_s/{s}", 0.0) for r in rows for s in INFERENCE)
                results.append({"latency": latency, "prefetch": prefetch, "runs": len(rows), "wall": wall,
                                "busy": busy, "inference_share": inference / busy,
                                "adopted": sum(r.get("perf/prefetch_adopted", 0) for r in rows)})
                r = results[-1]
                print(f"[idle] {run_id}: {r['runs']} runs, {wall:.0f} s wall, {busy:.0f} s worker busy, "
                      f"idle {1 - busy / wall:.1%}", flush=True)
    finally:
        ray_head.stop_head(ray_head.read_head(head_root), head_root)
    print(f"\nworkers' idle share over {args.runs} pipeline runs (config: {' '.join(HEAVY + args.overrides)})")
    print(f"{'pod start s':>11}{'prefetch':>10}{'s/run':>8}{'worker s/it':>12}{'inference':>10}{'adopted':>9}"
          f"{'idle share':>12}")
    for r in results:
        print(f"{r['latency']:>11.0f}{'on' if r['prefetch'] else 'off':>10}{r['wall'] / r['runs']:>8.1f}"
              f"{r['busy'] / r['runs']:>12.1f}{r['inference_share']:>10.0%}{r['adopted']:>6.0f}/{r['runs']:<2}"
              f"{1 - r['busy'] / r['wall']:>12.1%}")
    for latency in latencies:
        off, on = (next(r for r in results if r["latency"] == latency and r["prefetch"] == p) for p in (False, True))
        print(f"pod start {latency:.0f} s: idle share {1 - off['busy'] / off['wall']:.1%} -> "
              f"{1 - on['busy'] / on['wall']:.1%} with prefetch; s/run {off['wall'] / off['runs']:.1f} -> "
              f"{on['wall'] / on['runs']:.1f} (goal at 5 s: <= 15%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    o = sub.add_parser("overhead", help="pipeline runs vs one direct controller")
    o.add_argument("--iterations", type=int, default=None, help="default: the run's default total")
    i = sub.add_parser("idle", help="workers' idle share between pipeline runs, with and without prefetch")
    i.add_argument("--runs", type=int, default=10, help="timed pipeline runs per setting (after one untimed)")
    i.add_argument("--latencies", default="5,20", help="simulated pod start seconds, comma-separated")
    i.add_argument("overrides", nargs="*", help="extra config overrides (e.g. to size the iteration)")
    args = parser.parse_args()
    (overhead if args.mode == "overhead" else idle)(args, parser)


if __name__ == "__main__":
    main()
