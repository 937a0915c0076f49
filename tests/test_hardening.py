"""Bad input never reaches a shell, a path or a process: run ids and store URIs are
checked at every entry point; every config field has a range; our own processes are
recognized by more than a PID; records that point outside themselves are refused."""

import json
import stat
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_core.runtime import processes, ray_head
from rlhf_core.session import session
from rlhf_core.cli import main
from rlhf_core.config import RunConfig, _leaf_paths
from rlhf_core.runtime.processes import pid_alive
from rlhf_core.record.run_ids import RunIdError, StoreUriError, validate_run_id, validate_store_uri
from rlhf_core.record.run_layout import RunRef

BAD_RUN_IDS = ["x; touch PWNED", "x;touch PWNED;echo", "$(id)", "`id`", "../x", "a/b", "x" * 300, "ünïcode",
               "-rf", ".hidden", "", "a b", "x\ny"]


@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_bad_run_ids_are_refused_before_anything_exists(run_id, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["run", "--direct", "--iterations", "1"], ["run", "--iterations", "1"], ["iterate"],
                 ["serve", "--foreground"], ["stop-session"],
                 ["submit", "--host", "http://127.0.0.1:9", "--store", "s3://b/r"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, f"--run-id={run_id}", f"trainer.output_dir={tmp_path / 'out'}"]
                 if argv[0] not in ("stop-session", "submit") else [*argv, f"--run-id={run_id}"])
        message = str(exc.value)
        assert message.startswith("rlhf: --run-id: expected 1-128 ASCII letters") and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no PWNED, nothing
    assert not (Path(tmp_path).parent / "x").exists()


def test_good_run_ids_pass_unchanged():
    for run_id in ("nightly", "Qwen2.5-7B_ppo", "run-20261201-000000-abc123", "a" * 128):
        assert validate_run_id(run_id) == run_id
    with pytest.raises(RunIdError, match=r"\(300 characters\)"):
        validate_run_id("x" * 300)


def test_store_uris_are_checked():
    for uri in ("runs/store", "/abs/store", "file:///tmp/s", "s3://bucket/runs", "gs://b/r", "memory://x"):
        assert validate_store_uri(uri) == uri
    for uri, why in (("http://evil/x", "expected a scheme among"), ("ftp://h/x", "expected a scheme among"),
                     ("", "expected a path or a URI"), ("s3://b/\nx", "printable characters only"),
                     ("://x", "expected a path or scheme"),
                     # fsspec chains: each '::' part is a filesystem of its own (reference:: made a request)
                     ("zip::s3://b/x.zip", "no fsspec '::' chain"), ("reference::s3://b/r.json", "no fsspec '::'"),
                     ("s3://b/x::memory://y", "no fsspec '::' chain"), ("simplecache::s3://b/x", "no fsspec")):
        with pytest.raises(StoreUriError, match=why):
            validate_store_uri(uri)
    with pytest.raises(SystemExit, match="rlhf: --store: expected a scheme among"):
        main(["run", "--direct", "--store", "http://example.invalid/x", "--run-id", "ok"])
    from rlhf_core.snapshot import fs as sfs

    with pytest.raises(ValueError, match=r"^expected one filesystem's URI \(no fsspec '::' chain\); found "
                                         r"'http::127.0.0.1:9/a'$"):
        sfs.resolve("http::127.0.0.1:9/a")  # refused before fsspec sees it, for a URI no entry point checked


def test_the_session_entrypoint_is_quoted_for_the_shell(tmp_path):
    """Ray runs the entrypoint with a shell: a store path full of shell syntax arrives as
    one argument and runs nothing."""
    store = f"file://{tmp_path}/st;touch PWNED;$(touch PWNED2) `touch PWNED3` 'q\" x"
    entry = session.session_entrypoint(RunRef(store, "run-1"))
    printer = f"{shlex.quote(sys.executable)} -c 'import sys, json; print(json.dumps(sys.argv[1:]))'"
    cmd = entry.replace(f"{shlex.quote(sys.executable)} -m rlhf_core.cli", printer, 1)
    out = subprocess.run(["sh", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["serve", "--foreground", "--run-id", "run-1", "--store", store]
    assert not list(tmp_path.glob("PWNED*"))
    with pytest.raises(RunIdError):
        session.session_entrypoint(RunRef("runs/store", "x; touch PWNED"))


def test_job_runtime_env_carries_no_secret(tmp_path, monkeypatch):
    """What is submitted to the Jobs API (the runtime env Ray logs and returns) holds
    settings, never the keys; they go to a 0600 file in the head's folder."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASECRETKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-x-1")

    class Client:
        submitted = {}

        def list_jobs(self):
            return []

        def submit_job(self, **kw):
            self.submitted.update(kw)

    head = ray_head.HeadInfo(address="127.0.0.1:1", token_path=str(tmp_path / "ray-token"), temp_dir="/tmp/x",
                             pid=0)
    client = Client()
    session.submit_job(client, RunConfig(), RunRef("file:///tmp/s", "r"), head)
    env = client.submitted["runtime_env"]["env_vars"]
    blob = json.dumps(client.submitted, default=str)
    assert "secret" not in blob.lower().replace("aws_secret_access_key", "") and "AKIASECRETKEY" not in blob
    assert env["AWS_DEFAULT_REGION"] == "eu-x-1"
    path = Path(env["RLHF_CREDENTIALS_FILE"])
    assert path.stat().st_mode & 0o777 == 0o600
    for key in session.SECRET_ENV:
        monkeypatch.delenv(key)
    session.load_credentials_file(str(path))
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "very-secret" and os.environ["AWS_SESSION_TOKEN"] == "session-secret"
    assert not path.exists()  # read once, by the serve job: the secrets live in its process only


# ------------------------------------------------------------------ config ranges

LEAVES = sorted(_leaf_paths(RunConfig()))
values = st.one_of(st.integers(-10, 10).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                   st.sampled_from(["", "none", "true", "false", "x", "1e-9", "-0", "nan", "inf", "fsdp"]),
                   st.text(max_size=12))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.lists(st.tuples(st.sampled_from(LEAVES), values), min_size=1, max_size=3))
def test_no_raw_exception_escapes_a_command(overrides, capsys):
    """Any override, however wrong, ends in a one-line `rlhf: ...` error naming a field,
    or a valid config; never a traceback."""
    args = [f"{key}={value}" for key, value in overrides]
    try:
        assert main(["config", *args]) == 0
    except SystemExit as exc:
        message = str(exc.code)
        assert message.startswith("rlhf: config error: ") and "\n" not in message
        assert any(key in message for key, _ in overrides) or "must" in message or "needs" in message


@pytest.mark.parametrize("override, field", [
    ("actor.ppo_mini_batch_size=0", "actor.ppo_mini_batch_size"), ("trainer.cpus_per_worker=0", "cpus_per_worker"),
    ("rollout.temperature=0", "rollout.temperature"), ("algorithm.kl_ctrl.horizon=0", "horizon"),
    ("algorithm.kl_ctrl.target_kl=0", "target_kl"), ("algorithm.kl_ctrl.type=adaptve", "kl_ctrl.type"),
    ("model.dtype=os", "model.dtype"), ("actor.lr=nan", "actor.lr"), ("critic.ppo_mini_batch_size=0", "critic"),
])
def test_each_reported_bad_value_is_named(override, field):
    with pytest.raises(SystemExit, match=field):
        main(["config", override])


def test_serve_foreground_validates_its_config(monkeypatch):
    monkeypatch.setenv("RLHF_SESSION_CONFIG", json.dumps({"actor": {"ppo_mini_batch_size": 0}}))
    with pytest.raises(SystemExit, match="rlhf: session config: actor.ppo_mini_batch_size: expected a value > 0"):
        main(["serve", "--foreground", "--run-id", "r", "--store", "runs/store"])


# ------------------------------------------------------------------ our processes only

def test_stop_head_never_kills_a_process_it_did_not_start(tmp_path):
    """A recorded head whose PID now belongs to another process (reused PID) is left
    alone, and an empty temp dir matches nothing."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fake = ray_head.HeadInfo(address="127.0.0.1:1", token_path="", temp_dir=str(tmp_path / "rlhf-ray-x"),
                                 pid=stranger.pid, started_at="1")
        (tmp_path / "ray-head.json").write_text(json.dumps(fake.__dict__))
        assert ray_head.read_head(tmp_path) is None  # not our head: start time and command line differ
        ray_head.stop_head(fake, tmp_path)
        ray_head.stop_head(ray_head.HeadInfo(address="", token_path="", temp_dir="", pid=stranger.pid))
        time.sleep(0.3)
        assert stranger.poll() is None, "a process we did not start was killed"
        assert ray_head._pids_with("") == []
    finally:
        stranger.kill()


def _dead_within(pids: list[int], timeout_s: float = 120) -> list[int]:
    """The PIDs of ``pids`` still alive after waiting up to ``timeout_s`` for them to end."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def test_a_real_head_is_recognized_stopped_and_cleaned(tmp_path):
    info = ray_head.start_head(tmp_path / "head", num_cpus=1)
    try:
        assert ray_head.is_our_head(info) and info.started_at and Path(info.temp_dir).exists()
        processes = ray_head.head_processes(info)
        assert info.pid in processes and len(processes) > 2
    finally:
        ray_head.stop_head(info, tmp_path / "head")
    assert _dead_within(processes) == []
    assert not Path(info.temp_dir).exists()  # the temp dir goes with the head


def test_a_run_adopts_the_head_of_a_dead_run_but_not_a_users_head(tmp_path):
    info = ray_head.start_head(tmp_path / "head", num_cpus=1, owner_pid=2 ** 22 + 7)  # an owner that is gone
    try:
        adopted, ours = ray_head.adopt_or_start(tmp_path / "head", owner_pid=os.getpid())
        assert ours and adopted.pid == info.pid and ray_head.read_head(tmp_path / "head").owner_pid == os.getpid()
        ray_head.set_owner(tmp_path / "head", adopted, 0)  # the user's now (`rlhf head start`, --keep-session)
        again, ours = ray_head.adopt_or_start(tmp_path / "head", owner_pid=os.getpid())
        assert not ours and again.pid == info.pid
    finally:
        ray_head.stop_head(info, tmp_path / "head")


# ------------------------------------------------------------------ records that point outside

def test_lineage_stops_on_a_cycle(tmp_path):
    from rlhf_core.record.lineage import LineageError, chain

    run = tmp_path / "store" / "r"
    for n, parent in ((0, None), (1, 1)):
        (run / f"iter-{n:06d}").mkdir(parents=True)
        (run / f"iter-{n:06d}" / "MANIFEST.json").write_text(json.dumps({
            "format": "rlhf.iteration", "schema_version": 1, "parent_iteration": parent, "config_hash": "h",
            "code_version": {}, "data_cursor": {}, "checkpoint": "", "global_step": n + 1, "kl_coef": 0,
            "metrics": {}, "config": {}, "snapshots": {},
            "weights": {"checkpoint": "", "checkpoint_step": 0, "redo": list(range(n + 1))}}))
    with pytest.raises(LineageError, match="iteration 1 names 1 as its parent"):
        chain(f"file://{run}/iter-000001")


def test_a_snapshot_manifest_naming_paths_outside_it_is_refused():
    from rlhf_core.snapshot.errors import SnapshotSchemaError
    from rlhf_core.snapshot.layout import parse_manifest

    base = {"format": "rlhf.snapshot", "schema_version": 1, "data_prefix": "data-1", "num_rows": 0,
            "fields": {}, "metadata": {}}
    for key in ("../../etc/passwd", "/etc/passwd", "a/../../b", "a//b"):
        with pytest.raises(SnapshotSchemaError, match="is not a relative path"):
            parse_manifest(json.dumps({**base, "objects": {key: {"size": 1, "sha256": "x"}}}).encode(), "u")
    assert parse_manifest(json.dumps({**base, "objects": {"zarr.json": {"size": 1, "sha256": "x"}}}).encode(), "u")
    for array in ("../../other-run/data-1/batch/x", "/abs", "batch/../../x", "batch\\x"):  # a field's array too
        with pytest.raises(SnapshotSchemaError, match=r"field 'x''s array .* is not a relative path inside data-1/"):
            parse_manifest(json.dumps({**base, "objects": {}, "fields": {"x": {"array": array}}}).encode(), "u")
    assert parse_manifest(json.dumps({**base, "objects": {}, "fields": {"x": {"array": "batch/x", "shape": [0]}}}).encode(), "u")


def test_local_pipeline_run_folders_are_pruned(tmp_path):
    from pipelines.local import prune_run_folders

    for i in range(8):
        (tmp_path / f"ppo-iteration-{i}").mkdir()
        os.utime(tmp_path / f"ppo-iteration-{i}", (i, i))
    gone = prune_run_folders(str(tmp_path), keep=5)
    assert len(gone) == 3 and sorted(p.name for p in tmp_path.iterdir()) == [f"ppo-iteration-{i}" for i in range(3, 8)]


# ------------------------------------------------------------ private files, temp dirs

def test_the_ray_token_and_the_credentials_are_private_from_their_first_byte(tmp_path, monkeypatch):
    """Whenever the head's token file or a credentials file is opened, it is already
    readable by this user only (the file is created with mode 0600, not chmod'ed after)."""
    import io

    seen: list[tuple[str, int]] = []
    real_io_open, real_os_open = io.open, os.open

    def look(path) -> None:
        name = os.path.basename(str(path))
        if "ray-token" in name or "credentials" in name:
            seen.append((name, os.stat(path).st_mode & 0o777))

    def io_open(file, *args, **kwargs):
        handle = real_io_open(file, *args, **kwargs)
        look(file)
        return handle

    def os_open(path, *args, **kwargs):
        fd = real_os_open(path, *args, **kwargs)
        look(path)
        return fd

    class Stop(Exception):
        pass

    def stop(*_a, **_k):
        raise Stop()

    monkeypatch.setattr(io, "open", io_open)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(ray_head, "free_ports", stop)  # the first step after the token is written
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    umask = os.umask(0o022)
    try:
        with pytest.raises(Stop):
            ray_head.start_head(tmp_path / "head")
        session.write_credentials_file(str(tmp_path))
    finally:
        os.umask(umask)
        monkeypatch.undo()
    assert any("ray-token" in n for n, _ in seen), seen
    assert any("credentials" in n for n, _ in seen) and all(mode == 0o600 for _, mode in seen), seen
    assert (tmp_path / "head" / "ray-token").stat().st_mode & 0o777 == 0o600


def test_no_local_ray_temp_dir_outlives_its_process():
    """A process that started a local Ray of its own (direct runs, replay) leaves no temp
    dir when it ends; one SIGKILLed leaves it, and the next start removes it (its owner is
    known dead), while a folder whose owner lives, or that is not ours, stays."""
    import shutil
    import signal
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="rt-"))  # short: Ray's socket paths must fit 107 bytes
    try:
        _temp_dirs_in(tmp_path, signal)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _temp_dirs_in(tmp_path: Path, signal) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    code = "from rlhf_core.runtime.ray_head import start_local_ray; start_local_ray(num_cpus=1); print('up', flush=True)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "up" in done.stdout, done.stderr[-2000:]
    assert not list(tmp_path.glob("rlhf-ray-*"))  # ended normally: cleaned at exit
    killed = subprocess.Popen([sys.executable, "-c", code + "; import time; time.sleep(300)"], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert killed.stdout.readline().strip() == "up"
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the process and its Ray: no exit handler runs
        killed.wait(120)
    left = list(tmp_path.glob("rlhf-ray-*"))
    assert len(left) == 1
    # Ray makes its own folders mode 0777; they sit behind ours, which only this user can enter
    assert (left[0] / "ray").is_dir()
    assert stat.S_IMODE(left[0].stat().st_mode) == 0o700
    # its Ray's processes die in a cascade after the kill; the folder is an orphan once none names it
    deadline = time.monotonic() + 120
    while ray_head._pids_with(str(left[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = tmp_path / "rlhf-ray-alive"
    alive.mkdir()
    (alive / ray_head.LOCAL_RAY_OWNER).write_text(json.dumps(processes.this_process()))
    foreign = tmp_path / "rlhf-ray-foreign"
    foreign.mkdir()
    assert ray_head.remove_orphan_local_rays(str(tmp_path)) == [str(left[0])]
    assert alive.exists() and foreign.exists() and not left[0].exists()


def test_a_reused_run_id_does_not_start_from_another_configs_initial_checkpoint(tmp_path):
    """INITIAL.json records the config that wrote the step-0 checkpoint; a run that has
    committed nothing yet, started again with another config under the same id, is refused
    (it would have loaded the other config's initial weights), naming the differences."""
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.restore import open_run

    first = apply_overrides(RunConfig(), ["actor.lr=1e-4"])
    istore = IterationStore(RunRef(f"file://{tmp_path}/store", "reused"))
    istore.commit_initial_checkpoint(f"file://{tmp_path}/store/reused/checkpoints/step-000000-a", {},
                                     first.to_dict(), first.config_hash())
    assert open_run(first, istore, log=lambda *a: None).global_step == 0
    with pytest.raises(ConfigError, match=r"^run reused's initial checkpoint was written with another config; .*"
                                          r"actor.lr: 0.0001 -> 0.0003"):
        open_run(RunConfig(), istore, log=lambda *a: None)


def test_a_checkpoint_that_cannot_be_written_ends_in_one_line_naming_the_file_and_cause(monkeypatch):
    """torch.distributed.checkpoint raises a BaseException (it passes `except Exception`):
    a full disk ends the command in one line with each rank's cause, not every rank's
    traceback."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from rlhf_core import cli

    try:
        raise OSError(28, "No space left on device", "/store/run/checkpoints/step-000003/actor/__0_0.distcp")
    except OSError as exc:
        failure = _wrap_exception(exc)

    def write(args):
        raise CheckpointException("save failed", {0: failure})

    parser = cli.build_parser()
    real = parser.parse_args

    def parse(argv=None):  # the `config` command, its work replaced by a failing checkpoint write
        args = real(argv)
        args.func = write
        return args

    monkeypatch.setattr(parser, "parse_args", parse)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.delenv("RLHF_DEBUG", raising=False)
    with pytest.raises(SystemExit) as ended:
        cli.main(["config"])
    message = str(ended.value.code)
    assert "\n" not in message and message.startswith("rlhf: config failed: the checkpoint could not be written")
    assert "rank 0: OSError: [Errno 28] No space left on device: '/store/run/checkpoints/step-000003/actor/" \
           "__0_0.distcp'" in message
