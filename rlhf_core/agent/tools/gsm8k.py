"""verl's gsm8k answer tool (``verl.tools.gsm8k_tool.Gsm8kTool``): the model submits its
answer; the tool says whether it parses and is right, and penalizes an answer that does
not improve on the last (-0.05, verl's step reward)."""

from __future__ import annotations

from rlhf_core.agent.tools.base import BaseTool, ToolResponse
from rlhf_core.data.gsm8k import compute_score


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: dict) -> None:
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return float(compute_score("openai/gsm8k", state["response"], str(state["ground_truth"]))["score"])

    async def release(self, instance_id, **kwargs):
        self._instances.pop(instance_id, None)
