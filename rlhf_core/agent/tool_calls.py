"""Tool calls in a turn's text, in verl's ``hermes`` format:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
#: formats ``rollout.multi_turn.format`` may name (verl's parser names)
FORMATS = ("hermes",)


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it; ``error`` says why it cannot be run (the model is
    told, the call is counted, nothing crashes)."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for match in _CALL.finditer(text):
        raw = match.group(1).strip()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not JSON: {exc.msg} at {exc.pos}", raw))
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call is {"name": ..., "arguments": {...}}', raw))
            continue
        arguments = body.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(body["name"], {}, "the arguments of a tool call are a JSON object", raw))
            continue
        calls.append(ToolCall(body["name"], arguments, None, raw))
    return calls
