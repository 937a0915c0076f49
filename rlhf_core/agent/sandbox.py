"""The local sandbox model-written code runs in (the code interpreter tool without a
SandboxFusion server).

Each run is a new process tree, isolated by the kernel, not by Python:
- a network namespace of its own (``unshare --net``): no interface but a loopback of its
  own, so nothing on the host or beyond is reachable;
- a root of its own (a mount namespace, ``pivot_root`` onto a fresh tmpfs, the old root
  detached): the system's ``/usr`` (and ``/bin``, ``/lib``... as the host lays them out),
  the interpreter's installation and ``/dev/null``-like devices, all read-only, a ``/proc``
  of its own pid namespace and size-bounded tmpfs on ``/tmp`` (the run's folder is
  ``/tmp/work``), ``/var/tmp`` and ``/dev/shm``. Nothing else of the host is there to
  read or write: no home, no store, no cache, no ``/run``, whoever runs the trainer;
- no capabilities (the bounding set is emptied) and no new privileges (``no_new_privs``):
  run by root, the code runs as a user id of its own (``SANDBOX_UIDS``: one per run, so
  runs side by side do not share their process allowance); run by another user, it stays
  that user, in a user namespace, without the powers of that namespace's root;
- resource limits: CPU seconds, address space, processes (a fork bomb meets it), file
  size, open files, no core files; a wall-clock limit and an output limit kill the pid
  namespace's first process, and the kernel then kills everything in it (a process that
  left the process group included);
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

#: The user ids code runs as when we are root: one per run, drawn at random, owning no file.
SANDBOX_UIDS = range(1_900_000_000, 2_000_000_000)
NOBODY = 65534
#: What the code's root holds of the host, read-only (where the host has it).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
#: pivot_root(2) by machine (glibc has no wrapper)
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


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
    a user with no rights of its own cannot reach it) the system's."""
    if os.getuid() != 0 or _world_executable(sys.executable):
        return os.path.realpath(sys.executable)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return os.path.realpath(candidate)
    raise SandboxUnavailable("no Python interpreter that the sandbox's user (no rights of its own) may run")


#: Runs inside the new namespaces, as the namespaces' root, before the code: builds the
#: code's root, sets the limits, drops every capability (and the user, when we are root),
#: then replaces itself with the code's interpreter. Failures exit 125 (unavailable).
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18

def fail(what):
    sys.stderr.write(f"cannot {what} (errno {ctypes.get_errno()})\n")
    os._exit(125)

def mount(source, target, kind, flags, data=None):
    if libc.mount(source and source.encode(), target.encode(), kind and kind.encode(), flags,
                  data and data.encode()) != 0:
        fail(f"mount {kind or source or '(a remount)'} on {target}")

def bind(path, root):
    inside = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        if not os.path.lexists(inside):
            os.symlink(os.readlink(path), inside)
        return
    if os.path.isdir(path):
        os.makedirs(inside, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), exist_ok=True)
        open(inside, "a").close()
    mount(path, inside, None, MS_BIND | MS_REC)
    # the source's own flags stay (a user namespace may not drop a noexec it inherited)
    held = os.statvfs(path).f_flag
    kept = (held & (MS_NOSUID | MS_NODEV | 8 | 1024 | 2048)) | ((1 << 21) if held & 4096 else 0)
    mount(None, inside, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept
          | (0 if path.startswith("/dev/") else MS_NODEV))

def build():  # the code's root: a fresh tmpfs over the host's /tmp, pivoted onto, the host's detached
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in spec["binds"]:
        if os.path.lexists(path):
            bind(path, root)
    for target, size in (("/tmp", spec["tmp_mb"]), ("/var/tmp", 1), ("/dev/shm", 1)):
        os.makedirs(root + target, exist_ok=True)
        mount("tmpfs", root + target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,mode=1777")
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | 8)  # 8: MS_NOEXEC
    os.makedirs(root + "/.old", exist_ok=True)
    os.chdir(root)
    if libc.syscall(spec["pivot_root"], b".", b".old") != 0:
        fail("pivot_root")
    os.chdir("/")
    if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH: nothing of the host's root is left to uncover
        fail("detach the host's root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs("/tmp/work", mode=0o777, exist_ok=True)
    os.chmod("/tmp/work", 0o777)
    os.chdir("/tmp/work")

def drop():  # no capability, no new privileges, the run's user (as root), the limits
    PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # up to the kernel's last capability
        cap += 1
    if cap < 38:
        fail("empty the capability bounding set")
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("set no_new_privs")
    for name, value in (("RLIMIT_CPU", spec["cpu_s"]), ("RLIMIT_AS", spec["memory_mb"] << 20),
                        ("RLIMIT_NPROC", spec["processes"]), ("RLIMIT_FSIZE", spec["file_mb"] << 20),
                        ("RLIMIT_NOFILE", spec["open_files"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))

try:  # whatever fails before the code starts: the sandbox is unavailable here, not the code's error
    build()
    drop()
    os.execve(spec["python"], [spec["python"], "-I", "-c", spec["code"]],
              {"PATH": "/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"})
except Exception as exc:
    sys.stderr.write(f"cannot start the code: {type(exc).__name__}: {exc}\n")
    os._exit(125)
"""


def _nproc_limit(limits: Limits, uid: int | None) -> int:
    """RLIMIT_NPROC counts every process of the real user: a run's own user id has none
    but the run's; for the caller's (not root), its processes now plus the run's allowance."""
    if uid is not None:
        return limits.processes
    try:
        import psutil

        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
    except Exception:  # noqa: BLE001 - best effort; the wall clock and CPU limits still hold
        mine = 4096
    return mine + limits.processes


def _binds(python: str) -> list[str]:
    """What the code's root holds of the host: the system's folders and a few files, and
    the installation ``python`` belongs to (its prefix: ``bin/``'s parent, holding its
    ``lib/pythonX.Y``). An installation that is no such folder (``/``, a home with a
    ``bin/``), or that sits where the code's own tmpfs go, is refused: the sandbox is
    unavailable with it."""
    prefix = os.path.dirname(os.path.dirname(python))
    if any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        return [*SYSTEM_DIRS, *SYSTEM_FILES]
    stdlib = os.path.join(prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    if prefix in ("/", "") or not os.path.isdir(stdlib) or any(
            prefix == d or prefix.startswith(d + "/") for d in ("/tmp", "/var/tmp", "/dev/shm", "/proc")):
        raise SandboxUnavailable(f"the interpreter {python} is not in an installation folder the sandbox can show "
                                 f"read-only (expected its prefix to hold {stdlib}, outside /tmp, /var/tmp, /dev/shm)")
    return [*SYSTEM_DIRS, *SYSTEM_FILES, prefix]


def _run_uid(uid_map: str | None = None) -> int:
    """A user id of its own for this run, owning no file: one of ``SANDBOX_UIDS`` where
    this user namespace maps them (a container's root under a user namespace maps fewer:
    then the top of its largest range, nobody's 65534 as the last resort). ``uid_map``:
    ``/proc/self/uid_map``'s text (read when None)."""
    import secrets

    try:
        if uid_map is None:
            with open("/proc/self/uid_map", encoding="ascii") as fh:
                uid_map = fh.read()
        ranges = [tuple(map(int, line.split())) for line in uid_map.splitlines() if line.strip()]
    except (OSError, ValueError):
        ranges = []
    mapped = [(inside, inside + count) for inside, _, count in ranges]
    if any(lo <= SANDBOX_UIDS.start and SANDBOX_UIDS.stop <= hi for lo, hi in mapped):
        return SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]
    lo, hi = max(mapped, key=lambda r: r[1] - r[0], default=(0, 0))
    spare = range(max(lo + 1, hi - 4096, 1000), hi - 2)  # below 65534 (nobody) at a 65536-id map's top
    return spare[secrets.randbelow(len(spare))] if len(spare) > 0 else NOBODY


def _stop(proc: subprocess.Popen) -> None:
    """Kill the pid namespace's first process (unshare's child), which takes everything in
    the namespace with it, whatever process group or session each has made; then unshare."""
    try:
        import psutil

        for child in psutil.Process(proc.pid).children():
            child.kill()
    except Exception:  # noqa: BLE001 - unshare is gone already: so is its namespace
        pass
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def _communicate(proc: subprocess.Popen, stdin: bytes, wall_s: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """(stdout, stderr, why it was stopped: None, "timeout" or "output"): each stream is
    kept up to ``cap`` bytes; past the wall clock or the cap the sandbox is stopped, so
    neither a flood of output nor a stuck process holds this caller's memory or thread."""
    import selectors
    import threading

    def feed():
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    threading.Thread(target=feed, daemon=True).start()
    kept, why = {proc.stdout: bytearray(), proc.stderr: bytearray()}, None
    deadline = time.monotonic() + wall_s
    with selectors.DefaultSelector() as selector:
        for stream in kept:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = why or "timeout"
                _stop(proc)
                break
            for key, _ in selector.select(timeout=left):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fileobj]
                buffer += chunk[:cap + 1 - len(buffer)] if len(buffer) <= cap else b""
                if len(buffer) > cap and why is None:
                    why = "output"
                    _stop(proc)
    proc.wait()
    for stream in kept:
        stream.close()
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), why


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> SandboxResult:
    """Run ``code`` with ``stdin`` in the sandbox; never raises for what the code does."""
    import platform

    unshare = shutil.which("unshare")
    if unshare is None:
        return SandboxResult("unavailable", None, "", "sandbox: util-linux unshare is not installed", 0.0)
    if platform.machine() not in _PIVOT_ROOT:
        return SandboxResult("unavailable", None, "", f"sandbox: no pivot_root number for {platform.machine()}", 0.0)
    root = os.getuid() == 0
    try:
        python = interpreter()
        binds = _binds(python)
    except SandboxUnavailable as exc:
        return SandboxResult("unavailable", None, "", f"sandbox: {exc}", 0.0)
    uid = _run_uid() if root else None
    spec = {"code": code, "python": python, "uid": uid, "tmp_mb": limits.file_mb * 4, "binds": binds,
            "pivot_root": _PIVOT_ROOT[platform.machine()], "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb,
            "processes": _nproc_limit(limits, uid), "file_mb": limits.file_mb, "open_files": limits.open_files}
    namespaces = ["--net", "--mount", "--pid", "--fork", "--mount-proc"] + ([] if root else ["--map-root-user"])
    # the launcher runs as the namespaces' root under the caller's interpreter (trusted)
    command = [unshare, *namespaces, "--", os.path.realpath(sys.executable), "-I", "-c", _LAUNCHER,
               json.dumps(spec)]
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True, cwd="/")
    out, err, stopped = _communicate(proc, stdin.encode(), limits.wall_s, limits.output_bytes)
    seconds = time.monotonic() - t0
    cap = limits.output_bytes
    truncated = len(out) > cap or len(err) > cap
    stdout, stderr = out[:cap].decode(errors="replace"), err[:cap].decode(errors="replace")
    if proc.returncode == 125 or stderr.startswith(("unshare: unshare failed", "unshare: failed to execute",
                                                     "unshare: cannot", "unshare: write failed")):
        return SandboxResult("unavailable", proc.returncode, "", f"sandbox: {stderr.strip()[:500]}", seconds)
    if stopped == "timeout":
        status = "timeout"
    elif stopped == "output":
        status, stderr = "killed", (stderr + f"\nsandbox: stopped past {cap} bytes of output").lstrip()
    elif (proc.returncode is not None and proc.returncode < 0) or "unshare: sigprocmask" in stderr:
        # a signal (the CPU limit's SIGXCPU/SIGKILL, the kernel's OOM kill), which unshare
        # passes on or, failing to re-raise it, reports
        status, stderr = "killed", stderr.replace("unshare: sigprocmask unblock failed: Invalid argument", "").strip()
    elif proc.returncode == 0:
        status = "ok"
    else:
        status = "error"
    return SandboxResult(status, proc.returncode, stdout, stderr, seconds, truncated)
