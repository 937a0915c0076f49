"""verl's gsm8k interaction (``verl.interactions.gsm8k_interaction.Gsm8kInteraction``): the
user checks the last assistant message's ``#### answer`` (gsm8k's strict rule) and says it
is right, which ends the trajectory, or asks the model to reflect and try again."""

from __future__ import annotations

from rlhf_core.agent.interactions.base import BaseInteraction
from rlhf_core.data.gsm8k import compute_score

CORRECT = "Your response is correct!"
TRY_AGAIN = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self._instances: dict[str, dict] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = last
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, TRY_AGAIN, reward, {}

    async def calculate_score(self, instance_id, **kwargs) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return float(compute_score("openai/gsm8k", state["response"], str(state["ground_truth"]))["score"])

    async def finalize_interaction(self, instance_id, **kwargs) -> None:
        self._instances.pop(instance_id, None)
