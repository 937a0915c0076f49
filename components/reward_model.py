"""Kubeflow components that put a learned reward model in front of a fine-tune: train it
from preference pairs (``rlhf_core.trainer.preference``), then hand its model artifact to
the fine-tune's config, so KFP's lineage reads policy <- reward model <- preferences."""

from typing import NamedTuple

from kfp import dsl

from components.iteration import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train_reward_model(preferences: str, base: str, out: str, store: str, reward_model: dsl.Output[dsl.Model],
                       metrics: dsl.Output[dsl.Metrics], epochs: int = 1, lr: float = 1e-5, batch_size: int = 8,
                       max_length: int = 512, eval_share: float = 0.1, seed: int = 0,
                       skip_bad_rows: bool = False, run_id: str = "") -> str:
    """A one-label reward model trained with the Bradley-Terry loss on ``preferences``
    (parquet / JSONL, a path or an object-store URI) from ``base``, written to ``out``: a
    folder (a mounted volume) or an empty ``s3://`` / ``gs://`` prefix (uploaded with its
    ``SHA256SUMS``). The ``reward_model`` artifact names ``out`` and carries the folder's
    content hash and the preferences' URI and sha256; ``metrics`` the held-out accuracy and
    margin. Each epoch is recorded in ``store`` (scored pairs, checkpoint, manifest) as run
    ``run_id``: a retried task given the same id continues after its last committed epoch
    (empty: a new run). Returns ``out``."""
    import tempfile

    from rlhf_core.data.fetch import is_remote
    from rlhf_core.trainer.preference import RewardModelTraining, publish
    from rlhf_core.trainer.preference import train_reward_model as train
    from rlhf_core.workers.modeling import content_sha256

    spec = RewardModelTraining(data=preferences, base=base, out=out, epochs=epochs, lr=lr, batch_size=batch_size,
                               max_length=max_length, eval_share=eval_share, seed=seed, skip_bad_rows=skip_bad_rows,
                               store=store, run_id=run_id or None)
    spec.check()  # before anything is read
    with tempfile.TemporaryDirectory(prefix="rlhf-rm-") as scratch:
        if is_remote(out):
            spec.out = f"{scratch}/reward-model"
        record = train(spec)
        digest = content_sha256(spec.out)
        if is_remote(out):
            publish(spec.out, out)
    reward_model.uri = out  # where the folder is: what reward_model.model.path takes
    reward_model.metadata.update({"sha256": digest, "preferences": record["data"]["uri"],
                                  "preferences_sha256": record["data"]["sha256"], "base": base,
                                  "pairs": record["pairs"], "held_out_pairs": record["held_out_pairs"],
                                  "run": record["run"]})
    last = record["curve"][-1] if record["curve"] else {}
    for key in ("accuracy", "margin", "loss"):
        if key in last:
            metrics.log_metric(f"held_out_{key}", float(last[key]))
            reward_model.metadata[f"held_out_{key}"] = float(last[key])
    return out


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def with_reward_model(config: str, config_hash: str,
                      reward_model: dsl.Input[dsl.Model]) -> NamedTuple("Config", config=str, config_hash=str):
    """The fine-tune's resolved config (``config``, checked against ``config_hash``) scored
    by ``reward_model``: ``reward_model.enable`` and ``reward_model.model.path`` set to the
    artifact's URI, validated, and handed on with its new hash."""
    from collections import namedtuple

    from rlhf_core.config import apply_overrides, config_from_handover, handover

    cfg = config_from_handover(config, config_hash)
    scored = apply_overrides(cfg, ["reward_model.enable=true", f"reward_model.model.path={reward_model.uri}"],
                             notes=[]).validate()
    out = handover(scored)
    return namedtuple("Config", ["config", "config_hash"])(out["config"], out["config_hash"])
