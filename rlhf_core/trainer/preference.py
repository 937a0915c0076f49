"""Training a reward model from preference pairs (the "human feedback" of RLHF).

An HF sequence classifier with one label (a causal LM's backbone with a new score head,
or an existing reward model) learns r(prompt, response) with the Bradley-Terry loss,
-log sigmoid(r(chosen) - r(rejected)). A pair's two sides are scored exactly as the
reward-model worker scores a response during PPO (``workers.reward_model.sequence_scores``:
the score head at the last real token), and they are written as the policy would have
produced them (``data.preferences.side_text``). Each epoch is followed by the held-out
pairs' accuracy (the share where chosen outscores rejected) and mean margin.

The result is a model folder ``reward_model.model.path`` takes, with
``rlhf_reward_model.json`` recording where it came from: the preference data's URI and
sha256, the base model, the settings and the held-out curve. A PPO run scored by it
records the folder's content hash in every iteration manifest, so ``rlhf lineage`` walks
from the policy back to the preferences.

One process, no sharding: what fits one machine (tiny to ~1B-class models on CPU).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlhf_core.workers.reward_model import PROVENANCE


class RewardModelTrainingError(ValueError):
    """Settings or a base model that cannot be trained from; one line."""


@dataclass
class RewardModelTraining:
    data: str                   # preference pairs: .parquet / .jsonl, a path or an s3:// / gs:// URI
    base: str                   # a causal LM or a one-label sequence classifier folder (or builtin:digits)
    out: str                    # the reward model folder to write
    epochs: int = 1
    lr: float = 1e-5
    batch_size: int = 8         # pairs per optimizer step
    max_length: int = 512       # tokens per side; a longer side keeps its end (where the score is read)
    eval_share: float = 0.1     # the pairs held out (at least one when > 0)
    seed: int = 0
    skip_bad_rows: bool = False  # count and skip malformed pairs instead of refusing the file
    remove_padding: bool = True  # each batch's sides packed without padding (exact up to float rounding)

    def check(self) -> None:
        for name, ok, expected in (("epochs", self.epochs >= 1, "at least 1"), ("lr", self.lr > 0, "above 0"),
                                   ("batch_size", self.batch_size >= 1, "at least 1"),
                                   ("max_length", self.max_length >= 2, "at least 2"),
                                   ("eval_share", 0 <= self.eval_share < 1, "in [0, 1)")):
            if not ok:
                raise RewardModelTrainingError(f"--{name.replace('_', '-')}: expected {expected}; found "
                                               f"{getattr(self, name)}")


def load_base(path: str):
    """A one-label sequence classifier from ``path``: the model itself, or a causal LM's
    backbone with a new score head (seeded by the caller)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path)
    if any(a.endswith("ForSequenceClassification") for a in (config.architectures or [])) and config.num_labels != 1:
        raise RewardModelTrainingError(f"--base: expected a causal LM or a one-label classifier; found a classifier "
                                       f"with num_labels={config.num_labels} in {path}")
    # fp32 master weights whatever the checkpoint's dtype (AdamW's small steps vanish in bf16)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise RewardModelTrainingError(f"--base: expected a model whose classifier head is a Linear named 'score' "
                                       f"(Llama, Qwen2, Mistral, Gemma); found {type(model).__name__}")
    model.config.use_cache = False
    return model


def _encode(tokenizer, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ids and mask of ``texts``; how many were cut (their start dropped)."""
    rows, cut = [], 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_length:
            ids, cut = ids[-max_length:], cut + 1
        rows.append(ids)
    from rlhf_core.workers.reward_model import right_padded

    return (*right_padded(rows, tokenizer.pad_token_id), cut)


def _score_pairs(model, tokenizer, pairs, max_length: int, packed: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    from rlhf_core.data.preferences import side_text
    from rlhf_core.workers.reward_model import sequence_scores

    texts = [side_text(tokenizer, p.prompt, p.chosen) for p in pairs] + \
        [side_text(tokenizer, p.prompt, p.rejected) for p in pairs]
    ids, mask, cut = _encode(tokenizer, texts, max_length)
    scores = sequence_scores(model, ids, mask, (mask.cumsum(1) - 1).clamp(min=0), packed=packed)
    return scores[:len(pairs)], scores[len(pairs):], cut


def evaluate(model, tokenizer, pairs, max_length: int, batch_size: int, packed: bool = False) -> dict:
    """Held-out accuracy (chosen outscores rejected), mean margin and loss."""
    from rlhf_core.algorithms import bradley_terry_loss

    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            c, r, _ = _score_pairs(model, tokenizer, pairs[start:start + batch_size], max_length, packed)
            chosen.append(c)
            rejected.append(r)
    c, r = torch.cat(chosen), torch.cat(rejected)
    return {"accuracy": float((c > r).float().mean()), "margin": float((c - r).mean()),
            "loss": float(bradley_terry_loss(c, r)), "pairs": len(pairs)}


def train_reward_model(spec: RewardModelTraining, log=print) -> dict:
    """Train, evaluate each epoch, write the folder; returns the provenance record."""
    from rlhf_core.algorithms import bradley_terry_loss
    from rlhf_core.data.preferences import load_pairs
    from rlhf_core.record.iteration_store import code_version
    from rlhf_core.workers import modeling

    spec.check()
    pairs, data = load_pairs(spec.data, spec.skip_bad_rows)
    order = list(range(len(pairs)))
    random.Random(spec.seed).shuffle(order)
    held = max(1, round(spec.eval_share * len(pairs))) if spec.eval_share > 0 else 0
    if held >= len(pairs):
        raise RewardModelTrainingError(f"--eval-share: expected to leave pairs to train on; found {held} of "
                                       f"{len(pairs)} pairs held out")
    held_out, train = [pairs[i] for i in order[:held]], [pairs[i] for i in order[held:]]
    base = modeling.resolve_model_path(spec.base, spec.seed, field="--base")
    tokenizer = modeling.load_tokenizer(base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(spec.seed)  # the new score head's initial weights
    model = load_base(base)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if spec.remove_padding:
        from rlhf_core.workers import packing

        packing.enable_packing(model, on_gpu=False)  # this loop runs on the CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    curve = []
    if held_out:
        curve.append({"epoch": 0, **evaluate(model.eval(), tokenizer, held_out, spec.max_length, spec.batch_size,
                                                  spec.remove_padding)})
        log(f"[rm] before training: held-out accuracy {curve[-1]['accuracy']:.3f} margin {curve[-1]['margin']:.3f} "
            f"({held} pairs)")
    rng, cut, t0 = random.Random(spec.seed + 1), 0, time.perf_counter()
    for epoch in range(1, spec.epochs + 1):
        model.train()
        rng.shuffle(train)
        losses = []
        for start in range(0, len(train), spec.batch_size):
            batch = train[start:start + spec.batch_size]
            chosen, rejected, batch_cut = _score_pairs(model, tokenizer, batch, spec.max_length, spec.remove_padding)
            cut += batch_cut if epoch == 1 else 0
            margins = [p.margin for p in batch]  # a pair without one asks for no margin (0)
            margin = torch.tensor([m or 0.0 for m in margins]) if any(m is not None for m in margins) else None
            loss = bradley_terry_loss(chosen, rejected, margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        row = {"epoch": epoch, "train_loss": sum(losses) / len(losses)}
        if held_out:
            row.update(evaluate(model.eval(), tokenizer, held_out, spec.max_length, spec.batch_size,
                                spec.remove_padding))
        curve.append(row)
        log(f"[rm] epoch {epoch}/{spec.epochs} train loss {row['train_loss']:.4f}"
            + (f" | held-out accuracy {row['accuracy']:.3f} margin {row['margin']:.3f} ({held} pairs)"
               if held_out else "") + f" | {time.perf_counter() - t0:.0f}s")
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {"format": 1, "data": data, "base": spec.base, "settings": asdict(spec), "pairs": len(pairs),
              "train_pairs": len(train), "held_out_pairs": held, "cut_sides": cut, "curve": curve,
              "code_version": code_version()}
    (out / PROVENANCE).write_text(json.dumps(record, indent=1, sort_keys=True))
    log(f"[rm] wrote {out} (reward_model.model.path={out}); trained on {len(train)} pairs of {data['uri']}"
        + (f", {sum(data['skipped'].values())} rows skipped" if data["skipped"] else ""))
    return record


def publish(folder: str, uri: str, storage_options: dict | None = None) -> None:
    """Upload a reward-model folder to an empty object-store prefix, file by file, then
    ``SHA256SUMS`` (``sha256sum``'s format) last: what ``reward_model.model.path`` fetches is
    checked against it, on stores whose ETags are not MD5s too."""
    import hashlib

    from rlhf_core.data.fetch import SUMS
    from rlhf_core.snapshot import fs as sfs

    loc = sfs.resolve(uri, storage_options)
    if loc.fs.exists(loc.path) and loc.fs.ls(loc.path):
        raise RewardModelTrainingError(f"--out: expected an empty prefix for the reward model; found objects under "
                                       f"{uri}")
    sums = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        loc.fs.put_file(str(path), loc.child(name).path)
        sums.append(f"{digest.hexdigest()}  {name}\n")
    loc.fs.pipe_file(loc.child(SUMS).path, "".join(sums).encode())

