"""What running each iteration as its own Kubeflow pipeline run costs, with and without
pipelining (the next iteration's run started while the current one runs). One command
prints every figure:

    .venv/bin/python benchmarks/orchestration.py [--iterations K] [--runs N] [--latencies 5,20]
    .venv/bin/python benchmarks/orchestration.py overhead [--iterations K]   # only the first two parts
    .venv/bin/python benchmarks/orchestration.py idle [--runs N] [--latencies 5,20]  # only the third

1. The default run (``rlhf run``: its default iterations, or ``--iterations``) directly by
   one controller process, as KFP local pipeline runs one at a time (``--no-pipelining``)
   and as pipelined pipeline runs (the default), start-up included: wall times and their
   ratios to the direct run.
2. Where one pipeline run's time goes in steady state, both ways (phase marks the
   processes write under ``RLHF_PHASE_LOG``): runner, executor start, imports, Ray connect,
   the wait for the iteration before (pipelined: overlapped with its stages), the
   iteration, disconnect, report, exit; the fixed cost of a run is its total minus the
   stages and minus that wait. Ray connect is also measured alone (a fresh process
   joining an idle head).
3. The session workers' idle share between iterations, 1 - worker busy time / wall time
   over ``--runs`` iterations of a fine-tune driven by the driver (``components/driver.py``)
   through the local stand-in of the KFP API, with each component's start delayed by a
   simulated pod start (``RLHF_SIMULATED_POD_START_S``: scheduling and image start, which
   the local runner does not have), with and without pipelining; the session computes
   ahead in both. The config (``HEAVY``) made an iteration ~30-40 s of worker time when it
   was chosen (3a0cca3); the work since (padding trimmed, bypass mode) makes it ~11 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from rlhf_core.config import RunConfig, apply_overrides, handover
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


#: (label, from phase, to phase) of one pipeline run; see rlhf_core.runtime.probes.phase
PHASES = (("local runner: task set-up, process spawn", "run_start", "process_start"),
          ("executor start (python, kfp, executor)", "process_start", "body_start"),
          ("imports (rlhf_core, torch, ray)", "body_start", "imported"),
          ("Ray connect", "imported", "connected"),
          ("wait for the iteration before", "connected", "waited"),
          ("iterate (attach, lease, stages, commit)", "waited", "iterated"),
          ("Ray disconnect", "iterated", "disconnected"),
          ("report (curve, samples)", "disconnected", "reported"),
          ("exit, outputs, runner wrap-up", "reported", "run_end"))
WAIT = "wait for the iteration before"


def breakdown(phase_log: Path, rows: list[dict]) -> list[dict]:
    """Per pipeline run that committed an iteration, in iteration order: each phase's
    seconds, the stages and the commit of its iteration, and its fixed cost."""
    events = [json.loads(line) for line in phase_log.read_text().splitlines() if line.strip()]
    marks: dict[str, dict] = {}
    for event in events:  # runs overlap when pipelined: their marks are told apart by run
        marks.setdefault(event.get("run") or "?", {}).setdefault(event["phase"], event["t"])
    by_start = sorted((m for m in marks.values() if all(p in m for _, a, b in PHASES for p in (a, b))),
                      key=lambda m: m["run_start"])
    out = []
    for m, row in zip(by_start, rows):  # each run that iterated committed the next iteration
        phases = {label: m[b] - m[a] for label, a, b in PHASES}
        phases["total"] = m["run_end"] - m["run_start"]
        phases["stages"] = row["timing_s/iteration"]
        phases["commit"] = row.get("timing_s/commit", 0.0)
        phases["fixed"] = phases["total"] - phases["stages"] - phases[WAIT]
        out.append(phases)
    return out


def ray_connect_alone(samples: int = 3) -> float:
    """Seconds a fresh process takes to import ray and join an idle head (median)."""
    from rlhf_core.runtime import ray_head

    root = Path(tempfile.mkdtemp(prefix="rlhf-connect-"))
    info = ray_head.start_head(root)
    code = ("import time, sys; from rlhf_core.runtime import ray_head; info = ray_head.read_head(sys.argv[1]); "
            "t = time.perf_counter(); ray_head.connect(info, 'bench'); print(time.perf_counter() - t); "
            "ray_head.disconnect()")
    try:
        times = sorted(float(subprocess.run([sys.executable, "-c", code, str(root)], cwd=ROOT, capture_output=True,
                                            text=True, check=True).stdout.split()[-1]) for _ in range(samples))
    finally:
        ray_head.stop_head(info, root)
    return times[len(times) // 2]


def overhead(args) -> None:
    k = args.iterations
    work = Path(tempfile.mkdtemp(prefix="rlhf-orch-"))
    print(f"[bench] outputs under {work}", flush=True)
    print("[bench] Ray connect alone ...", flush=True)
    alone = ray_connect_alone()
    print("[bench] direct run ...", flush=True)
    direct = timed_run(["--direct"], k, work / "direct")
    results = {}
    for label, mode in (("one at a time", ["--no-pipelining"]), ("pipelined", [])):
        print(f"[bench] the same run as pipeline runs, {label} ...", flush=True)
        log = work / f"phases-{len(results)}.jsonl"
        wall = timed_run(mode, k, work / label.replace(" ", "-"), {"RLHF_PHASE_LOG": str(log)})  # its own head
        rows = [json.loads(line) for line in
                (work / label.replace(" ", "-") / "bench" / "metrics.jsonl").read_text().splitlines()]
        runs = breakdown(log, rows)[1:]  # the first run starts the session: not steady state
        results[label] = {"wall": wall, "n": len(rows),
                          "mean": {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]} if runs else {}}
    n = results["pipelined"]["n"]
    print(f"\n{n} iterations (the default run{'' if k is None else ' with --iterations'}), start-up included")
    print(f"{'mode':<40}{'wall s':>9}{'/ direct':>10}")
    print(f"{'direct (one controller process)':<40}{direct:>9.1f}{1:>9.2f}x")
    for label, r in results.items():
        print(f"{'KFP local pipeline runs, ' + label:<40}{r['wall']:>9.1f}{r['wall'] / direct:>9.2f}x")
    piped, seq = results["pipelined"], results["one at a time"]
    print(f"ratio pipeline/direct: {seq['wall'] / direct:.2f}x one at a time, {piped['wall'] / direct:.2f}x "
          f"pipelined (goal <= 1.5x); per-iteration overhead {(seq['wall'] - direct) / n:.2f} s -> "
          f"{(piped['wall'] - direct) / n:.2f} s")
    if not (seq["mean"] and piped["mean"]):
        return
    print(f"\none pipeline run in steady state (mean of runs 2..{n}), seconds")
    print(f"  {'phase':<46}{'one at a time':>14}{'pipelined':>11}")
    for label, _, _ in PHASES:
        note = " (overlaps the stages before)" if label == WAIT else ""
        print(f"  {label + note:<46}{seq['mean'][label]:>14.2f}{piped['mean'][label]:>11.2f}")
        if label.startswith("iterate"):
            for key, text in (("stages", "of which the stages (work)"), ("commit", "of which the commit")):
                print(f"    {text:<44}{seq['mean'][key]:>14.2f}{piped['mean'][key]:>11.2f}")
    print(f"  {'total':<46}{seq['mean']['total']:>14.2f}{piped['mean']['total']:>11.2f}")
    print(f"fixed cost of one pipeline run (total - stages - wait): {seq['mean']['fixed']:.2f} s one at a time, "
          f"{piped['mean']['fixed']:.2f} s pipelined (goal <= 3 s)")
    print(f"Ray connect of a fresh process joining an idle head: {alone:.2f} s (median of 3); in steady state "
          f"{seq['mean']['Ray connect']:.2f} s one at a time, {piped['mean']['Ray connect']:.2f} s pipelined "
          f"(the session computes ahead, or the iteration before runs, on the same cores)")


#: 6144 responses an iteration (rollout, reward, reference log-probs, update): ~30-40 s of
#: worker time on this machine's 2 cores when chosen, ~11 s on 37499f8.
HEAVY = ["data.train_batch_size=384", "rollout.n=16", "actor.ppo_mini_batch_size=384", "actor.use_kl_loss=true"]
INFERENCE = ("rollout", "reward", "old_log_prob", "ref_log_prob", "values")


def idle(args) -> None:
    from components.driver import Plan, drive
    from pipelines.local import LocalKfpStandIn
    from rlhf_core.runtime import ray_head

    latencies = [float(x) for x in args.latencies.split(",")]
    work = Path(tempfile.mkdtemp(prefix="rlhf-idle-"))
    print(f"[bench] outputs under {work}", flush=True)
    head_root = work / "head"
    ray_head.start_head(head_root)
    store = f"file://{work / 'store'}"
    os.environ.pop("RAY_ADDRESS", None)
    results = []
    try:
        for latency in latencies:
            for pipelined in (False, True):
                run_id = f"lat{int(latency)}-{'pipelined' if pipelined else 'one-at-a-time'}"
                overrides = [*HEAVY, *args.overrides, "trainer.progress=false", f"trainer.output_dir={work / 'out'}"]
                standin = LocalKfpStandIn(str(head_root), str(work / "kfp" / run_id))
                os.makedirs(work / "kfp" / run_id, exist_ok=True)
                given = {"run_id": run_id, "store": store, **handover(apply_overrides(RunConfig(), overrides).validate())}
                plan = lambda total: Plan(run_id, store, given,
                                          iterations=total, poll_s=0.2, pipelined=pipelined)
                # the session starts and the models load in a first iteration, not timed; it
                # has the session compute the next one ahead, as every iteration but a last does
                os.environ["RLHF_SIMULATED_POD_START_S"] = "0"
                warm = standin.run_pipeline("local", f"{run_id} warm-up", params={
                    **given, "prefetch_next": True,
                    "attempt": f"bench:{run_id}/warm-up"})
                while standin.get_run(warm.run_id).state == "RUNNING":
                    time.sleep(0.2)
                os.environ["RLHF_SIMULATED_POD_START_S"] = str(latency)
                t0 = time.perf_counter()
                try:
                    outcome = drive(standin, plan(1 + args.runs), "", "local", log=lambda *a: None)
                    wall = time.perf_counter() - t0
                finally:
                    standin.close()
                subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stop-session", "--run-id", run_id,
                                "--head-root", str(head_root)], cwd=ROOT, capture_output=True)
                rows = [json.loads(line) for line in
                        (work / "out" / run_id / "metrics.jsonl").read_text().splitlines()][1:]
                busy = sum(r["perf/worker_time_s"] for r in rows)
                inference = sum(r.get(f"timing_worker_s/{s}", 0.0) for r in rows for s in INFERENCE)
                # steady state: from the first driven iteration's commit to the last one's;
                # the worker time in it is that of the iterations after the first (their
                # computing ahead starts after the commit before them, and the last
                # iteration computes nothing ahead)
                committed = [_committed_at(work / "store" / run_id, n) for n in range(1, 1 + len(rows))]
                steady_wall = committed[-1] - committed[0]
                steady_busy = sum(r["perf/worker_time_s"] for r in rows[1:])
                results.append({"latency": latency, "pipelined": pipelined, "runs": len(rows), "wall": wall,
                                "busy": busy, "inference_share": inference / busy,
                                "steady_wall": steady_wall, "steady_busy": steady_busy,
                                "adopted": sum(r.get("perf/prefetch_adopted", 0) for r in rows),
                                "submitted": len(outcome.runs)})
                r = results[-1]
                print(f"[idle] {run_id}: {r['runs']} iterations, {wall:.0f} s wall, {busy:.0f} s worker busy, "
                      f"idle {1 - busy / wall:.1%}; steady state {1 - steady_busy / steady_wall:.1%}", flush=True)
    finally:
        os.environ.pop("RLHF_SIMULATED_POD_START_S", None)
        ray_head.stop_head(ray_head.read_head(head_root), head_root)
    print(f"\nworkers' idle share over {args.runs} iterations of a driven fine-tune (config: "
          f"{' '.join(HEAVY + args.overrides)}; the session computes ahead in every row)")
    print("(whole: from the driver's start, so the first run's pod start and start-up, which nothing\n"
          " can overlap, are in it; steady: from the first driven iteration's commit to the last's)")
    print(f"{'pod start s':>11}{'pipelining':>12}{'s/iteration':>13}{'worker s/it':>12}{'inference':>10}"
          f"{'adopted':>9}{'idle whole':>12}{'steady s/it':>13}{'idle steady':>13}")
    steady = lambda r: 1 - r["steady_busy"] / r["steady_wall"]
    for r in results:
        print(f"{r['latency']:>11.0f}{'on' if r['pipelined'] else 'off':>12}{r['wall'] / r['runs']:>13.1f}"
              f"{r['busy'] / r['runs']:>12.1f}{r['inference_share']:>10.0%}{r['adopted']:>6.0f}/{r['runs']:<2}"
              f"{1 - r['busy'] / r['wall']:>12.1%}{r['steady_wall'] / (r['runs'] - 1):>13.1f}{steady(r):>13.1%}")
    for latency in latencies:
        off, on = (next(r for r in results if r["latency"] == latency and r["pipelined"] == p) for p in (False, True))
        goal = "<= 5%" if latency <= 5 else "<= 15%" if latency <= 20 else "none"
        print(f"pod start {latency:.0f} s: steady idle share {steady(off):.1%} -> {steady(on):.1%} pipelined "
              f"(goal {goal}; whole run {1 - off['busy'] / off['wall']:.1%} -> {1 - on['busy'] / on['wall']:.1%}); "
              f"steady s/iteration {off['steady_wall'] / (off['runs'] - 1):.1f} -> "
              f"{on['steady_wall'] / (on['runs'] - 1):.1f}")


def _committed_at(store: Path, iteration: int) -> float:
    from datetime import datetime

    manifest = json.loads((store / f"iter-{iteration:06d}" / "MANIFEST.json").read_text())
    return datetime.fromisoformat(manifest["committed_at"]).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("all", "overhead", "idle"), default="all")
    parser.add_argument("--iterations", type=int, default=None, help="default: the run's default total")
    parser.add_argument("--runs", type=int, default=5, help="timed iterations per idle setting (after one untimed)")
    parser.add_argument("--latencies", default="5,20", help="simulated pod start seconds, comma-separated")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the idle part (sizing)")
    args = parser.parse_intermixed_args()  # `idle --runs 5 data.x=1`: options among the overrides
    if args.iterations is not None and args.iterations < 3:
        parser.error("--iterations: at least 3 (steady state is measured between runs 2 and K)")
    if args.runs < 3:
        parser.error("--runs: at least 3 (steady state is measured between the first driven commit and the last)")
    # what the image runs: its pip install byte-compiles the packages (here an editable
    # install and PYTHONDONTWRITEBYTECODE=1 would have every process compile them anew)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "rlhf_core", "components", "pipelines"],
                   cwd=ROOT, check=True)  # (compileall -q prints only what failed)
    if args.mode in ("all", "overhead"):
        overhead(args)
    if args.mode in ("all", "idle"):
        idle(args)


if __name__ == "__main__":
    main()
