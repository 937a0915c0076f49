"""verl's tool-config YAML (``rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

verl's own tool classes map to ours (``VERL_TOOLS``); another class name is imported
(code the run's owner chose, like a reward function: ``package.module.Class`` or
``path/to/file.py:Class``), its imports of verl's ``BaseTool`` and schemas answered by
ours (``verl_imports``), and must subclass our ``BaseTool``.
Everything is checked before any worker is placed; an error names the file and the entry.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.agent.tools.base import BaseTool

#: verl's tool classes -> ours (module:class)
VERL_TOOLS = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "rlhf_core.agent.tools.gsm8k:Gsm8kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rlhf_core.agent.tools.code_interpreter:CodeInterpreterTool",
    "verl.tools.search_tool.SearchTool": "rlhf_core.agent.tools.search:SearchTool",
}
#: verl's tool classes not served here, and why
NOT_HERE = {
    "verl.tools.mcp_search_tool.MCPSearchTool": "MCP tools are not built here",
    "verl.tools.mcp_base_tool.MCPBaseTool": "MCP tools are not built here",
    "verl.tools.geo3k_tool.Geo3kTool": "multimodal tools are not built here",
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "multimodal tools are not built here",
}
#: the most bytes a tool config may have
MAX_BYTES = 1 << 20


class ToolConfigError(ValueError):
    """One line: the file, the entry, what was expected and what was found."""


@dataclass(frozen=True)
class ToolSpec:
    class_name: str      # as the file names it
    target: str          # module:class built
    config: dict
    schema: dict
    source: str = ""     # the file and entry, for errors

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def _target(class_name: str, where: str) -> str:
    if class_name in NOT_HERE:
        raise ToolConfigError(f"{where}.class_name: {class_name} is refused: {NOT_HERE[class_name]}")
    if class_name in VERL_TOOLS:
        return VERL_TOOLS[class_name]
    if ":" in class_name:
        return class_name
    module, _, name = class_name.rpartition(".")
    if not module:
        raise ToolConfigError(f"{where}.class_name: expected a dotted class path (module.Class); found {class_name!r}")
    return f"{module}:{name}"


#: tool configs that ship with the package (``tool_config_path=builtin:<name>``)
BUILT_IN_CONFIGS = {"calculator": Path(__file__).parent / "tools" / "calculator.yaml"}


def config_file(path: str) -> Path:
    """The file a ``tool_config_path`` names (``builtin:<name>``: one that ships here)."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILT_IN_CONFIGS:
            raise ToolConfigError(f"rollout.multi_turn.tool_config_path: expected one of "
                                  f"{['builtin:' + n for n in BUILT_IN_CONFIGS]} or a file; found {path!r}")
        return BUILT_IN_CONFIGS[name]
    return Path(path)


def read_yaml_file(file: Path, where: str):
    """A config file's YAML, bounded in size; refused in one line starting with ``where``."""
    import yaml

    if not file.is_file():
        raise ToolConfigError(f"{where}: expected a YAML file; found none there")
    if file.stat().st_size > MAX_BYTES:
        raise ToolConfigError(f"{where}: expected at most {MAX_BYTES} bytes; found {file.stat().st_size}")
    try:
        return yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"{where}: not YAML: {str(exc).splitlines()[0]}") from None


def load_tool_config(path: str) -> list[ToolSpec]:
    where = f"rollout.multi_turn.tool_config_path={path}"
    data = read_yaml_file(config_file(path), where)
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{where}: expected a mapping with a 'tools' list; found {type(data).__name__}")
    specs, names = [], set()
    for i, entry in enumerate(data["tools"]):
        at = f"{where}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{at}: expected a mapping with class_name; found {entry!r}"[:300])
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolConfigError(f"{at}.tool_schema: expected {{type: function, function: {{name: ...}}}}; "
                                  f"found {schema!r}"[:300])
        if function["name"] in names:
            raise ToolConfigError(f"{at}.tool_schema.function.name: {function['name']!r} is named twice")
        names.add(function["name"])
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{at}.config: expected a mapping; found {type(config).__name__}")
        specs.append(ToolSpec(entry["class_name"], _target(entry["class_name"], at), config, schema, at))
    return specs


#: verl's modules a user's tool imports, served by ours while it is imported (its
#: ``from verl.tools.base_tool import BaseTool`` then gives our BaseTool)
VERL_MODULES = {"verl.tools.base_tool": "rlhf_core.agent.tools.base",
                "verl.tools.schemas": "rlhf_core.agent.tools.base",
                "verl.interactions.base": "rlhf_core.agent.interactions.base"}
#: their parent packages, made empty for the import when absent
VERL_PACKAGES = ("verl", "verl.tools", "verl.interactions")


@contextmanager
def verl_imports():
    """``verl.tools.base_tool`` and ``verl.tools.schemas`` as our modules, for the length of
    a user's tool import (verl itself need not be installed; if it is, the tool still gets
    our classes). ``sys.modules`` is as it was afterwards."""
    before = {name: sys.modules.get(name) for name in (*VERL_PACKAGES, *VERL_MODULES)}
    for name in VERL_PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []  # a package: its submodules are the ones below
            sys.modules[name] = package
    for name, ours in VERL_MODULES.items():
        sys.modules[name] = importlib.import_module(ours)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _import_tool_module(module_name: str):
    """A dotted module, or a ``.py`` file (the run owner's code, like a reward file), with
    verl's tool imports served by ours."""
    with verl_imports():
        if not module_name.endswith(".py"):
            return importlib.import_module(module_name)
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ImportError(f"no such file {str(path)!r}")
        name = "rlhf_user_tool_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look a class's module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module


def tool_class(spec: ToolSpec):
    module_name, _, class_name = spec.target.partition(":")
    where = spec.source or "rollout.multi_turn.tool_config_path"
    try:
        module = _import_tool_module(module_name)
    except ImportError as exc:
        raise ToolConfigError(f"{where}.class_name: tool {spec.name!r}: {spec.class_name}: cannot import "
                              f"{module_name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the owner's module failed as it ran: say which, in one line
        raise ToolConfigError(f"{where}.class_name: tool {spec.name!r}: {spec.class_name}: importing {module_name} "
                              f"raised {type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, BaseTool):
        raise ToolConfigError(f"{where}.class_name: tool {spec.name!r}: {spec.class_name}: expected a subclass of "
                              f"rlhf_core.agent.tools.base.BaseTool (a verl tool's import of verl's BaseTool "
                              f"changed to ours); found {cls!r}")
    return cls


def build_tools(specs: list[ToolSpec]) -> dict[str, BaseTool]:
    """Each tool once per process (instances are per trajectory, through ``create``); a
    tool that refuses its config is refused in one line naming the file and the entry."""
    tools = {}
    for spec in specs:
        cls = tool_class(spec)
        try:
            tools[spec.name] = cls(dict(spec.config), spec.schema)
        except (ValueError, TypeError, KeyError) as exc:
            raise ToolConfigError(f"{spec.source}.config: tool {spec.name!r}: {exc}") from None
    return tools


def file_digest(path: str) -> str:
    """The tool or interaction config by content (the manifest and lineage name it so)."""
    return "sha256:" + hashlib.sha256(config_file(path).read_bytes()).hexdigest()


def tools_identity(path: str) -> dict:
    """What the manifest says of the tools that answered: the config file by content hash
    and each tool's class as the file names it and as built here."""
    return {"config": str(path), "sha256": file_digest(path).split(":", 1)[1],
            "classes": {spec.name: {"class_name": spec.class_name, "built": spec.target}
                        for spec in load_tool_config(path)}}
