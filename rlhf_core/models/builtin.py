"""The built-in task's model, built on this machine: a 2-layer Qwen2 (randomly initialised
with the run's seed) that a short supervised phase warm-starts until its sampled reward is
about 0.2 - good enough to produce the format, far from solving the task - and that RL then
has to improve. Nothing is downloaded; the result is cached by a hash of everything that
determines it. The task itself (prompts, reward) is ``rlhf_core/data/builtin.py``."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlhf_core.data.builtin import DATA_SOURCE, NUM_DIGITS, VOCAB, make_rows, reward_score
from rlhf_core.data.fetch import node_cache

MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
WARM_START = {"target_reward": 0.2, "max_steps": 400, "batch_size": 64, "lr": 3e-4, "eval_every": 5}
#: The built-in teacher (``builtin:teacher``, for on-policy distillation): a larger model of
#: the same vocabulary, trained by the same supervised phase until it solves the task.
TEACHER_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}
TEACHER_TRAINING = {"target_reward": 0.97, "max_steps": 4000, "batch_size": 64, "lr": 1e-3, "eval_every": 25}
BUILTIN_VERSION = 1  # bump when anything above changes the cached model


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<pad>")
    fast.save_pretrained(path)
    return fast


def builtin_model_path(seed: int = 0, progress: bool = True, teacher: bool = False) -> str:
    """Directory of the warm-started built-in model (built and cached on first use);
    ``teacher``: the built-in teacher's (``TEACHER_SHAPE`` trained to solve the task)."""
    shape, recipe = (TEACHER_SHAPE, TEACHER_TRAINING) if teacher else (MODEL_SHAPE, WARM_START)
    key = hashlib.sha256(json.dumps([BUILTIN_VERSION, VOCAB, shape, recipe, seed],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = node_cache() / f"builtin-digits-{'teacher-' if teacher else ''}{key}"
    if (path / "WARM_START.json").exists():
        return str(path)
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    # one builder per node: the processes that want the model while it is built wait for it
    # (the lock goes with its holder's death) instead of each running the warm start
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "WARM_START.json").exists():
            return str(path)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        _build_and_warm_start(tmp, seed, progress, shape, recipe)
        try:
            os.rename(tmp, path)  # atomic publish (a builder without the lock, an older version, may have won)
        except OSError:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _build_and_warm_start(path: Path, seed: int, progress: bool, shape: dict = MODEL_SHAPE,
                          recipe: dict = WARM_START) -> None:
    import torch

    from rlhf_core.models.qwen2 import qwen2_from_config

    torch.manual_seed(seed)
    build_tokenizer(path)  # saved next to the model
    model = qwen2_from_config(use_cache=True, vocab_size=len(VOCAB), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              tie_word_embeddings=False, torch_dtype="float32", **shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
    rows = make_rows(4096, seed=seed + 99)  # SFT prompts differ from the RL prompts
    eval_rows = make_rows(128, seed=seed + 7)
    prompt_len = NUM_DIGITS + 2  # <bos> digits =
    history = []

    def encode(batch):
        ids = [[1] + [VOCAB[c] for c in r["prompt"]] + [VOCAB[c] for c in r["ground_truth"]] + [2]
               for r in batch]
        return torch.tensor(ids)

    def sampled_reward() -> float:
        model.eval()
        with torch.no_grad():
            ids = torch.tensor([[1] + [VOCAB[c] for c in r["prompt"]] for r in eval_rows])
            gen = torch.Generator().manual_seed(seed)
            for _ in range(NUM_DIGITS + 1):
                logits = model(ids).logits[:, -1]
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                ids = torch.cat([ids, nxt], dim=1)
        model.train()
        inv = {v: k for k, v in VOCAB.items()}
        scores = []
        for row, out in zip(eval_rows, ids[:, prompt_len:].tolist()):
            text = "".join(inv[t] for t in (out[:out.index(2)] if 2 in out else out) if t >= 3)
            scores.append(reward_score(DATA_SOURCE, text, row["ground_truth"])["score"])
        return sum(scores) / len(scores)

    from tqdm import tqdm

    bar = tqdm(range(recipe["max_steps"]), desc="warm-start SFT", disable=not progress, leave=False)
    reward = sampled_reward()
    for step in bar:
        batch = [rows[(step * recipe["batch_size"] + i) % len(rows)] for i in range(recipe["batch_size"])]
        ids = encode(batch)
        logits = model(ids).logits[:, prompt_len - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ids[:, prompt_len:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % recipe["eval_every"] == 0:
            reward = sampled_reward()
            history.append({"step": step + 1, "loss": loss.item(), "reward": reward})
            bar.set_postfix(loss=f"{loss.item():.3f}", reward=f"{reward:.2f}")
            if reward >= recipe["target_reward"]:
                break
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    (path / "WARM_START.json").write_text(json.dumps({"seed": seed, "history": history,
                                                     "final_reward": reward}, indent=1))
