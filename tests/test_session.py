"""The long-lived session: a Ray job that iterations attach to; it survives a killed
worker and a SIGKILLed controller at any point, ends when idle, and never runs an
iteration twice.

Each `rlhf iterate` runs in its own process (as a Kubeflow component would) against this
project's own Ray head (non-default ports, token auth), which the test stops by PID.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import fingerprint, small_config

from rlhf_core.config import apply_overrides
from rlhf_core.runtime import ray_head
from rlhf_core.trainer.run import run_direct
from rlhf_core.record.run_layout import RunRef

OVERRIDES = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false"]


@pytest.fixture
def head_root(tmp_path):
    root = tmp_path / "head"
    yield root
    ray_head.stop_head(ray_head.read_head(root), root)  # ours, by PID (what `rlhf head stop` does)


def user_env() -> dict:
    """A user's shell: none of the Ray settings this test process made for its own Ray."""
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", *ray_head.LOOPBACK_ENV):
        env.pop(name, None)
    return env


def iterate(tmp_path, head_root, *extra, overrides=(), kill_at=None, check=True):
    env = {**user_env(), "RLHF_CACHE": os.environ.get("RLHF_CACHE", str(tmp_path / "cache"))}
    if kill_at:
        env["RLHF_KILL_AT"] = kill_at
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "iterate", "--run-id", "run", "--quiet",
                           "--store", f"file://{tmp_path / 'store'}", "--head-root", str(head_root), *extra,
                           *OVERRIDES, *overrides, f"trainer.output_dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def head_pids_named(head_root, marker: str) -> list[int]:
    """Processes of *our* head (its process tree and whatever names its temp dir) whose
    command line contains ``marker``: never another run's processes on this machine."""
    info = ray_head.read_head(head_root)
    found = []
    for pid in ray_head.head_processes(info) if info else []:
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" "):
                found.append(pid)
        except OSError:
            continue
    return found


def session_worker_pids(head_root):
    return head_pids_named(head_root, "ray::Colocated")


def assert_same_as_direct(tmp_path, iterations, overrides=()):
    cfg = apply_overrides(small_config(tmp_path / "direct-out"), list(overrides))
    run_direct(cfg, iterations, RunRef(f"file://{tmp_path / 'direct'}", "run"), log=lambda *a: None)
    a, b = fingerprint(tmp_path / "direct", "run"), fingerprint(tmp_path / "store", "run")
    assert sorted(a) == sorted(b)
    assert not [k for k in a if a[k] != b[k]]


def test_iterations_attach_survive_a_killed_worker_and_match_a_direct_run(tmp_path, head_root, ray_local):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path / "cache"))
    assert "session: generation 1, job rlhf-session-run-1" in iterate(tmp_path, head_root).stdout
    out = iterate(tmp_path, head_root).stdout
    assert "session: generation 1" in out and "iteration 1:" in out  # attached, not rebuilt

    before = set(session_worker_pids(head_root))
    assert before, "the session's worker process should be running"
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    out = iterate(tmp_path, head_root).stdout
    # the same job rebuilt its workers from the last checkpoint; the iteration finished
    assert "session: generation 2, job rlhf-session-run-1" in out and "iteration 2:" in out

    # the session's job itself dies (its driver SIGKILLed), then a worker: nobody is left
    # to rebuild, so the next trigger clears the remains and submits a new session job
    driver = head_pids_named(head_root, "serve --foreground")
    assert driver, "the session job's driver should be running"
    for pid in driver + session_worker_pids(head_root):
        os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    out = iterate(tmp_path, head_root).stdout
    assert "job rlhf-session-run-2" in out and "iteration 3:" in out
    assert_same_as_direct(tmp_path, 4)


# Every stage of a PPO iteration with a critic and a reference model, in order.
ALL_STAGES = ["rollout", "reward", "old_log_prob", "ref_log_prob", "values", "advantage", "update_critic",
              "update_actor", "weight_sync"]
PPO = ["algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "algorithm.rollout_correction.bypass_mode=false"]


def test_controller_sigkilled_at_every_stage_resumes_bit_identical(tmp_path, head_root, ray_local):
    """Iteration 1 is attempted again and again, each controller SIGKILLed at the next
    point: after each stage's work (before its snapshot), inside a snapshot write, and
    between checkpoint and commit. The session's workers stay up, possibly with weights
    the dead controller changed. The last attempt finishes, and everything matches an
    uninterrupted run bit for bit."""
    os.environ.setdefault("RLHF_CACHE", str(tmp_path / "cache"))
    iterate(tmp_path, head_root, overrides=PPO)  # iteration 0, and a live session
    iteration = tmp_path / "store" / "run" / "iter-000001"
    points = [f"stage:{s}" for s in ALL_STAGES[:7]] + ["snapshot:*/update_actor", "stage:update_actor",
                                                        "stage:weight_sync", "commit:1"]
    for point in points:
        proc = iterate(tmp_path, head_root, overrides=PPO, kill_at=point, check=False)
        assert proc.returncode == -signal.SIGKILL, f"{point}: {proc.stdout[-1500:]}{proc.stderr[-3000:]}"
        assert not (iteration / "MANIFEST.json").exists()
        if point.startswith("stage:") and point[6:] != "weight_sync":
            assert not (iteration / point[6:] / "SNAPSHOT.json").exists()  # killed before the commit
        if point == "snapshot:*/update_actor":
            assert list((iteration / "update_actor").glob("data-*"))  # data written, no manifest
            assert not (iteration / "update_actor" / "SNAPSHOT.json").exists()
    assert sorted(p.name for p in iteration.iterdir()) == sorted(ALL_STAGES[:-1])  # all but weight_sync
    out = iterate(tmp_path, head_root, "--iterations", "2", overrides=PPO).stdout
    assert "iteration 1:" in out and "iteration 2:" in out
    assert_same_as_direct(tmp_path, 3, PPO)


def test_overlapping_trigger_leaves_a_leased_iteration_alone(tmp_path, head_root):
    leases = tmp_path / "store" / "run" / "leases" / "iter-000000"
    leases.mkdir(parents=True)
    (leases / "00000001.json").write_text(json.dumps({"holder": "kfp:other/run-iteration", "token": 1,
                                                      "state": "held", "at": time.time()}))
    out = iterate(tmp_path, head_root).stdout
    assert "lease held by kfp:other/run-iteration" in out
    assert not (tmp_path / "store" / "run" / "iter-000000").exists()
    # a stale lease (its holder stopped renewing long ago) is taken over
    (leases / "00000002.json").write_text(json.dumps({"holder": "kfp:other/run-iteration", "token": 1,
                                                      "state": "held", "at": time.time() - 7200}))
    os.utime(leases / "00000002.json", (time.time() - 7200, time.time() - 7200))  # the store's stamp is its age
    out = iterate(tmp_path, head_root).stdout
    assert "iteration 0:" in out
    records = [json.loads(p.read_text()) for p in sorted(leases.iterdir())]
    assert records[2]["token"] == 3 and records[-1]["state"] == "released"
    manifest = json.loads((tmp_path / "store" / "run" / "iter-000000" / "MANIFEST.json").read_text())
    assert manifest["lease"]["token"] == 3


def session_job(head_root, submission_id):
    """(status, logs) of a session job, asked through the Jobs API by a fresh process
    (Ray reads its token settings once per process)."""
    code = ("import json, sys; from rlhf_core.runtime import ray_head; "
            "c = ray_head.jobs_client(ray_head.read_head(sys.argv[1])); "
            "print(json.dumps([str(c.get_job_status(sys.argv[2])), c.get_job_logs(sys.argv[2])]))")
    out = subprocess.run([sys.executable, "-c", code, str(head_root), submission_id], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_session_job_ends_when_idle(tmp_path, head_root):
    iterate(tmp_path, head_root, overrides=["trainer.session_idle_timeout_s=3"])
    deadline = time.monotonic() + 120
    while (job := session_job(head_root, "rlhf-session-run-1"))[0] != "SUCCEEDED":
        assert time.monotonic() < deadline, job[1][-2000:]
        time.sleep(1)
    assert "ended (idle)" in job[1]
    wait_until(lambda: not session_worker_pids(head_root), "the idle session's workers to exit")
    # the next trigger brings a new session up from the checkpoint
    out = iterate(tmp_path, head_root).stdout
    assert "job rlhf-session-run-2" in out and "iteration 1:" in out
    # and `rlhf stop-session` ends it: its job, its workers and every placement group
    assert session_worker_pids(head_root)
    stop = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stop-session", "--run-id", "run", "--head-root",
                           str(head_root)], capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr[-2000:]
    # (the serve job, told to stop, also kills its workers and releases its pool: who
    # got there first varies, so the counts are not asserted here; test_multinode is exact)
    assert "session stopped: job stopped" in stop.stdout, stop.stdout
    wait_until(lambda: session_job(head_root, "rlhf-session-run-2")[0] == "STOPPED", "the session job to stop")
    wait_until(lambda: not session_worker_pids(head_root), "the stopped session's workers to exit")


def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` with a deadline far beyond what a loaded machine needs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


SECRET = "rlhf-test-secret-" + "7f3a9c1e5b"  # never written anywhere but the user's 0600 file
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listening_sockets(pids):
    """(pid, local address hex, port) of every listening TCP socket the PIDs hold."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((inodes[fields[9]], address, int(port, 16)))
    return found


def test_secrets_stay_out_of_logs_and_ray_listens_on_loopback_with_a_token(tmp_path, head_root, monkeypatch):
    """A session run with object-store credentials in the environment: the secret is in
    no file under the Ray temp dir, no Jobs API answer, no snapshot, manifest, metrics
    file or log (only in the user's own 0600 credentials file); every socket our Ray
    processes listen on is a loopback one, and a client without the token is refused."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok-" + SECRET)
    monkeypatch.setenv("AWS_REGION", "eu-test-1")
    out = iterate(tmp_path, head_root)
    assert "iteration 0:" in out.stdout
    info = ray_head.read_head(head_root)

    listening = listening_sockets(ray_head.head_processes(info))
    assert listening, "the head's processes should listen somewhere"
    exposed = [(pid, addr, port) for pid, addr, port in listening if addr not in LOOPBACK]
    assert not exposed, exposed

    code = ("import json, sys; from rlhf_core.runtime import ray_head; "
            "c = ray_head.jobs_client(ray_head.read_head(sys.argv[1])); "
            "print(json.dumps([j.dict() if hasattr(j, 'dict') else vars(j) for j in c.list_jobs()], default=str))")
    jobs = subprocess.run([sys.executable, "-c", code, str(head_root)], capture_output=True, text=True, timeout=120)
    assert jobs.returncode == 0, jobs.stderr[-2000:]
    assert "rlhf-session-run-1" in jobs.stdout and SECRET not in jobs.stdout
    assert "eu-test-1" in jobs.stdout  # settings that are not secret do travel

    leaks = []
    for folder in (info.temp_dir, tmp_path / "store", tmp_path / "out", head_root):
        for path in Path(folder).rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    if SECRET.encode() in path.read_bytes():
                        leaks.append(str(path))
                except OSError:
                    continue
    assert not leaks, leaks
    assert SECRET not in out.stdout + out.stderr
    assert not list(Path(head_root).glob(ray_head.CREDENTIALS_GLOB))  # the serve job took them and removed the file

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={info.address!r}); print('IN')"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert probe.returncode != 0 and "IN" not in probe.stdout


def test_next_iteration_computed_ahead_is_adopted_and_bit_identical(tmp_path, head_root, ray_local):
    """After each commit the session computes the next iteration's inference stages; the
    next controller adopts them (same snapshots, same weights as a direct run). A result
    computed ahead for another state is dropped, never adopted."""
    os.environ.setdefault("RLHF_CACHE", str(tmp_path / "cache"))
    out = iterate(tmp_path, head_root, overrides=PPO).stdout
    assert "computing iteration 1 ahead: started" in out
    out = iterate(tmp_path, head_root, overrides=PPO).stdout
    assert "iteration 1: adopting the stages computed ahead (rollout, reward, old_log_prob, ref_log_prob, " \
           "values)" in out, out
    # trainer.prefetch=false: this controller still adopts what was computed for it, but
    # leaves nothing computed ahead for the next one
    out = iterate(tmp_path, head_root, overrides=[*PPO, "trainer.prefetch=false"]).stdout
    assert "iteration 2: adopting" in out and "ahead:" not in out
    out = iterate(tmp_path, head_root, overrides=PPO).stdout
    assert "iteration 3: computing every stage (nothing was prefetched)" in out

    # iteration 4 is computed ahead; then the run is rolled back to before iteration 3
    # (its manifest removed): the controller redoes iteration 3, and the result computed
    # for iteration 4 must not be taken for it
    store = tmp_path / "store" / "run"
    (store / "iter-000003" / "MANIFEST.json").unlink()
    out = iterate(tmp_path, head_root, overrides=PPO).stdout
    assert "iteration 3: computing every stage (prefetched for another state (iteration: 4 != 3" in out, out
    ahead = [json.loads((store / f"iter-{n:06d}" / "MANIFEST.json").read_text())["computed_ahead"] for n in range(4)]
    inference = ["rollout", "reward", "old_log_prob", "ref_log_prob", "values"]
    assert ahead == [[], inference, inference, []]
    assert_same_as_direct(tmp_path, 4, PPO)


def test_two_controllers_started_together_commit_the_iteration_once(tmp_path, head_root, ray_local):
    """Two triggers of one iteration at the same moment (a KFP retry racing a pod that is
    not dead, two schedules): one takes the lease and trains, the other leaves before it
    touches the workers; the committed checkpoint is the one the manifest names, and the
    weights are those of a run nobody raced."""
    import psutil

    from helpers import status_of

    os.environ.setdefault("RLHF_CACHE", str(tmp_path / "cache"))
    iterate(tmp_path, head_root)  # iteration 0, and a live session
    # whichever takes the lease stops itself right before its commit, still holding it, so
    # the other meets the lease however late it starts (a loaded machine may start it after
    # the first would have committed); the winner goes on once the other has left
    env = {**user_env(), "RLHF_FREEZE_AT": "commit:1"}
    argv = [sys.executable, "-m", "rlhf_core.cli", "iterate", "--run-id", "run", "--quiet", "--store",
            f"file://{tmp_path / 'store'}", "--head-root", str(head_root), *OVERRIDES,
            f"trainer.output_dir={tmp_path / 'out'}"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    deadline = time.monotonic() + 600
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)  # until one has ended
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    while status_of(psutil.Process(winner.pid)) != psutil.STATUS_STOPPED and winner.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)  # until the winner is at its freeze point
    assert winner.poll() is None, winner.communicate()  # stopped there, the iteration not committed
    assert not (tmp_path / "store" / "run" / "iter-000001" / "MANIFEST.json").exists()
    os.kill(winner.pid, signal.SIGCONT)
    outs = [p.communicate(timeout=600) for p in (loser, winner)]
    assert all(p.returncode == 0 for p in procs), outs
    trained = [o for o, _ in outs if "iteration 1:" in o]
    left = [o for o, _ in outs if "lease held by" in o]
    assert len(trained) == 1 and len(left) == 1, outs
    manifest = json.loads((tmp_path / "store" / "run" / "iter-000001" / "MANIFEST.json").read_text())
    checkpoint = Path(manifest["checkpoint"].removeprefix("file://"))
    import hashlib

    assert manifest["checkpoint_sha256"]
    for name, digest in manifest["checkpoint_sha256"].items():
        assert hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() == digest, name
    assert_same_as_direct(tmp_path, 2)
