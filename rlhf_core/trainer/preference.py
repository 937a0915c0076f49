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

from rlhf_core.record.run_layout import REWARD_MODEL_TRAINING_FORMAT
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
    store: str = "runs/store"   # where each epoch is recorded (scored pairs, checkpoint, manifest)
    run_id: str | None = None   # None: a new run; an existing one continues after its last epoch

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


def base_and_tokenizer(base: str, seed: int):
    """(the one-label classifier ``load_base`` makes of the folder ``base``, its tokenizer),
    padding with EOS where the tokenizer has no pad token; ``seed`` seeds a new score head."""
    from rlhf_core.workers import modeling

    tokenizer = modeling.load_tokenizer(base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)  # the new score head's initial weights
    model = load_base(base)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, tokenizer


def write_folder(model, tokenizer, out: Path) -> None:
    """The reward-model folder ``reward_model.model.path`` takes: weights and tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


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


def evaluate(model, tokenizer, pairs, max_length: int, batch_size: int, packed: bool = False
             ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Held-out accuracy (chosen outscores rejected), mean margin and loss; the scores."""
    from rlhf_core.algorithms import bradley_terry_loss

    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            c, r, _ = _score_pairs(model, tokenizer, pairs[start:start + batch_size], max_length, packed)
            chosen.append(c)
            rejected.append(r)
    c, r = torch.cat(chosen), torch.cat(rejected)
    return ({"accuracy": float((c > r).float().mean()), "margin": float((c - r).mean()),
             "loss": float(bradley_terry_loss(c, r)), "pairs": len(pairs)}, c, r)


ROLE = "reward_model"                            # the checkpoint's folder inside checkpoints/step-E-A/
# settings a resumed run may change: where it writes the folder, how many epochs in all, and
# where the preferences are read from (their content is checked by its sha256)
_RESUMABLE = ("out", "epochs", "store", "run_id", "data")


def settings_hash(spec: RewardModelTraining) -> str:
    import hashlib

    fixed = {k: v for k, v in sorted(asdict(spec).items()) if k not in _RESUMABLE}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def _scored_pairs(pairs, chosen: torch.Tensor, rejected: torch.Tensor, **columns) -> "DataProto":
    """A snapshot's batch: each pair's row in the file (``uid`` ``pair-{row}``) and its two
    scores (and ``columns``)."""
    import numpy as np

    from rlhf_core.protocol import DataProto

    tensors = {"row": torch.tensor([p.row for p in pairs], dtype=torch.int64), "chosen_score": chosen.float(),
               "rejected_score": rejected.float(), **{k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}}
    objects = {"uid": np.array([f"pair-{p.row}" for p in pairs], dtype=object),  # rlhf snapshots show --uid
               **{k: np.array(v, dtype=object) for k, v in columns.items() if not isinstance(v, torch.Tensor)}}
    return DataProto.from_dict(tensors=tensors, non_tensors=objects)


class _Record:
    """The training run in the store, as PPO's iterations are: ``{store}/{run_id}/iter-{E}/``
    holds epoch E's scored pairs (``train_pairs``: each pair's scores at the step that
    trained on it; ``held_out``: the held-out pairs scored after the epoch, their texts
    too) and its MANIFEST.json, committed last; ``checkpoints/step-{E}-{A}/reward_model/``
    the weights and optimizer after it (sharded-checkpoint format, read back checked).
    Epoch 0 is the evaluation before training."""

    def __init__(self, spec: RewardModelTraining, data: dict) -> None:
        from rlhf_core.record.iteration_store import IterationStore
        from rlhf_core.record.run_ids import new_run_id
        from rlhf_core.record.run_layout import RunRef

        spec.run_id = spec.run_id or new_run_id("rm")
        self.spec, self.data = spec, data
        self.store = IterationStore(RunRef(spec.store, spec.run_id))
        self.hash = settings_hash(spec)

    @property
    def uri(self) -> str:
        return self.store.run_uri

    def last(self) -> dict | None:
        """The last committed epoch's manifest, checked to continue this training; None for a new run."""
        committed = self.store.committed_iterations()
        if not committed:
            return None
        where = f"{self.uri} (--store {self.spec.store} --run-id {self.spec.run_id})"
        manifest = self.store.read_manifest(committed[-1], format=REWARD_MODEL_TRAINING_FORMAT)
        if manifest["settings_hash"] != self.hash:
            changed = sorted(k for k, v in manifest["settings"].items()
                             if k not in _RESUMABLE and asdict(self.spec).get(k) != v)
            raise RewardModelTrainingError(f"--run-id: expected the settings of run {where} to continue it; found "
                                           f"{', '.join(changed) or 'other settings'} changed")
        if manifest["data"]["sha256"] != self.data["sha256"]:
            raise RewardModelTrainingError(f"--data: expected the preferences run {where} trained on (sha256 "
                                           f"{manifest['data']['sha256'][:16]}...); found sha256 "
                                           f"{self.data['sha256'][:16]}... at {self.data['uri']}")
        return manifest

    def commit(self, epoch: int, metrics: dict, snapshots: dict, model=None, optimizer=None, scheduler=None,
               extra: dict | None = None) -> str:
        from rlhf_core.checkpoint.writer import finish_sharded, start_sharded
        from rlhf_core.record.iteration_store import code_version

        checkpoint, sums = None, None
        if model is not None:
            checkpoint = self.store.new_checkpoint_uri(epoch)
            sums = finish_sharded(start_sharded(checkpoint, ROLE, model, optimizer, scheduler))
        for stage, batch in snapshots.items():
            self.store.save(epoch, stage, batch, standalone=True)
        return self.store.commit_iteration(epoch, {
            "settings": asdict(self.spec), "settings_hash": self.hash, "data": self.data, "base": self.spec.base,
            "code_version": code_version(), "checkpoint": checkpoint, "checkpoint_sha256": sums, "metrics": metrics,
            "snapshots": {stage: self.store.stage_uri(epoch, stage) for stage in snapshots}, **(extra or {})},
            format=REWARD_MODEL_TRAINING_FORMAT)


def _epoch_order(train: list, seed: int, epoch: int) -> list:
    """Epoch E's order of the training pairs: a function of (seed, E) alone, so a resumed
    run sees what an uninterrupted one would have."""
    order = list(train)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def train_reward_model(spec: RewardModelTraining, log=print, folder: str | None = None) -> dict:
    """Train, evaluate and record each epoch in the store, write the folder; returns the
    provenance record. A run with committed epochs continues after the last one."""
    from rlhf_core.algorithms import bradley_terry_loss
    from rlhf_core.checkpoint.reader import load_sharded
    from rlhf_core.data.preferences import load_pairs, side_text
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
    record = _Record(spec, data)
    last = record.last()
    base = modeling.resolve_model_path(spec.base, spec.seed, field="--base")
    model, tokenizer = base_and_tokenizer(base, spec.seed)
    if spec.remove_padding:
        from rlhf_core.workers import packing

        packing.enable_packing(model, on_gpu=False)  # this loop runs on the CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # constant; checkpointed with the rest

    texts = {side: [side_text(tokenizer, p.prompt, getattr(p, side)) for p in held_out]
             for side in ("chosen", "rejected")}  # what the held-out snapshots show beside the scores

    def held_out_scores() -> tuple[dict, dict]:
        metrics, c, r = evaluate(model.eval(), tokenizer, held_out, spec.max_length, spec.batch_size,
                                 spec.remove_padding)
        return metrics, {"held_out": _scored_pairs(held_out, c, r, chosen_text=texts["chosen"],
                                                   rejected_text=texts["rejected"])}

    if last is None:
        curve, start, cut = [], 0, 0
        log(f"[rm] run {record.uri}")
        metrics, snapshots = held_out_scores() if held_out else ({}, {})
        if held_out:
            log(f"[rm] before training: held-out accuracy {metrics['accuracy']:.3f} margin {metrics['margin']:.3f} "
                f"({held} pairs)")
        curve.append({"epoch": 0, **metrics})
        record.commit(0, metrics, snapshots, extra={"curve": curve, "cut_sides": 0})
    else:
        curve, start, cut = [dict(row) for row in last["curve"]], last["iteration"], last["cut_sides"]
        if start > 0:
            from rlhf_core.record.checkpoints import checked_checkpoint_uri
            uri = checked_checkpoint_uri(record.store, last["checkpoint"], start,
                                         f"{record.store.iteration_uri(start)}/MANIFEST.json")
            load_sharded(uri, ROLE, model, optimizer, scheduler, expected=last["checkpoint_sha256"])
        log(f"[rm] run {record.uri}: continuing after epoch {start}")
    t0 = time.perf_counter()
    for epoch in range(start + 1, spec.epochs + 1):
        model.train()
        losses, seen, scored, steps = [], [], ([], []), []
        batches = _epoch_order(train, spec.seed, epoch)
        for step, begin in enumerate(range(0, len(batches), spec.batch_size)):
            batch = batches[begin:begin + spec.batch_size]
            chosen, rejected, batch_cut = _score_pairs(model, tokenizer, batch, spec.max_length, spec.remove_padding)
            cut += batch_cut if epoch == 1 else 0
            margins = [p.margin for p in batch]  # a pair without one asks for no margin (0)
            margin = torch.tensor([m or 0.0 for m in margins]) if any(m is not None for m in margins) else None
            loss = bradley_terry_loss(chosen, rejected, margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            seen += batch
            scored[0].append(chosen.detach())
            scored[1].append(rejected.detach())
            steps += [step] * len(batch)
        row = {"epoch": epoch, "train_loss": sum(losses) / len(losses)}
        snapshots = {"train_pairs": _scored_pairs(seen, torch.cat(scored[0]), torch.cat(scored[1]),
                                                  step=torch.tensor(steps, dtype=torch.int64))}
        if held_out:
            metrics, held_snapshot = held_out_scores()
            row.update(metrics)
            snapshots.update(held_snapshot)
        curve.append(row)
        record.commit(epoch, {k: v for k, v in row.items() if k != "epoch"}, snapshots, model, optimizer, scheduler,
                      extra={"curve": curve, "cut_sides": cut})
        log(f"[rm] epoch {epoch}/{spec.epochs} train loss {row['train_loss']:.4f}"
            + (f" | held-out accuracy {row['accuracy']:.3f} margin {row['margin']:.3f} ({held} pairs)"
               if held_out else "") + f" | {time.perf_counter() - t0:.0f}s")
    out = Path(folder or spec.out)  # folder: where the files go before they are published at spec.out
    write_folder(model, tokenizer, out)
    provenance = {"format": 1, "data": data, "base": spec.base, "settings": asdict(spec), "pairs": len(pairs),
                  "train_pairs": len(train), "held_out_pairs": held, "cut_sides": cut, "curve": curve,
                  "run": record.uri, "code_version": code_version()}
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=1, sort_keys=True))
    log(f"[rm] wrote {out} (reward_model.model.path={out}); trained on {len(train)} pairs of {data['uri']}"
        + (f", {sum(data['skipped'].values())} rows skipped" if data["skipped"] else "") + f"; run {record.uri}")
    return provenance


def train_reward_model_to(spec: RewardModelTraining, log=print) -> dict:
    """``train_reward_model`` whose ``spec.out`` may be an object-store prefix: the folder
    is written to a scratch folder, then published there (``SHA256SUMS`` last). An
    occupied prefix is refused before training."""
    import shutil
    import tempfile

    from rlhf_core.data.fetch import is_remote

    if not is_remote(spec.out):
        return train_reward_model(spec, log)
    target = spec.out
    check_empty_prefix(target)
    scratch = tempfile.mkdtemp(prefix="rlhf-rm-")
    try:
        local = f"{scratch}/reward-model"
        provenance = train_reward_model(spec, log, folder=local)
        publish(local, target)
        log(f"[rm] published {target} (reward_model.model.path={target})")
        return provenance
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def check_empty_prefix(uri: str, storage_options: dict | None = None) -> None:
    from rlhf_core.snapshot import fs as sfs

    loc = sfs.resolve(uri, storage_options)
    if loc.fs.exists(loc.path) and loc.fs.ls(loc.path):
        raise RewardModelTrainingError(f"--out: expected an empty prefix for the reward model; found objects under "
                                       f"{uri}")


def publish(folder: str, uri: str, storage_options: dict | None = None) -> None:
    """Upload a reward-model folder to an empty object-store prefix, file by file, then
    ``SHA256SUMS`` (``sha256sum``'s format) last: what ``reward_model.model.path`` fetches is
    checked against it, on stores whose ETags are not MD5s too."""
    import hashlib

    from rlhf_core.data.fetch import SUMS
    from rlhf_core.snapshot import fs as sfs

    check_empty_prefix(uri, storage_options)
    loc = sfs.resolve(uri, storage_options)
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

