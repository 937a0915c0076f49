"""Tokens exactly as the model sees them: the prompt rendered once through the chat
template (with the tools' schemas), then each inserted message rendered alone and
appended to the tokens so far (the whole chat is never re-tokenized: what the policy
generated stays the tokens it generated)."""

from __future__ import annotations

#: a conversation the inserted messages are rendered after, and cut from: the template's
#: own preamble (a default system prompt) is in both renderings and drops out
_BEFORE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TemplateError(ValueError):
    """The chat template cannot render what the loop needs (one line)."""


def prompt_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def message_tokens(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens ``messages`` add after an assistant turn, up to the next assistant
    turn's start (the generation prompt)."""
    before = tokenizer.apply_chat_template(_BEFORE, add_generation_prompt=False, tokenize=False)
    after = tokenizer.apply_chat_template(_BEFORE + messages, add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise TemplateError("the chat template renders a conversation differently once messages follow it: "
                            "inserted messages cannot be appended to the tokens so far")
    return tokenizer.encode(after[len(before):].lstrip("\n"), add_special_tokens=False)


def check_tokenization(tokenizer, prompt_ids: list[int], response_ids: list[int], messages: list[dict],
                       tools: list[dict] | None, mode: str) -> str | None:
    """verl's ``tokenization_sanity_check_mode``: whether the tokens built turn by turn
    decode to what rendering the whole chat at once gives (``disable``: not checked;
    ``strict``/``ignore_strippable``: compared, the latter ignoring whitespace at the
    edges of each message). Returns the difference, or None."""
    if mode == "disable":
        return None
    built = tokenizer.decode(prompt_ids + response_ids, skip_special_tokens=False)
    whole = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=False, tokenize=False)
    if mode == "ignore_strippable":
        built, whole = "".join(built.split()), "".join(whole.split())
    if whole.startswith(built) or built.startswith(whole):
        return None
    at = next((i for i, (a, b) in enumerate(zip(built, whole)) if a != b), min(len(built), len(whole)))
    return f"the tokens differ from the rendered chat at character {at}: {built[at:at + 40]!r} vs {whole[at:at + 40]!r}"
