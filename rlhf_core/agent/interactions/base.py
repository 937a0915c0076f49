"""verl's interaction interface (``verl.interactions.base.BaseInteraction``), ours: per
trajectory an interaction is started (with the row's ``extra_info.interaction_kwargs``),
asked for the user's reply after each assistant turn that calls no tool, and finalized.
``generate_response`` returns (end the trajectory?, the user's text, this turn's score,
extra data)."""

from __future__ import annotations

import uuid
from typing import Any


class BaseInteraction:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config or {}
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or uuid.uuid4().hex

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "", 0.0, {}

    async def calculate_score(self, *args, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, *args, **kwargs) -> None:
        return None
