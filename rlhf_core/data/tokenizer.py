"""The controller's prompt tokenizer: the model's ``tokenizer.json``, read with the
``tokenizers`` library alone, and its chat template, rendered with jinja2 as
``transformers`` renders it.

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
        self.path = path
        self._hf = None
        self._template = None
        if not (root / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path)
            self.bos_token_id, self.pad_token_id = self._hf.bos_token_id, self._hf.pad_token_id
            return
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in HF
            if (root / name).exists():
                config.update(json.loads((root / name).read_text()))
        self._special = {k: self._content(v) for k, v in config.items()
                         if k in SPECIAL_TOKENS and v is not None}
        self.bos_token_id = self._token_id(self._special.get("bos_token"))
        self.pad_token_id = self._token_id(self._special.get("pad_token"))
        # transformers 5 writes the template to chat_template.jinja, earlier versions into the config
        if (root / "chat_template.jinja").exists():
            self._template = (root / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            self._template = config["chat_template"]

    @staticmethod
    def _content(token):
        return token.get("content") if isinstance(token, dict) else token

    def _token_id(self, token) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf(text, add_special_tokens=False)["input_ids"]
        return self._tok.encode(text, add_special_tokens=False).ids

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for chat ``messages``, ending where the assistant's turn starts."""
        if self._hf is not None:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if self._template is None:
            raise ValueError(f"model {self.path}: no chat template (chat_template.jinja or tokenizer_config.json "
                             f"chat_template), but the prompts are chat messages")
        return _render(self._template, messages, self._special)


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _render(template: str, messages: list[dict], special: dict) -> str:
    """Render like ``transformers``: a sandboxed jinja2 environment with trimmed blocks,
    loop controls, ``tojson`` and ``raise_exception``, the special tokens as variables."""
    from jinja2 import ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
