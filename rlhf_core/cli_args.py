"""The arguments every command that acts on a run shares (``--run-id``, ``--store``,
``--head-root``), declared once: the `rlhf` commands, their plugins and the local
stand-ins' entry points add them with ``add_run_arguments``.

Every argument that names a run or a URI in a store is checked by argparse itself
(``type=run_id`` / ``store_uri`` / ``run_uri``), so a bad one is refused while parsing,
before any path, process or request exists, and the error names the argument. ``Parser``
turns argparse's errors into the one ``rlhf: ...`` line every command ends with.
"""

from __future__ import annotations

import argparse
import re
import sys

from rlhf_core.record.run_ids import run_id_problem, store_uri_problem

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
        kind = TYPES.get(name)
        if value is REQUIRED:
            parser.add_argument(flag, required=True, type=kind, help=text)
        else:
            parser.add_argument(flag, default=value, type=kind, help=text)


def run_id(text: str) -> str:
    """argparse type of a run id (``run_ids.validate_run_id``'s rule)."""
    problem = run_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def store_uri(text: str) -> str:
    """argparse type of a store URI, or of anything in a store (``run_ids.validate_store_uri``'s
    rule): refused on its text alone, before fsspec resolves it (which may mean a network
    lookup)."""
    problem = store_uri_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def run_uri(text: str) -> str:
    """argparse type of a URI inside a run (``{store}/{run_id}[/iter-NNNNNN[/stage]]`` or
    ``.../checkpoints/step-SSSSSS``): a store URI whose run id is valid too."""
    from rlhf_core.record import run_layout

    text = store_uri(text)
    loc = run_layout.parse(text)
    name = run_layout.run_id_of(loc.run_uri if loc is not None else text)
    problem = run_id_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"the run id in it: {problem}")
    return text


TYPES = {"run_id": run_id, "store": store_uri}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors end the command like every other `rlhf` error: the
    usage, then one line ``rlhf: --store: expected ...; found ...`` (``SystemExit`` with
    that line, exit status 1). Subcommand parsers are of the same class (argparse makes
    them with the parent's)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        message = message[len("argument "):] if message.startswith("argument ") else message
        raise SystemExit(f"{self.prog.split()[0]}: {one_line(message)}")


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the blanks around them) made single spaces: an
    error a user reads is one line, whatever a library put in it."""
    return re.sub(r"\s*[\r\n]+\s*", " ", str(text)).strip()
