"""The arguments every command that acts on a run shares (``--run-id``, ``--store``,
``--head-root``), declared once: the `rlhf` commands, their plugins and the local
stand-ins' entry points add them with ``add_run_arguments``."""

from __future__ import annotations

import argparse

REQUIRED = object()  # the argument must be given
ABSENT = object()     # the command does not take it

HELP = {
    "run_id": "the run's id (1-128 letters, digits, '.', '_', '-'); an existing run continues from its last "
              "committed iteration",
    "store": "fsspec URI of the run's store: snapshots, manifests and checkpoints (default runs/store)",
    "head_root": "folder of the local Ray head (its state and token), started if absent (default: "
                 "{trainer.output_dir}/head, the one every command uses)",
}


def add_run_arguments(parser: argparse.ArgumentParser, *, run_id=REQUIRED, store=None, head_root=ABSENT,
                      **help_overrides: str) -> None:
    """``--run-id`` / ``--store`` / ``--head-root`` on ``parser``: each REQUIRED, ABSENT, or
    a default; ``help_overrides`` (``run_id_help=...``) replaces a help text where a command
    means something more specific."""
    for name, value in (("run_id", run_id), ("store", store), ("head_root", head_root)):
        if value is ABSENT:
            continue
        flag = "--" + name.replace("_", "-")
        text = help_overrides.get(f"{name}_help", HELP[name])
        if value is REQUIRED:
            parser.add_argument(flag, required=True, help=text)
        else:
            parser.add_argument(flag, default=value, help=text)
