"""The micro-batch memory check (``config.micro_batch_memory``): what a micro-batch's
logits and activations ask of a GPU, refused in one line beyond half its memory, at
``validate()`` when the model folder is readable and on the workers once it is loaded;
the shipped GPU configs fit a 7B model on 80 GB GPUs."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from components.kuberay.spec import load_deployment
from rlhf_core.config import (LOGIT_BUDGET_BYTES, ConfigError, ModelShape, RunConfig, apply_overrides,
                              micro_batch_memory)
from rlhf_core.workers import modeling

ROOT = Path(__file__).resolve().parent.parent
#: Qwen2.5-7B-Instruct's sizes (its config.json)
QWEN_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28}
CONFIGS = ["gpu.yaml", "qwen2.5-7b-2x8.yaml"]
GIB = 2**30


@pytest.fixture
def qwen_7b_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN_7B}))
    return tmp_path


@pytest.mark.parametrize("name", CONFIGS)
def test_the_shipped_gpu_configs_fit_a_7b_model_on_80_gb(name, qwen_7b_folder):
    cfg, _ = load_deployment(ROOT / "manifests" / "configs" / name, [f"model.path={qwen_7b_folder}"])
    assert cfg.resources.gpu_memory_gib == 80
    estimates = micro_batch_memory(cfg, ModelShape(**QWEN_7B))
    assert {path.split(".")[0] for path, _, _ in estimates} == {"actor"}
    assert all(0 < need <= 40 * GIB for _, _, need in estimates), estimates


def test_a_gpu_config_with_whole_mini_batches_is_refused_naming_the_field(qwen_7b_folder):
    """What gpu.yaml was: no micro-batch size, so all 32 x 8 / 8 rows of a mini-batch at once."""
    undo = [f"model.path={qwen_7b_folder}", "actor.use_dynamic_bsz=false", "actor.log_prob_use_dynamic_bsz=false",
            "model.enable_gradient_checkpointing=false"]
    with pytest.raises(ConfigError, match=r"^actor.ppo_micro_batch_size_per_gpu: expected a micro-batch whose "
                                          r"logits and activations fit in 50% of a GPU's 80 GiB \(40.0 GiB\); "
                                          r"found ~\d+\.\d GiB for 32 rows x 2048 tokens \(vocabulary 152064, "
                                          r"hidden 3584, 28 layers\): lower it, or set "
                                          r"model.enable_gradient_checkpointing$"):
        load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml", undo)
    # with update micro-batches of 2 rows, the log-prob pass over all 256 rows is next
    with pytest.raises(ConfigError, match=r"^actor.log_prob_micro_batch_size_per_gpu: .* for 256 rows x 2048 "
                                          r"tokens .*: lower it$"):
        load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml", undo + ["actor.ppo_micro_batch_size_per_gpu=2"])
    # the same config where the folder cannot be read here (a volume of the cluster): the workers check
    cfg, _ = load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml", undo[1:])
    assert cfg.model.path == "/models/Qwen2.5-7B-Instruct"


def test_the_estimate_counts_sliced_logits_and_gradient_checkpointing():
    shape = ModelShape(**QWEN_7B)
    cfg = apply_overrides(RunConfig(), ["resources.gpus_per_node=8", "actor.world_size=8",
                                        "data.max_prompt_length=512", "rollout.response_length=512",
                                        "actor.ppo_micro_batch_size_per_gpu=1", "actor.use_kl_loss=true"])
    (update_path, held, one_row), (log_prob_path, _, _) = micro_batch_memory(cfg, shape)
    assert (update_path, held) == ("actor.ppo_micro_batch_size_per_gpu", "1 rows x 1024 tokens")
    assert log_prob_path == "actor.log_prob_micro_batch_size_per_gpu"
    per_layer = 6 * 3584 + 4 * 18944
    # 1,024 tokens x 152,064 words of fp32 exceed the budget: three budgets of slices, not the full logits
    assert one_row == 3 * LOGIT_BUDGET_BYTES + 1024 * 28 * per_layer * 2
    cfg.actor.ppo_micro_batch_size_per_gpu = 4
    four_rows = micro_batch_memory(cfg, shape)[0][2]
    assert four_rows - 3 * LOGIT_BUDGET_BYTES == 4 * (one_row - 3 * LOGIT_BUDGET_BYTES)  # logits stay sliced
    cfg.model.enable_gradient_checkpointing = True
    assert micro_batch_memory(cfg, shape)[0][2] == 3 * LOGIT_BUDGET_BYTES + 4096 * (28 * 3584 + per_layer) * 2
    # a vocabulary whose logits fit the budget: the full pass, counted whole
    small = ModelShape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    assert micro_batch_memory(cfg, small)[0][2] == 4096 * 1000 * (2 + 12) + 4096 * (2 * 64 + 6 * 64 + 4 * 128) * 2
    # the critic's passes when there is one, sized by its own fields
    cfg = apply_overrides(cfg, ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2"])
    assert [p for p, _, _ in micro_batch_memory(cfg, shape)][2:] == ["critic.ppo_micro_batch_size_per_gpu",
                                                                     "critic.forward_micro_batch_size_per_gpu"]


def test_the_workers_check_with_the_loaded_models_shape_and_the_devices_memory():
    """On GPU ranks the loaded model's shape is checked against the declared memory, else
    the device's own (given here: this machine has no GPU); CPU ranks check nothing."""
    hf_config = SimpleNamespace(**QWEN_7B)
    big = apply_overrides(RunConfig(), ["resources.gpus_per_node=8", "actor.world_size=8", "actor.use_kl_loss=true",
                                        "data.max_prompt_length=1024", "rollout.response_length=1024",
                                        "actor.ppo_micro_batch_size_per_gpu=2",
                                        "actor.log_prob_micro_batch_size_per_gpu=4"])
    modeling.check_micro_batch_memory(big, hf_config, device_bytes=80 * GIB)
    with pytest.raises(ConfigError, match=r"^actor.ppo_micro_batch_size_per_gpu: .* of a GPU's 24 GiB "):
        modeling.check_micro_batch_memory(big, hf_config, device_bytes=24 * GIB)
    big.resources.gpu_memory_gib = 80  # declared wins over the device
    modeling.check_micro_batch_memory(big, hf_config, device_bytes=24 * GIB)
    cpu = apply_overrides(RunConfig(), ["data.max_prompt_length=1024", "rollout.response_length=1024"])
    modeling.check_micro_batch_memory(cpu, hf_config, device_bytes=1)  # nothing to check on CPU


@pytest.mark.parametrize("content", ['{"vocab_size": "many"}', "not json", '{"hidden_size": 64}'])
def test_a_folder_whose_config_says_no_sizes_is_left_to_the_workers(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    assert ModelShape.from_folder(str(tmp_path)) is None
    assert ModelShape.from_folder("s3://bucket/model") is None and ModelShape.from_folder("builtin:digits") is None


def test_verls_qwen2_7b_script_fits_80_gb_and_not_24(qwen_7b_folder):
    """verl's run_qwen2-7b.sh (40 rows a micro-batch, gradient checkpointing) as written,
    on H100s (80 GB) and on GPUs of 24 GB."""
    from tests.test_verl_keys import QWEN2_7B

    script = [a for a in QWEN2_7B if not a.startswith("actor_rollout_ref.model.path=")]
    ours = [f"model.path={qwen_7b_folder}", "resources.gpu_memory_gib=80"]
    apply_overrides(RunConfig(), script + ours, notes=[]).validate()
    with pytest.raises(ConfigError, match=r"^actor.ppo_micro_batch_size_per_gpu: .* for 40 rows x 1536 tokens "):
        apply_overrides(RunConfig(), script + ours + ["resources.gpu_memory_gib=24"], notes=[]).validate()


def test_a_7b_reward_model_is_bounded_by_default_and_its_row_count_refused_beyond_memory(qwen_7b_folder, tmp_path):
    """[6/7] item 3: gpu.yaml with a 7B reward model: by default its forwards hold at most
    forward_max_token_len_per_gpu tokens (estimated, and within half of 80 GB); a row count
    too large for the GPU is refused naming the reward model's field."""
    rm_folder = tmp_path / "rm"
    rm_folder.mkdir()
    (rm_folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **QWEN_7B}))
    enable = [f"model.path={qwen_7b_folder}", "reward_model.enable=true", f"reward_model.model.path={rm_folder}"]
    cfg, _ = load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml", enable)
    [(path, held, need)] = [p for p in micro_batch_memory(cfg, ModelShape(**QWEN_7B), ModelShape(**QWEN_7B))
                            if p[0].startswith("reward_model.")]
    per_layer = 6 * 3584 + 4 * 18944
    assert (path, held) == ("reward_model.forward_max_token_len_per_gpu", "32768 tokens")
    assert need == 32768 * (per_layer + 3584) * 2 < 40 * GIB
    with pytest.raises(ConfigError, match=r"^reward_model.micro_batch_size_per_gpu: expected a micro-batch whose "
                                          r"logits and activations fit in 50% of a GPU's 80 GiB \(40.0 GiB\); found "
                                          r"~\d+\.\d GiB for 256 rows x 2048 tokens \(vocabulary 152064, hidden 3584, "
                                          r"28 layers\): lower it$"):
        load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml",
                        enable + ["reward_model.micro_batch_size_per_gpu=256"])
    # served by the reward loop (vLLM's own batching): no forward here to estimate
    served = load_deployment(ROOT / "manifests" / "configs" / "gpu.yaml",
                             enable + ["reward_model.micro_batch_size_per_gpu=256", "reward_model.use_reward_loop=true"])
    assert served[0].reward_model.use_reward_loop


def test_the_reward_model_worker_checks_its_loaded_models_shape():
    cfg = apply_overrides(RunConfig(), ["resources.gpus_per_node=8", "actor.world_size=8", "reward_model.enable=true",
                                        "reward_model.model.path=/models/rm", "reward_model.micro_batch_size_per_gpu=256",
                                        "data.max_prompt_length=1024", "rollout.response_length=1024"])
    rm_config = SimpleNamespace(**QWEN_7B)
    modeling.check_micro_batch_memory(cfg, None, device_bytes=2000 * GIB, reward_model_config=rm_config)
    with pytest.raises(ConfigError, match=r"^reward_model.micro_batch_size_per_gpu: .* for 256 rows x 2048 tokens"):
        modeling.check_micro_batch_memory(cfg, None, device_bytes=80 * GIB, reward_model_config=rm_config)
