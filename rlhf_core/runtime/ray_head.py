"""A Ray head of our own on this machine: non-default ports, token auth, stopped by PID.

The embedded default needs a Ray cluster that outlives any one process (the training
session's actors live in it while each iteration's controller comes and goes). We never
attach to a cluster we did not start and never run ``ray stop`` (it would stop every
Ray on the machine): the head runs in its own process group, and stopping it ends exactly
the processes whose command line names its private temp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_core.runtime.net import free_ports
from rlhf_core.runtime.processes import known_dead, pid_alive, process_start_time, this_process


@dataclass
class HeadInfo:
    address: str          # host:port of the GCS, what ray.init(address=...) takes
    token_path: str       # RAY_AUTH_TOKEN_PATH for clients
    temp_dir: str
    pid: int              # the `ray start --block` process (its group holds the head)
    dashboard_url: str = ""  # the Ray Jobs API (the session runs as a Ray job)
    started_at: str = ""  # the process's start time (/proc/PID/stat): a reused PID differs
    owner_pid: int = 0    # the `rlhf run` that started it and stops it (0: someone's own head)

    @classmethod
    def remote(cls, address: str, dashboard_url: str) -> "HeadInfo":
        """A cluster someone else runs (KubeRay): ``ray://host:10001`` and its Jobs API;
        the token comes from ``RAY_AUTH_TOKEN`` (a Kubernetes secret), not a file."""
        return cls(address=address, token_path="", temp_dir="", pid=0, dashboard_url=dashboard_url)


#: Every Ray process we start on this machine listens on loopback only: with this set, Ray
#: takes 127.0.0.1 as the node address and its servers (GCS, raylet, agents, workers)
#: bind to it instead of every interface.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

#: Stage payloads of small models are a few hundred KB: passing them inline with the call
#: instead of through the object store saves a round trip per stage. Every Ray we start
#: (our head, a direct run's local Ray) uses these.
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 4 * 1024 * 1024, "task_rpc_inlined_bytes_limit": 16 * 1024 * 1024}


def _ray_binary() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


def default_head_root(output_dir: str = "runs") -> str:
    """Where the local head of runs writing to ``output_dir`` lives (every command's default)."""
    return os.path.join(output_dir, "head")


def head_state_path(root: str | Path) -> Path:
    return Path(root) / "ray-head.json"


def is_our_head(info: HeadInfo) -> bool:
    """The recorded head process is still the one we started: same PID, same start time,
    and its command line names the head's private temp dir (never trust a PID alone)."""
    if not info.pid or not info.temp_dir or not pid_alive(info.pid):
        return False
    if info.started_at and process_start_time(info.pid) != info.started_at:
        return False
    try:
        return info.temp_dir.encode() in Path(f"/proc/{info.pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_head(root: str | Path) -> HeadInfo | None:
    """The head recorded under ``root``, if it is still running (a dead or reused PID: None)."""
    path = head_state_path(root)
    if not path.exists():
        return None
    info = HeadInfo(**json.loads(path.read_text()))
    return info if is_our_head(info) else None


def set_owner(root: str | Path, info: HeadInfo, owner_pid: int) -> None:
    """Record who stops the head (0: nobody automatically; `rlhf head stop`)."""
    info.owner_pid = owner_pid
    head_state_path(root).write_text(json.dumps(asdict(info), indent=1))


def adopt_or_start(root: str | Path, owner_pid: int) -> tuple[HeadInfo, bool]:
    """For a run: the head under ``root`` and whether this run must stop it at the end.
    A head someone started by hand stays theirs; one whose owning run died (SIGKILL) is
    adopted and stopped like one this run started."""
    existing = read_head(root)
    if existing is not None and existing.owner_pid and not pid_alive(existing.owner_pid):
        set_owner(root, existing, owner_pid)
        return existing, True
    if existing is not None:
        return existing, existing.owner_pid == owner_pid
    return start_head(root, owner_pid=owner_pid), True


def start_head(root: str | Path, num_cpus: int | None = None, timeout_s: float = 60.0,
               owner_pid: int = 0) -> HeadInfo:
    """Start (or reuse) the head recorded under ``root``; ``owner_pid``: the run that will
    stop it (0: it stays until `rlhf head stop`)."""
    root = Path(root).resolve()
    existing = read_head(root)
    if existing is not None:
        return existing
    root.mkdir(parents=True, exist_ok=True)
    token_path = root / "ray-token"
    if not token_path.exists():
        write_private(token_path, secrets.token_hex(32))
    temp_dir = Path(tempfile.mkdtemp(prefix=LOCAL_RAY_PREFIX, dir=os.environ.get("RLHF_RAY_TMP", "/tmp")))
    # distinct ports, picked together (separate picks can return one port twice, and Ray
    # refuses to start), none in the range Ray keeps for its workers
    port, dashboard_port, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(
        7, avoid=lambda p: 10002 <= p <= 19999)
    env = {**os.environ, **LOOPBACK_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    env.pop("RAY_AUTH_TOKEN", None)  # the file is this head's token, not one from our environment
    args = [_ray_binary(), "start", "--head", "--block", f"--port={port}",
            f"--num-cpus={num_cpus or max(2, os.cpu_count() or 2)}", f"--temp-dir={ray_temp_dir(temp_dir)}",
            "--disable-usage-stats", f"--ray-client-server-port={client}", "--node-ip-address=127.0.0.1",
            # the dashboard serves the Jobs API; every port of ours is a free one, never a
            # default (another Ray on this machine may hold those)
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
            f"--system-config={json.dumps(RAY_SYSTEM_CONFIG)}"]
    log = open(root / "ray-head.log", "ab")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = HeadInfo(address=f"127.0.0.1:{port}", token_path=str(token_path), temp_dir=str(temp_dir),
                    pid=process.pid, dashboard_url=f"http://127.0.0.1:{dashboard_port}",
                    started_at=process_start_time(process.pid), owner_pid=owner_pid)
    try:  # a head not yet recorded is stopped on any way out (a timeout, SIGTERM, Ctrl-C): nobody else knows it
        _wait_for_ports(process, (port, dashboard_port), timeout_s, root)
        head_state_path(root).write_text(json.dumps(asdict(info), indent=1))
    except BaseException:
        stop_head(info)
        raise
    return info


def _wait_for_ports(process: subprocess.Popen, ports: tuple[int, ...], timeout_s: float, root: Path) -> None:
    deadline = time.monotonic() + timeout_s
    for probe in ports:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"ray head exited with {process.returncode}; see {root / 'ray-head.log'}")
            try:
                with socket.create_connection(("127.0.0.1", probe), timeout=1):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise TimeoutError(f"ray head port {probe} not up after {timeout_s:.0f}s; see {root / 'ray-head.log'}")


def write_private(path: str | Path, text: str) -> None:
    """A file only this user can read, from its first byte (created with mode 0600, then
    renamed into place: no moment with the default permissions, no half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stop_head(info: HeadInfo | None, root: str | Path | None = None) -> None:
    """End the head and every process of it, by PID, once its identity is checked (a
    recorded PID now belonging to another process is left alone), remove its temp dir,
    and forget it (``root``: where its state file lives, and any object-store credentials
    a session of it did not take)."""
    if root is not None:
        head_state_path(root).unlink(missing_ok=True)
        for left in Path(root).glob(CREDENTIALS_GLOB):
            left.unlink(missing_ok=True)
    if info is None or not info.temp_dir:
        return
    if is_our_head(info):
        # Ray job drivers (the session's `rlhf serve`) run in sessions of their own and do
        # not name the temp dir: find every descendant now, while the tree still links them.
        family = _descendants(info.pid)
        try:
            os.kill(info.pid, signal.SIGTERM)  # `ray start --block` then stops its processes in order
        except OSError:
            pass
        # an idle head drains in ~2 s; one with live actors waits for them, and nothing of
        # ours needs a graceful end (the store is the record), so do not wait long
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and pid_alive(info.pid):
            time.sleep(0.2)
        try:  # whatever of the group is left (agents rename themselves, so also by group)
            current = process_start_time(info.pid)
            if not current or not info.started_at or current == info.started_at:
                os.killpg(info.pid, signal.SIGKILL)
        except OSError:
            pass
    else:
        family = []
    for pid in _pids_with(info.temp_dir) + family:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(info.temp_dir, ignore_errors=True)


def head_processes(info: HeadInfo) -> list[int]:
    """Every live process of our head: its tree and whatever names its temp dir."""
    if not is_our_head(info):
        return []
    return sorted(set([info.pid] + _descendants(info.pid) + _pids_with(info.temp_dir)))


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _pids_with(marker: str) -> list[int]:
    if len(marker) < 8:  # an empty or tiny marker would match every process on the machine
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def local_ray_env() -> None:
    """Before this process starts a Ray of its own (``ray.init(address="local")``): token
    auth with a fresh token and loopback-only servers. Ray reads these when it starts its
    processes; set them before ``import ray`` where possible."""
    os.environ.update(LOOPBACK_ENV)
    os.environ["RAY_AUTH_MODE"] = "token"
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _auth_env(info: HeadInfo) -> None:
    # Ray reads its auth settings when it is first imported: set them before that.
    os.environ["RAY_AUTH_MODE"] = "token"
    if info.token_path:  # our own local head: its token file, and its loopback address as is
        os.environ["RAY_AUTH_TOKEN_PATH"] = info.token_path
        os.environ.pop("RAY_AUTH_TOKEN", None)
        # without this, Ray rewrites a 127.0.0.1 address to the machine's address, where
        # a loopback-only head does not listen
        os.environ.update(LOOPBACK_ENV)


def resolve_head(head_root: str, ray_address: str = "", dashboard_url: str = "") -> HeadInfo:
    """The cluster a component talks to: the given one (KubeRay), or this machine's own
    head under ``head_root`` (started when absent)."""
    if ray_address:
        return HeadInfo.remote(ray_address, dashboard_url)
    return start_head(head_root)


def jobs_client(info: HeadInfo, timeout_s: float = 60.0):
    """A Ray Jobs API client for the head (token auth), once its job agent accepts work."""
    _auth_env(info)
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return JobSubmissionClient(info.dashboard_url)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def connect(info: HeadInfo, namespace: str) -> None:
    """``ray.init`` this process against the head, in the run's namespace."""
    _auth_env(info)
    import ray

    if ray.is_initialized():
        return
    with _sigterm_handler_kept():
        ray.init(address=info.address, namespace=namespace, log_to_driver=False, configure_logging=False)


@contextlib.contextmanager
def _sigterm_handler_kept():
    """``ray.init`` sets SIGTERM's handler to ``sys.exit``; a handler the caller installed
    (``rlhf run``'s, which ends the processes it started first) is put back after it."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def disconnect() -> None:
    """Leave the cluster now (a controller exiting through interpreter teardown takes
    about a second longer)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


#: The object-store credentials a session submission leaves for its serve job (which
#: removes the file once it has read it).
CREDENTIALS_GLOB = "object-store-credentials-*.json"
LOCAL_RAY_PREFIX = "rlhf-ray-"
LOCAL_RAY_OWNER = "rlhf-owner.json"


def ray_temp_dir(private: str | Path) -> str:
    """Ray's temp dir inside ``private`` (a ``mkdtemp`` folder, mode 0700). Ray makes its
    temp dir and every folder in it mode 0777 so other users can share them; one level
    down, behind a folder only this user can enter, nobody else reaches its sockets,
    logs or session files."""
    return str(Path(private) / "ray")


def start_local_ray(num_cpus: int | None = None) -> None:
    """A Ray of this process's own (direct runs, replay): loopback only, token auth. Its
    temp dir goes when this process ends; one a killed process left is removed by the
    next start (the folder names its owner: only a process known to be dead is cleaned
    up after)."""
    local_ray_env()
    import atexit

    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    remove_orphan_local_rays()
    temp_dir = tempfile.mkdtemp(prefix=LOCAL_RAY_PREFIX)
    (Path(temp_dir) / LOCAL_RAY_OWNER).write_text(json.dumps(this_process()))
    with _sigterm_handler_kept():
        ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
                 _temp_dir=ray_temp_dir(temp_dir), log_to_driver=False,
                 configure_logging=False, _system_config=RAY_SYSTEM_CONFIG)

    def end() -> None:  # Ray's processes write into the folder until they are gone
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    atexit.register(end)


def remove_orphan_local_rays(where: str | None = None) -> list[str]:
    """Remove the temp dirs of local Rays whose owning process has ended (SIGKILLed: no
    exit handler ran) and that no process uses any more; returns what went."""
    gone = []
    for folder in Path(where or tempfile.gettempdir()).glob(LOCAL_RAY_PREFIX + "*"):
        try:
            owner = json.loads((folder / LOCAL_RAY_OWNER).read_text())
        except (OSError, ValueError):
            continue  # not a folder of ours (a head's, or someone else's): left alone
        if known_dead(owner) and not _pids_with(str(folder)):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(str(folder))
    return gone
