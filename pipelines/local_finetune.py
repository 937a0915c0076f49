"""A fine-tune driven on this machine: the driver's loop (``components/driver.py``) over
the local stand-in of the KFP API (``pipelines/local.py``), what the driver pipeline does
on a cluster. ``python -m pipelines.local_finetune --run-id R --store S --head-root H
--root P --iterations N [overrides]``."""

from __future__ import annotations

import argparse
import os
import signal

from components.driver import Plan, drive, report_markdown
from rlhf_core.config import RunConfig, apply_overrides, handover
from rlhf_core.cli_args import REQUIRED, add_run_arguments
from pipelines.local import LocalKfpStandIn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.local_finetune")
    add_run_arguments(parser, store=REQUIRED, head_root=REQUIRED)
    parser.add_argument("--root", required=True, help="folder for the local pipeline runs")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--more", type=int, default=None)
    parser.add_argument("--stop-at-reward", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--no-pipelining", dest="pipelined", action="store_false",
                        help="submit an iteration's run only once the one before it has ended")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # finish the current run, submit no more
    os.makedirs(args.root, exist_ok=True)
    cfg = apply_overrides(RunConfig(), list(args.overrides)).validate()
    plan = Plan(args.run_id, args.store, {"run_id": args.run_id, "store": args.store, **handover(cfg)},
                iterations=args.iterations, more=args.more, stop_at_reward=args.stop_at_reward,
                budget_s=args.budget_s, poll_s=args.poll_s, pipelined=args.pipelined)
    standin = LocalKfpStandIn(args.head_root, args.root)
    try:
        outcome = drive(standin, plan, "", "local", stopping=lambda: bool(stop))
    finally:
        standin.close()
    with open(os.path.join(args.root, "report.md"), "w", encoding="utf-8") as f:
        f.write(report_markdown(plan, outcome))
    print(f"[driver] {outcome.reason}; committed {outcome.committed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
