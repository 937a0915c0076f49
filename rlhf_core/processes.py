"""Facts about processes on this machine (no Ray, no store): used by the local Ray head's
bookkeeping and by leases, which tell a dead local holder from a live one."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID runs on this machine (a zombie, exited but not yet
    reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
