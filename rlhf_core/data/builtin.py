"""The built-in task: reverse a string of digits, with a small model built on this machine.

Nothing is downloaded. The tokenizer is a word-level vocabulary of digits and a few
specials; the model is a 2-layer Qwen2 (randomly initialised with the run's seed) that a
short supervised phase warm-starts until its sampled reward is about 0.25 - good enough
to produce the format, far from solving the task - and that RL then has to improve. The
result is cached by a hash of everything that determines it.

Prompt ``"3141="`` -> response ``"1413"``; reward = fraction of positions right, halved
when the length is wrong (partial credit, so the signal is dense from the start).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

DATA_SOURCE = "builtin/digits_reverse"
NUM_DIGITS = 4
VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "=": 3, **{str(d): 4 + d for d in range(10)}}
MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
WARM_START = {"target_reward": 0.2, "max_steps": 400, "batch_size": 64, "lr": 3e-4, "eval_every": 5}
BUILTIN_VERSION = 1  # bump when anything above changes the cached model


def reward_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Partial credit for reversing digits: share of correct positions, halved if the
    response has the wrong length."""
    answer = "".join(ch for ch in solution_str if ch.isdigit())
    matches = sum(a == b for a, b in zip(answer, ground_truth))
    score = matches / len(ground_truth)
    if len(answer) != len(ground_truth):
        score *= 0.5
    return {"score": score, "exact": float(answer == ground_truth)}


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(NUM_DIGITS))
        rows.append({"prompt": f"{digits}=", "ground_truth": digits[::-1], "data_source": DATA_SOURCE,
                     "extra_info": {"index": i}})
    return rows


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_CACHE", Path.home() / ".cache" / "rlhf-core"))


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


def builtin_model_path(seed: int = 0, progress: bool = True) -> str:
    """Directory of the warm-started built-in model (built and cached on first use)."""
    key = hashlib.sha256(json.dumps([BUILTIN_VERSION, VOCAB, MODEL_SHAPE, WARM_START, seed],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / f"builtin-digits-{key}"
    if (path / "WARM_START.json").exists():
        return str(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _build_and_warm_start(tmp, seed, progress)
    try:
        os.rename(tmp, path)  # atomic publish; a concurrent builder may have won
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _build_and_warm_start(path: Path, seed: int, progress: bool) -> None:
    import torch

    from rlhf_core.workers.qwen2 import qwen2_from_config

    torch.manual_seed(seed)
    build_tokenizer(path)  # saved next to the model
    model = qwen2_from_config(use_cache=True, vocab_size=len(VOCAB), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              tie_word_embeddings=False, torch_dtype="float32", **MODEL_SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START["lr"])
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

    bar = tqdm(range(WARM_START["max_steps"]), desc="warm-start SFT", disable=not progress, leave=False)
    reward = sampled_reward()
    for step in bar:
        batch = [rows[(step * WARM_START["batch_size"] + i) % len(rows)] for i in range(WARM_START["batch_size"])]
        ids = encode(batch)
        logits = model(ids).logits[:, prompt_len - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 ids[:, prompt_len:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % WARM_START["eval_every"] == 0:
            reward = sampled_reward()
            history.append({"step": step + 1, "loss": loss.item(), "reward": reward})
            bar.set_postfix(loss=f"{loss.item():.3f}", reward=f"{reward:.2f}")
            if reward >= WARM_START["target_reward"]:
                break
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    (path / "WARM_START.json").write_text(json.dumps({"seed": seed, "history": history,
                                                     "final_reward": reward}, indent=1))
