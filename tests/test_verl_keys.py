"""verl's keys, config files and run semantics (issue 27): a verl run script's argument
list runs here with its entry point changed and nothing else."""

from __future__ import annotations

import json
import re
import types

import pytest

from rlhf_core.config import ConfigError, RunConfig, apply_overrides, load_config
from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet
from rlhf_core.verl_keys import NEVER

#: verl's examples/grpo_trainer/run_qwen2-7b.sh, its arguments as written there.
QWEN2_7B = [
    "algorithm.adv_estimator=grpo", "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.train_batch_size=1024", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]', "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
]
#: What many verl scripts add: a reward function from the team's own file.
CUSTOM_REWARD = ["custom_reward_function.path=$HOME/rewards/gsm8k_reward.py", "custom_reward_function.name=score"]
REWARD_FILE = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    # a reward verl's way: one float per response (here: half credit for any answer)
    return 0.5
"""


def test_the_qwen2_7b_script_maps_to_our_fields_with_verls_meaning():
    notes: list[str] = []
    cfg = apply_overrides(RunConfig(), QWEN2_7B, notes=notes)
    assert (cfg.model.path, cfg.actor.lr, cfg.actor.ppo_mini_batch_size) == ("Qwen/Qwen2-7B-Instruct", 1e-6, 256)
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 40 and cfg.actor.log_prob_micro_batch_size_per_gpu == 40
    assert (cfg.rollout.n, cfg.rollout.name, cfg.rollout.response_length) == (5, "vllm", 1024)
    assert cfg.actor.fsdp_config.ref_param_offload is True and cfg.actor.fsdp_config.param_offload is False
    assert (cfg.resources.gpus_per_node, cfg.resources.nnodes, cfg.actor.world_size) == (8, 1, 8)
    assert (cfg.trainer.checkpoint_every, cfg.trainer.total_epochs, cfg.trainer.critic_warmup) == (20, 15, 0)
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == ("verl_grpo_example_gsm8k",
                                                                       "qwen2_7b_function_rm")
    assert cfg.data.filter_overlong_prompts is True and cfg.model.enable_gradient_checkpointing is True
    assert (cfg.data.val_files, cfg.trainer.test_freq) == ("$HOME/data/gsm8k/test.parquet", 5)
    cfg.validate()
    assert cfg.trainer.logger == "console,wandb"  # honoured: W&B (offline without a key) beside the console
    assert cfg.model.use_remove_padding is True and cfg.critic_remove_padding is True


def test_gpus_per_node_times_nodes_is_the_world_size_in_either_order():
    for items in (["trainer.nnodes=2", "trainer.n_gpus_per_node=4"], ["trainer.n_gpus_per_node=4", "trainer.nnodes=2"]):
        cfg = apply_overrides(RunConfig(), items, notes=[])
        assert (cfg.resources.nnodes, cfg.resources.gpus_per_node, cfg.actor.world_size) == (2, 4, 8)


def test_save_freq_minus_one_checkpoints_only_at_the_end_and_kl_is_k1():
    cfg = apply_overrides(RunConfig(), ["trainer.save_freq=-1", "algorithm.kl_penalty=kl",
                                        "actor_rollout_ref.actor.clip_ratio=0.1"], notes=[])
    assert cfg.trainer.checkpoint_every == NEVER and cfg.algorithm.kl_penalty == "k1"
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.1, 0.1)


@pytest.mark.parametrize("item, message", [
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4", "verl key "
     "'actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space': no counterpart here (`rlhf config --verl` lists"),
    ("reward_model.launch_reward_fn_async=True", "verl key 'reward_model.launch_reward_fn_async'=True: no "
     "asynchronous reward function here"),
    ("trainer.val_only=True", "verl key 'trainer.val_only'=True: no validation-only runs here"),
    ("trainer.bogus=1", "unknown config key 'trainer.bogus'"),
])
def test_a_refused_verl_key_is_one_line_naming_it(item, message):
    with pytest.raises(ConfigError) as refused:
        apply_overrides(RunConfig(), [item], notes=[])
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert "verl" in str(refused.value)


def test_verls_enforce_eager_sets_the_engines():
    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.rollout.enforce_eager=True"], notes=[])
    assert cfg.rollout.enforce_eager is True and RunConfig().rollout.enforce_eager is None


def test_verl_fields_hash_only_what_they_train():
    for item in ("trainer.critic_warmup=2", "data.filter_overlong_prompts=true"):
        assert apply_overrides(RunConfig(), [item]).config_hash() != RunConfig().config_hash()
    for item in ("trainer.total_epochs=3", "trainer.project_name=p", "trainer.experiment_name=e"):
        assert apply_overrides(RunConfig(), [item]).config_hash() == RunConfig().config_hash()


def test_a_verl_yaml_file_then_overrides_with_provenance(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 16\n  max_response_length: 12\n"
                    "actor_rollout_ref:\n  actor:\n    optim: {lr: 2.0e-5}\n  rollout: {n: 4}\n"
                    "trainer:\n  logger: [console]\n  total_training_steps: null\n")
    cfg, provenance = load_config(str(path), ["rollout.n=2", "actor.ppo_mini_batch_size=8"], notes=[])
    assert (cfg.data.train_batch_size, cfg.rollout.response_length, cfg.actor.lr, cfg.rollout.n) == (16, 12, 2e-5, 2)
    assert provenance["data.train_batch_size"] == f"file:{path}"
    assert provenance["rollout.response_length"] == f"file:{path} verl:data.max_response_length"
    assert provenance["rollout.n"] == "override" and provenance["trainer.total_iterations"] == "default"
    assert load_config(None, ["actor_rollout_ref.rollout.n=3"], notes=[])[1]["rollout.n"] == "verl:actor_rollout_ref.rollout.n"


class _Tok:
    bos_token_id, pad_token_id = 1, 0

    def encode(self, text):
        return [ord(c) % 50 + 3 for c in text]


def test_filter_overlong_prompts_drops_them_before_batching():
    from rlhf_core.data.dataset import DatasetError, PromptLoader

    rows = [{"prompt": "x" * n, "ground_truth": "1", "data_source": "d"} for n in (3, 20, 5, 30, 7)]
    loader = PromptLoader(rows, _Tok(), batch_size=2, max_prompt_length=9, seed=0, filter_overlong=True)
    assert [len(r["prompt"]) for r in loader.rows] == [3, 5, 7] and loader.iterations_per_epoch == 1
    with pytest.raises(DatasetError, match="prompt of row 1 has 21 tokens"):
        PromptLoader(rows, _Tok(), batch_size=2, max_prompt_length=9, seed=0)
    with pytest.raises(DatasetError, match=r"exceeds the dataset size \(3 after data.filter_overlong_prompts\)"):
        PromptLoader(rows, _Tok(), batch_size=4, max_prompt_length=9, seed=0, filter_overlong=True)


def test_critic_warmup_skips_the_actor_update_while_verls_step_is_below_it():
    from rlhf_core.protocol import DataProto
    from rlhf_core.trainer.ppo import PPOTrainer

    calls = []
    fake = types.SimpleNamespace(config=apply_overrides(RunConfig(), ["trainer.critic_warmup=3"]),
                                 _stage_metrics=lambda batch, metrics: calls.append(("metrics", metrics)) or batch)
    fake.actor = types.SimpleNamespace(update_actor=lambda batch: calls.append("update") or 1 / 0)
    for step in (0, 1):  # verl's steps 1 and 2
        batch = DataProto.from_dict(tensors={}, meta_info={"global_step": step})
        assert PPOTrainer.update_actor(fake, batch) is batch
    assert calls == [("metrics", {}), ("metrics", {})]
    with pytest.raises(Exception):  # verl's step 3: the actor updates (the fake has no batch for it)
        PPOTrainer.update_actor(fake, DataProto.from_dict(tensors={}, meta_info={"global_step": 2}))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("qwen2-tiny"))


def test_total_epochs_counts_whole_batches_of_the_filtered_set(tiny_model, tmp_path):
    from rlhf_core.trainer.loaders import total_iterations

    data = write_verl_parquet(tmp_path / "train.parquet", count=20)
    base = [f"model.path={tiny_model}", f"data.train_files={data}", "data.max_prompt_length=64"]
    cfg = apply_overrides(RunConfig(), base + ["data.train_batch_size=6", "trainer.total_epochs=3"], notes=[])
    assert total_iterations(cfg) == 3 * (20 // 6)
    assert total_iterations(apply_overrides(RunConfig(), ["trainer.total_iterations=7"])) == 7


def test_the_qwen2_7b_script_scaled_down_runs_through_rlhf_run_direct(tiny_model, tmp_path, capsys, ray_local):
    """The script's keys, every one, plus a custom reward file, values scaled to a tiny
    model on CPU, n_gpus_per_node left out: verl's meaning of total_epochs (2 epochs of
    floor(10 / 4) = 4 iterations), validation before training and every test_freq
    iterations under verl's metric names, every score from the reward file."""
    from rlhf_core.cli import main

    data = write_verl_parquet(tmp_path / "train.parquet", count=10)
    test = write_verl_parquet(tmp_path / "test.parquet", count=4)
    reward = tmp_path / "gsm8k_reward.py"
    reward.write_text(REWARD_FILE)
    scaled = {"data.train_files": str(data), "data.val_files": str(test), "trainer.test_freq": "2",
              "custom_reward_function.path": str(reward),
              "data.train_batch_size": "4", "data.max_prompt_length": "64",
              "data.max_response_length": "4", "actor_rollout_ref.model.path": str(tiny_model),
              "actor_rollout_ref.actor.ppo_mini_batch_size": "2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.tensor_model_parallel_size": "1", "actor_rollout_ref.rollout.name": "hf",
              "actor_rollout_ref.rollout.n": "2", "trainer.save_freq": "1", "trainer.total_epochs": "2"}
    argv = []
    for item in QWEN2_7B + CUSTOM_REWARD:
        key = item.split("=", 1)[0]
        if key in ("trainer.n_gpus_per_node",):
            continue
        argv.append(f"{key}={scaled[key]}" if key in scaled else item)
    out = tmp_path / "out"
    assert main(["run", "--direct", "--run-id", "verl", "--store", f"file://{tmp_path / 'store'}", *argv,
                 f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    rows = [json.loads(line) for line in (out / "verl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * (10 // 4)
    assert all(r["critic/score/mean"] == 0.5 for r in rows)  # the file's reward scored every response
    val = "val-core/openai/gsm8k/reward/mean@1"
    assert [val in r for r in rows] == [True, False, True, False]  # before training, then every test_freq
    assert rows[0][val] == rows[2][val] == 0.5
    provenance = json.loads((out / "verl" / "provenance.json").read_text())
    assert provenance["rollout.response_length"] == "verl:data.max_response_length"
    assert provenance["trainer.total_iterations"] == provenance["trainer.total_epochs"] == "override"
    assert "[rlhf] wandb: offline" in capsys.readouterr().err
    assert list((out / "verl").glob("wandb/offline-run-*/run-rlhf-verl.wandb"))


def test_ulysses_sequence_parallelism_is_a_layout_noted_not_a_setting():
    """verl's Ulysses splits a sequence's heads over ranks: the same losses, so any size is
    taken with a note (the config is unchanged) and a non-number refused."""
    from rlhf_core.config import ConfigError

    for key in ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size"):
        for size in (1, 4):
            notes = []
            cfg = apply_overrides(RunConfig(), [f"{key}={size}"], notes=notes)
            assert cfg.to_dict() == RunConfig().to_dict() and any("no sequence parallelism" in n for n in notes)
        with pytest.raises((ConfigError, ValueError), match=f"{key}'=two: expected a positive integer"):
            apply_overrides(RunConfig(), [f"{key}=two"])


def test_an_empty_argument_from_a_broken_line_continuation_is_noted():
    notes = []
    cfg = apply_overrides(RunConfig(), ["algorithm.gamma=0.9", " "], notes=notes)
    assert cfg.algorithm.gamma == 0.9 and any("empty argument" in n for n in notes), notes


def test_the_table_in_docs_is_the_one_rlhf_config_verl_prints():
    """docs/verl.md shows the table as the code has it (regenerate the block from
    `rlhf config --verl` when a key changes)."""
    from pathlib import Path

    from rlhf_core.config import fields_where
    from rlhf_core.verl_keys import table_text

    doc = (Path(__file__).resolve().parents[1] / "docs" / "verl.md").read_text()
    block = doc.split("## The table", 1)[1].split("```", 2)[1].strip("\n")
    printed = table_text(set(fields_where(lambda meta: True)))
    assert block == printed.rstrip("\n"), "docs/verl.md's table is stale: paste `rlhf config --verl` there"


def test_top_k_is_verls_for_both_engines_and_off_means_off(tmp_path):
    """``rollout.top_k`` (verl's key): k keeps the k likeliest tokens; -1 and 0 are off, and
    off is said to transformers too (its generate keeps 50 by default)."""
    import torch

    from rlhf_core.config import RolloutConfig
    from rlhf_core.protocol import DataProto
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers import modeling
    from rlhf_core.rollout import top_k_setting
    from rlhf_core.rollout.engines.hf import HFEngine as HFRollout

    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.rollout.top_k=1",
                                        "actor_rollout_ref.rollout.val_kwargs.top_k=5"], notes=[])
    assert (cfg.rollout.top_k, cfg.rollout.val_kwargs.top_k) == (1, 5)
    assert top_k_setting(-1, off=-1) == top_k_setting(0, off=-1) == {"top_k": -1}  # vLLM's off
    assert top_k_setting(0, off=0) == {"top_k": 0} and top_k_setting(7, off=0) == {"top_k": 7}
    with pytest.raises(ConfigError, match="rollout.top_k"):
        apply_overrides(RunConfig(), ["rollout.top_k=-2"]).validate()
    with pytest.raises(ConfigError, match="bypass_mode: expected false .* rollout.top_k=4"):
        apply_overrides(RunConfig(), ["rollout.top_k=4",
                                      "algorithm.rollout_correction.bypass_mode=true"], notes=[]).validate()

    folder = str(build_model_folder(tmp_path / "tiny"))
    model, tokenizer = modeling.load_causal_lm(folder, "float32"), modeling.load_tokenizer(folder)
    ids = torch.tensor([[0, 0, 7, 8, 9], [0, 5, 6, 7, 8], [3, 4, 5, 6, 7], [0, 0, 17, 18, 19]])
    prompts = lambda: DataProto.from_dict({"input_ids": ids, "attention_mask": (ids != 0).long(),
                                           "sample_seed": torch.arange(4)})
    greedy_prompts = prompts()
    greedy_prompts.meta_info["do_sample"] = False
    settings = dict(response_length=6, temperature=3.0)
    greedy = HFRollout(model, tokenizer, RolloutConfig(**settings), seed=0).generate_batch(greedy_prompts)
    top1 = HFRollout(model, tokenizer, RolloutConfig(**settings, top_k=1), seed=0).generate_batch(prompts())
    sampled = HFRollout(model, tokenizer, RolloutConfig(**settings), seed=0).generate_batch(prompts())
    assert torch.equal(top1.batch["responses"], greedy.batch["responses"])  # one token left: the argmax
    assert not torch.equal(sampled.batch["responses"], greedy.batch["responses"])


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_checkpoint_contents_are_always_whole_and_a_smaller_list_is_refused(role):
    for value in ("['model','optimizer','extra']", "['model','optimizer','extra','hf_model']", "[model,optimizer]"):
        notes = []
        apply_overrides(RunConfig(), [f"{role}.checkpoint.save_contents={value}"], notes=notes)
        assert len(notes) == 1 and "`rlhf export <checkpoint>` writes that folder" in notes[0]
    for value in ("['model']", "['optimizer','extra']", "['model','optimizer','lora']"):
        with pytest.raises(ConfigError, match=r"checkpoints here always hold the model, the optimizer and the extra"):
            apply_overrides(RunConfig(), [f"{role}.checkpoint.load_contents={value}"], notes=[])


def test_every_command_that_takes_a_config_takes_a_verl_yaml_under_its_overrides(tmp_path, capsys):
    """``--config`` on config, iterate, serve, submit and schedule as on run: the file's keys
    (verl's nested layout here), then the overrides on top."""
    import json

    import yaml

    from rlhf_core.cli import build_parser, main

    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"rollout": {"n": 4, "top_k": 20},
                                                          "actor": {"optim": {"lr": 2e-6}}},
                                    "algorithm": {"rollout_correction": {"bypass_mode": False}},
                                    "data": {"train_batch_size": 32}}))
    assert main(["config", "--handover", "--config", str(path), "actor_rollout_ref.rollout.n=2"]) == 0
    cfg = json.loads(json.loads(capsys.readouterr().out)["config"])
    assert (cfg["rollout"]["n"], cfg["rollout"]["top_k"], cfg["actor"]["lr"], cfg["data"]["train_batch_size"]) == \
        (2, 20, 2e-6, 32)  # the override wins over the file
    parser = build_parser()
    for command in (["iterate", "--run-id", "r"], ["serve", "--run-id", "r"],
                    ["submit", "--host", "h", "--store", "s3://b/runs", "--run-id", "r"],
                    ["schedule", "--host", "h", "--store", "s3://b/runs", "--run-id", "r", "--cron", "0 * * * *"]):
        assert parser.parse_args([*command, "--config", str(path)]).config == str(path), command
    from pipelines.cli import _remote

    args = parser.parse_args(["submit", "--host", "h", "--store", "s3://b/runs", "--run-id", "r", "--config",
                              str(path), "data.train_batch_size=64"])
    _, submitted, _, _ = _remote(args)
    assert (submitted.rollout.top_k, submitted.data.train_batch_size) == (20, 64)
    path.write_text("- not a mapping\n")
    with pytest.raises(SystemExit, match=r"--config .*ppo_trainer.yaml: expected a mapping of config keys; found list"):
        main(["config", "--config", str(path)])


@pytest.mark.parametrize("overrides, message", [
    (["rollout.max_num_batched_tokens=512"], "rollout.max_num_batched_tokens: expected at least "
                                             "rollout.max_num_seqs=1024 (vLLM's rule); found 512"),
    (["rollout.max_num_batched_tokens=32", "rollout.max_num_seqs=8", "data.max_prompt_length=64"],
     "rollout.max_num_batched_tokens: expected at least the engine's max_model_len=72 without chunked prefill"),
])
def test_vllms_token_budget_rules_are_checked_before_any_engine_starts(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        apply_overrides(RunConfig(), overrides + ["rollout.name=vllm"]).validate()
    # on GPU nodes chunked prefill is vLLM's default: a prompt may span engine steps
    apply_overrides(RunConfig(), ["rollout.max_num_batched_tokens=32", "rollout.max_num_seqs=8",
                                  "data.max_prompt_length=64", "rollout.name=vllm",
                                  "resources.gpus_per_node=1"]).validate()


def test_a_config_file_that_multiplies_itself_is_refused_and_interpolations_inside_text_resolve(tmp_path):
    """18 levels of YAML aliases, each doubling the one before (500 bytes naming ~260,000
    strings), are refused in one line before anything is built; `proj-${...}` is resolved
    as OmegaConf does (the key beside it too), never left as text; a mapping inside text
    is refused."""
    from rlhf_core.config import ConfigError, load_config

    lines = ['a0: &a0 ["xxxxxxxx", "xxxxxxxx"]'] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, 18)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert bomb.stat().st_size < 600
    with pytest.raises(ConfigError, match=r"^--config .*bomb.yaml: expected at most 100000 values once YAML's "
                                          r"aliases are expanded") as refused:
        load_config(str(bomb), [], notes=[])
    assert "\n" not in str(refused.value)
    partial = tmp_path / "partial.yaml"
    partial.write_text("trainer:\n  experiment_name: exp7\n  project_name: proj-${trainer.experiment_name}-"
                       "${.experiment_name}\n")
    cfg, _ = load_config(str(partial), [], notes=[])
    assert cfg.trainer.project_name == "proj-exp7-exp7"
    cfg, _ = load_config(str(partial), ["trainer.experiment_name=other"], notes=[])  # as Hydra: the override first
    assert cfg.trainer.project_name == "proj-other-other"
    partial.write_text("trainer:\n  project_name: proj-${algorithm}\nalgorithm:\n  gamma: 1.0\n")
    with pytest.raises(ConfigError, match=r"the interpolation \$\{algorithm\} inside 'proj-\$\{algorithm\}': "
                                          r"expected a single value; found a dict"):
        load_config(str(partial), [], notes=[])
