"""Probes the code carries into production, each off unless its environment variable is
set: crash points (the reliability tests kill a process at a named point), a simulated pod
start and phase marks (the orchestration benchmark).

``RLHF_KILL_AT=<pattern>`` makes this process SIGKILL itself (no cleanup, no finally
blocks: what a node failure or an OOM kill does) the first time it reaches a point whose
name matches the fnmatch ``<pattern>``. Points:

    stage:<name>        the stage's work is done (workers changed), its snapshot not written
                        (the previous stages' are committed)
    snapshot:<uri>      a snapshot's data is written, its manifest (the commit) is not
    commit:<iteration>  the checkpoint is written, the iteration manifest is not

``RLHF_FREEZE_AT=<pattern>`` makes this process SIGSTOP itself at such a point instead: it
hangs there (what a wedged node does) until something kills it. A test that kills a whole
process group "in the middle of an iteration" freezes the controller first, so the
iteration cannot commit before the kill arrives however fast it runs.

``RLHF_SIMULATED_POD_START_S=<seconds>`` makes every Kubeflow component wait that long
before it does anything (``pod_started``): it stands for the pod being scheduled and its
image started, which the KFP local runner does not have (benchmarks/orchestration.py).

``RLHF_PHASE_LOG=<file>`` makes ``phase(name)`` append ``{"pid", "run", "phase", "t", "cpu"}``
(wall clock; this process's CPU seconds) to that file as one JSON line: where a Kubeflow component's time goes
(benchmarks/orchestration.py). ``run`` is ``RLHF_PHASE_RUN``, which a pipelined starter's
runner sets per pipeline run (runs overlap, so their marks interleave). ``phase("process_start")`` logs when this process was
created (from /proc), so the time before any Python code ran is counted too.

Unset in production; reading one environment variable is all each costs.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import time


def reached(point: str) -> None:
    pattern = os.environ.get("RLHF_KILL_AT")
    if pattern and fnmatch.fnmatchcase(point, pattern):
        os.kill(os.getpid(), signal.SIGKILL)
    pattern = os.environ.get("RLHF_FREEZE_AT")
    if pattern and fnmatch.fnmatchcase(point, pattern):
        os.kill(os.getpid(), signal.SIGSTOP)


def pod_started() -> None:
    delay = float(os.environ.get("RLHF_SIMULATED_POD_START_S") or 0)
    if delay > 0:
        time.sleep(delay)


def phase(name: str) -> None:
    path = os.environ.get("RLHF_PHASE_LOG")
    if not path:
        return
    t = _process_start() if name == "process_start" else time.time()
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "run": os.environ.get("RLHF_PHASE_RUN"), "phase": name,
                            "t": t, "cpu": time.process_time()}) + "\n")


def _process_start() -> float:
    """This process's creation time (wall clock, 10 ms resolution), from /proc: its age
    (uptime now - its start in ticks since boot) before now. /proc/stat's boot time is
    whole seconds, which put up to a second between this and other marks."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
