"""A code interpreter (verl's ``SandboxFusionTool``): runs the Python the model wrote and
answers with its output. With ``config.sandbox_fusion_url`` the code runs on that
SandboxFusion server; otherwise in the local sandbox (``agent/sandbox.py``: no network,
bounded CPU, memory, processes, files and time, none of the run's files or credentials)."""

from __future__ import annotations

import asyncio

from rlhf_core.agent import sandbox
from rlhf_core.agent.tools.base import BaseTool, ToolResponse


class CodeInterpreterTool(BaseTool):
    def __init__(self, config: dict, tool_schema: dict) -> None:
        super().__init__(config, tool_schema)
        self.url = self.config.get("sandbox_fusion_url") or ""
        self.limits = sandbox.Limits(wall_s=float(self.config.get("default_timeout", 10)),
                                     cpu_s=int(self.config.get("default_timeout", 10)),
                                     memory_mb=int(self.config.get("memory_limit_mb", 512)))
        self.language = self.config.get("default_language", "python")
        if self.language != "python":
            raise ValueError(f"code interpreter tool {self.name!r}: config.default_language: expected python; "
                             f"found {self.language!r}")

    async def execute(self, instance_id, parameters, **kwargs):
        code = parameters.get("code", "")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: no code given"), 0.0, {"status": "error"}
        if self.url:
            from rlhf_core.workers import sandbox_fusion

            answer = await asyncio.to_thread(sandbox_fusion.run_case, self.url, code, None, self.limits.memory_mb)
            run = (answer or {}).get("run_result") or {}
            if not answer:
                return ToolResponse(text="Error: the sandbox did not answer"), 0.0, {"status": "error"}
            text = str(run.get("stdout", "")) + str(run.get("stderr", ""))
            return ToolResponse(text=text), 0.0, {"status": str(run.get("status", answer.get("status")))}
        result = await asyncio.to_thread(sandbox.run_python, code, "", self.limits)
        if result.status == "ok":
            text = result.stdout
        elif result.status == "timeout":
            text = f"{result.stdout}Error: timed out after {self.limits.wall_s:g} s"
        elif result.status == "unavailable":
            text = "Error: the code sandbox is unavailable here"
        else:
            text = result.stdout + result.stderr
        return ToolResponse(text=text), 0.0, {"status": result.status, "seconds": result.seconds}
