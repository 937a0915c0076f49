"""The critic's own starting model (verl's ``critic.model.path``): a causal LM gets a zero
value head; a reward model (a one-label sequence classifier) starts the value head from
its score head, as OpenRLHF and InstructGPT initialise the critic."""

import pytest
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.testing.model_folders import build_model_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("critic")
    policy = build_model_folder(root / "policy")
    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    with torch.no_grad():
        reward_model.score.weight.normal_()  # a head that is not zero, to tell it from a fresh one
    reward_model.config.pad_token_id = reward_model.config.eos_token_id
    reward_model.save_pretrained(root / "rm")
    return {"policy": str(policy), "rm": str(root / "rm"), "rm_model": reward_model}


def test_a_reward_model_starts_the_critic_with_its_backbone_and_score_head(folders):
    from rlhf_core.workers.modeling import ValueModel, is_sequence_classifier

    assert is_sequence_classifier(folders["rm"]) and not is_sequence_classifier(folders["policy"])
    value_model = ValueModel(folders["rm"]).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask, positions = torch.ones_like(ids), torch.arange(6).unsqueeze(0)
    with torch.no_grad():
        expected = folders["rm_model"].eval().score(folders["rm_model"].model(input_ids=ids).last_hidden_state)
        values = value_model(ids, mask, positions)
    assert torch.allclose(values, expected.squeeze(-1), atol=1e-5)  # every position: the reward model's score there
    assert float(value_model.value_head.bias) == 0.0
    fresh = ValueModel(folders["policy"])
    assert float(fresh.value_head.weight.abs().sum()) == 0.0  # a causal LM: a zero head, as before


def test_a_critic_model_of_another_vocabulary_is_refused_before_placement(folders, tmp_path):
    from transformers import Qwen2Config

    from rlhf_core.trainer.preflight import PreflightError, check_critic_model

    Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                num_hidden_layers=1, vocab_size=77).save_pretrained(tmp_path / "other")
    cfg = apply_overrides(RunConfig(), [f"model.path={folders['policy']}", "algorithm.adv_estimator=gae",
                                        f"critic.model.path={tmp_path / 'other'}"], notes=[])
    assert cfg.critic.model_path == str(tmp_path / "other")  # verl's key
    with pytest.raises(PreflightError, match=r"^critic.model_path: expected a model of the policy's vocabulary "
                                             r"\(vocab_size \d+, .*\); found vocab_size 77 in "):
        check_critic_model(cfg)
    check_critic_model(apply_overrides(cfg, [f"critic.model_path={folders['rm']}"]))  # the same vocabulary
    check_critic_model(apply_overrides(cfg, ["algorithm.adv_estimator=grpo"]))  # no critic: nothing to check


def test_the_critics_model_enters_the_config_hash():
    base = RunConfig()
    assert apply_overrides(RunConfig(), ["critic.model_path=/m/rm"]).config_hash() != base.config_hash()
