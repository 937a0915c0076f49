"""The path grammar of a run in the store (DESIGN.md, "Snapshot layout"), in one place::

    {store}/{run_id}/iter-{N:06d}/{stage}/         a stage's snapshot
    {store}/{run_id}/iter-{N:06d}/MANIFEST.json    the iteration, committed last
    {store}/{run_id}/checkpoints/step-{S:06d}/     the state after S iterations
    {store}/{run_id}/leases/iter-{N:06d}/{G:08d}.json   who runs iteration N (a log of records)
    {store}/{run_id}/replays/iter-{N:06d}/...      what-if replays, apart from the originals

Everything that builds or parses such a path uses these functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST = "MANIFEST.json"
_ITERATION_DIR = re.compile(r"^iter-(\d{6})$")
_LOCATION = re.compile(r"^(?P<run>.+?)/(?:iter-(?P<iter>\d{6})(?:/(?P<rest>.*))?"
                       r"|checkpoints/step-(?P<step>\d{6})(?:/.*)?)$")


def iteration_dir(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def checkpoint_dir(step: int) -> str:
    return f"checkpoints/step-{step:06d}"


def iteration_of_dir(name: str) -> int | None:
    """N for a folder named ``iter-NNNNNN``, else None."""
    m = _ITERATION_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Location:
    """What a URI inside a run names."""

    run_uri: str
    iteration: int | None = None   # an iteration, or something inside one
    stage: str | None = None       # the first path component inside the iteration
    step: int | None = None        # a checkpoint

    @property
    def store(self) -> str:
        return self.run_uri.rpartition("/")[0]

    @property
    def run_id(self) -> str:
        return self.run_uri.rpartition("/")[2]

    @property
    def iteration_uri(self) -> str | None:
        return None if self.iteration is None else f"{self.run_uri}/{iteration_dir(self.iteration)}"


def parse(uri: str) -> Location | None:
    """The run, iteration, stage or checkpoint ``uri`` names; None when it names none of
    them (a run or store URI)."""
    m = _LOCATION.match(uri.rstrip("/"))
    if m is None:
        return None
    if m.group("step") is not None:
        return Location(m.group("run"), step=int(m.group("step")))
    stage = (m.group("rest") or "").split("/", 1)[0] or None
    return Location(m.group("run"), iteration=int(m.group("iter")), stage=stage)
