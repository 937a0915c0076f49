"""Config overrides and the bad-input errors of the training path."""

import json

import pytest

from rlhf_core.config import ConfigError, RunConfig, apply_overrides, config_from_dict
from rlhf_core.data.dataset import DatasetError, PromptLoader, load_rows
from rlhf_core.workers.reward import load_reward_fn
from rlhf_core.workers.reward_managers import RewardFunctionError, ScoringRows, naive


def test_dotted_overrides_are_typed():
    cfg = apply_overrides(RunConfig(), ["actor.lr=1e-5", "rollout.n=4", "critic.enable=true",
                                        "algorithm.kl_ctrl.type=adaptive", "rollout.name=hf"])
    assert cfg.actor.lr == 1e-5 and cfg.rollout.n == 4 and cfg.critic.enable is True
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.use_critic


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temperatur'; did you mean rollout.temperature"):
        apply_overrides(RunConfig(), ["rollout.temperatur=0.5"])


def test_wrong_type_names_field_expected_and_found():
    with pytest.raises(ConfigError, match=r"rollout.n: expected int, found 'four'"):
        apply_overrides(RunConfig(), ["rollout.n=four"])
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_overrides(RunConfig(), ["rollout.n"])


def test_validate_catches_inconsistent_settings():
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size \(5\) must divide data.train_batch_size \(256\)"):
        apply_overrides(RunConfig(), ["actor.ppo_mini_batch_size=5"]).validate()
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator: expected a registered name \(.*gae, .*grpo, .*\); "
                                          r"found 'ppo2'"):
        apply_overrides(RunConfig(), ["algorithm.adv_estimator=ppo2"]).validate()
    with pytest.raises(ConfigError, match="needs rollout.n >= 2"):
        apply_overrides(RunConfig(), ["rollout.n=1"]).validate()


def test_bypass_mode_needs_log_probs_of_the_distribution_trained():
    """The engine's log-probs stand for the policy's only under the plain softmax: top-p
    truncates it (either engine), and vLLM reports raw log-probs (before temperature)."""
    bypass = "algorithm.rollout_correction.bypass_mode"
    with pytest.raises(ConfigError, match=rf"^{bypass}: expected false .* found true with rollout.top_p=0.9"):
        apply_overrides(RunConfig(), ["rollout.top_p=0.9"]).validate()
    with pytest.raises(ConfigError, match=rf"^{bypass}: expected false .*temperature 1.* rollout.temperature=0.7"):
        apply_overrides(RunConfig(), ["rollout.name=vllm", "rollout.temperature=0.7"]).validate()
    # HF scores with the temperature the update divides by; recomputing, or on-policy, needs nothing
    assert apply_overrides(RunConfig(), ["rollout.temperature=0.7"]).validate().old_log_prob_column == "rollout_log_probs"
    assert apply_overrides(RunConfig(), ["rollout.top_p=0.9", f"{bypass}=false"]).validate().old_log_prob_column \
        == "old_log_probs"
    on_policy = apply_overrides(RunConfig(), ["rollout.top_p=0.9", "actor.ppo_mini_batch_size=256"]).validate()
    assert on_policy.old_log_prob_column is None


def test_each_config_choice_lives_once_and_is_checked_there():
    """Strategies, engines and reward names are declared in config and validated there;
    registry-backed fields take their valid names (and their help) from the registry."""
    import dataclasses

    from rlhf_core import algorithms
    from rlhf_core.config import NAMED_REWARDS, STRATEGIES, ActorConfig, AlgorithmConfig, field_help
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import reward

    assert not hasattr(sharding, "STRATEGIES") and reward.NAMED_REWARDS is NAMED_REWARDS
    with pytest.raises(ConfigError, match=r"reward.function: expected module:function or one of verl, builtin, gsm8k; "
                                          r"found 'gsm9k'"):
        apply_overrides(RunConfig(), ["reward.function=gsm9k"]).validate()
    apply_overrides(RunConfig(), ["reward.function=my_pkg.rewards:score"]).validate()  # checked, not imported
    with pytest.raises(ConfigError, match=r"actor.strategy: expected one of fsdp, ddp; found 'zero3'"):
        apply_overrides(RunConfig(), ["actor.strategy=zero3"]).validate()
    assert STRATEGIES == ("fsdp", "ddp")
    fields = {f.name: f for f in dataclasses.fields(AlgorithmConfig) + dataclasses.fields(ActorConfig)}

    @algorithms.register_adv_est("test_only_estimator")
    def _estimator(**kwargs):
        raise NotImplementedError

    try:
        assert "test_only_estimator" in field_help(fields["adv_estimator"])  # help follows the registry
        apply_overrides(RunConfig(), ["algorithm.adv_estimator=test_only_estimator"]).validate()
    finally:
        algorithms.ADV_ESTIMATORS.pop("test_only_estimator")
        algorithms.ADV_ESTIMATOR_SPECS.pop("test_only_estimator", None)
    assert all(name in field_help(fields["kl_loss_type"]) for name in algorithms.KL_ESTIMATORS)
    assert "seq-mean-token-sum" in field_help(fields["loss_agg_mode"])


def test_field_classes_are_field_metadata():
    """What config_hash leaves out and what a replay may not change are marked on the fields."""
    from rlhf_core.config import fields_where
    from rlhf_core.trainer.replay import CHECKPOINT_FIELDS

    unhashed = fields_where(lambda meta: not meta["hashed"])
    assert {"trainer.progress", "trainer.checkpoint_every", "resources.nnodes"} <= set(unhashed)
    base = RunConfig().config_hash()
    for path in unhashed:
        value = RunConfig()
        for part in path.split("."):  # sections nest (rollout.val_kwargs.n)
            value = getattr(value, part)
        changed = not value if isinstance(value, bool) else (value + 1 if isinstance(value, (int, float)) else "x")
        if value is None:  # an optional switch (rollout.enforce_eager: None means "the device's default")
            changed = True
        assert apply_overrides(RunConfig(), [f"{path}={changed}"]).config_hash() == base, path
    assert "resources" not in {p.split(".")[0] for p in fields_where(lambda meta: meta["hashed"])}
    assert set(CHECKPOINT_FIELDS) == {"model.path", "model.dtype", "actor.world_size", "critic.enable",
                                      "algorithm.adv_estimator", "model.lora_rank", "model.lora_alpha",
                                      "model.target_modules", "model.exclude_modules", "model.lora_adapter_path",
                                      "critic.lora_rank", "critic.lora_alpha", "critic.target_modules",
                                      "critic.exclude_modules", "critic.model_path"}
    assert apply_overrides(RunConfig(), ["actor.lr=0.1"]).config_hash() != base


def test_config_hash_changes_with_any_field_and_dict_roundtrip():
    a, b = RunConfig(), apply_overrides(RunConfig(), ["actor.clip_ratio_high=0.3"])
    assert a.config_hash() != b.config_hash()
    assert config_from_dict(b.to_dict()).config_hash() == b.config_hash()


# ------------------------------------------------------------------ reward function errors


def _returns_text(data_source, solution_str, ground_truth, extra_info):
    return "great"


def score_rows(fn, name, data_sources, solutions, ground_truths, extra_infos, uids):
    """verl's naive manager over rows of one-token responses."""
    return naive(fn, name, ScoringRows(data_sources, solutions, ground_truths, extra_infos, uids, [1] * len(uids)),
                 None)


def test_reward_function_that_raises_names_function_and_uid():
    with pytest.raises(RewardFunctionError, match=r"reward function t:f raised on uid '0-7' \(row 1\): ZeroDivisionError: oops"):
        score_rows(_raises_on_second(), "t:f", ["d", "d"], ["1", "2"], ["1", "2"],
                   [{}, {}], ["0-3", "0-7"])


def _raises_on_second():
    calls = []

    def fn(*args):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("oops")
        return 1.0

    return fn


def test_reward_function_returning_non_number_is_refused():
    with pytest.raises(RewardFunctionError, match=r"returned 'great' \(str\) for uid 'u1'; expected a finite number"):
        score_rows(_returns_text, "m:f", ["d"], ["x"], ["x"], [{}], ["u1"])
    with pytest.raises(RewardFunctionError, match="returned a dict without 'score'"):
        score_rows(lambda *a: {"acc": 1}, "m:f", ["d"], ["x"], ["x"], [{}], ["u1"])
    with pytest.raises(RewardFunctionError, match="returned nan"):
        score_rows(lambda *a: float("nan"), "m:f", ["d"], ["x"], ["x"], [{}], ["u1"])


def test_reward_dict_extras_and_loader_errors():
    scores, extras = score_rows(lambda *a: {"score": 0.5, "acc": 1.0}, "m:f", ["d", "d"], ["a", "b"],
                                ["a", "b"], [{}, {}], ["u0", "u1"])
    assert scores == [0.5, 0.5] and extras == {"acc": [1.0, 1.0]}
    with pytest.raises(ValueError, match="reward.function: expected module:function or one of \\['builtin', 'gsm8k', 'verl'\\]; found 'not_a_spec'"):
        load_reward_fn("not_a_spec")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_reward_fn("json:nope")


# ------------------------------------------------------------------ datasets


class _Tok:
    bos_token_id, pad_token_id = 1, 0

    def encode(self, text):
        return [ord(c) % 50 + 3 for c in text]


def test_empty_dataset_and_missing_columns(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="the dataset is empty"):
        load_rows(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0 lacks column\(s\) \['data_source'\]; required: \['prompt', "
                                           r"'data_source'\] and ground_truth \(or verl's reward_model.ground_truth\)"):
        load_rows(str(bad))
    bad.write_text(json.dumps({"prompt": "x", "data_source": "d"}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0 lacks ground_truth \(ours\) or reward_model.ground_truth"):
        load_rows(str(bad))


def test_prompt_longer_than_context_is_refused():
    rows = [{"prompt": "x" * 40, "ground_truth": "y", "data_source": "t"}]
    with pytest.raises(DatasetError, match="prompt of row 0 has 41 tokens, more than data.max_prompt_length=16"):
        PromptLoader(rows, _Tok(), batch_size=1, max_prompt_length=16, seed=0)


def test_loader_left_pads_keeps_uids_and_cursor(tmp_path):
    rows = [{"prompt": "ab" * (i + 1), "ground_truth": str(i), "data_source": "t"} for i in range(5)]
    loader = PromptLoader(rows, _Tok(), batch_size=2, max_prompt_length=12, seed=3, shuffle=False)
    first = loader.next_batch()
    assert first.non_tensor_batch["uid"].tolist() == ["0-0", "0-1"]
    assert first.batch["attention_mask"][0].tolist() == [0] * 9 + [1] * 3
    loader.next_batch()
    third = loader.next_batch()  # 4, then rolls over into epoch 1
    assert third.non_tensor_batch["uid"].tolist() == ["0-4", "1-0"]
    assert loader.cursor.to_dict() == {"epoch": 1, "position": 1}
    # a second reader of the same prompts (the asynchronous rollouter's) moves on its own
    from rlhf_core.data.dataset import Cursor

    reader = loader.at(Cursor(0, 2))
    assert reader.next_batch().non_tensor_batch["uid"].tolist() == ["0-2", "0-3"]
    assert reader.cursor.to_dict() == {"epoch": 0, "position": 4} and loader.cursor.to_dict() == {"epoch": 1,
                                                                                                   "position": 1}
    assert loader.next_batch().non_tensor_batch["uid"].tolist() == ["1-1", "1-2"]


def test_prompt_tokenizer_matches_transformers(tmp_path):
    """The controller's transformers-free tokenizer gives the ids AutoTokenizer gives."""
    from transformers import AutoTokenizer

    from rlhf_core.models.builtin import build_tokenizer
    from rlhf_core.data.tokenizer import PromptTokenizer

    path = str(tmp_path / "tokenizer")  # the built-in model's tokenizer, as its folder holds it
    build_tokenizer(path)
    fast, hf = PromptTokenizer(path), AutoTokenizer.from_pretrained(path)
    assert fast._hf is None  # the tokenizers-only path is the one under test
    assert (fast.bos_token_id, fast.pad_token_id) == (hf.bos_token_id, hf.pad_token_id)
    for row in load_rows("builtin:digits")[:200]:
        assert fast.encode(row["prompt"]) == hf(row["prompt"], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("direct", [True, False])
def test_a_prompt_too_long_is_refused_before_any_worker_is_placed_or_pipeline_started(tmp_path, monkeypatch, direct):
    """verl's data.truncation=error, checked by `rlhf run` before it starts Ray, places a
    worker group or starts a pipeline run (it used to come after the workers' start)."""
    from rlhf_core import cli
    from rlhf_core.trainer import run as run_module
    from rlhf_core.workers.worker_set import WorkerSet

    def never(*args, **kwargs):
        raise AssertionError("placed or started before the inputs were checked")

    monkeypatch.setattr(WorkerSet, "build", classmethod(never))
    monkeypatch.setattr(run_module, "start_local_ray", never)
    monkeypatch.setitem(cli.RUN_MODES, "pipeline", never)
    store = tmp_path / "store"
    with pytest.raises(SystemExit, match=r"^rlhf: prompt of row \d+ has 6 tokens, more than "
                                         r"data.max_prompt_length=3; raise the limit, shorten the prompt or set "
                                         r"data.truncation=left\|right"):
        cli.main(["run", *(["--direct"] if direct else []), "--iterations", "1", "--run-id", "long",
                  "--store", f"file://{store}", "data.max_prompt_length=3", "trainer.progress=false",
                  f"trainer.output_dir={tmp_path / 'out'}"])
    assert not (store / "long").exists()


def test_a_model_vllms_cpu_attention_cannot_serve_is_refused_from_its_config(tmp_path):
    from transformers import Qwen2Config

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.trainer.preflight import PreflightError, check_rollout_model

    Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                num_hidden_layers=1, vocab_size=32).save_pretrained(tmp_path)  # head_dim 16, no weights
    cfg = apply_overrides(RunConfig(), [f"model.path={tmp_path}", "rollout.name=vllm"])
    with pytest.raises(PreflightError, match=r"^rollout.name=vllm: vLLM's CPU attention needs a head_dim of at "
                                             r"least 32; found 16 in model.path "):
        check_rollout_model(cfg)
    check_rollout_model(apply_overrides(cfg, ["rollout.name=hf"]))  # transformers' generate serves it
    check_rollout_model(apply_overrides(cfg, ["resources.gpus_per_node=1"]))  # and vLLM on a GPU


def test_verls_prompt_key_and_reward_fn_key_name_the_columns_read(tmp_path):
    import json as _json

    from rlhf_core.data.dataset import DatasetError, load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(_json.dumps({"question": [{"role": "user", "content": "2+2?"}], "source": "math",
                                 "reward_model": {"ground_truth": "4"}}) + "\n")
    (row,) = load_rows(str(path), prompt_key="question", source_key="source")
    assert row["prompt"] == [{"role": "user", "content": "2+2?"}] and row["data_source"] == "math"
    with pytest.raises(DatasetError, match=r"row 0 lacks column\(s\) \['prompt', 'data_source'\]; required: "
                                           r"\['prompt', 'data_source'\] and ground_truth"):
        load_rows(str(path))
    with pytest.raises(DatasetError, match=r"lacks column\(s\) \['query'\]; required: \['query', 'source'\] "
                                           r"\(data.prompt_key, data.reward_fn_key\)"):
        load_rows(str(path), prompt_key="query", source_key="source")


def test_a_trained_model_in_16_bits_is_refused_unless_asked_for():
    """AdamW stepping bf16 weights rounds an update of lr 1e-6 on a weight of 0.02 away
    (half a bf16 step there is ~6e-5): fp32 master weights, bf16 compute. LoRA trains its
    adapters in fp32 over a 16-bit base, so the base may be bf16."""
    import torch

    from rlhf_core.config import ConfigError, RunConfig, apply_overrides

    weight = torch.tensor([0.02], dtype=torch.bfloat16)
    assert torch.equal(weight - 1e-6, weight)  # the update rounds away
    with pytest.raises(ConfigError, match=r"^model.dtype: expected float32 for trained weights .* found bfloat16 "
                                          r"\(model.train_in_16bit=true trains them anyway\)$"):
        apply_overrides(RunConfig(), ["model.dtype=bfloat16"]).validate()
    apply_overrides(RunConfig(), ["model.dtype=bfloat16", "model.train_in_16bit=true"]).validate()
    apply_overrides(RunConfig(), ["model.dtype=bfloat16", "model.lora_rank=8"]).validate()
    import yaml

    shipped = yaml.safe_load(open("manifests/configs/gpu.yaml"))  # the GPU example trains fp32 master weights
    assert shipped["model"]["dtype"] == "float32" and "train_in_16bit" not in shipped["model"]
