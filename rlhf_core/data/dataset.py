"""Prompt datasets: rows of (prompt, ground_truth, data_source), batched as DataProtos.

Sources: a parquet or jsonl file (a path, or an ``s3://`` / ``gs://`` URI fetched once per
node into the cache: ``data/fetch.py``), or ``builtin:digits``. Two row formats load:

- verl's, as its data preprocessing writes it (e.g. GSM8K): ``prompt`` a list of chat
  messages (``{"role", "content"}``), ``data_source``, ``reward_model: {"style",
  "ground_truth"}``, ``extra_info``; the prompt goes through the model's chat template;
- ours: ``prompt`` text, ``ground_truth``, ``data_source``, optional ``extra_info``.

The loader keeps an explicit cursor (epoch, position) so a resumed run continues with
exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from rlhf_core.protocol import DataProto, object_column

REQUIRED = ("prompt", "data_source")
TRUNCATION = ("error", "left", "right")


class DatasetError(ValueError):
    """The prompt dataset is missing, empty or malformed."""


def load_rows(source: str, seed: int = 0, field: str = "data.train_files", prompt_key: str = "prompt",
              source_key: str = "data_source") -> list[dict]:
    """Rows as ``{prompt, ground_truth, data_source, extra_info}``; ``prompt`` is text or a
    list of chat messages, read from the column ``prompt_key`` (verl's ``data.prompt_key``),
    ``data_source`` from ``source_key`` (``data.reward_fn_key``). ``source`` is a local
    path, a ``file://``, ``s3://`` or ``gs://`` URI (fetched once per node into the cache),
    or ``builtin:<name>``."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name == "calculator":
            from rlhf_core.data.calculator import make_rows as calculator_rows

            return calculator_rows(2048, seed=seed + 1)
        if name != "digits":
            raise DatasetError(f"unknown built-in dataset {name!r}; available: ['calculator', 'digits']")
        from rlhf_core.data.builtin import make_rows

        return make_rows(2048, seed=seed + 1)
    from rlhf_core.data import fetch

    local = source[len("file://"):] if source.startswith("file://") else source
    if source.endswith((".parquet", ".jsonl", ".json")) and fetch.is_remote(source):
        try:
            local = fetch.fetch(source, field)  # once per node, into the cache, checked
        except fetch.FetchError as exc:
            raise DatasetError(str(exc)) from None
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(local).to_pylist()
    elif source.endswith((".jsonl", ".json")):
        with open(local, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise DatasetError(f"{field} must be .parquet, .jsonl or builtin:<name>; found {source!r}")
    if not rows:
        raise DatasetError(f"{source}: the dataset is empty (no prompt rows)")
    return [_normalize(source, i, row, prompt_key, source_key) for i, row in enumerate(rows)]


def _normalize(source: str, index: int, row: dict, prompt_key: str = "prompt",
               source_key: str = "data_source") -> dict:
    required = [prompt_key, source_key]
    missing = [c for c in required if c not in row]
    if missing:
        renamed = {"prompt": prompt_key, "data_source": source_key}
        keys = "" if renamed == dict(zip(REQUIRED, REQUIRED)) else " (data.prompt_key, data.reward_fn_key)"
        raise DatasetError(f"{source}: row {index} lacks column(s) {missing}; required: {required}{keys} and "
                           f"ground_truth (or verl's reward_model.ground_truth)")
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DatasetError(f"{source}: row {index} prompt: expected chat messages "
                                   f"{{'role': str, 'content': str}}; found {message!r}")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    elif not isinstance(prompt, str):
        raise DatasetError(f"{source}: row {index} prompt: expected text or a list of chat messages; found "
                           f"{type(prompt).__name__}")
    if "ground_truth" in row:
        truth = row["ground_truth"]
    elif isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"]:
        truth = row["reward_model"]["ground_truth"]
    else:
        raise DatasetError(f"{source}: row {index} lacks ground_truth (ours) or reward_model.ground_truth "
                           f"(verl's format)")
    out = {"prompt": prompt, "ground_truth": truth, "data_source": row[source_key],
           "extra_info": row.get("extra_info") or {}}
    if row.get("agent_name") is not None:  # verl's: the agent loop this row runs through
        if not isinstance(row["agent_name"], str):
            raise DatasetError(f"{source}: row {index} agent_name: expected a loop's name; found "
                               f"{type(row['agent_name']).__name__}")
        out["agent_name"] = row["agent_name"]
    return out


def _truth(value):
    """A ground truth as a reward function takes it: text (as before), or, for searchR1's
    ``{"target": [...]}`` and a code task's test cases, plain dicts and lists."""
    def plain(v):
        if hasattr(v, "tolist"):  # parquet's arrays
            v = v.tolist()
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    value = plain(value)
    return value if isinstance(value, (dict, list)) else str(value)


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
                 seed: int, shuffle: bool = True, cursor: Cursor | None = None, truncation: str = "error",
                 filter_overlong: bool = False, keep_chat: bool = False) -> None:
        """``filter_overlong`` (``data.filter_overlong_prompts``): the rows whose prompt is
        longer than ``max_prompt_length`` tokens are dropped first, as verl's dataset does.
        ``keep_chat``: batches carry each prompt's chat messages in a ``raw_chat`` column
        (None for a prompt given as text), verl's ``return_raw_chat``: a reward model with
        a chat template of its own re-templates the conversation from them."""
        if not rows:
            raise DatasetError("the prompt dataset is empty")
        self.rows, self.tokenizer = rows, tokenizer
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.seed, self.shuffle = seed, shuffle
        if truncation not in TRUNCATION:
            raise DatasetError(f"data.truncation: expected one of {', '.join(TRUNCATION)}; found {truncation!r}")
        self.truncation = truncation
        self.keep_chat = keep_chat
        self.cursor = cursor or Cursor()
        self._texts = [self._text(i, r) for i, r in enumerate(rows)]
        if filter_overlong:
            kept = [i for i, text in enumerate(self._texts) if len(self._tokens(i, text)) <= max_prompt_length]
            if not kept:
                raise DatasetError(f"data.filter_overlong_prompts: every one of the {len(rows)} prompts is longer "
                                   f"than data.max_prompt_length={max_prompt_length} tokens")
            self.rows, self._texts = [rows[i] for i in kept], [self._texts[i] for i in kept]
        if batch_size > len(self.rows):
            raise DatasetError(f"data.train_batch_size ({batch_size}) exceeds the dataset size ({len(self.rows)}"
                               f"{' after data.filter_overlong_prompts' if filter_overlong else ''})")
        self._encoded = [self._encode(i, text) for i, text in enumerate(self._texts)]

    def at(self, cursor: Cursor) -> "PromptLoader":
        """This loader's prompts (tokenized once) read from ``cursor`` on: a second reader of
        the same data, with a position of its own (the asynchronous rollouter's)."""
        import copy

        other = copy.copy(self)
        other.cursor = Cursor(cursor.epoch, cursor.position)
        return other

    @property
    def iterations_per_epoch(self) -> int:
        """verl's dataloader length (``drop_last=True``): whole batches in one pass."""
        return len(self.rows) // self.batch_size

    def _text(self, index: int, row: dict) -> str:
        """The prompt as the model reads it: chat messages through the model's template."""
        if isinstance(row["prompt"], str):
            return row["prompt"]
        try:
            return self.tokenizer.apply_chat_template(row["prompt"])
        except ValueError as exc:
            raise DatasetError(f"row {index}: {exc}") from None

    def _tokens(self, index: int, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        chat = not isinstance(self.rows[index]["prompt"], str)
        if self.tokenizer.bos_token_id is not None and not chat:  # a chat template writes its own BOS
            ids = [self.tokenizer.bos_token_id] + ids
        return ids

    def _encode(self, index: int, text: str) -> list[int]:
        ids = self._tokens(index, text)
        if len(ids) <= self.max_prompt_length:
            return ids
        if self.truncation == "left":  # keep the end: the question and the assistant turn's start
            return ids[-self.max_prompt_length:]
        if self.truncation == "right":
            return ids[:self.max_prompt_length]
        raise DatasetError(
            f"prompt of row {index} has {len(ids)} tokens, more than data.max_prompt_length="
            f"{self.max_prompt_length}; raise the limit, shorten the prompt or set data.truncation=left|right "
            f"({text[:60]!r}...)")

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
        columns = {
            "uid": object_column([f"{epoch}-{i}" for epoch, i in picked]),
            "raw_prompt": object_column([self._texts[i] for _, i in picked]),
            "ground_truth": object_column([_truth(r["ground_truth"]) for r in rows]),
            "data_source": object_column([r["data_source"] for r in rows]),
            "extra_info": object_column([r.get("extra_info") or {} for r in rows]),
        }
        if self.keep_chat:
            columns["raw_chat"] = object_column([r["prompt"] if isinstance(r["prompt"], list) else None
                                                 for r in rows])
        if any("agent_name" in r for r in rows):
            columns["agent_name"] = object_column([r.get("agent_name", "") for r in rows])
        return DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, non_tensors=columns)
