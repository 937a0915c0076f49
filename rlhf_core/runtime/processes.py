"""Facts about processes on this machine (no Ray, no store): used by the local Ray head's
bookkeeping and by leases, which tell a dead local holder from a live one."""

from __future__ import annotations

import os
import socket
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


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks since boot): with the PID, it names one
    process; "" when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def this_process() -> dict:
    """What identifies this process to another one on the same machine: the host, the
    boot, the PID namespace (containers sharing a host name do not share it), the PID
    and its start time."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid_ns": _pid_namespace(), "pid": pid,
            "started": process_start_time(pid)}


def known_dead(process: object) -> bool:
    """Whether ``process`` (a ``this_process()`` of some earlier time) has certainly ended:
    only a process that can see it (same host, boot and PID namespace) can tell; from
    anywhere else the answer is no (the caller waits for a lease's TTL instead)."""
    if not isinstance(process, dict):
        return False
    here = this_process()
    if any(process.get(k) != here[k] for k in ("host", "boot", "pid_ns")) or not here["boot"]:
        return False
    pid = process.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if not pid_alive(pid):
        return True
    return bool(process.get("started")) and process_start_time(pid) != process.get("started")  # PID reused


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` (a process the caller started) and every process under it: the
    parent first (it cannot start another child meanwhile), the ones under it as listed
    while the tree still linked them."""
    import psutil

    try:
        parent = psutil.Process(pid)
        below = parent.children(recursive=True)
    except psutil.Error:
        return
    for proc in [parent, *below]:
        try:
            proc.kill()
        except psutil.Error:
            pass
