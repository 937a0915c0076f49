"""Runs a batch's trajectories side by side: each row's loop is a coroutine; every turn is a
request, and the requests of the turns waiting together go to the rollout as one call (the
manager balances them over the replicas, the n samples of a prompt together). Tools run
while the others wait for their turn; a turn's calls run side by side.

What decides a trajectory is fixed by the row: its turns' seeds derive from its sample
seed, requests are sent in row order, and with recorded answers (a replay) no tool runs:
the answer the model was given is given again, and a call that differs from the one
recorded is a replay difference, not a new call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from rlhf_core.agent.tool_calls import ToolCall
from rlhf_core.agent.tools.base import BaseTool, argument_error
from rlhf_core.agent.trajectory import Trajectory
from rlhf_core.rollout.engine import Completion, GenerationRequest

#: how long one tool call may take before its answer is a timeout error
TOOL_TIMEOUT_S = 60.0


class ReplayMismatch(RuntimeError):
    """A replayed trajectory called a tool differently from its record."""


@dataclass
class AgentRow:
    index: int
    prompt_ids: list[int]        # as the dataset rendered the prompt (single-turn's)
    messages: list[dict]         # the chat (raw_prompt), rendered again with the tools
    seed: int
    agent_name: str
    tools_kwargs: dict = field(default_factory=dict)
    #: replay: the calls recorded for this row (answers given instead of calling a tool)
    recorded_calls: list[dict] | None = None
    #: extra_info.interaction_kwargs: which interaction answers it (``name``) and its arguments
    interaction_kwargs: dict | None = None


@dataclass
class AgentContext:
    tokenizer: object
    settings: object              # rollout.multi_turn
    response_length: int
    #: the tools by name, or a function building them when first called (a replay, which
    #: gives recorded answers, builds none: no tool class is imported)
    tools: dict[str, BaseTool] | Callable[[], dict[str, BaseTool]]
    eos_ids: tuple[int, ...] = ()
    generate: Callable = None     # set by run_trajectories
    tool_timeout_s: float = TOOL_TIMEOUT_S
    #: the schemas rendered into the prompt (default: the built tools')
    schemas: list[dict] | None = None
    #: the interactions (simulated users) by name, or a function building them; None: none
    interactions: dict | Callable | None = None

    @property
    def tool_schemas(self) -> list[dict]:
        if self.schemas is not None:
            return self.schemas
        return [tool.tool_schema for tool in self.built_tools().values()]

    def built_tools(self) -> dict[str, BaseTool]:
        if callable(self.tools):
            self.tools = self.tools()
        return self.tools

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def ended(self, tokens: list[int]) -> bool:
        return bool(tokens) and tokens[-1] in self.eos_ids

    @staticmethod
    def turn_seed(seed: int, turn: int) -> int:
        """Turn 0 samples with the row's seed; later turns with seeds derived from it."""
        return seed if turn == 0 else (seed * 1_000_003 + turn * 7919) % (2 ** 31 - 1)

    def _truncated(self, text: str) -> tuple[str, bool]:
        limit, side = self.settings.max_tool_response_length, self.settings.tool_response_truncate_side
        if not text or len(text) <= limit:
            return text, False
        if side == "left":  # verl's names: "left" keeps the start
            return text[:limit] + "...(truncated)", True
        if side == "right":
            return "(truncated)..." + text[-limit:], True
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[-half:], True

    async def call_tool(self, row: AgentRow, trajectory: Trajectory, turn: int, k: int, call: ToolCall) -> str:
        """The answer the model is given for one call; the call is recorded."""
        record = {"turn": turn, "index": k, "name": call.name, "arguments": call.arguments, "started": time.time()}
        if row.recorded_calls is not None:
            return self._replayed(row, trajectory, record, call)
        reward = 0.0
        if call.error is not None:
            status, text = "error", f"Error: {call.error}"
        elif call.name not in self.built_tools():
            status, text = "error", f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}"
        elif (problem := argument_error(self.tools[call.name].tool_schema, call.arguments)) is not None:
            status, text = "error", f"Error: {call.name}: {problem}"
        else:
            status, text, reward = await self._run(row, call)
        text, truncated = self._truncated(text or "")
        record.update(status=status, answer=text, truncated=truncated, reward=reward, ended=time.time(),
                      error=call.error)
        trajectory.tool_calls.append(record)
        trajectory.tool_rewards.append(reward)
        return text

    async def _run(self, row: AgentRow, call: ToolCall) -> tuple[str, str, float]:
        tool, instance = self.tools[call.name], None
        try:
            async def create_and_execute():
                nonlocal instance
                kwargs = (row.tools_kwargs or {}).get(call.name, {}) or {}
                instance, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
                return await tool.execute(instance, call.arguments, **kwargs.get("execute_kwargs", {}))

            response, reward, _ = await asyncio.wait_for(create_and_execute(), self.tool_timeout_s)
            # a text or a ToolResponse (verl's tools have returned both)
            return "ok", (response if isinstance(response, str) else response.text) or "", float(reward or 0.0)
        except asyncio.TimeoutError:
            return "timeout", f"Error: the tool {call.name} did not answer within {self.tool_timeout_s:g} s", 0.0
        except Exception as exc:  # noqa: BLE001 - a tool's failure is its answer (verl's text)
            return "error", f"Error when executing tool: {exc}", 0.0
        finally:
            if instance is not None:
                try:
                    await tool.release(instance)
                except Exception:  # noqa: BLE001 - releasing is best effort
                    pass

    def _replayed(self, row: AgentRow, trajectory: Trajectory, record: dict, call: ToolCall) -> str:
        recorded = next((c for c in row.recorded_calls if c.get("turn") == record["turn"]
                         and c.get("index") == record["index"]), None)
        if recorded is None or recorded["name"] != call.name or recorded.get("arguments") != call.arguments:
            raise ReplayMismatch(f"row {row.index}, turn {record['turn']}: the replay called {call.name}"
                                 f"({call.arguments}); the record has {recorded and recorded['name']}"
                                 f"({recorded and recorded.get('arguments')})")
        trajectory.tool_calls.append(dict(recorded))
        trajectory.tool_rewards.append(float(recorded.get("reward", 0.0)))
        return recorded["answer"]

    async def interact(self, row: AgentRow, trajectory: Trajectory, turn: int) -> tuple[str, bool]:
        """The simulated user's reply to assistant turn ``turn`` and whether it ends the
        trajectory; recorded with the calls (index -1, ``interaction:<name>``), and in a
        replay given from the record instead of asking again."""
        kwargs = dict(row.interaction_kwargs or {})
        name = kwargs.get("name")
        record = {"turn": turn, "index": -1, "name": f"interaction:{name}", "arguments": {}, "started": time.time()}
        if row.recorded_calls is not None:
            recorded = next((c for c in row.recorded_calls if c.get("turn") == turn and c.get("index") == -1), None)
            if recorded is None or recorded.get("name") != record["name"]:
                raise ReplayMismatch(f"row {row.index}, turn {turn}: the replay asked interaction {name!r}; the "
                                     f"record has {recorded and recorded.get('name')}")
            trajectory.tool_calls.append(dict(recorded))
            trajectory.turn_scores.append(float(recorded.get("reward", 0.0)))
            return str(recorded["answer"]), bool(recorded.get("terminate"))
        if callable(self.interactions):
            self.interactions = self.interactions()
        interaction = (self.interactions or {}).get(name)
        if interaction is None:
            raise ValueError(f"extra_info.interaction_kwargs.name: expected one of {sorted(self.interactions or {})} "
                             f"(rollout.multi_turn.interaction_config_path); found {name!r} in row {row.index}")
        instance = await interaction.start_interaction(f"{row.index}-{row.seed}-t{turn}", **kwargs)
        try:
            done, text, score, _ = await interaction.generate_response(instance, self.messages(row, trajectory),
                                                                       **kwargs)
        finally:
            await interaction.finalize_interaction(instance)
        score = float(score or 0.0)
        record.update(status="ok", answer=str(text), truncated=False, reward=score, terminate=bool(done),
                      ended=time.time())
        trajectory.tool_calls.append(record)
        trajectory.turn_scores.append(score)
        return str(text), bool(done)

    def messages(self, row: AgentRow, trajectory: Trajectory) -> list[dict]:
        """The chat so far, as an interaction reads it: the prompt's messages, then each turn
        (an assistant's text without special tokens, as verl decodes it)."""
        out = [dict(m) for m in row.messages]
        for turn in trajectory.turns:
            tokens = trajectory.response_ids[turn["start"]:turn["end"]]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if turn["role"] == "assistant" \
                else turn["text"]
            out.append({"role": turn["role"], "content": text})
        return out

    def skip_tool(self, trajectory: Trajectory, turn: int, k: int, call: ToolCall) -> None:
        """A call past ``max_parallel_calls``: recorded, not run, not answered (verl drops it)."""
        trajectory.tool_calls.append({"turn": turn, "index": k, "name": call.name, "arguments": call.arguments,
                                      "status": "skipped", "answer": "", "truncated": False, "reward": 0.0})


def run_trajectories(rows: list[AgentRow], loops: dict, ctx: AgentContext,
                     generate_round: Callable[[list[GenerationRequest]], tuple[list[Completion], list[int]]]
                     ) -> tuple[list[Trajectory], dict]:
    """Every row's trajectory, in row order, and the rounds' statistics. ``loops``: agent
    name -> loop; ``generate_round``: one call to the rollout for a list of requests."""
    stats = {"rounds": 0, "requests": 0}

    async def main() -> list[Trajectory]:
        waiting: dict[tuple[int, int], tuple[GenerationRequest, asyncio.Future]] = {}
        active = len(rows)
        changed = asyncio.Event()

        async def generate(row: int, turn: int, prompt_ids: list[int], seed: int, max_tokens: int):
            future = asyncio.get_running_loop().create_future()
            waiting[(row, turn)] = (GenerationRequest(f"{row}-t{turn}", tuple(prompt_ids), seed, max_tokens), future)
            changed.set()
            return await future

        ctx.generate = generate

        async def one(row: AgentRow) -> Trajectory:
            nonlocal active
            try:
                return await loops[row.agent_name].run(ctx, row)
            finally:
                active -= 1
                changed.set()

        async def batcher() -> None:
            while active:
                await changed.wait()
                changed.clear()
                if active and len(waiting) == active:  # every live trajectory waits for its turn
                    keys = sorted(waiting)  # row order: a prompt's n samples together, fixed by the rows
                    batch = [waiting.pop(k) for k in keys]
                    try:
                        completions, versions = await asyncio.to_thread(generate_round, [r for r, _ in batch])
                    except BaseException as exc:  # every waiting trajectory fails with it
                        for _, future in batch:
                            future.set_exception(exc)
                        raise
                    stats["rounds"] += 1
                    stats["requests"] += len(batch)
                    for (_, future), completion, version in zip(batch, completions, versions):
                        future.set_result((completion, version))

        flusher = asyncio.create_task(batcher())
        try:
            return list(await asyncio.gather(*(one(row) for row in rows)))
        finally:
            flusher.cancel()

    return asyncio.run(main()), stats
