"""The controller's prompt tokenizer: the model's ``tokenizer.json``, read with the
``tokenizers`` library alone.

Each Kubeflow iteration is a fresh controller process, and importing ``transformers``
costs it about two seconds on every iteration; encoding prompts needs only the
tokenizer's vocabulary and its special tokens. Models without a ``tokenizer.json``
(slow, sentencepiece-only tokenizers) fall back to ``transformers.AutoTokenizer``; the
two paths give the same ids (tests/test_config_and_inputs.py checks it).
"""

from __future__ import annotations

import json
from pathlib import Path


class PromptTokenizer:
    """``encode(text) -> ids`` without special tokens, plus the BOS and PAD ids."""

    def __init__(self, path: str) -> None:
        root = Path(path)
        self._hf = None
        if not (root / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path)
            self.bos_token_id, self.pad_token_id = self._hf.bos_token_id, self._hf.pad_token_id
            return
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        special = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in HF
            if (root / name).exists():
                special.update({k: v for k, v in json.loads((root / name).read_text()).items()
                                if k in ("bos_token", "pad_token") and v is not None})
        self.bos_token_id = self._token_id(special.get("bos_token"))
        self.pad_token_id = self._token_id(special.get("pad_token"))

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf(text, add_special_tokens=False)["input_ids"]
        return self._tok.encode(text, add_special_tokens=False).ids
