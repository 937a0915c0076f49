"""Prompt datasets: rows of (prompt, ground_truth, data_source), batched as DataProtos.

Sources: a parquet or jsonl file (columns ``prompt``, ``ground_truth``, ``data_source``,
optional ``extra_info``), or ``builtin:digits``. The loader keeps an explicit cursor
(epoch, position) so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from rlhf_core.protocol import DataProto, object_column

REQUIRED = ("prompt", "ground_truth", "data_source")


class DatasetError(ValueError):
    """The prompt dataset is missing, empty or malformed."""


def load_rows(source: str, seed: int = 0) -> list[dict]:
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name != "digits":
            raise DatasetError(f"unknown built-in dataset {name!r}; available: ['digits']")
        from rlhf_core.data.builtin import make_rows

        return make_rows(2048, seed=seed + 1)
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(source).to_pylist()
    elif source.endswith((".jsonl", ".json")):
        with open(source, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise DatasetError(f"data.train_files must be .parquet, .jsonl or builtin:<name>; found {source!r}")
    if not rows:
        raise DatasetError(f"{source}: the dataset is empty (no prompt rows)")
    for i, row in enumerate(rows):
        missing = [c for c in REQUIRED if c not in row]
        if missing:
            raise DatasetError(f"{source}: row {i} lacks column(s) {missing}; required: {list(REQUIRED)}")
    return rows


@dataclass
class Cursor:
    """Where the loader is: which epoch's permutation and how far into it."""

    epoch: int = 0
    position: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


class PromptLoader:
    """Yields prompt batches as DataProtos with left-padded token ids and a ``uid`` per
    prompt (``{epoch}-{row index}``: stable across restarts, shared by its n responses)."""

    def __init__(self, rows: list[dict], tokenizer, batch_size: int, max_prompt_length: int,
                 seed: int, shuffle: bool = True, cursor: Cursor | None = None) -> None:
        if not rows:
            raise DatasetError("the prompt dataset is empty")
        if batch_size > len(rows):
            raise DatasetError(f"data.train_batch_size ({batch_size}) exceeds the dataset size ({len(rows)})")
        self.rows, self.tokenizer = rows, tokenizer
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.seed, self.shuffle = seed, shuffle
        self.cursor = cursor or Cursor()
        self._encoded = [self._encode(i, r) for i, r in enumerate(rows)]

    def _encode(self, index: int, row: dict) -> list[int]:
        ids = self.tokenizer.encode(row["prompt"])
        if self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id] + ids
        if len(ids) > self.max_prompt_length:
            raise DatasetError(
                f"prompt of row {index} has {len(ids)} tokens, more than data.max_prompt_length="
                f"{self.max_prompt_length}; raise the limit or shorten the prompt "
                f"({row['prompt'][:60]!r}...)")
        return ids

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> DataProto:
        """The next ``batch_size`` prompts (an epoch's tail rolls into the next epoch)."""
        picked: list[tuple[int, int]] = []
        while len(picked) < self.batch_size:
            order = self._order(self.cursor.epoch)
            take = order[self.cursor.position:self.cursor.position + self.batch_size - len(picked)]
            picked += [(self.cursor.epoch, i) for i in take]
            self.cursor.position += len(take)
            if self.cursor.position >= len(order):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
        return self._collate(picked)

    def _collate(self, picked: list[tuple[int, int]]) -> DataProto:
        pad = self.tokenizer.pad_token_id or 0
        length = self.max_prompt_length
        ids = torch.full((len(picked), length), pad, dtype=torch.long)
        mask = torch.zeros((len(picked), length), dtype=torch.long)
        for row, (_, index) in enumerate(picked):
            tokens = self._encoded[index]
            ids[row, length - len(tokens):] = torch.tensor(tokens)
            mask[row, length - len(tokens):] = 1
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)

        rows = [self.rows[i] for _, i in picked]
        return DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
            non_tensors={
                "uid": object_column([f"{epoch}-{i}" for epoch, i in picked]),
                "raw_prompt": object_column([r["prompt"] for r in rows]),
                "ground_truth": object_column([str(r["ground_truth"]) for r in rows]),
                "data_source": object_column([r["data_source"] for r in rows]),
                "extra_info": object_column([r.get("extra_info") or {} for r in rows]),
            },
        )
