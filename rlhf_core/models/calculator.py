"""The built-in tool task's model (``model.path=builtin:calculator``): a 2-layer Qwen2 over
the task's vocabulary, warm-started on this machine so that it knows the tool-call format
but not when to use it: a quarter of its supervised examples call the calculator and copy
its answer, the rest answer directly (which a model this small cannot get right). RL then
has to learn to use the tool. Cached by a hash of everything that determines it."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from rlhf_core.data.calculator import CALL_HEAD, CALL_TAIL, CHAT_TEMPLATE, TOOL_TOKENS, VOCAB
from rlhf_core.data.fetch import node_cache

MODEL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
WARM_START = {"tool_share": 0.25, "steps": 1200, "batch_size": 64, "lr": 1e-3}
VERSION = 1


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens(TOOL_TOKENS)  # whole: the call's JSON around the expression is two tokens
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _ids(text_parts: list[str]) -> list[int]:
    out = []
    for part in text_parts:
        out += [VOCAB[part]] if part in VOCAB else [VOCAB[c] for c in part]
    return out


def example(a: int, b: int, with_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, loss mask): what the model should write is 1, the prompt and the tool's
    answer 0."""
    prompt = _ids(["<bos>", f"{a}*{b}", "="])
    product = str(a * b)
    if not with_tool:
        answer = _ids([product, "<eos>"])
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    call = _ids(["<tool_call>", CALL_HEAD, f"{a}*{b}", CALL_TAIL, "</tool_call>", "<eos>"])
    response = _ids(["<tool_response>", product, "</tool_response>"])
    answer = _ids([product, "<eos>"])
    ids = prompt + call + response + answer
    return ids, [0] * len(prompt) + [1] * len(call) + [0] * len(response) + [1] * len(answer)


def calculator_model_path(seed: int = 0, progress: bool = True) -> str:
    key = hashlib.sha256(json.dumps([VERSION, VOCAB, MODEL_SHAPE, WARM_START, CHAT_TEMPLATE, seed],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = node_cache() / f"builtin-calculator-{key}"
    if (path / "WARM_START.json").exists():
        return str(path)
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "WARM_START.json").exists():
            return str(path)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        _warm_start(tmp, seed, progress)
        try:
            os.rename(tmp, path)
        except OSError:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def _warm_start(path: Path, seed: int, progress: bool) -> None:
    import torch

    from rlhf_core.models.qwen2 import qwen2_from_config

    torch.manual_seed(seed)
    rng = random.Random(seed + 99)  # its own numbers: the RL prompts are drawn apart
    build_tokenizer(path)
    model = qwen2_from_config(use_cache=True, vocab_size=len(VOCAB), bos_token_id=VOCAB["<bos>"],
                              eos_token_id=VOCAB["<eos>"], pad_token_id=VOCAB["<pad>"], tie_word_embeddings=False,
                              torch_dtype="float32", **MODEL_SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START["lr"])
    from tqdm import tqdm

    losses = []
    for step in tqdm(range(WARM_START["steps"]), desc="warm-start SFT (calculator)", disable=not progress,
                     leave=False):
        rows = [example(rng.randint(100, 999), rng.randint(100, 999), rng.random() < WARM_START["tool_share"])
                for _ in range(WARM_START["batch_size"])]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
        logits = model(ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(ids.shape[0], -1)
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path, safe_serialization=True)
    (path / "WARM_START.json").write_text(json.dumps({"seed": seed, "final_loss": sum(losses[-50:]) / 50,
                                                     "warm_start": WARM_START}, indent=1))
