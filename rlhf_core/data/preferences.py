"""Preference pairs for training a reward model: rows of (prompt, chosen, rejected).

Read from a parquet or JSONL file (a path, or an ``s3://`` / ``gs://`` URI fetched once
into the cache and checked), in the layouts TRL's ``RewardTrainer`` and OpenRLHF's
``train_rm`` read:

- text: ``prompt`` text, ``chosen`` / ``rejected`` response texts;
- conversational: ``prompt`` a list of chat messages and ``chosen`` / ``rejected`` the
  assistant's messages, or, without ``prompt`` (TRL's implicit prompt), ``chosen`` and
  ``rejected`` whole conversations that share their leading messages;
- an optional ``margin`` (a number: how much surer the annotator was, Llama 2's).

Each side becomes the text the policy would have produced (``side_text``): the prompt as
the prompt loader lays it out, then the response and the EOS token. That is what a
reward model sharing the policy's tokenizer scores during PPO (the sampled tokens as they
are), so it is trained on exactly that representation.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from dataclasses import dataclass

#: bounds on what is read before anything is tokenized
MAX_FILE_BYTES = 2 * 2**30
MAX_ROW_CHARS = 4 * 2**20


class PreferenceDataError(ValueError):
    """A preference file or row that cannot be trained on; one line naming the row."""


@dataclass(frozen=True)
class PreferencePair:
    row: int
    prompt: list[dict] | str          # chat messages, or text
    chosen: str
    rejected: str
    margin: float | None = None


def load_pairs(source: str, skip_bad_rows: bool = False) -> tuple[list[PreferencePair], dict]:
    """The file's pairs and what was read: ``{"uri", "sha256", "rows", "skipped"}``
    (``skipped``: {reason: count} when ``skip_bad_rows``; otherwise the first bad row is
    refused, naming it)."""
    from rlhf_core.data import fetch

    local = source[len("file://"):] if source.startswith("file://") else source
    if fetch.is_remote(source):
        try:
            local = fetch.fetch(source, "--data")
        except fetch.FetchError as exc:
            raise PreferenceDataError(str(exc)) from None
    try:
        size = os.path.getsize(local)
        if size > MAX_FILE_BYTES:
            raise PreferenceDataError(f"{source}: expected at most {MAX_FILE_BYTES} bytes of preference pairs; "
                                      f"found {size}")
        raw = open(local, "rb").read()
    except OSError as exc:
        raise PreferenceDataError(f"--data: expected a readable .parquet or .jsonl file; found {source!r} "
                                  f"({exc.strerror})") from None
    if source.endswith(".parquet"):
        import io

        import pyarrow.parquet as pq

        import pyarrow as pa

        try:
            rows = pq.read_table(io.BytesIO(raw)).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PreferenceDataError(f"{source}: expected a readable parquet file; found one pyarrow cannot read "
                                      f"({reason[:120]})") from None
    elif source.endswith((".jsonl", ".json")):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            raise PreferenceDataError(f"{source}: line {line}: expected UTF-8 text; found byte "
                                      f"{raw[exc.start]:#04x} at offset {exc.start}") from None
        rows = []
        # JSON Lines ends a row at "\n" alone: U+2028 and the other characters str.splitlines
        # breaks at may stand inside a JSON string
        for i, line in enumerate(text.split("\n")):
            if len(line) > MAX_ROW_CHARS:
                raise PreferenceDataError(f"{source}: line {i + 1}: expected at most {MAX_ROW_CHARS} characters; "
                                          f"found {len(line)}")
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise PreferenceDataError(f"{source}: line {i + 1}: expected a JSON object; found "
                                              f"{line[:40]!r}") from None
    else:
        raise PreferenceDataError(f"--data: expected a .parquet or .jsonl file; found {source!r}")
    pairs, skipped = [], {}
    for i, row in enumerate(rows):
        try:
            pairs.append(_pair(i, row))
        except PreferenceDataError as exc:
            if not skip_bad_rows:
                raise PreferenceDataError(f"{source}: {exc} (or --skip-bad-rows to count and skip such rows)") \
                    from None
            reason = str(exc).split(": ", 1)[1]
            skipped[reason] = skipped.get(reason, 0) + 1
    if len(pairs) < 2:
        raise PreferenceDataError(f"{source}: expected at least 2 usable preference pairs; found {len(pairs)}"
                                  + (f" ({sum(skipped.values())} rows skipped)" if skipped else ""))
    return pairs, {"uri": source, "sha256": hashlib.sha256(raw).hexdigest(), "rows": len(rows), "skipped": skipped}


def _messages(value, what: str, row: int) -> list[dict]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise PreferenceDataError(f"row {row}: {what}: expected chat messages {{'role': str, 'content': str}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _lone_surrogate(value) -> bool:
    """Whether a string in ``value`` holds half of a UTF-16 pair (JSON's "\\ud800"), which no
    tokenizer can encode."""
    if isinstance(value, str):
        return any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(v) for v in value.values())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False


def _pair(row: int, data) -> PreferencePair:
    if not isinstance(data, dict):
        raise PreferenceDataError(f"row {row}: expected an object with chosen and rejected; found "
                                  f"{type(data).__name__}")
    if _lone_surrogate(data):
        raise PreferenceDataError(f"row {row}: expected text; found a lone UTF-16 surrogate (half a character)")
    for side in ("chosen", "rejected"):
        if data.get(side) in (None, "", []):
            raise PreferenceDataError(f"row {row}: {side} is missing or empty")
    prompt, chosen, rejected = data.get("prompt"), data["chosen"], data["rejected"]
    if isinstance(chosen, list) or isinstance(rejected, list):
        chosen, rejected = _messages(chosen, "chosen", row), _messages(rejected, "rejected", row)
        if prompt is None:  # TRL's implicit prompt: the shared leading messages
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        for side, turns in (("chosen", chosen), ("rejected", rejected)):
            if len(turns) != 1 or turns[0]["role"] != "assistant":
                raise PreferenceDataError(f"row {row}: {side}: expected one assistant message after the prompt; "
                                          f"found {[m['role'] for m in turns]}")
        chosen, rejected = chosen[0]["content"], rejected[0]["content"]
        if isinstance(prompt, list):
            prompt = _messages(prompt, "prompt", row) if prompt else []
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        raise PreferenceDataError(f"row {row}: chosen and rejected: expected text or chat messages")
    if prompt is None:
        prompt = ""
    if isinstance(prompt, list) and prompt:
        prompt = _messages(prompt, "prompt", row)
    if not isinstance(prompt, (str, list)):
        raise PreferenceDataError(f"row {row}: prompt: expected text or chat messages; found {type(prompt).__name__}")
    if not chosen.strip() or not rejected.strip():
        raise PreferenceDataError(f"row {row}: {'chosen' if not chosen.strip() else 'rejected'} is missing or empty")
    if chosen == rejected:
        raise PreferenceDataError(f"row {row}: chosen and rejected are identical")
    margin = data.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, numbers.Real)
                               or not math.isfinite(margin)):
        raise PreferenceDataError(f"row {row}: margin: expected a finite number; found {margin!r}")
    return PreferencePair(row, prompt, chosen, rejected, None if margin is None else float(margin))


def side_text(tokenizer, prompt: list[dict] | str, response: str) -> str:
    """One side of a pair as the policy would have produced it under ``tokenizer`` (the
    prompt loader's layout: chat messages through the chat template with the generation
    prompt; text as it is, after the BOS token when the tokenizer has one), then the
    response and the EOS token."""
    if isinstance(prompt, list):
        if not tokenizer.chat_template:
            raise PreferenceDataError("--base: expected a tokenizer with a chat template for chat-message prompts; "
                                      "found none")
        head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) if prompt else ""
    else:
        head = (tokenizer.bos_token or "") + prompt
    return head + response + (tokenizer.eos_token or "")
