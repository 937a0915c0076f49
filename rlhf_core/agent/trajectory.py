"""One row's trajectory: the tokens after its prompt (generated and inserted), which of
them the policy generated, their log-probs, and the record of every turn and tool call.
The record goes into the rollout snapshot as JSON text columns (data, never code)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Trajectory:
    prompt_ids: list[int]
    seed: int
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    #: {"role": "assistant"|"tool"|"user", "start", "end" (token span in the response), "text"}
    turns: list[dict] = field(default_factory=list)
    #: {"turn", "name", "arguments", "status" (ok|error|timeout), "answer" (as given to the
    #: model), "truncated", "error", "started", "ended", "reward"}
    tool_calls: list[dict] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    #: each interaction reply's score (verl's ``turn_scores``)
    turn_scores: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    cut: bool = False     # the turns together reached the response length
    version: int | None = None  # the weight version of the last turn (every turn's: ``versions``)
    versions: list[int] = field(default_factory=list)

    def append(self, role: str, tokens: list[int], text: str, log_probs: list[float] | None = None) -> None:
        start = len(self.response_ids)
        self.response_ids += tokens
        generated = role == "assistant"
        self.response_mask += [int(generated)] * len(tokens)
        self.log_probs += (log_probs or [0.0] * len(tokens)) if generated else [0.0] * len(tokens)
        self.turns.append({"role": role, "start": start, "end": len(self.response_ids), "text": text})

    @property
    def generated_tokens(self) -> int:
        return sum(self.response_mask)

    def record(self) -> dict[str, str]:
        """The row's record as text columns of the rollout snapshot."""
        return {"agent/turns": json.dumps(self.turns, ensure_ascii=False),
                "agent/tool_calls": json.dumps(self.tool_calls, ensure_ascii=False, default=str)}


def recorded_answers(tool_calls_json: str) -> list[dict]:
    """A row's recorded tool calls (``agent/tool_calls``), checked to be what the record
    writes: a list of objects with a name and an answer text."""
    calls = json.loads(tool_calls_json)
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("answer"), str)
                                              and isinstance(c.get("name"), str) for c in calls):
        raise ValueError("agent/tool_calls: expected a JSON list of calls, each with a name and an answer text")
    return calls
