"""The reward model as Kubeflow components: trained from preference pairs on the KFP local
runner into an object-store prefix (SeaweedFS), its artifact handed to the fine-tune's
config; the compiled pipeline wires preferences -> reward model -> fine-tune."""

import json
import uuid

import pytest
import yaml

from rlhf_core.config import RunConfig, apply_overrides, config_from_handover, handover
from rlhf_core.testing.model_folders import build_model_folder
from tests.test_reward_model_training import apple_pairs, write_jsonl


def test_the_compiled_pipeline_trains_the_reward_model_and_hands_it_to_the_fine_tune():
    from pipelines.ppo_iteration import COMPILED_RM_FINETUNE

    spec = list(yaml.safe_load_all(COMPILED_RM_FINETUNE.read_text()))[0]
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"train-reward-model", "with-reward-model", "drive-finetune"}
    handed = tasks["with-reward-model"]["inputs"]["artifacts"]["reward_model"]["taskOutputArtifact"]
    assert handed == {"outputArtifactKey": "reward_model", "producerTask": "train-reward-model"}
    driver = tasks["drive-finetune"]["inputs"]["parameters"]
    for name in ("config", "config_hash"):  # the driver runs the config that names the reward model
        assert driver[name]["taskOutputParameter"] == {"outputParameterKey": name, "producerTask": "with-reward-model"}
    # its epochs go to the fine-tune's store under the pipeline job's name, so a retry continues them
    trained = tasks["train-reward-model"]
    assert trained["inputs"]["parameters"]["store"] == {"componentInputParameter": "store"}
    assert trained["inputs"]["parameters"]["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_name}}"}}
    assert trained["retryPolicy"]["maxRetryCount"] >= 1
    assert {"preferences", "reward_model_base", "reward_model_out", "iterations", "kube_spec"} <= set(
        spec["root"]["inputDefinitions"]["parameters"])


@pytest.mark.kfp
@pytest.mark.slow
def test_a_reward_model_trained_by_its_component_scores_the_fine_tune_that_names_it(s3_server, tmp_path,
                                                                                    monkeypatch):
    from kfp import dsl

    from components.reward_model import train_reward_model, with_reward_model
    from pipelines.local import local_init
    from rlhf_core.workers import modeling
    from rlhf_core.workers import reward_model as rm

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path / "node-cache"))
    base = build_model_folder(tmp_path / "base")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(40))
    out = f"s3://{s3_server.bucket}/rm-{uuid.uuid4().hex[:8]}"
    cfg = apply_overrides(RunConfig(), [f"model.path={base}", "actor.lr=2e-5"]).validate()

    @dsl.pipeline(name="rm-then-config")
    def rm_then_config(preferences: str, base: str, out: str, store: str, config: str, config_hash: str) -> str:
        trained = train_reward_model(preferences=preferences, base=base, out=out, epochs=2, lr=1e-3, batch_size=8,
                                     eval_share=0.2, store=store, run_id="rm-component")
        return with_reward_model(config=config, config_hash=config_hash,
                                 reward_model=trained.outputs["reward_model"]).outputs["config"]

    local_init(str(tmp_path / "kfp"))
    store = f"s3://{s3_server.bucket}/runs-{uuid.uuid4().hex[:8]}"
    run = rm_then_config(preferences=str(pairs), base=str(base), out=out, store=store, **handover(cfg))
    scored = json.loads(run.output)
    assert scored["reward_model"]["enable"] is True and scored["reward_model"]["model"]["path"] == out
    assert scored["actor"]["lr"] == 2e-5  # the rest as it was

    # the folder on the store: fetched (checked against its SHA256SUMS) and loaded as the worker loads it
    fs = s3_server._client
    listed = {path.rsplit("/", 1)[-1] for path in fs.ls(out[len("s3://"):])}
    assert {"SHA256SUMS", "model.safetensors", "config.json", rm.PROVENANCE} <= listed
    fetched = modeling.resolve_model_path(out, seed=0, field=rm.FIELD)
    assert rm.load_reward_model(fetched).config.num_labels == 1
    record = json.loads(open(f"{fetched}/{rm.PROVENANCE}").read())
    assert record["data"]["uri"] == str(pairs) and record["curve"][-1]["accuracy"] >= 0.75, record["curve"]
    # the artifact says what the run's manifests will record: the same content hash
    artifacts = [json.loads(p.read_text()) for p in (tmp_path / "kfp").rglob("executor_output.json")]
    metadata = next(a["artifacts"]["reward_model"]["artifacts"][0] for a in artifacts
                    if "reward_model" in a.get("artifacts", {}))
    assert metadata["uri"] == out
    assert metadata["metadata"]["sha256"] == rm.content_sha256(fetched)
    assert metadata["metadata"]["preferences_sha256"] == record["data"]["sha256"]
    assert metadata["metadata"]["held_out_accuracy"] == record["curve"][-1]["accuracy"]
    # each epoch recorded on the store: manifest, scored pairs, checkpoint; the folder names its run
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import REWARD_MODEL_TRAINING_FORMAT, RunRef

    epochs = IterationStore(RunRef(store, "rm-component"), storage_options=None)
    assert record["run"] == metadata["metadata"]["run"] == f"{store}/rm-component"
    assert epochs.committed_iterations() == [0, 1, 2]
    assert epochs.read_manifest(2, format=REWARD_MODEL_TRAINING_FORMAT)["metrics"]["accuracy"] == \
        record["curve"][-1]["accuracy"]
    # a second training into the same prefix is refused: nothing published is overwritten
    from rlhf_core.trainer.preference import RewardModelTrainingError, publish

    with pytest.raises(RewardModelTrainingError, match=f"^--out: expected an empty prefix for the reward model; "
                                                       f"found objects under {out}$"):
        publish(fetched, out)
    assert config_from_handover(json.dumps(scored, sort_keys=True),
                                apply_overrides(cfg, ["reward_model.enable=true", f"reward_model.model.path={out}"])
                                .config_hash()).reward_model.model.path == out
