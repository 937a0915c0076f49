"""verl's tool interface (``verl.tools.base_tool.BaseTool``), ours: per trajectory a tool
instance is created, executed (once per call), scored and released; ``tool_schema`` is the
OpenAI function schema the chat template renders into the prompt."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict,
               "array": list}


@dataclass
class ToolResponse:
    """What the model is shown (text only here)."""

    text: str | None = None


class ToolSchema(dict):
    """The OpenAI function schema as a dict that verl's tool code can also read as its
    ``OpenAIFunctionToolSchema`` (``schema.function.name``, ``model_dump()``)."""

    def __getattr__(self, key: str):
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, dict) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **_) -> dict:
        return {k: v.model_dump() if isinstance(v, ToolSchema) else v for k, v in self.items()}

    @classmethod
    def model_validate(cls, data: dict) -> "ToolSchema":
        return cls(data)


#: verl's name for it (``verl.tools.schemas.OpenAIFunctionToolSchema``)
OpenAIFunctionToolSchema = ToolSchema


class BaseTool:
    """Subclass and override what the tool does; the defaults do nothing."""

    def __init__(self, config: dict, tool_schema: dict) -> None:
        self.config = config or {}
        self.tool_schema = ToolSchema(tool_schema)
        self.name = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=""), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def argument_error(schema: dict, arguments: dict) -> str | None:
    """Why ``arguments`` fail the tool's parameter schema (required keys, unknown keys,
    JSON types, enums), or None."""
    params = schema.get("function", {}).get("parameters", {}) or {}
    properties = params.get("properties", {}) or {}
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [k for k in arguments if k not in properties]
    if unknown and properties:
        return f"unknown argument(s) {unknown}; expected some of {sorted(properties)}"
    for key, value in arguments.items():
        spec = properties.get(key, {})
        expected = _JSON_TYPES.get(spec.get("type"))
        if expected and (not isinstance(value, expected) or (spec.get("type") != "boolean" and isinstance(value, bool))):
            return f"argument {key!r}: expected {spec['type']}; found {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r}: expected one of {spec['enum']}; found {value!r}"
    return None
