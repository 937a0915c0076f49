"""A batch of prompt rows in, the rollout's columns out, through agent loops: the rows'
trajectories become responses (every turn, generated and inserted), ``response_mask``
(1 where the policy generated), the engine's log-probs (0 elsewhere), the attention mask
over all of it, and the record of turns and calls as text columns."""

from __future__ import annotations

import json

import numpy as np
import torch

from rlhf_core.agent.runner import AgentContext, AgentRow, run_trajectories
from rlhf_core.agent.trajectory import Trajectory, recorded_answers
from rlhf_core.protocol import DataProto, object_column


class AgentBatchError(ValueError):
    """A row the agent loop cannot take (one line)."""


#: The weight version of a row that generated nothing (an agent's trajectory with no turn).
NO_VERSION = -1


def generated_versions(weight_version: torch.Tensor) -> set[int]:
    """The weight versions that generated a batch's rows (its ``weight_version`` column)."""
    return {v for v in weight_version.tolist() if v != NO_VERSION}


def recorded_calls(non_tensor_batch: dict) -> dict[int, str] | None:
    """What a committed agent batch recorded of its tools: each row's sample seed -> its
    ``agent/tool_calls`` (what a replay or a resume gives again instead of calling a
    tool); None for a batch no agent generated."""
    if "agent/seed" not in non_tensor_batch:
        return None
    return dict(zip((int(s) for s in non_tensor_batch["agent/seed"].tolist()),
                    non_tensor_batch["agent/tool_calls"].tolist()))


def rows_of(prompts: DataProto, default_loop: str, replaying: bool = False) -> list[AgentRow]:
    """Each prompt row as an agent loop's input; ``replaying``: with the calls recorded in
    the batch's ``agent/tool_calls`` column (a rollout replayed from its record)."""
    nt = prompts.non_tensor_batch
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    seeds = prompts.batch["sample_seed"].tolist()
    chats = nt.get("raw_chat")
    names = nt.get("agent_name")
    rows = []
    for i in range(len(prompts)):
        extra = nt["extra_info"][i] if "extra_info" in nt else {}
        extra = extra if isinstance(extra, dict) else {}
        chat = chats[i] if chats is not None else None
        messages = list(chat) if isinstance(chat, (list, tuple, np.ndarray)) else \
            [{"role": "user", "content": str(nt["raw_prompt"][i])}]
        recorded = recorded_answers(nt["agent/tool_calls"][i]) if replaying else None
        interaction = extra.get("interaction_kwargs")
        rows.append(AgentRow(i, ids[i][mask[i]].tolist(), [dict(m) for m in messages], int(seeds[i]),
                             str(names[i]) if names is not None and names[i] else default_loop,
                             dict(extra.get("tools_kwargs") or {}), recorded,
                             dict(interaction) if isinstance(interaction, dict) else None))
    return rows


def batch_of(prompts: DataProto, trajectories: list[Trajectory], response_length: int, pad_id: int) -> DataProto:
    """The rollout's columns. ``prompts`` is the trajectory's first prompt (the tool agent
    renders it again with the tools' schemas), left-padded to the batch's prompt width."""
    width = prompts.batch["input_ids"].shape[1]
    n = len(trajectories)
    longest = max(len(t.prompt_ids) for t in trajectories)
    if longest > width:
        raise AgentBatchError(f"data.max_prompt_length: expected prompts of at most {width} tokens; found one of "
                              f"{longest} once rendered with the tools' schemas (raise data.max_prompt_length)")
    prompt_ids = torch.full((n, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width), dtype=torch.long)
    responses = torch.full((n, response_length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, response_length), dtype=torch.long)
    valid = torch.zeros((n, response_length), dtype=torch.long)
    log_probs = torch.zeros((n, response_length), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        prompt_ids[i, width - len(t.prompt_ids):] = torch.tensor(t.prompt_ids, dtype=torch.long)
        prompt_mask[i, width - len(t.prompt_ids):] = 1
        k = min(len(t.response_ids), response_length)
        if k:
            responses[i, :k] = torch.tensor(t.response_ids[:k], dtype=torch.long)
            response_mask[i, :k] = torch.tensor(t.response_mask[:k], dtype=torch.long)
            log_probs[i, :k] = torch.tensor(t.log_probs[:k], dtype=torch.float32)
            valid[i, :k] = 1
    attention_mask = torch.cat([prompt_mask, valid], dim=1)
    out = DataProto.from_dict({
        "prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
        "rollout_log_probs": log_probs * response_mask, "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "weight_version": torch.tensor([min(t.versions) if t.versions else NO_VERSION for t in trajectories],
                                       dtype=torch.long),
    }, {
        "agent/turns": object_column([json.dumps(t.turns, ensure_ascii=False) for t in trajectories]),
        "agent/tool_calls": object_column([json.dumps(t.tool_calls, ensure_ascii=False, default=str)
                                           for t in trajectories]),
        "agent/num_turns": object_column([t.assistant_turns + t.user_turns + 1 for t in trajectories]),
        "agent/tool_reward": object_column([float(sum(t.tool_rewards)) for t in trajectories]),
        "agent/cut": object_column([bool(t.cut) for t in trajectories]),
        "agent/seed": object_column([int(t.seed) for t in trajectories]),  # what a replay finds its record by
    })
    return out


def agent_metrics(trajectories: list[Trajectory], stats: dict) -> dict[str, float]:
    """verl's multi-turn metric names, with ours for tool calls and inserted tokens."""
    def mean(values):
        return float(np.mean(values)) if len(values) else 0.0

    turns = [t.assistant_turns + t.user_turns + 1 for t in trajectories]
    tool_calls = [[c for c in t.tool_calls if c.get("index") != -1] for t in trajectories]  # -1: an interaction's
    calls = [len([c for c in cs if c.get("status") != "skipped"]) for cs in tool_calls]
    errors = [len([c for c in cs if c.get("status") in ("error", "timeout")]) for cs in tool_calls]
    generated = [t.generated_tokens for t in trajectories]
    inserted = [len(t.response_ids) - t.generated_tokens for t in trajectories]
    return {"num_turns/mean": mean(turns), "num_turns/max": float(max(turns, default=0)),
            "num_turns/min": float(min(turns, default=0)),
            "agent/tool_calls/mean": mean(calls), "agent/tool_errors/mean": mean(errors),
            "agent/tool_timeouts": float(sum(c.get("status") == "timeout" for t in trajectories
                                             for c in t.tool_calls)),
            "agent/truncated_answers": float(sum(bool(c.get("truncated")) for t in trajectories
                                                 for c in t.tool_calls)),
            "agent/generated_tokens/mean": mean(generated), "agent/inserted_tokens/mean": mean(inserted),
            "agent/cut_fraction": mean([float(t.cut) for t in trajectories]),
            "agent/interaction_turns/mean": mean([len(t.turn_scores) for t in trajectories]),
            "agent/turn_score/mean": mean([s for t in trajectories for s in t.turn_scores]),
            "agent/rounds": float(stats.get("rounds", 0))}


def run_batch(prompts: DataProto, ctx: AgentContext, loops: dict, default_loop: str, generate_round,
              pad_id: int, replaying: bool = False) -> tuple[DataProto, dict[str, float]]:
    rows = rows_of(prompts, default_loop, replaying)
    check_prompt_lengths(rows, loops, ctx, prompts.batch["input_ids"].shape[1])
    trajectories, stats = run_trajectories(rows, loops, ctx, generate_round)
    return batch_of(prompts, trajectories, ctx.response_length, pad_id), agent_metrics(trajectories, stats)


def check_prompt_lengths(rows: list[AgentRow], loops: dict, ctx: AgentContext, width: int) -> None:
    """Every row's first prompt as its loop renders it (the tool agent adds the tools'
    schemas) fits the batch's prompt width, checked before anything is generated."""
    for row in rows:
        loop = loops.get(row.agent_name)
        render = getattr(loop, "prompt_ids", None)
        length = len(render(ctx, row)) if render is not None else len(row.prompt_ids)
        if length > width:
            raise AgentBatchError(f"data.max_prompt_length: expected prompts of at most {width} tokens; found one "
                                  f"of {length} (row {row.index}) once rendered with the tools' schemas (raise "
                                  f"data.max_prompt_length)")
