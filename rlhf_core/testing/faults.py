"""Crash points for the reliability tests.

``RLHF_KILL_AT=<pattern>`` makes this process SIGKILL itself (no cleanup, no finally
blocks: what a node failure or an OOM kill does) the first time it reaches a point whose
name matches the fnmatch ``<pattern>``. Points:

    stage:<name>        the stage's work is done (workers changed), its snapshot not written
    snapshot:<uri>      a snapshot's data is written, its manifest (the commit) is not
    commit:<iteration>  the checkpoint is written, the iteration manifest is not

Unset in production; reading one environment variable is all it costs.
"""

from __future__ import annotations

import fnmatch
import os
import signal


def reached(point: str) -> None:
    pattern = os.environ.get("RLHF_KILL_AT")
    if pattern and fnmatch.fnmatchcase(point, pattern):
        os.kill(os.getpid(), signal.SIGKILL)
