"""The long-lived session: iterations attach to it, survive its death, and never overlap.

Each `rlhf iterate` runs in its own process (as a Kubeflow component would) against this
project's own Ray head (non-default port, token auth), which the test stops by PID.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_resume import fingerprint, small_config

from rlhf_core.trainer.run import run_direct

OVERRIDES = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false"]


@pytest.fixture
def head_root(tmp_path):
    root = tmp_path / "head"
    yield root
    subprocess.run([sys.executable, "-m", "rlhf_core.cli", "head", "stop", "--root", str(root)],
                   capture_output=True, timeout=120)


def iterate(tmp_path, head_root, *extra):
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "iterate", "--run-id", "run", "--quiet",
                           "--store", f"file://{tmp_path / 'store'}", "--head-root", str(head_root), *extra,
                           *OVERRIDES, f"trainer.output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def session_worker_pids():
    out = subprocess.run(["pgrep", "-f", "ray::Colocated"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_iterations_attach_survive_a_killed_worker_and_match_a_direct_run(tmp_path, head_root, ray_local):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path / "cache"))
    assert "session: started" in iterate(tmp_path, head_root)
    out = iterate(tmp_path, head_root)
    assert "session: attached" in out and "iteration 1:" in out

    before = set(session_worker_pids())
    assert before, "the session's worker process should be running"
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    out = iterate(tmp_path, head_root)
    assert "session: started" in out and "iteration 2:" in out  # restarted from the checkpoint

    # the same three iterations run directly, in one process, end bit-identical
    run_direct(small_config(tmp_path / "direct-out"), 3, f"file://{tmp_path / 'direct'}", "run",
               log=lambda *a: None)
    a, b = fingerprint(tmp_path / "direct", "run"), fingerprint(tmp_path / "store", "run")
    assert sorted(a) == sorted(b)
    assert not [k for k in a if a[k] != b[k]]


def test_overlapping_trigger_leaves_a_leased_iteration_alone(tmp_path, head_root):
    lease = tmp_path / "store" / "run" / "leases" / "iter-000000.json"
    lease.parent.mkdir(parents=True)
    lease.write_text(json.dumps({"holder": "other-host:42", "taken_at": time.time()}))
    out = iterate(tmp_path, head_root)
    assert "lease held by other-host:42" in out
    assert not (tmp_path / "store" / "run" / "iter-000000").exists()
    # a stale lease (its holder died long ago) is taken over
    lease.write_text(json.dumps({"holder": "dead-host:1", "taken_at": time.time() - 7200}))
    out = iterate(tmp_path, head_root)
    assert "iteration 0:" in out and not lease.exists()


def test_sigkilled_controller_resumes_bit_identical(tmp_path, head_root, ray_local):
    """SIGKILL the controller mid-iteration (the session's workers stay up, possibly
    dirty); the next trigger finishes, and everything matches an uninterrupted run."""
    env = {**os.environ, "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    env.pop("RAY_ADDRESS", None)
    iterate(tmp_path, head_root)  # iteration 0, and a live session
    args = [sys.executable, "-m", "rlhf_core.cli", "iterate", "--run-id", "run", "--quiet", "--iterations", "2",
            "--store", f"file://{tmp_path / 'store'}", "--head-root", str(head_root), *OVERRIDES,
            f"trainer.output_dir={tmp_path / 'out'}"]
    victim = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "store" / "run" / "iter-000001" / "reward" / "SNAPSHOT.json"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert victim.poll() is None, "controller finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)  # somewhere after the reward stage committed
    victim.wait()
    # the dead controller's lease goes stale at once (same host, dead pid): retry finishes
    out = iterate(tmp_path, head_root, "--iterations", "2")
    assert "iteration 2:" in out

    run_direct(small_config(tmp_path / "direct-out"), 3, f"file://{tmp_path / 'direct'}", "run",
               log=lambda *a: None)
    a, b = fingerprint(tmp_path / "direct", "run"), fingerprint(tmp_path / "store", "run")
    assert sorted(a) == sorted(b)
    assert not [k for k in a if a[k] != b[k]]
