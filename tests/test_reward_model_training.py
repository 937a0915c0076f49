"""Training a reward model from preference pairs (``rlhf reward-model train``): the
Bradley-Terry loss, the pair layouts TRL and OpenRLHF read, bad rows, a model that
learns the preference, and a folder the reward-model worker loads with its origin."""

import hashlib
import json

import pytest
import torch

from rlhf_core.algorithms import bradley_terry_loss
from rlhf_core.data.preferences import PreferenceDataError, load_pairs, side_text
from rlhf_core.testing.model_folders import build_model_folder, question


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def apple_pairs(count: int, chat: bool = True) -> list[dict]:
    """A preference an annotator could hold: the response that explains its count over a
    bare wrong number (what a tiny model learns in seconds)."""
    rows = []
    for i in range(count):
        text, answer = question(i)
        wrong = str(int(answer) + 1 + i % 3)
        prompt = [{"role": "user", "content": text}] if chat else text
        rows.append({"prompt": prompt, "chosen": f"He has {answer} apples. #### {answer}",
                     "rejected": f"#### {wrong}"})
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("base"))


def test_the_bradley_terry_loss_is_the_negative_log_likelihood_of_the_preferences():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0], requires_grad=True), torch.tensor([0.0, 0.0, -1.0])
    loss = bradley_terry_loss(chosen, rejected)
    expected = -torch.log(torch.sigmoid(torch.tensor([1.0, 0.0, 3.0]))).mean()
    assert loss.item() == pytest.approx(expected.item())
    loss.backward()
    assert (chosen.grad < 0).all()  # descending the loss raises the chosen side's score
    assert float(bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]))) == \
        pytest.approx(float(torch.log(torch.tensor(2.0))))  # a margin as large as the gap: no better than even


def test_the_layouts_trl_and_openrlhf_read_give_the_same_pairs(tmp_path):
    text = [{"prompt": "Q?", "chosen": "good", "rejected": "bad"}]
    chat = [{"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "good"}],
             "rejected": [{"role": "assistant", "content": "bad"}], "margin": 2}]
    implicit = [{"chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "good"}],
                 "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "bad"}]}]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(chat * 2), tmp_path / "chat.parquet")
    got = {name: load_pairs(str(path))[0][0] for name, path in (
        ("text", write_jsonl(tmp_path / "text.jsonl", text * 2)), ("chat", tmp_path / "chat.parquet"),
        ("implicit", write_jsonl(tmp_path / "implicit.jsonl", implicit * 2)))}
    assert got["text"].prompt == "Q?" and got["chat"].prompt == got["implicit"].prompt == [{"role": "user",
                                                                                            "content": "Q?"}]
    assert {(p.chosen, p.rejected) for p in got.values()} == {("good", "bad")}
    assert got["chat"].margin == 2.0 and got["text"].margin is None
    pairs, record = load_pairs(str(tmp_path / "text.jsonl"))
    assert record["sha256"] == hashlib.sha256((tmp_path / "text.jsonl").read_bytes()).hexdigest()
    assert record["rows"] == 2 and record["skipped"] == {}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Q", "chosen": "a"}, "row 1: rejected is missing or empty"),
    ({"prompt": "Q", "chosen": "", "rejected": "b"}, "row 1: chosen is missing or empty"),
    ({"prompt": "Q", "chosen": "  ", "rejected": "b"}, "row 1: chosen is missing or empty"),
    ({"prompt": "Q", "chosen": "same", "rejected": "same"}, "row 1: chosen and rejected are identical"),
    ({"prompt": "Q", "chosen": "a", "rejected": "b", "margin": "big"}, "row 1: margin: expected a finite number"),
    ({"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]},
     "row 1: chosen: expected one assistant message after the prompt"),
    ({"prompt": "Q", "chosen": "a\ud800", "rejected": "b"},
     "row 1: expected text; found a lone UTF-16 surrogate (half a character)"),
])
def test_a_bad_row_is_refused_naming_it_or_counted_and_skipped(tmp_path, row, message):
    good = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, row, good])
    with pytest.raises(PreferenceDataError) as refused:
        load_pairs(str(path))
    assert str(refused.value).startswith(f"{path}: {message}") and "--skip-bad-rows" in str(refused.value)
    assert "\n" not in str(refused.value)
    pairs, record = load_pairs(str(path), skip_bad_rows=True)
    assert [p.row for p in pairs] == [0, 2] and sum(record["skipped"].values()) == 1


def test_a_file_that_cannot_be_read_as_pairs_is_refused_in_one_line(tmp_path):
    broken = tmp_path / "pairs.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "Q", "chosen": "a", "rejected": "b"}\n{"prompt": "caf\xe9"}\n')
    nan = write_jsonl(tmp_path / "nan.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b", "margin": float("nan")}])
    for path, message in ((broken, f"{broken}: expected a readable parquet file; found one pyarrow cannot read ("),
                          (latin, f"{latin}: line 2: expected UTF-8 text; found byte 0xe9 at offset "),
                          (nan, f"{nan}: row 0: margin: expected a finite number; found nan")):
        with pytest.raises(PreferenceDataError) as refused:
            load_pairs(str(path))
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value), refused.value


def test_a_side_is_written_as_the_policy_would_have_produced_it(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    chat = [{"role": "user", "content": "How many?"}]
    assert side_text(tok, chat, "#### 3") == tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                     tokenize=False) + "#### 3" + tok.eos_token
    # text as the prompt loader lays it out: as it is, after the BOS token when there is one
    assert side_text(tok, "How many?", "#### 3") == (tok.bos_token or "") + "How many?#### 3" + tok.eos_token


def test_a_reward_model_learns_the_preference_and_its_folder_says_where_it_came_from(base, tmp_path, monkeypatch):
    from rlhf_core.cli import main
    from rlhf_core.workers import reward_model as rm

    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(80))
    out = tmp_path / "rm"
    assert main(["reward-model", "train", "--data", str(data), "--base", str(base), "--out", str(out),
                 "--epochs", "3", "--lr", "1e-3", "--batch-size", "8", "--eval-share", "0.2",
                 "--store", str(tmp_path / "store"), "--run-id", "rm-apples"]) == 0
    record = json.loads((out / rm.PROVENANCE).read_text())
    curve = record["curve"]
    assert [row["epoch"] for row in curve] == [0, 1, 2, 3] and record["held_out_pairs"] == 16
    assert curve[-1]["accuracy"] >= 0.9 > curve[0]["accuracy"], curve
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert record["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    model = rm.load_reward_model(str(out))  # what reward_model.model.path takes
    assert model.config.num_labels == 1
    assert rm.trained_from(str(out)) == {"data": str(data), "data_sha256": record["data"]["sha256"],
                                         "base": str(base), "run": f"file://{tmp_path}/store/rm-apples"}


def test_training_refuses_bad_settings_and_data_in_one_line(base, tmp_path, capsys):
    from rlhf_core.cli import main

    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(4) + [{"prompt": "Q", "chosen": "a", "rejected": "a"}])
    for argv, message in (([], "rlhf: " + str(data) + ": row 4: chosen and rejected are identical"),
                          (["--epochs", "0"], "rlhf: --epochs: expected at least 1; found 0"),
                          (["--eval-share", "0.9", "--skip-bad-rows"], "rlhf: --eval-share: expected to leave pairs")):
        with pytest.raises(SystemExit) as refused:
            main(["reward-model", "train", "--data", str(data), "--base", str(base), "--out", str(tmp_path / "o"),
                  "--store", str(tmp_path / "store"), *argv])
        assert str(refused.value.code).startswith(message), refused.value.code
    assert not (tmp_path / "o").exists() and not (tmp_path / "store").exists(), \
        "nothing is written for a refused training"


def _train(base, data, tmp_path, run_id: str, epochs: int, **settings):
    from rlhf_core.trainer.preference import RewardModelTraining, train_reward_model

    settings = {"lr": 1e-3, "batch_size": 8, "eval_share": 0.2, **settings}
    spec = RewardModelTraining(data=str(data), base=str(base), out=str(tmp_path / f"{run_id}-out"), epochs=epochs,
                               store=str(tmp_path / "store"), run_id=run_id, **settings)
    return train_reward_model(spec, log=lambda *_: None)


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


def test_each_epoch_is_recorded_and_a_run_killed_mid_epoch_continues_to_the_same_model(base, tmp_path, monkeypatch):
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import REWARD_MODEL_TRAINING_FORMAT, RunRef
    from rlhf_core.snapshot import load_snapshot

    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(40))  # 32 to train on: 4 steps an epoch
    whole = _train(base, data, tmp_path, "rm-whole", 3)

    class Killed(Exception):
        pass

    steps, step = {"n": 0}, torch.optim.AdamW.step

    def dies_at_the_sixth(self, *args, **kwargs):
        steps["n"] += 1
        if steps["n"] == 6:  # in epoch 2
            raise Killed
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_the_sixth)
    with pytest.raises(Killed):
        _train(base, data, tmp_path, "rm-killed", 3)
    monkeypatch.undo()
    store = IterationStore(RunRef(str(tmp_path / "store"), "rm-killed"))
    assert store.committed_iterations() == [0, 1], "epoch 2 was not committed"
    resumed = _train(base, data, tmp_path, "rm-killed", 3)
    assert resumed["curve"] == whole["curve"] and len(whole["curve"]) == 4
    ours, theirs = _weights(tmp_path / "rm-killed-out"), _weights(tmp_path / "rm-whole-out")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # what each epoch recorded: its manifest, the held-out pairs as they were scored, every
    # training pair once with its scores at the step that trained on it, a checked checkpoint
    run = IterationStore(RunRef(str(tmp_path / "store"), "rm-whole"))
    assert run.committed_iterations() == [0, 1, 2, 3]
    train_rows = None
    for epoch in range(4):
        manifest = run.read_manifest(epoch, format=REWARD_MODEL_TRAINING_FORMAT)
        assert manifest["metrics"] == {k: v for k, v in whole["curve"][epoch].items() if k != "epoch"}
        held = load_snapshot(manifest["snapshots"]["held_out"])
        accuracy = (held.batch["chosen_score"] > held.batch["rejected_score"]).float().mean().item()
        assert accuracy == pytest.approx(manifest["metrics"]["accuracy"], abs=1e-6) and len(held) == 8
        assert all("He has" in t for t in held.non_tensor_batch["chosen_text"])
        assert not any("He has" in t for t in held.non_tensor_batch["rejected_text"])
        if epoch == 0:
            assert manifest["checkpoint"] is None and "train_pairs" not in manifest["snapshots"]
            continue
        trained = load_snapshot(manifest["snapshots"]["train_pairs"])
        rows = sorted(trained.batch["row"].tolist())
        assert rows == (train_rows or rows) and len(rows) == len(set(rows)) == 32
        assert set(rows).isdisjoint(held.batch["row"].tolist())
        train_rows = rows
        assert sorted(set(trained.batch["step"].tolist())) == [0, 1, 2, 3]
        assert manifest["checkpoint"].startswith(f"{run.run_uri}/checkpoints/step-{epoch:06d}-")
        assert any(name.startswith("reward_model/") for name in manifest["checkpoint_sha256"])
    assert whole["run"] == run.run_uri


def test_a_training_run_is_known_to_gc_lineage_and_export(base, tmp_path, capsys):
    """A training killed after its checkpoint was written and before its epoch committed
    leaves a folder no record names: ``rlhf gc`` collects it once past the grace period
    and keeps what the record names (the policy's overrides decide among those, the
    newest stays). ``rlhf lineage`` shows the epochs over their preferences, and ``rlhf
    export`` writes any epoch's checkpoint as the folder training writes."""
    import os
    import time

    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.workers import reward_model as rm

    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(40))
    whole = _train(base, data, tmp_path, "rm-g", 2)

    class Killed(Exception):
        pass

    commit = IterationStore.commit_iteration

    def killed_before_epoch_3_commits(self, iteration, *args, **kwargs):
        if iteration == 3:
            raise Killed
        return commit(self, iteration, *args, **kwargs)

    IterationStore.commit_iteration = killed_before_epoch_3_commits
    try:
        with pytest.raises(Killed):
            _train(base, data, tmp_path, "rm-g", 3)
    finally:
        IterationStore.commit_iteration = commit
    run_dir = tmp_path / "store" / "rm-g"
    checkpoints = lambda: sorted(p.name.rsplit("-", 1)[0] for p in (run_dir / "checkpoints").iterdir())  # noqa: E731
    assert checkpoints() == ["step-000001", "step-000002", "step-000003"]
    run_uri = f"file://{run_dir}"

    assert main(["gc", run_uri, "--grace-s", "600"]) == 0
    assert checkpoints() == ["step-000001", "step-000002", "step-000003"], "the orphan is young: a writer may be live"
    old = time.time() - 7200
    for folder, _, files in os.walk(run_dir / "checkpoints"):
        for name in files:
            os.utime(os.path.join(folder, name), (old, old))
    assert main(["gc", run_uri, "--grace-s", "600"]) == 0
    assert checkpoints() == ["step-000001", "step-000002"], "the kill's orphan is collected, the committed stay"
    assert main(["gc", run_uri, "trainer.keep_checkpoints=1", "--grace-s", "600"]) == 0
    assert checkpoints() == ["step-000002"], "the policy keeps the newest, which a continued training loads"
    capsys.readouterr()

    store = IterationStore(RunRef(str(tmp_path / "store"), "rm-g"))
    newest = store.read_manifest(2, format=None)["checkpoint"]
    assert main(["lineage", run_uri]) == 0
    table = capsys.readouterr().out
    assert f"reward model training on preferences {data} (sha256 {whole['data']['sha256'][:16]}...)" in table
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["2", "1", "0"] and newest in table
    assert main(["lineage", newest, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["iteration"], r["wrote_checkpoint"]) for r in rows] == [
        ("reward_model_training", 2, newest), ("reward_model_training", 1, rows[1]["wrote_checkpoint"]),
        ("reward_model_training", 0, None)]
    assert rows[0]["metrics"]["accuracy"] == whole["curve"][2]["accuracy"]

    assert main(["export", newest, "--out", str(tmp_path / "exported")]) == 0
    ours, theirs = _weights(tmp_path / "exported"), _weights(tmp_path / "rm-g-out")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert rm.trained_from(str(tmp_path / "exported")) == rm.trained_from(str(tmp_path / "rm-g-out"))
    record = json.loads((tmp_path / "exported" / "EXPORT.json").read_text())
    assert record["checkpoint_uri"] == newest and record["global_step"] == 2 and record["reward_model"]
    assert rm.load_reward_model(str(tmp_path / "exported")).config.num_labels == 1
    with pytest.raises(SystemExit, match="iteration 3, which writes step 3's checkpoint, is not committed"):
        main(["export", newest.replace("step-000002", "step-000003"), "--out", str(tmp_path / "orphan")])


def test_continuing_a_run_with_other_settings_or_preferences_is_refused_in_one_line(base, tmp_path):
    from rlhf_core.cli import main
    from rlhf_core.trainer.preference import RewardModelTrainingError

    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(20))
    _train(base, data, tmp_path, "rm-a", 1)
    run = f"file://{tmp_path}/store/rm-a"
    with pytest.raises(RewardModelTrainingError, match=f"^--run-id: expected the settings of run {run} .* to "
                                                       f"continue it; found lr, seed changed$"):
        _train(base, data, tmp_path, "rm-a", 2, seed=1, lr=1e-4)
    other = write_jsonl(tmp_path / "other.jsonl", apple_pairs(21))
    with pytest.raises(RewardModelTrainingError, match=r"^--data: expected the preferences run .* trained on "
                                                       r"\(sha256 [0-9a-f]{16}\.\.\.\); found sha256 [0-9a-f]{16}"):
        _train(base, other, tmp_path, "rm-a", 2)
    # a PPO command given the reward model's run refuses it, naming the format it found
    with pytest.raises(SystemExit) as refused:
        main(["replay", f"{run}/iter-000001"])
    assert "not an iteration manifest this build reads (format 'rlhf.reward_model_training'" in str(refused.value)
    with pytest.raises(SystemExit, match=r"^rlhf: file://.*/rm-a: expected a PPO run \(manifests of format "
                                         r"'rlhf.iteration'\) to continue; found 'rlhf.reward_model_training' "):
        main(["run", "--direct", "--iterations", "2", "--store", str(tmp_path / "store"), "--run-id", "rm-a"])


def test_a_line_separator_inside_a_json_string_is_text_and_rows_are_bounded(tmp_path, monkeypatch):
    """JSON Lines ends a row at a newline alone: U+2028 (which str.splitlines breaks at)
    inside a string is the string's; a row longer than the bound is refused naming its line."""
    from rlhf_core.data import preferences

    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Q\u2028more", "chosen": "a\u2029b", "rejected": "c\x85d"}, {"prompt": "Q", "chosen": "a",
                                                                                     "rejected": "b"}]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    pairs, record = load_pairs(str(path))
    assert record["rows"] == 2 and pairs[0].prompt == "Q\u2028more" and pairs[0].rejected == "c\x85d"
    monkeypatch.setattr(preferences, "MAX_ROW_CHARS", 40)
    path.write_text(json.dumps({"prompt": "Q" * 50, "chosen": "a", "rejected": "b"}) + "\n")
    with pytest.raises(PreferenceDataError, match=r": line 1: expected at most 40 characters; found 96$"):
        load_pairs(str(path))


def test_the_command_writes_the_reward_model_to_an_object_store_prefix(base, tmp_path, monkeypatch, s3_server):
    """`--out s3://...` publishes the folder there (SHA256SUMS last), no local folder named
    `s3:`; an occupied prefix is refused before training."""
    import uuid

    from rlhf_core.cli import main
    from rlhf_core.workers import modeling
    from rlhf_core.workers import reward_model as rm

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "node-cache"))
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(16))
    out = f"s3://{s3_server.bucket}/rm-{uuid.uuid4().hex[:8]}"
    args = ["reward-model", "train", "--data", str(data), "--base", str(base), "--out", out, "--epochs", "1",
            "--eval-share", "0", "--store", str(tmp_path / "store")]
    assert main(args) == 0
    assert not (tmp_path / "s3:").exists()
    listed = {path.rsplit("/", 1)[-1] for path in s3_server._client.ls(out[len("s3://"):])}
    assert {"SHA256SUMS", "model.safetensors", "config.json", rm.PROVENANCE} <= listed
    fetched = modeling.resolve_model_path(out, seed=0, field=rm.FIELD)  # checked against its sums
    assert rm.load_reward_model(fetched).config.num_labels == 1
    assert json.loads(open(f"{fetched}/{rm.PROVENANCE}").read())["settings"]["out"] == out
    with pytest.raises(SystemExit, match=r"--out: expected an empty prefix for the reward model; found objects"):
        main(args)
