"""verl's ``tool_agent``: generate; run the tool calls of the turn (up to
``max_parallel_calls``, side by side); append their answers as the chat template renders
tool messages; generate again, until a turn calls no tool or a limit is reached
(``max_assistant_turns``, ``max_user_turns``, the response length over all turns). With
an interaction configured, a turn without a call is answered by the simulated user (a
user message) until it says the trajectory is done."""

from __future__ import annotations

import asyncio

from rlhf_core.agent import chat
from rlhf_core.agent.tool_calls import parse_hermes
from rlhf_core.agent.trajectory import Trajectory


class ToolAgentLoop:
    @staticmethod
    def prompt_ids(ctx, row) -> list[int]:
        """The first prompt: the row's chat rendered with the tools' schemas."""
        return chat.prompt_tokens(ctx.tokenizer, row.messages, ctx.tool_schemas)

    async def run(self, ctx, row) -> Trajectory:
        settings = ctx.settings
        prompt_ids = self.prompt_ids(ctx, row)
        trajectory = Trajectory(prompt_ids, row.seed)
        turn = 0
        while True:
            left = ctx.response_length - len(trajectory.response_ids)
            completion, version = await ctx.generate(row.index, turn, prompt_ids + trajectory.response_ids,
                                                     ctx.turn_seed(row.seed, turn), left)
            text = ctx.decode(completion.token_ids)
            trajectory.append("assistant", completion.token_ids, text, completion.log_probs)
            trajectory.versions.append(version)
            trajectory.assistant_turns += 1
            if len(trajectory.response_ids) >= ctx.response_length:
                trajectory.cut = not ctx.ended(completion.token_ids)
                break
            if settings.max_assistant_turns and trajectory.assistant_turns >= settings.max_assistant_turns:
                break
            if settings.max_user_turns and trajectory.user_turns >= settings.max_user_turns:
                break
            calls = parse_hermes(text)
            if not calls:
                if ctx.interactions is None:
                    break
                # a simulated user answers the turn (verl's interaction), then the model again
                reply, done = await ctx.interact(row, trajectory, turn)
                tokens = chat.message_tokens(ctx.tokenizer, [{"role": "user", "content": reply}])
                if len(trajectory.response_ids) + len(tokens) >= ctx.response_length:
                    trajectory.cut = True
                    break
                trajectory.append("user", tokens, ctx.tokenizer.decode(tokens))
                trajectory.user_turns += 1
                turn += 1
                if done:
                    break
                continue
            answers = await asyncio.gather(*(ctx.call_tool(row, trajectory, turn, k, call)
                                              for k, call in enumerate(calls[:settings.max_parallel_calls])))
            for k, call in enumerate(calls[settings.max_parallel_calls:], start=settings.max_parallel_calls):
                ctx.skip_tool(trajectory, turn, k, call)
            tokens = chat.message_tokens(ctx.tokenizer, [{"role": "tool", "content": a} for a in answers])
            if len(trajectory.response_ids) + len(tokens) >= ctx.response_length:
                trajectory.cut = True  # verl's rule: an answer that does not fit ends the trajectory
                break
            trajectory.append("tool", tokens, ctx.tokenizer.decode(tokens))
            trajectory.user_turns += 1
            turn += 1
        return trajectory
