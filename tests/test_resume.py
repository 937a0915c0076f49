"""Resume: an interrupted run continues at the first uncommitted stage and ends exactly
where an uninterrupted run ends (weights and every committed snapshot bit-identical)."""

import hashlib
import json
import os
import re

import pytest

from helpers import fingerprint, names_nothing, small_config, uris_naming_nothing
from rlhf_core.record.lineage import chain, format_lineage
from rlhf_core.config import ConfigError, apply_overrides
from rlhf_core.trainer.run import run_direct
from rlhf_core.record.run_layout import RunRef

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    os.environ.setdefault("RLHF_CACHE", str(tmp_path_factory.mktemp("rlhf-cache")))


class Crash(RuntimeError):
    pass


def crash_at(iteration, stage):
    def hook(it, name):
        if (it, name) == (iteration, stage):
            raise Crash(f"injected at iteration {it}, stage {name}")
    return hook


def test_interrupted_run_resumes_bit_identical(tmp_path):
    quiet = lambda *a: None
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    run_direct(small_config(tmp_path / "out"), 2, RunRef(f"file://{store_a}", "run"), log=quiet)

    # crash after the advantage stage committed (nothing stateful ran yet) ...
    with pytest.raises(Crash):
        run_direct(small_config(tmp_path / "out"), 2, RunRef(f"file://{store_b}", "run"), log=quiet,
                   on_stage=crash_at(1, "update_actor"))
    assert (store_b / "run/iter-000001/advantage/SNAPSHOT.json").exists()
    assert not (store_b / "run/iter-000001/MANIFEST.json").exists()
    # ... then after update_actor changed the weights but before the checkpoint
    with pytest.raises(Crash):
        run_direct(small_config(tmp_path / "out"), 1, RunRef(f"file://{store_b}", "run"), log=quiet,
                   on_stage=crash_at(1, "weight_sync"))
    result = run_direct(small_config(tmp_path / "out"), 1, RunRef(f"file://{store_b}", "run"), log=quiet)
    assert [r["iteration"] for r in result["rows"]] == [1]

    a, b = fingerprint(store_a, "run"), fingerprint(store_b, "run")
    assert sorted(a) == sorted(b)
    different = [k for k in a if a[k] != b[k]]
    assert not different, f"differs after resume: {different}"
    manifest = json.loads((store_b / "run/iter-000001/MANIFEST.json").read_text())
    assert manifest["parent_iteration"] == 0 and manifest["global_step"] == 2
    assert re.search(r"/checkpoints/step-000002-[0-9a-f]+$", manifest["checkpoint"])
    assert "rollout" in manifest["snapshots"] and manifest["code_version"]["source_sha256"]
    assert manifest["lease"]["holder"].startswith("local:")  # a direct run commits under a lease too


def test_continuing_with_another_config_is_refused(tmp_path):
    store = f"file://{tmp_path / 's'}"
    run_direct(small_config(tmp_path / "out"), 1, RunRef(store, "run"), log=lambda *a: None)
    changed = apply_overrides(small_config(tmp_path / "out"), ["actor.lr=0.1"])
    with pytest.raises(ConfigError, match=r"another config.*actor.lr: 0.0003 -> 0.1"):
        run_direct(changed, 1, RunRef(store, "run"), log=lambda *a: None)


def test_a_checkpoint_changed_after_its_commit_is_refused_on_resume(tmp_path, monkeypatch):
    """The iteration manifest records every checkpoint file's sha256; resuming from a
    checkpoint whose bytes changed stops with the file named. Local writes are fsynced
    before the manifest that makes them visible."""
    import os

    from rlhf_core.checkpoint.reader import CheckpointRefusedError, CorruptCheckpointError

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    store = tmp_path / "s"
    run_direct(small_config(tmp_path / "out"), 1, RunRef(f"file://{store}", "run"), log=lambda *a: None)
    manifest = json.loads((store / "run/iter-000000/MANIFEST.json").read_text())
    ckpt = store / "run/checkpoints" / manifest["checkpoint"].rsplit("/", 1)[-1]
    assert set(manifest["checkpoint_sha256"]) >= {"actor/.metadata", "actor/__0_0.distcp", "actor/rank-00000.pt",
                                                  "trainer_state.json"}
    assert manifest["checkpoint_sha256"]["actor/__0_0.distcp"] == hashlib.sha256(
        (ckpt / "actor/__0_0.distcp").read_bytes()).hexdigest()
    # the controller's own writes (checkpoint state, snapshot data) were fsynced here
    assert str(ckpt / "trainer_state.json") in synced
    assert any("/iter-000000/rollout/data-" in p for p in synced)

    weights = bytearray((ckpt / "actor/__0_0.distcp").read_bytes())
    weights[-1] ^= 0xFF
    (ckpt / "actor/__0_0.distcp").write_bytes(bytes(weights))
    with pytest.raises(CorruptCheckpointError,
                       match=r"^\S+/actor/__0_0.distcp: sha256 .* is not the .* its iteration committed[^\n]*$"):
        run_direct(small_config(tmp_path / "out"), 1, RunRef(f"file://{store}", "run"), log=lambda *a: None)

    # the bytes back as committed, but a trainer_state.json of another config whose sha256 the
    # record was made to list: the checkpoint's own config hash is compared with its record's
    weights[-1] ^= 0xFF
    (ckpt / "actor/__0_0.distcp").write_bytes(bytes(weights))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["config_hash"] = "0" * 64
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    manifest["checkpoint_sha256"]["trainer_state.json"] = hashlib.sha256(
        (ckpt / "trainer_state.json").read_bytes()).hexdigest()
    (store / "run/iter-000000/MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRefusedError,
                       match=r"^\S+/trainer_state.json: config_hash: expected \w+\.\.\., the hash its record names; "
                             r"found 0000000000000000\.\.\.[^\n]*$"):
        run_direct(small_config(tmp_path / "out"), 1, RunRef(f"file://{store}", "run"), log=lambda *a: None)


def test_an_iteration_count_is_the_runs_total(tmp_path, capsys):
    """`rlhf run --iterations N` means N in all: killed after some iterations and run again
    as the same command, it finishes the run, and a third time it does nothing; --more K
    adds K."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore

    store = f"file://{tmp_path / 's'}"
    common = ["run", "--direct", "--run-id", "count", "--store", store, "data.train_batch_size=8",
              "actor.ppo_mini_batch_size=4", "rollout.n=4", "trainer.progress=false",
              f"trainer.output_dir={tmp_path / 'out'}"]
    # the first attempt "crashes" after one committed iteration: stand in for it with --more 1
    assert main([*common[:1], "--more", "1", *common[1:]]) == 0
    assert main([*common[:1], "--iterations", "2", *common[1:]]) == 0
    assert "1 iteration(s) committed, 1 to run" in capsys.readouterr().out
    assert IterationStore(RunRef(store, "count")).committed_iterations() == [0, 1]
    assert main([*common[:1], "--iterations", "2", *common[1:]]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert IterationStore(RunRef(store, "count")).committed_iterations() == [0, 1]
    with pytest.raises(SystemExit, match="exclude each other"):
        main([*common[:1], "--iterations", "2", "--more", "1", *common[1:]])


def test_checkpoint_every_k_and_a_redo_of_the_rest_resume_bit_identically(tmp_path):
    """trainer.checkpoint_every=3: checkpoints at steps 0, 3 and the direct run's last; the
    weights between are the last checkpoint plus a redo of the committed update stages.
    A run whose workers die in iteration 4 (after its rollout and reward committed) comes
    back from checkpoint 3 plus a redo of iteration 3, and ends bit-identical to an
    unbroken run: snapshots (old log-probs of iteration 4 included) and checkpoints."""
    from rlhf_core.trainer.replay import replay

    quiet = lambda *a: None
    # the old_log_prob stage recomputes log-probs with the restored weights: compared below
    cfg = lambda: apply_overrides(small_config(tmp_path / "out"), ["trainer.checkpoint_every=3",
                                                                   "algorithm.rollout_correction.bypass_mode=false"])
    store_a, store_b = tmp_path / "a", tmp_path / "b"
    run_direct(cfg(), 5, RunRef(f"file://{store_a}", "run"), log=quiet)
    with pytest.raises(Crash):
        run_direct(cfg(), 5, RunRef(f"file://{store_b}", "run"), log=quiet, on_stage=crash_at(4, "old_log_prob"))
    steps = sorted(p.name.rsplit("-", 1)[0] for p in (store_b / "run/checkpoints").glob("step-*"))
    assert steps == ["step-000000", "step-000003"], steps
    weights = json.loads((store_b / "run/iter-000003/MANIFEST.json").read_text())["weights"]
    assert weights["checkpoint_step"] == 3 and weights["redo"] == [3]
    assert re.fullmatch(rf"file://{store_b}/run/checkpoints/step-000003-[0-9a-f]+", weights["checkpoint"])
    manifest = json.loads((store_b / "run/iter-000001/MANIFEST.json").read_text())
    # it wrote no checkpoint, and says so; its weights: the initial checkpoint + a redo of 0, 1
    assert manifest["checkpoint"] is None and manifest["checkpoint_sha256"] is None
    assert manifest["weights"]["redo"] == [0, 1]
    assert manifest["weights"]["checkpoint"] == json.loads((store_b / "run/checkpoints/INITIAL.json").read_text())[
        "checkpoint"]

    result = run_direct(cfg(), 1, RunRef(f"file://{store_b}", "run"), log=quiet)
    assert [r["iteration"] for r in result["rows"]] == [4]
    # every URI the manifests, the run's outputs and the lineage name is there
    assert not uris_naming_nothing(f"file://{store_b}", "run")
    assert not names_nothing(result["checkpoint"]) and "step-000005-" in result["checkpoint"]
    table = format_lineage(chain(f"file://{store_b}/run/iter-000004"))
    rows = {int(line.split()[0]): line for line in table.splitlines()[1:]}
    assert re.search(r"checkpoints/step-000005-[0-9a-f]+(  \(git .*)?$", rows[4]) and \
        re.search(r"checkpoints/step-000003-[0-9a-f]+ \+ redo 3(  \(git .*)?$", rows[3]), table
    a, b = fingerprint(store_a, "run"), fingerprint(store_b, "run")
    assert sorted(a) == sorted(b) and any("step-000005" in k for k in a)
    different = [k for k in a if a[k] != b[k]]
    assert not different, f"differs after checkpoint + redo: {different}"
    # an update stage between checkpoints replays the same way (checkpoint 0, redo of 0)
    results = replay(f"file://{store_b}/run/iter-000001/update_actor", log=quiet)
    assert [r.stage for r in results] == ["update_actor"] and results[0].ok
