"""Whoever can write the store cannot run code where a run is read back: a checkpoint's
files are used only as the bytes the record that commits it lists (an iteration's
manifest; for step 0 the run's INITIAL.json), in resume, replay and export; export reads
only a checkpoint such a record names; DCP's pickled metadata admits only the classes it
is made of; and replay imports a stored reward.function only when this machine vouches
for it. Each refusal is one line."""

import hashlib
import json
import os
import pickle
import re
import shutil
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from helpers import small_config
from rlhf_core.cli import main
from rlhf_core.config import apply_overrides
from rlhf_core.trainer.replay import ReplayError, replay
from rlhf_core.trainer.run import run_direct
from rlhf_core.record.run_layout import RunRef

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """One committed iteration (checkpoints at steps 0 and 1); tests tamper with copies."""
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))
    root = tmp_path_factory.mktemp("trust")
    run_direct(small_config(root / "out"), 1, RunRef(f"file://{root / 'store'}", "run"), log=lambda *a: None)
    return root


class CreatesAFile:
    """Pickled, it makes whoever unpickles it create ``path``: code run by loading."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def named(run, step: int) -> str:
    """``checkpoints/<folder>`` of the checkpoint after ``step`` iterations, as the record
    that commits it names it (the run's INITIAL.json; iteration ``step - 1``'s manifest)."""
    record = run / ("checkpoints/INITIAL.json" if step == 0 else f"iter-{step - 1:06d}/MANIFEST.json")
    return "checkpoints/" + json.loads(record.read_text())["checkpoint"].rstrip("/").rsplit("/", 1)[-1]


def copy_with(stored, tmp_path, replaced: dict[str, bytes]) -> str:
    """A copy of the stored run, as if written where it lies (its records name its own
    checkpoint folders: they hold URIs), with files (paths inside the run) replaced after
    the commit; its run URI."""
    shutil.copytree(stored / "store", tmp_path / "store")
    run = tmp_path / "store/run"
    for record in [*run.glob("iter-*/MANIFEST.json"), run / "checkpoints/INITIAL.json"]:
        record.write_text(record.read_text().replace(f"file://{stored / 'store'}/", f"file://{tmp_path / 'store'}/"))
    for rel, data in replaced.items():
        (run / rel).write_bytes(data)
    return f"file://{tmp_path / 'store'}/run"


def one_line_refusal(exc_info) -> str:
    message = str(exc_info.value)
    assert message.startswith("rlhf: ") and "\n" not in message and "Traceback" not in message, message
    return message


def test_dcp_metadata_is_unpickled_with_its_own_classes_only(stored, tmp_path):
    from rlhf_core.checkpoint.reader import CorruptCheckpointError, load_metadata

    real = (stored / "store/run" / named(stored / "store/run", 1) / "actor/.metadata").read_bytes()
    metadata = load_metadata(real, "step-000001/actor/.metadata")
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    marker = tmp_path / "created"
    with pytest.raises(CorruptCheckpointError, match=r"^x/.metadata: the DCP metadata names io.open; only the "
                                                     r"classes checkpoint metadata is made of are admitted$"):
        load_metadata(pickle.dumps(CreatesAFile(marker)), "x/.metadata")
    assert not marker.exists()


def test_the_initial_checkpoint_is_loaded_only_against_the_checksums_of_its_record(stored, tmp_path):
    """The step-0 checkpoint's one record is the run's INITIAL.json: its checksums are
    those of the folder it names, and they are what a load of step 0 checks. A step-0
    folder no record names (no checksums) is refused, in one line, before anything of it
    is unpickled."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.checkpoints import committed_checksums
    from rlhf_core.checkpoint.reader import CheckpointRefusedError

    run = stored / "store/run"
    record = json.loads((run / "checkpoints/INITIAL.json").read_text())
    meta = run / named(run, 0) / "actor/.metadata"
    assert record["checkpoint_sha256"]["actor/.metadata"] == hashlib.sha256(meta.read_bytes()).hexdigest()
    assert {"actor/__0_0.distcp", "actor/rank-00000.pt", "trainer_state.json"} <= set(record["checkpoint_sha256"])
    assert not list(run.glob("checkpoints/*/CHECKSUMS.json")), "one step-0 record: INITIAL.json"
    assert committed_checksums(IterationStore(RunRef(f"file://{stored / 'store'}", "run")), 0) == record["checkpoint_sha256"]

    # the same run with its step-0 folder but no INITIAL.json: nothing records its checksums
    marker = tmp_path / "created"
    uri = copy_with(stored, tmp_path, {f"{named(run, 0)}/actor/.metadata": pickle.dumps(CreatesAFile(marker))})
    old = tmp_path / "store/run/checkpoints"
    (old / named(run, 0).split("/")[1]).rename(old / "step-000000")
    (old / "INITIAL.json").unlink()
    with pytest.raises(CheckpointRefusedError, match=r"INITIAL.json: no committed checksums"):
        committed_checksums(IterationStore(RunRef(uri.rsplit("/", 1)[0], "run")), 0)
    with pytest.raises(SystemExit) as exc:
        main(["replay", f"{uri}/iter-000000/update_actor"])
    assert not marker.exists(), "replay unpickled a step-0 checkpoint no record lists the checksums of"
    assert "INITIAL.json: no committed checksums" in one_line_refusal(exc)


def test_export_of_a_checkpoint_changed_after_its_commit_runs_nothing(stored, tmp_path):
    marker = tmp_path / "created"
    step1 = named(stored / "store/run", 1)
    run = copy_with(stored, tmp_path, {f"{step1}/actor/.metadata": pickle.dumps(CreatesAFile(marker))})
    with pytest.raises(SystemExit) as exc:
        main(["export", f"{run}/{step1}", "--out", str(tmp_path / "hf")])
    assert not marker.exists(), "export unpickled a file it had not checked"
    assert f"{step1}/actor/.metadata: sha256 " in one_line_refusal(exc)
    assert not (tmp_path / "hf").exists()
    # a checkpoint no commit lists is not read at all
    with pytest.raises(SystemExit, match=r"^rlhf: \S+/ckpt: expected a run's checkpoint"):
        main(["export", f"file://{tmp_path}/ckpt", "--out", str(tmp_path / "hf")])


def test_export_reads_the_checkpoint_a_record_names_and_nothing_else(stored, tmp_path, capsys):
    """The checkpoints the records name (iteration 0's manifest: step-000001-<attempt>;
    INITIAL.json: step 0's) are exported from their checked bytes; a folder of the run
    that no record names is refused, even one with the very bytes of a committed
    checkpoint (a lost write, a copy), and so is a legacy step-N folder no record names."""
    from safetensors.torch import load_file

    run_dir = stored / "store/run"
    run = f"file://{run_dir}"
    step1 = named(run_dir, 1)
    assert re.fullmatch(r"checkpoints/step-000001-[0-9a-f]+", step1), step1
    assert main(["export", f"{run}/{step1}", "--out", str(tmp_path / "hf")]) == 0
    record = json.loads((tmp_path / "hf/EXPORT.json").read_text())
    assert record["global_step"] == 1 and "exported step 1" in capsys.readouterr().out
    assert load_file(tmp_path / "hf/model.safetensors")
    assert main(["export", f"{run}/{named(run_dir, 0)}", "--out", str(tmp_path / "hf0")]) == 0
    assert json.loads((tmp_path / "hf0/EXPORT.json").read_text())["global_step"] == 0

    copy = copy_with(stored, tmp_path, {})
    for unnamed in ("step-000001-0123456789ab", "step-000001", "step-000000-0123456789ab"):
        source = named(run_dir, int(unnamed[5:11]))
        shutil.copytree(tmp_path / "store/run" / source, tmp_path / "store/run/checkpoints" / unnamed)
        with pytest.raises(SystemExit, match=rf"^rlhf: \S+/checkpoints/{unnamed}: no committed record names this "
                                             rf"checkpoint \(\S+ names \S+\); only the checkpoint a record commits "
                                             rf"is exported$"):
            main(["export", f"{copy}/checkpoints/{unnamed}", "--out", str(tmp_path / f"hf-{unnamed}")])
        assert not (tmp_path / f"hf-{unnamed}").exists()


def test_replay_of_iteration_0_checks_the_initial_checkpoint(stored, tmp_path):
    marker = tmp_path / "created"
    step0 = named(stored / "store/run", 0)
    assert re.fullmatch(r"checkpoints/step-000000-[0-9a-f]+", step0), step0  # the one INITIAL.json names
    run = copy_with(stored, tmp_path, {f"{step0}/actor/.metadata": pickle.dumps(CreatesAFile(marker))})
    with pytest.raises(SystemExit) as exc:
        main(["replay", f"{run}/iter-000000/update_actor"])
    assert not marker.exists(), "replay unpickled the step-0 checkpoint without checking it"
    assert f"{step0}/actor/.metadata: sha256 " in one_line_refusal(exc)


def test_resume_refuses_a_changed_checkpoint_in_one_line(stored, tmp_path):
    marker = tmp_path / "created"
    step1 = named(stored / "store/run", 1)
    run = copy_with(stored, tmp_path, {f"{step1}/actor/.metadata": pickle.dumps(CreatesAFile(marker))})
    with pytest.raises(SystemExit) as exc:
        main(["run", "--direct", "--run-id", "run", "--store", run.rsplit("/", 1)[0], "--iterations", "2",
              "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false",
              f"trainer.output_dir={tmp_path / 'out'}"])
    assert not marker.exists()
    assert f"{step1}/actor/.metadata: sha256 " in one_line_refusal(exc)


def test_replay_imports_a_stored_reward_function_only_when_vouched_for(stored, tmp_path, monkeypatch):
    """A manifest naming reward.function=some_module:fn makes replay import some_module:
    code. Without the flag it is imported only when built in or registered by an
    installed package (entry points ``rlhf.rewards``), or named by the replay's own
    --override."""
    marker = tmp_path / "imported"
    (tmp_path / "stored_reward_fn.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                                  f"def score(*args):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = copy_with(stored, tmp_path, {})
    manifest_path = tmp_path / "store/run/iter-000000/MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["reward"]["function"] = "stored_reward_fn:score"
    manifest_path.write_text(json.dumps(manifest))

    with pytest.raises(ReplayError, match=r"^reward.function 'stored_reward_fn:score' \(from the iteration's "
                                          r"manifest\): expected a built-in reward or one an installed package "
                                          r"registers .* only with --trust-reward-function$"):
        replay(f"{run}/iter-000000", stages=["reward"], log=lambda *a: None)
    with pytest.raises(SystemExit) as exc:
        main(["replay", f"{run}/iter-000000/reward"])
    assert "--trust-reward-function" in one_line_refusal(exc)
    assert not marker.exists()

    from rlhf_core.trainer.replay import check_reward_function

    cfg = apply_overrides(small_config(tmp_path), ["reward.function=stored_reward_fn:score"])
    check_reward_function(cfg, [], trusted=True)                                   # the flag
    check_reward_function(cfg, ["reward.function=stored_reward_fn:score"], False)  # the replayer's own choice
    for builtin in ("gsm8k", "rlhf_core.data.gsm8k:compute_score"):
        check_reward_function(apply_overrides(small_config(tmp_path), [f"reward.function={builtin}"]), [], False)
    registered = [EntryPoint("mine", "stored_reward_fn:score", "rlhf.rewards")]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: registered if group == "rlhf.rewards"
                        else [])
    check_reward_function(cfg, [], False)  # an installed package registers it
    assert not marker.exists()


def test_a_checkpoint_uri_from_a_record_is_checked_before_any_request(stored, tmp_path):
    """Issue 39 item 5: a manifest naming a metadata endpoint (or another run's folder)
    as its weights' checkpoint is refused in one line before anything is fetched."""
    import http.server
    import threading

    requests = []

    class Recording(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server name
            requests.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}/latest/meta-data/iam"
    try:
        run = copy_with(stored, tmp_path, {})
        manifest_path = Path(run.removeprefix("file://")) / "iter-000000/MANIFEST.json"
        manifest = json.loads(manifest_path.read_text())
        honest = manifest["weights"]["checkpoint"]
        cases = {
            "metadata endpoint": endpoint,
            "another run": honest.replace("/run/checkpoints/", "/victim/checkpoints/"),
            "another step": honest.replace("step-000001-", "step-000002-"),
            "a chain": f"{honest}::memory://x",
        }
        for case, uri in cases.items():
            manifest["weights"]["checkpoint"] = uri
            manifest_path.write_text(json.dumps(manifest))
            with pytest.raises(SystemExit) as exc:
                main(["run", "--direct", "--run-id", "run", "--store", run.rsplit("/", 1)[0], "--iterations", "2",
                      "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
                      "trainer.progress=false", f"trainer.output_dir={tmp_path / 'out'}"])
            message = one_line_refusal(exc)
            assert "is not a checkpoint of this run for step 1" in message and "nothing was read" in message, \
                (case, message)
        # the same run copied with its record: what is read is this run's folder of that name
        from rlhf_core.record.checkpoints import checked_checkpoint_uri
        from rlhf_core.record.iteration_store import IterationStore
        from rlhf_core.record.run_layout import RunRef

        istore = IterationStore(RunRef(run.rsplit("/", 1)[0], "run"))
        written_at = honest.replace(f"{tmp_path / 'store'}/run/", f"{stored / 'store'}/run/")
        assert written_at != honest and checked_checkpoint_uri(istore, written_at, 1, "test") == honest
        initial = Path(run.removeprefix("file://")) / "checkpoints/INITIAL.json"
        record = json.loads(initial.read_text())
        record["checkpoint"] = endpoint
        initial.write_text(json.dumps(record))
        with pytest.raises(SystemExit) as exc:
            main(["replay", f"{run}/iter-000000/update_actor"])
        assert "INITIAL.json: checkpoint 'http://" in one_line_refusal(exc)
    finally:
        server.shutdown()
    assert requests == [], f"a record's URI was fetched before it was checked: {requests}"


def test_a_replay_posts_to_no_address_the_record_chose():
    """A manifest naming a SandboxFusion URL (a loopback server of the store writer's
    choosing) is refused before anything is sent; an override or --trust-reward-function
    names it here."""
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.replay import ReplayError, check_reward_function

    stored = apply_overrides(RunConfig(), ["reward_model.sandbox_fusion.url=http://127.0.0.1:9/run_code"])
    with pytest.raises(ReplayError, match=r"^reward_model.sandbox_fusion.url 'http://127.0.0.1:9/run_code' \(from the "
                                          r"iteration's manifest\): expected none or one named by --override"):
        check_reward_function(stored, [], trusted=False)
    check_reward_function(stored, ["reward_model.sandbox_fusion.url=http://sandbox:8080/run_code"], trusted=False)
    check_reward_function(stored, [], trusted=True)
    check_reward_function(RunConfig(), [], trusted=False)  # no address: nothing to refuse


@pytest.mark.parametrize("field", ["reward_model.model.path", "distillation.teacher_model.model_path"])
def test_a_replay_fetches_no_judge_or_teacher_from_an_address_the_record_chose(field):
    """A manifest naming a remote reward model, judge or teacher (an attacker's bucket) is
    refused before anything is fetched; a local folder, an override or the flag passes."""
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.replay import ReplayError, check_reward_function

    stored = RunConfig()
    for key, value in ((field, "s3://attacker-bucket/model"),):
        section, _, leaf = key.rpartition(".")
        target = stored
        for part in section.split("."):
            target = getattr(target, part)
        setattr(target, leaf, value)  # as a manifest's config holds it, whatever else it sets
    with pytest.raises(ReplayError, match=rf"^{field} 's3://attacker-bucket/model' \(from the iteration's manifest\): "
                                          r"expected a local folder or one named by --override; .* only with "
                                          r"--trust-reward-function$"):
        check_reward_function(stored, [], trusted=False)
    check_reward_function(stored, [f"{field}=s3://models/judge"], trusted=False)
    check_reward_function(stored, [], trusted=True)
    local = apply_overrides(RunConfig(), ["reward_model.enable=true", "reward_model.model.path=/models/rm"])
    check_reward_function(local, [], trusted=False)


def test_a_resumed_iterations_coefficient_and_cursor_from_a_snapshot_are_checked_as_data():
    """A committed stage's meta_info sets the KL coefficient and the prompt cursor a resumed
    iteration goes on with: a NaN coefficient would poison every later loss, a negative
    cursor never reaches a prompt; each is refused in one line naming the snapshot."""
    from rlhf_core.data.dataset import Cursor
    from rlhf_core.snapshot.errors import SnapshotSchemaError
    from rlhf_core.trainer.ppo import resumed_state

    where = "file:///s/run/iter-000003/reward"
    assert resumed_state({"kl_coef": 0.05, "prompt_cursor": {"epoch": 1, "position": 8}}, where) == \
        (0.05, Cursor(1, 8))
    assert resumed_state({}, where) == (None, None)
    for meta, field in (({"kl_coef": float("nan")}, "kl_coef"), ({"kl_coef": -1.0}, "kl_coef"),
                        ({"kl_coef": "0.1"}, "kl_coef"), ({"kl_coef": True}, "kl_coef"),
                        ({"prompt_cursor": {"epoch": 0, "position": -3}}, "prompt_cursor"),
                        ({"prompt_cursor": {"epoch": 0, "position": 1.5}}, "prompt_cursor"),
                        ({"prompt_cursor": {"epoch": 0, "position": 1, "extra": 1}}, "prompt_cursor")):
        with pytest.raises(SnapshotSchemaError, match=rf"^{where}: meta_info.{field}: expected "):
            resumed_state(meta, where)


def test_a_rollouts_weight_version_from_a_snapshot_names_no_step_from_the_future(tmp_path):
    """Replaying an asynchronous iteration's rollout loads the weights its snapshot says
    generated it: only a step of the iteration's past is taken."""
    import torch

    from rlhf_core.protocol import DataProto
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.replay import ReplayError, generated_by

    istore = IterationStore(RunRef(f"file://{tmp_path}", "run"))
    for n, versions in ((2, [1, -1]), (3, [7, 7]), (4, [-1, -1])):  # -1: an agent row that generated nothing
        istore.save(n, "rollout", DataProto.from_dict(tensors={"weight_version": torch.tensor(versions)}),
                    standalone=True)
    istore.flush()
    assert generated_by(istore, 2) == 1
    with pytest.raises(ReplayError, match=r"^iteration 4: expected one weight version in its rollout batch; found "
                                          r"\[\]$"):
        generated_by(istore, 4)
    for n, version in ((3, 7),):
        with pytest.raises(ReplayError, match=rf"^iteration {n}: weight_version: expected a step in \[0, {n}\] .*; "
                                              rf"found {version}$"):
            generated_by(istore, n)
