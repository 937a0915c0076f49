"""verl's ``single_turn_agent``: one generation from the prompt as the dataset rendered it
(today's rollout, turn for turn)."""

from __future__ import annotations

from rlhf_core.agent.trajectory import Trajectory


class SingleTurnAgentLoop:
    async def run(self, ctx, row) -> Trajectory:
        trajectory = Trajectory(list(row.prompt_ids), row.seed)
        completion, version = await ctx.generate(row.index, 0, trajectory.prompt_ids, row.seed, ctx.response_length)
        trajectory.append("assistant", completion.token_ids, ctx.decode(completion.token_ids), completion.log_probs)
        trajectory.assistant_turns, trajectory.versions = 1, [version]
        return trajectory
