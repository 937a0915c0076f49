"""The reward-model worker (``rlhf_core.workers.reward_model``): verl's semantics, checked
against an independent Hugging Face computation of the same reward model; the reward
composition of the naive reward manager; the refusals."""

import hashlib

import numpy as np
import pytest
import torch

from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.controller import Worker
from rlhf_core.protocol import DataProto, object_column
from rlhf_core.testing.model_folders import PLAIN_CHAT, build_model_folder, build_reward_model_folder
from rlhf_core.workers import reward_model as rm

PROMPT, RESPONSE = 40, 8
CHATS = [[{"role": "user", "content": "Tom has 3 apples and buys 11 more."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many apples?"}],
         [{"role": "user", "content": "Count: 7 and 8."}]]
ANSWERS = ["He has 14 apples. #### 14", "#### 5", "15"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy = build_model_folder(root / "policy")
    return {"policy": policy,
            "same": build_reward_model_folder(root / "rm-same", policy),
            "other": build_reward_model_folder(root / "rm-other", policy, chat_template=PLAIN_CHAT, seed=2)}


def rollout_batch(policy_folder, ends=(True, False, True), lengths=(8, 5, 3)) -> DataProto:
    """The rollout's layout: chat prompts left-padded to PROMPT, responses right-padded to
    RESPONSE (``ends``: the response ends with EOS; ``lengths``: its tokens, EOS included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_folder)
    rows, masks = [], []
    for chat, answer, end, length in zip(CHATS, ANSWERS, ends, lengths):
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        response = (tok(answer, add_special_tokens=False)["input_ids"] * 4)[:length - int(end)]
        response += [tok.eos_token_id] if end else []
        rows.append(([tok.pad_token_id] * (PROMPT - len(prompt)) + prompt,
                     response + [tok.pad_token_id] * (RESPONSE - len(response))))
        masks.append([0] * (PROMPT - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (RESPONSE - len(response)))
    ids = torch.tensor([p + r for p, r in rows])
    mask = torch.tensor(masks)
    texts = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
         "responses": ids[:, PROMPT:]},
        {"raw_chat": object_column(CHATS), "raw_prompt": object_column(texts)})


def hf_score(folder, ids: list[int]) -> float:
    """The reward model on one unpadded sequence, plain Hugging Face: its pooled logit."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def make_worker(folders, which: str, extra=(), monkeypatch=None):
    cfg = apply_overrides(RunConfig(), [f"model.path={folders['policy']}", "reward_model.enable=true",
                                        f"reward_model.model.path={folders[which]}",
                                        f"data.max_prompt_length={PROMPT}", f"rollout.response_length={RESPONSE}",
                                        *extra])
    worker = rm.RewardModelWorker(cfg)
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker.init_model()
    return worker


def test_the_score_is_the_models_at_the_last_valid_token_placed_at_the_responses_last(folders, monkeypatch):
    """Same tokenizer and template as the policy: the sampled tokens are scored as they
    are; each score equals the model's on the row's unpadded sequence, and sits at the
    response's last valid token (a response cut without EOS included)."""
    worker = make_worker(folders, "same", monkeypatch=monkeypatch)
    assert worker.retemplates is False
    data = rollout_batch(folders["policy"])
    scores = worker.compute_rm_score(data).batch["rm_scores"]
    mask = data.batch["attention_mask"]
    for i in range(len(data)):
        valid = int(mask[i, PROMPT:].sum())
        expected = hf_score(folders["same"], data.batch["input_ids"][i][mask[i].bool()].tolist())
        assert scores[i, valid - 1].item() == pytest.approx(expected, abs=1e-5)
        assert not scores[i, :valid - 1].any() and not scores[i, valid:].any()
    assert len({round(float(s), 4) for s in scores.sum(1)}) == 3, "the responses' scores differ"


def test_a_reward_model_with_its_own_chat_template_reads_the_re_templated_chat(folders, monkeypatch):
    """verl's _switch_chat_template: the response decoded with the policy's tokenizer, EOS
    text removed, appended to the prompt's messages, templated by the reward model's
    template without a generation prompt, tokenized without special tokens."""
    from transformers import AutoTokenizer

    worker = make_worker(folders, "other", monkeypatch=monkeypatch)
    assert worker.retemplates is True
    data = rollout_batch(folders["policy"])
    scores = worker.compute_rm_score(data).batch["rm_scores"].sum(1)
    policy_tok, rm_tok = (AutoTokenizer.from_pretrained(folders[k]) for k in ("policy", "other"))
    for i, chat in enumerate(CHATS):
        valid = int(data.batch["attention_mask"][i, PROMPT:].sum())
        response = policy_tok.decode(data.batch["responses"][i][:valid].tolist()).replace(policy_tok.eos_token, "")
        text = rm_tok.apply_chat_template(chat + [{"role": "assistant", "content": response}], tokenize=False)
        assert text.startswith(f"{chat[0]['role']}: ") and "<|im_start|>" not in text
        ids = rm_tok(text, add_special_tokens=False)["input_ids"]
        assert scores[i].item() == pytest.approx(hf_score(folders["other"], ids), abs=1e-5)


@pytest.mark.parametrize("rule", ["right", "left", "middle"])
def test_re_templated_inputs_longer_than_max_length_are_cut_by_verls_rules(folders, monkeypatch, rule):
    full = make_worker(folders, "other", monkeypatch=monkeypatch)
    data = rollout_batch(folders["policy"])
    ids, mask, _ = rm.retemplate(data, full.policy_tokenizer, full.tokenizer, 10_000, "right")
    worker = make_worker(folders, "other", ["reward_model.max_length=12", f"reward_model.truncation={rule}"],
                         monkeypatch=monkeypatch)
    scores = worker.compute_rm_score(data).batch["rm_scores"].sum(1)
    for i in range(len(data)):
        row = ids[i][mask[i].bool()].tolist()
        assert len(row) > 12
        kept = {"right": row[:12], "left": row[-12:], "middle": row[:6] + row[-6:]}[rule]
        assert scores[i].item() == pytest.approx(hf_score(folders["other"], kept), abs=1e-5)


def test_truncation_error_refuses_in_one_line(folders, monkeypatch):
    worker = make_worker(folders, "other", ["reward_model.max_length=12", "reward_model.truncation=error"],
                         monkeypatch=monkeypatch)
    with pytest.raises(rm.RewardModelError, match=r"^reward_model.max_length: row 0's re-templated input has \d+ "
                                                  r"tokens, more than 12; raise it or set reward_model.truncation"):
        worker.compute_rm_score(rollout_batch(folders["policy"]))


@pytest.mark.parametrize("extra", [["reward_model.micro_batch_size_per_gpu=1"],
                                   ["reward_model.use_dynamic_bsz=true",
                                    "reward_model.forward_max_token_len_per_gpu=48"],
                                   ["reward_model.model.use_remove_padding=true"],
                                   ["reward_model.model.use_remove_padding=true",
                                    "reward_model.micro_batch_size_per_gpu=2"]],
                         ids=["rows", "tokens", "packed", "packed-rows"])
@pytest.mark.parametrize("which", ["same", "other"])
def test_micro_batches_and_padding_removal_give_the_same_scores(folders, monkeypatch, extra, which):
    data = rollout_batch(folders["policy"])
    whole = make_worker(folders, which, monkeypatch=monkeypatch).compute_rm_score(data).batch["rm_scores"]
    split = make_worker(folders, which, extra, monkeypatch=monkeypatch).compute_rm_score(data).batch["rm_scores"]
    assert torch.allclose(whole, split, atol=1e-5, rtol=0) and torch.equal(whole != 0, split != 0)


@pytest.mark.parametrize("which", ["same", "other"])
def test_without_a_row_count_forwards_hold_at_most_the_token_budget(folders, monkeypatch, which):
    """[6/7] item 3: micro_batch_size_per_gpu 0 is not every row at once (a 7B reward model's
    forward over a rank's whole batch needs tens of GB): forwards of at most
    forward_max_token_len_per_gpu tokens, scores as one forward gives them."""
    data = rollout_batch(folders["policy"])
    one = make_worker(folders, which, [f"reward_model.micro_batch_size_per_gpu={len(data)}"], monkeypatch=monkeypatch)
    expected = one.compute_rm_score(data).batch["rm_scores"]
    bounded = make_worker(folders, which, ["reward_model.forward_max_token_len_per_gpu=48"], monkeypatch=monkeypatch)
    forwards, scores_of = [], rm.sequence_scores

    def counted(model, input_ids, attention_mask, *args, **kwargs):
        forwards.append(int(attention_mask.sum()))
        return scores_of(model, input_ids, attention_mask, *args, **kwargs)

    monkeypatch.setattr(rm, "sequence_scores", counted)
    got = bounded.compute_rm_score(data).batch["rm_scores"]
    assert len(forwards) > 1 and max(forwards) <= 48, forwards
    assert torch.allclose(got, expected, atol=1e-5, rtol=0) and torch.equal(got != 0, expected != 0)


@pytest.mark.parametrize("which", ["same", "other"])
def test_an_empty_batch_scores_to_an_empty_tensor(folders, monkeypatch, which):
    worker = make_worker(folders, which, monkeypatch=monkeypatch)
    empty = rollout_batch(folders["policy"]).select_idxs(torch.tensor([], dtype=torch.long))
    scores = worker.compute_rm_score(empty).batch["rm_scores"]
    assert scores.shape == (0, RESPONSE) and scores.dtype == torch.float32


def test_a_reward_model_pool_of_its_own_takes_the_reward_model_out_of_the_training_pool():
    """verl's enable_resource_pool / n_gpus_per_node / nnodes; shapes that cannot be placed
    are refused in one line naming the fields."""
    from rlhf_core.workers.worker_set import pool_plan, pool_prefixes

    on = ["reward_model.enable=true", "reward_model.model.path=/models/rm", "resources.cpus_per_node=8",
          "actor.world_size=2"]
    colocated = pool_plan(apply_overrides(RunConfig(), on).validate())
    assert [(p.name, p.process_on_nodes, p.roles) for p in colocated] == [
        ("train", (2,), ("actor", "reward", "reward_model"))]
    own = pool_plan(apply_overrides(RunConfig(), on + ["reward_model.enable_resource_pool=true",
                                                      "reward_model.n_gpus_per_node=3",
                                                      "reward_model.nnodes=2"]).validate())
    assert [(p.name, p.process_on_nodes, p.roles) for p in own] == [
        ("train", (2,), ("actor", "reward")), ("reward_model", (3, 3), ("reward_model",))]
    assert pool_prefixes("global_pool") == ["global_pool", "global_pool_critic", "global_pool_reward_model",
                                            "global_pool_rollout"]
    for extra, message in (
            (["reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=5", "reward_model.nnodes=1"],
             "reward_model.n_gpus_per_node, reward_model.nnodes: expected 1 to 4 ranks on each of at least 1 node "
             "(the training pool's node shape) with enable_resource_pool; found 5 x 1"),
            (["reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=2"],
             "reward_model.n_gpus_per_node, reward_model.nnodes: expected 1 to 4 ranks"),
            (["reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=3", "reward_model.nnodes=1",
              "actor.fsdp_config.fsdp_size=2"],
             "actor.fsdp_config.fsdp_size: expected a divisor of the reward model's 3 ranks (reward_model.n_gpus_per_node "
             "x nnodes)"),
            (["reward_model.enable=false", "reward_model.enable_resource_pool=true"],
             "reward_model.enable_resource_pool: expected reward_model.enable=true")):
        with pytest.raises(ConfigError) as refused:
            apply_overrides(RunConfig(), on + extra).validate()
        assert str(refused.value).startswith(message), refused.value


@pytest.mark.slow  # a vLLM engine per worker: ~20 s
def test_the_reward_loop_served_by_vllm_scores_what_the_fsdp_forward_scores(folders, monkeypatch):
    """verl's reward loop (use_reward_loop, rollout.name=vllm): vLLM's pooling runner on
    the inputs the FSDP path reads (the sampled tokens, or the re-templated chat, cut by
    max_length), the raw score at the last token: equal to the FSDP forward's in fp32."""
    data = rollout_batch(folders["policy"])
    for which, extra in (("same", []), ("other", ["reward_model.max_length=12", "reward_model.truncation=left"])):
        served = make_worker(folders, which, ["reward_model.use_reward_loop=true", *extra], monkeypatch=monkeypatch)
        assert hasattr(served, "engine") and not hasattr(served, "model")
        forward = make_worker(folders, which, extra, monkeypatch=monkeypatch)
        got, expected = (w.compute_rm_score(data).batch["rm_scores"] for w in (served, forward))
        assert torch.equal(got != 0, expected != 0) and torch.allclose(got, expected, atol=1e-5), (got, expected)
        del served


def test_a_row_without_a_response_token_scores_nothing():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = rm.scores_to_tokens(torch.tensor([2.5, 7.0]), mask)
    assert out.tolist() == [[0.0, 2.5, 0.0], [0.0, 0.0, 0.0]]


def test_a_model_that_is_not_a_one_label_classifier_is_refused_in_one_line(folders, tmp_path):
    with pytest.raises(rm.RewardModelError, match=r"^reward_model.model.path: expected a sequence-classification "
                                                  r"model \(architectures \*ForSequenceClassification\); found "
                                                  r"\['Qwen2ForCausalLM'\]"):
        rm.load_reward_model(str(folders["policy"]))
    two = build_reward_model_folder(tmp_path / "two", folders["policy"])
    import json

    config = json.loads((two / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "a", "1": "b"}, {"a": 0, "b": 1}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(rm.RewardModelError, match=r"^reward_model.model.path: expected a reward model with one "
                                                  r"label \(num_labels=1\); found num_labels=2"):
        rm.load_reward_model(str(two))


def test_an_enabled_reward_model_needs_a_path_and_an_estimator_without_a_greedy_baseline():
    with pytest.raises(ConfigError, match=r"^reward_model.model.path: expected a sequence-classification model "
                                          r"folder with reward_model.enable=True; found none$"):
        apply_overrides(RunConfig(), ["reward_model.enable=true"]).validate()
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator=remax: expected an estimator without"):
        apply_overrides(RunConfig(), ["reward_model.enable=true", "reward_model.model.path=/m",
                                      "algorithm.adv_estimator=remax"]).validate()


def test_reward_model_settings_train_nothing_while_it_is_off():
    base = RunConfig().config_hash()
    assert apply_overrides(RunConfig(), ["reward_model.micro_batch_size_per_gpu=4"]).config_hash() == base
    assert apply_overrides(RunConfig(), ["reward_model.enable=true", "reward_model.model.path=/m"]
                           ).config_hash() != base


# ------------------------------------------------------------------ the reward composition


def _reward_worker(folders, extra=()):
    from rlhf_core.workers.reward import RewardWorker

    worker = RewardWorker(apply_overrides(RunConfig(), [f"model.path={folders['policy']}", *extra]))
    worker.init_model()
    return worker


def _scored_batch(folders):
    data = rollout_batch(folders["policy"])
    response_mask = data.batch["attention_mask"][:, PROMPT:]
    rm_scores = rm.scores_to_tokens(torch.tensor([0.25, -1.5, 3.0]), response_mask)
    return DataProto.from_dict(
        {"responses": data.batch["responses"], "response_mask": response_mask, "rm_scores": rm_scores},
        {"uid": object_column(["a", "b", "c"]), "data_source": object_column(["t"] * 3),
         "ground_truth": object_column(["14", "5", "15"]), "extra_info": object_column([{"k": 1}, {}, {}])})


def test_with_a_reward_model_and_the_naive_manager_the_scores_are_the_rewards(folders):
    data = _scored_batch(folders)
    out = _reward_worker(folders).compute_reward(data)
    assert torch.equal(out.batch["token_level_scores"], data.batch["rm_scores"])
    assert len(out.non_tensor_batch["response_text"]) == 3


def test_a_custom_reward_file_sees_the_models_score_and_can_add_a_rule_bonus(folders, tmp_path):
    bonus = tmp_path / "bonus.py"
    bonus.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return extra_info['rm_score'] + (1.0 if ground_truth in solution_str else 0.0)\n")
    data = _scored_batch(folders)
    out = _reward_worker(folders, [f"custom_reward_function.path={bonus}", "custom_reward_function.name=score"]
                         ).compute_reward(data)
    texts = out.non_tensor_batch["response_text"]
    expected = [s + (1.0 if t in text else 0.0) for s, t, text in zip([0.25, -1.5, 3.0], ["14", "5", "15"], texts)]
    assert out.batch["token_level_scores"].sum(1).tolist() == pytest.approx(expected)
    assert expected != [0.25, -1.5, 3.0], "the bonus applied somewhere"
    assert torch.equal(out.batch["token_level_scores"] != 0, data.batch["rm_scores"] != 0)  # the same positions
    assert data.non_tensor_batch["extra_info"][0] == {"k": 1}, "the batch's extra_info is not changed"


def test_the_loader_keeps_chat_messages_for_a_reward_model(folders):
    from rlhf_core.data.dataset import PromptLoader
    from rlhf_core.data.tokenizer import PromptTokenizer

    rows = [{"prompt": chat, "ground_truth": "1", "data_source": "t"} for chat in CHATS] + \
        [{"prompt": "plain text", "ground_truth": "1", "data_source": "t"}]
    loader = PromptLoader(rows, PromptTokenizer(str(folders["policy"])), 4, 64, 0, shuffle=False, keep_chat=True)
    batch = loader.next_batch()
    assert list(batch.non_tensor_batch["raw_chat"]) == CHATS + [None]
    plain = PromptLoader(rows, PromptTokenizer(str(folders["policy"])), 4, 64, 0, shuffle=False).next_batch()
    assert "raw_chat" not in plain.non_tensor_batch
    assert isinstance(batch.non_tensor_batch["raw_chat"], np.ndarray)


# ------------------------------------------------------------------ verl's RM script, end to end

#: verl's examples/ppo_trainer/run_qwen2-7b_rm.sh, its arguments as written there.
QWEN2_7B_RM = [
    "algorithm.adv_estimator=gae", "data.train_files=$train_files", "data.val_files=$test_files",
    "data.train_batch_size=1024", "data.max_prompt_length=1024", "data.max_response_length=512",
    "data.filter_overlong_prompts=True", "data.truncation=error", "data.return_raw_chat=True",
    "actor_rollout_ref.model.path=$HOME/models/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "critic.optim.lr=1e-5",
    "critic.model.use_remove_padding=True", "critic.optim.lr_warmup_steps_ratio=0.05",
    "critic.model.path=$HOME/models/Qwen2-7B-Instruct", "critic.model.enable_gradient_checkpointing=True",
    "critic.ppo_micro_batch_size_per_gpu=32", "critic.model.fsdp_config.param_offload=False",
    "critic.model.fsdp_config.optimizer_offload=False", "reward_model.enable=True",
    "reward_model.model.path=$HOME/models/FsfairX-LLaMA3-RM-v0.1", "reward_model.use_reward_loop=True",
    "reward_model.rollout.name=vllm", "reward_model.rollout.gpu_memory_utilization=0.8",
    "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=2048",
    "reward_model.rollout.response_length=1024", "reward_model.num_workers=8", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]', "trainer.project_name=verl_example",
    "trainer.val_before_train=False", "trainer.experiment_name=Qwen2-7B-Instruct_hybrid_rm",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def test_verls_rm_script_scaled_down_scores_every_response_with_the_reward_model(folders, tmp_path, ray_local):
    """run_qwen2-7b_rm.sh's keys, every one, with values scaled to tiny folders on CPU,
    the reward model on a pool of its own: every response's reward is the reward model's score of its re-templated chat, as an
    independent Hugging Face computation on the stored responses gives it; the scoring
    stage has its own snapshot and replays exactly."""
    from transformers import AutoTokenizer

    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.lineage import chain, format_lineage
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.testing.model_folders import write_verl_parquet
    from rlhf_core.trainer.replay import ReplayError, replay

    from rlhf_core.trainer.preference import RewardModelTraining, train_reward_model
    from tests.test_reward_model_training import apple_pairs, write_jsonl

    # the reward model: trained here from preferences, on a classifier with a chat template of its own
    pairs = write_jsonl(tmp_path / "pairs.jsonl", apple_pairs(12))
    reward_folder = tmp_path / "rm"
    train_reward_model(RewardModelTraining(data=str(pairs), base=str(folders["other"]), out=str(reward_folder),
                                           lr=1e-3, batch_size=4, store=f"file://{tmp_path}/rm-store",
                                           run_id="rm-trained"), log=lambda line: None)
    # one iteration (4 prompts): what the test checks is per response, and the suite's time counts
    scaled = {"data.train_files": str(write_verl_parquet(tmp_path / "train.parquet", count=4)),
              "data.val_files": str(write_verl_parquet(tmp_path / "test.parquet", count=2)),
              "data.train_batch_size": "4", "data.max_prompt_length": "64", "data.max_response_length": "6",
              "actor_rollout_ref.model.path": str(folders["policy"]), "reward_model.model.path": str(reward_folder),
              "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
              "actor_rollout_ref.rollout.name": "hf", "critic.ppo_micro_batch_size_per_gpu": "4",
              "critic.model.path": str(folders["policy"]),
              "trainer.nnodes": "1", "trainer.total_epochs": "1"}
    argv = [f"{item.split('=', 1)[0]}={scaled[item.split('=', 1)[0]]}" if item.split("=", 1)[0] in scaled else item
            for item in QWEN2_7B_RM if not item.startswith("trainer.n_gpus_per_node=")]
    store = f"file://{tmp_path / 'store'}"
    # and the reward model on a pool of its own (verl's keys), as the scripts that set them place it
    own_pool = ["reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=1", "reward_model.nnodes=1"]
    assert main(["run", "--direct", "--run-id", "rm", "--store", store, *argv, *own_pool, "rollout.n=2",
                 "critic.ppo_mini_batch_size=2", f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress=false"]) == 0

    policy_tok, rm_tok = (AutoTokenizer.from_pretrained(folders[k]) for k in ("policy", "other"))
    istore = IterationStore(RunRef(store, "rm"))
    assert istore.committed_iterations() == [0]
    for n in (0,):
        scored, rewarded = istore.load(n, "rm_score"), istore.load(n, "reward")
        rm_scores = scored.batch["rm_scores"]
        assert torch.equal(rewarded.batch["token_level_scores"], rm_scores)
        for i in range(len(scored)):
            valid = int(scored.batch["attention_mask"][i, -6:].sum())
            response = policy_tok.decode(scored.batch["responses"][i][:valid].tolist())
            chat = list(scored.non_tensor_batch["raw_chat"][i]) + [
                {"role": "assistant", "content": response.replace(policy_tok.eos_token, "")}]
            ids = rm_tok(rm_tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
            assert rm_scores[i, valid - 1].item() == pytest.approx(hf_score(reward_folder, ids), abs=1e-5)
            assert int((rm_scores[i] != 0).sum()) <= 1
    results = replay(f"{store}/rm", stages=["rm_score", "reward"], iteration=0, log=lambda line: None)
    assert [(r.stage, r.ok) for r in results] == [("rm_score", True), ("reward", True)]

    # the manifests and the lineage name what scored the responses, by content
    digest = rm.content_sha256(str(reward_folder))
    assert [istore.read_manifest(n)["reward_model"] for n in (0,)] == [{
        "path": str(reward_folder), "sha256": digest,
        "trained_from": {"data": str(pairs), "data_sha256": hashlib.sha256(pairs.read_bytes()).hexdigest(),
                         "base": str(folders["other"]), "run": f"file://{tmp_path}/rm-store/rm-trained"}}]
    table = format_lineage(chain(f"{store}/rm")).splitlines()
    assert table[-2:] == [f"scored by reward model {reward_folder} (sha256 {digest[:16]}...): iterations 0",
                          f"  trained from preferences {pairs} (sha256 "
                          f"{hashlib.sha256(pairs.read_bytes()).hexdigest()[:16]}...) on {folders['other']} "
                          f"in run file://{tmp_path}/rm-store/rm-trained"]
    # a reward model whose content changed is refused for the stages it computes
    (reward_folder / "README.md").write_text("retrained")
    with pytest.raises(ReplayError, match=r"^reward_model.model.path: expected the reward model iteration 0 used "
                                          rf"\({reward_folder}, sha256 {digest[:16]}\.\.\.\); found "):
        replay(f"{store}/rm", stages=["rm_score"], iteration=0, log=lambda line: None)
    # and a run continued with it is refused before its workers do anything (the identity
    # is what the reward-model workers report: the path and the folder's content hash)
    from types import SimpleNamespace

    from rlhf_core.trainer.restore import check_models_unchanged

    now = {"path": str(reward_folder), "sha256": rm.content_sha256(str(reward_folder))}
    with pytest.raises(ConfigError, match=r"^reward_model.model.path: expected the reward model run rm was scored by "
                                          rf"\({reward_folder}, sha256 {digest[:16]}\.\.\.\); found {reward_folder} "
                                          rf"with sha256 {now['sha256'][:16]}\.\.\. \(the folder's content changed"):
        check_models_unchanged(istore, SimpleNamespace(reward_model_identity=lambda: now))
    (reward_folder / "README.md").unlink()
    assert rm.content_sha256(str(reward_folder)) == digest
    check_models_unchanged(istore, SimpleNamespace(reward_model_identity=lambda: {**now, "sha256": digest}))


def test_a_manifests_reward_model_record_is_checked_when_read():
    import json

    from rlhf_core.record.manifest_schema import ManifestError, parse_manifest

    good = {"reward_model": {"path": "/m", "sha256": "a" * 64}}
    assert parse_manifest(json.dumps(good).encode(), "m")["reward_model"]["path"] == "/m"
    for bad, found in (({"path": "/m"}, "nothing"), ({"path": "/m", "sha256": "abc"}, '"abc"')):
        with pytest.raises(ManifestError, match=rf"^m: reward_model.sha256: expected a sha256 hex string; found {found}"):
            parse_manifest(json.dumps({"reward_model": bad}).encode(), "m")


def test_the_reward_functions_score_can_be_logged_beside_the_models_and_is_never_the_reward(folders, tmp_path,
                                                                                           monkeypatch):
    (tmp_path / "rm_count_score.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(ground_truth in solution_str), 'length': len(solution_str)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _scored_batch(folders)
    out = _reward_worker(folders, ["reward.function=rm_count_score:score", "reward_model.log_function_score=true"]
                         ).compute_reward(data)
    assert torch.equal(out.batch["token_level_scores"], data.batch["rm_scores"])
    texts = out.non_tensor_batch["response_text"]
    assert list(out.non_tensor_batch["reward_extra/function_score"]) == [float(t in x) for t, x in
                                                                        zip(["14", "5", "15"], texts)]
    assert list(out.non_tensor_batch["reward_extra/length"]) == [len(x) for x in texts]
    assert apply_overrides(RunConfig(), ["reward_model.enable=true", "reward_model.model.path=/m",
                                         "reward_model.log_function_score=true"]).config_hash() == \
        apply_overrides(RunConfig(), ["reward_model.enable=true", "reward_model.model.path=/m"]).config_hash()


def test_a_reward_model_to_re_template_for_needs_a_chat_template(folders, tmp_path, monkeypatch):
    import json
    import shutil

    bare = shutil.copytree(folders["other"], tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(rm.RewardModelError, match=r"^reward_model.model.path: expected a chat template in the "
                                                  r"reward model's tokenizer .*; found none in "):
        make_worker({**folders, "bare": bare}, "bare", monkeypatch=monkeypatch)


def test_a_reward_function_cannot_change_what_its_sibling_rows_see(folders, tmp_path, monkeypatch):
    (tmp_path / "rm_mutating.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    seen = len(extra_info.setdefault('seen', []))\n"
        "    extra_info['seen'].append(1)\n"
        "    return float(seen)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _scored_batch(folders)
    shared = {"seen": []}
    data.non_tensor_batch["extra_info"] = object_column([shared] * 3)  # as repeat() leaves them: one dict
    data.batch.pop("rm_scores")
    out = _reward_worker(folders, ["reward.function=rm_mutating:score"]).compute_reward(data)
    assert out.batch["token_level_scores"].sum(1).tolist() == [0.0, 0.0, 0.0] and shared == {"seen": []}


def test_the_memory_estimate_skips_models_that_do_not_name_its_sizes():
    from types import SimpleNamespace

    from rlhf_core.config import ModelShape

    assert ModelShape.from_hf_config(SimpleNamespace(vocab_size=50257, hidden_size=768, num_hidden_layers=12)) is None
    assert ModelShape.from_hf_config(SimpleNamespace(vocab_size=10, hidden_size=8, intermediate_size=None,
                                                     num_hidden_layers=1)) is None


def test_a_reward_model_whose_tokenizer_outgrows_its_embedding_is_refused_at_load(folders, tmp_path):
    """A tokenizer that adds its own special token when the folder loads makes an id the
    embedding has no row for: one line naming the folder and both sizes, at load."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from rlhf_core.workers.reward_model import RewardModelError, check_vocabulary

    check_vocabulary(AutoTokenizer.from_pretrained(folders["other"]), str(folders["other"]))  # as built: fits
    folder = tmp_path / "rm-grown"
    shutil.copytree(folders["other"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = AutoConfig.from_pretrained(folder).vocab_size
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_{i}>" for i in range(rows - len(tokenizer) + 1)]})
    tokenizer.save_pretrained(folder)
    grown = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(RewardModelError, match=rf"^reward_model.model.path: expected token ids that fit the model's "
                                               rf"embedding; found a tokenizer of {rows + 1} tokens for {rows} "
                                               rf"embedding rows in .*rm-grown$"):
        check_vocabulary(grown, str(folder))


def _two_rank_main(rank: int, world: int, rdzv: str, folders: dict, out: str) -> None:
    """One rank of a 2-rank FSDP reward-model group: rank 1 must neither read the weights
    nor hash the folder (both raise there); every rank scores the batch."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    from transformers import AutoModelForSequenceClassification

    if rank != 0:
        def refused(*args, **kwargs):
            raise AssertionError(f"rank {rank} read or hashed the reward model's folder")

        AutoModelForSequenceClassification.from_pretrained = refused
        rm.content_sha256 = refused
    cfg = apply_overrides(RunConfig(), [f"model.path={folders['policy']}", "reward_model.enable=true",
                                        f"reward_model.model.path={folders['same']}", "actor.world_size=2",
                                        f"data.max_prompt_length={PROMPT}", f"rollout.response_length={RESPONSE}"])
    worker = rm.RewardModelWorker(cfg)
    worker.init_model()
    scores = worker.compute_rm_score(rollout_batch(folders["policy"])).batch["rm_scores"]
    torch.save({"scores": scores, "identity": worker.identity()}, f"{out}.rank{rank}")


@pytest.mark.slow
def test_rank_0_alone_reads_and_hashes_the_reward_model_and_every_rank_scores_with_its_weights(folders, tmp_path):
    """[6/7] item 4: a 7B reward model was read and hashed by every rank of a node (8x the
    host memory and the volume's reads); now by rank 0, its weights broadcast into the
    others' shards, as the actor's are."""
    import uuid

    import torch.multiprocessing as mp

    out = str(tmp_path / "rm")
    mp.start_processes(_two_rank_main, args=(2, uuid.uuid4().hex[:8], folders, out), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    data = rollout_batch(folders["policy"])
    mask = data.batch["attention_mask"]
    for i in range(len(data)):
        valid = int(mask[i, PROMPT:].sum())
        expected = hf_score(folders["same"], data.batch["input_ids"][i][mask[i].bool()].tolist())
        for seen in ranks:
            assert seen["scores"][i, valid - 1].item() == pytest.approx(expected, abs=1e-5)
    assert ranks[0]["identity"]["sha256"] == rm.content_sha256(str(folders["same"]))
    assert ranks[1]["identity"]["sha256"] is None
