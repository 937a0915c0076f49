"""A Ray head of our own on this machine: non-default ports, token auth, stopped by PID.

The embedded default needs a Ray cluster that outlives any one process (the training
session's actors live in it while each iteration's controller comes and goes). We never
attach to a cluster we did not start and never run ``ray stop`` (it would stop every
Ray on the machine): the head runs in its own process group, and stopping it ends exactly
the processes whose command line names its private temp dir.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class HeadInfo:
    address: str          # host:port of the GCS, what ray.init(address=...) takes
    token_path: str       # RAY_AUTH_TOKEN_PATH for clients
    temp_dir: str
    pid: int              # the `ray start --block` process (its group holds the head)
    dashboard_url: str = ""  # the Ray Jobs API (the session runs as a Ray job)

    @classmethod
    def remote(cls, address: str, dashboard_url: str) -> "HeadInfo":
        """A cluster someone else runs (KubeRay): ``ray://host:10001`` and its Jobs API;
        the token comes from ``RAY_AUTH_TOKEN`` (a Kubernetes secret), not a file."""
        return cls(address=address, token_path="", temp_dir="", pid=0, dashboard_url=dashboard_url)

    @property
    def client_env(self) -> dict:
        """Environment a client needs to connect (token auth)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path, "RAY_ADDRESS": self.address}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _ray_binary() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else "ray"


def head_state_path(root: str | Path) -> Path:
    return Path(root) / "ray-head.json"


def read_head(root: str | Path) -> HeadInfo | None:
    """The head recorded under ``root``, if its process is still alive."""
    path = head_state_path(root)
    if not path.exists():
        return None
    info = HeadInfo(**json.loads(path.read_text()))
    return info if pid_alive(info.pid) else None


def start_head(root: str | Path, num_cpus: int | None = None, timeout_s: float = 60.0) -> HeadInfo:
    """Start (or reuse) the head recorded under ``root``."""
    root = Path(root).resolve()
    existing = read_head(root)
    if existing is not None:
        return existing
    root.mkdir(parents=True, exist_ok=True)
    token_path = root / "ray-token"
    if not token_path.exists():
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
    temp_dir = Path(os.environ.get("RLHF_RAY_TMP", "/tmp")) / f"rlhf-ray-{secrets.token_hex(4)}"
    port, dashboard_port = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    args = [_ray_binary(), "start", "--head", "--block", f"--port={port}",
            f"--num-cpus={num_cpus or max(2, os.cpu_count() or 2)}", f"--temp-dir={temp_dir}",
            "--disable-usage-stats", f"--ray-client-server-port={_free_port()}",
            # the dashboard serves the Jobs API; every port of ours is a free one, never a
            # default (another Ray on this machine may hold those)
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
            # stage payloads of small models go inline with the call (see trainer/run.py)
            '--system-config={"max_direct_call_object_size": 4194304, "task_rpc_inlined_bytes_limit": 16777216}']
    log = open(root / "ray-head.log", "ab")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = HeadInfo(address=f"127.0.0.1:{port}", token_path=str(token_path), temp_dir=str(temp_dir),
                    pid=process.pid, dashboard_url=f"http://127.0.0.1:{dashboard_port}")
    deadline = time.monotonic() + timeout_s
    for probe in (port, dashboard_port):
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"ray head exited with {process.returncode}; see {root / 'ray-head.log'}")
            try:
                with socket.create_connection(("127.0.0.1", probe), timeout=1):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            stop_head(info)
            raise TimeoutError(f"ray head port {probe} not up after {timeout_s:.0f}s; see {root / 'ray-head.log'}")
    head_state_path(root).write_text(json.dumps(asdict(info), indent=1))
    return info


def stop_head(info: HeadInfo | None, root: str | Path | None = None) -> None:
    """End the head and every process of it (found by its private temp dir), by PID, and
    forget it (``root``: where its state file lives)."""
    if root is not None:
        head_state_path(root).unlink(missing_ok=True)
    if info is None:
        return
    # Ray job drivers (the session's `rlhf serve`) run in sessions of their own and do not
    # name the temp dir: find every descendant now, while the process tree still links them.
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
        os.killpg(info.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in _pids_with(info.temp_dir) + family:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


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
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _auth_env(info: HeadInfo) -> None:
    # Ray reads its auth settings when it is first imported: set them before that.
    os.environ["RAY_AUTH_MODE"] = "token"
    if info.token_path:
        os.environ["RAY_AUTH_TOKEN_PATH"] = info.token_path


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
    ray.init(address=info.address, namespace=namespace, log_to_driver=False, configure_logging=False)


def disconnect() -> None:
    """Leave the cluster now (a controller exiting through interpreter teardown takes
    about a second longer)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
