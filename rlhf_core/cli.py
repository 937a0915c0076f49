"""The ``rlhf`` command.

Subcommands grow with the project; today:

* ``rlhf run``: the main job on the embedded default. Until the trainer lands it runs the
  DataProto demo: a GRPO-shaped batch goes through repeat -> chunk -> a Ray worker and back
  over the pickle-free wire -> concat -> union, and the command prints what it did.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_run(args: argparse.Namespace) -> int:
    from rlhf_core.demo import run_dataproto_demo

    return run_dataproto_demo(prompts=args.prompts, n=args.n, workers=args.workers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the main job on the embedded default")
    run.add_argument("--prompts", type=int, default=6, help="prompts in the demo batch")
    run.add_argument("--n", type=int, default=4, help="responses sampled per prompt")
    run.add_argument("--workers", type=int, default=2, help="Ray worker actors")
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
