"""The local sandbox model-written code runs in (the code interpreter tool without a
SandboxFusion server).

Each run is a new process tree, isolated by the kernel, not by Python:
- a network namespace of its own (``unshare --net``): no interface but a loopback of its
  own, so nothing on the host or beyond is reachable;
- a mount namespace of its own with fresh, empty, size-bounded tmpfs on ``/tmp``,
  ``/var/tmp`` and ``/dev/shm``: the run's folder is ``/tmp/work`` there; what it writes
  vanishes with it, and the host's temporary folders (a run's store or cache on this
  machine) are out of sight;
- run by root, it drops to ``nobody`` before the code starts: it can read only what the
  world may read (not the run's credentials, caches or store) and write nowhere outside
  its tmpfs; run by another user, it keeps that user's id inside a user namespace;
- resource limits: CPU seconds, address space, processes (a fork bomb meets it), file
  size, open files, no core files; a wall-clock limit kills the whole process group;
- an environment of its own (no credentials, no proxy settings) and Python's isolated mode.

Where the kernel refuses namespaces (a container without them), nothing runs: the tool
answers that the sandbox is unavailable (set a SandboxFusion URL instead). Nothing of
the caller's is shared but the code, its stdin and the interpreter's installation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass

#: who runs the code when we are root
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    processes: int = 16
    file_mb: int = 16
    open_files: int = 64
    output_bytes: int = 65536


@dataclass
class SandboxResult:
    status: str           # "ok", "error" (non-zero exit), "timeout", "killed" (a limit), "unavailable"
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False


class SandboxUnavailable(RuntimeError):
    """The kernel would not give the sandbox its namespaces."""


def _world_executable(path: str) -> bool:
    """Whether a user with no rights of its own can run ``path`` (every folder on the way
    searchable by others, the file executable by others)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def interpreter() -> str:
    """The Python the code runs under: this one, or (when we are root and it sits where
    ``nobody`` cannot reach it) the system's."""
    if os.getuid() != 0 or _world_executable(sys.executable):
        return os.path.realpath(sys.executable)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return os.path.realpath(candidate)
    raise SandboxUnavailable("no Python interpreter that the sandbox user (nobody) may run")


#: Runs inside the new namespaces, as the namespaces' root, before the code: mounts the
#: tmpfs, sets the limits, drops the user, then replaces itself with the code's interpreter.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
for target, size in (("/tmp", spec["tmp_mb"]), ("/var/tmp", 1), ("/dev/shm", 1)):
    if os.path.isdir(target) and libc.mount(b"tmpfs", target.encode(), b"tmpfs", 0,
                                             f"size={size}m,mode=1777".encode()) != 0:
        sys.stderr.write(f"sandbox: cannot mount a tmpfs on {target} (errno {ctypes.get_errno()})\n")
        os._exit(125)
os.makedirs("/tmp/work", mode=0o777, exist_ok=True)
os.chmod("/tmp/work", 0o777)
os.chdir("/tmp/work")
if spec["drop_to"] is not None:
    os.setgroups([])
    os.setgid(spec["drop_to"])
    os.setuid(spec["drop_to"])
for name, value in (("RLIMIT_CPU", spec["cpu_s"]), ("RLIMIT_AS", spec["memory_mb"] << 20),
                    ("RLIMIT_NPROC", spec["processes"]), ("RLIMIT_FSIZE", spec["file_mb"] << 20),
                    ("RLIMIT_NOFILE", spec["open_files"]), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
os.execve(spec["python"], [spec["python"], "-I", "-c", spec["code"]],
          {"PATH": "/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
"""


def _nproc_limit(limits: Limits, drop_to: int | None) -> int:
    """RLIMIT_NPROC counts every process of the real user: for a user that is not
    ``nobody``, its processes now plus the sandbox's allowance."""
    if drop_to is not None:
        return limits.processes
    try:
        import psutil

        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
    except Exception:  # noqa: BLE001 - best effort; the wall clock and CPU limits still hold
        mine = 4096
    return mine + limits.processes


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> SandboxResult:
    """Run ``code`` with ``stdin`` in the sandbox; never raises for what the code does."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return SandboxResult("unavailable", None, "", "sandbox: util-linux unshare is not installed", 0.0)
    root = os.getuid() == 0
    try:
        python = interpreter()
    except SandboxUnavailable as exc:
        return SandboxResult("unavailable", None, "", f"sandbox: {exc}", 0.0)
    drop_to = NOBODY if root else None
    spec = {"code": code, "python": python, "drop_to": drop_to, "tmp_mb": limits.file_mb * 4,
            "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "processes": _nproc_limit(limits, drop_to),
            "file_mb": limits.file_mb, "open_files": limits.open_files}
    namespaces = ["--net", "--mount", "--pid", "--fork", "--mount-proc"] + ([] if root else ["--map-root-user"])
    # the launcher runs as the namespaces' root under the caller's interpreter (trusted)
    command = [unshare, *namespaces, "--", os.path.realpath(sys.executable), "-I", "-c", _LAUNCHER,
               json.dumps(spec)]
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True, cwd="/")
    timed_out = False
    try:
        out, err = proc.communicate(stdin.encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the pid namespace's init: everything in it dies with it
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    seconds = time.monotonic() - t0
    cap = limits.output_bytes
    truncated = len(out) > cap or len(err) > cap
    stdout, stderr = out[:cap].decode(errors="replace"), err[:cap].decode(errors="replace")
    if proc.returncode == 125 or stderr.startswith(("unshare: unshare failed", "unshare: failed to execute",
                                                     "unshare: cannot", "unshare: write failed")):
        return SandboxResult("unavailable", proc.returncode, "", f"sandbox: {stderr.strip()[:500]}", seconds)
    if timed_out:
        status = "timeout"
    elif (proc.returncode is not None and proc.returncode < 0) or "unshare: sigprocmask" in stderr:
        # a signal (the CPU limit's SIGXCPU/SIGKILL, the kernel's OOM kill), which unshare
        # passes on or, failing to re-raise it, reports
        status, stderr = "killed", stderr.replace("unshare: sigprocmask unblock failed: Invalid argument", "").strip()
    elif proc.returncode == 0:
        status = "ok"
    else:
        status = "error"
    return SandboxResult(status, proc.returncode, stdout, stderr, seconds, truncated)
