"""Agent loops by name: each module of ``loops/`` is one (its module name, verl's loop
names), and a run's ``agent_loop_config_path`` adds its own (verl's YAML:
``- name: ..., _target_: module.Class``, code the run's owner chose)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from rlhf_core.agent import loops

BUILT_IN = {"single_turn_agent": "SingleTurnAgentLoop", "tool_agent": "ToolAgentLoop"}


class AgentConfigError(ValueError):
    """One line: the key or file, what was expected, what was found."""


def loop_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(loops.__path__))


def user_loops(path: str) -> dict[str, str]:
    """name -> module:Class from verl's agent-loop YAML."""
    import yaml

    where = f"rollout.agent.agent_loop_config_path={path}"
    if not Path(path).is_file():
        raise AgentConfigError(f"{where}: expected a YAML file; found none there")
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise AgentConfigError(f"{where}: not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(entries, list):
        raise AgentConfigError(f"{where}: expected a list of {{name, _target_}}; found {type(entries).__name__}")
    out = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("_target_"), str) or "." not in entry["_target_"]:
            raise AgentConfigError(f"{where}: [{i}]: expected {{name: ..., _target_: module.Class}}; found {entry!r}"[:300])
        module, _, cls = entry["_target_"].rpartition(".")
        out[entry["name"]] = f"{module}:{cls}"
    return out


def _load(target: str, where: str):
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentConfigError(f"{where}: cannot import {module_name}: {exc}") from None
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise AgentConfigError(f"{where}: expected a class with an async run(ctx, row); found {cls!r}")
    return cls


def build_loops(agent_cfg) -> dict:
    """name -> loop instance, for every loop a run may name."""
    targets = {name: f"rlhf_core.agent.loops.{name}:{cls}" for name, cls in BUILT_IN.items()}
    if agent_cfg.agent_loop_config_path:
        targets.update(user_loops(agent_cfg.agent_loop_config_path))
    built = {name: _load(target, f"agent loop {name!r}")() for name, target in targets.items()}
    if agent_cfg.default_agent_loop not in built:
        raise AgentConfigError(f"rollout.agent.default_agent_loop: expected one of {sorted(built)}; found "
                               f"{agent_cfg.default_agent_loop!r}")
    return built


def default_loop(cfg) -> str:
    """The loop of a row without an ``agent_name``: ``rollout.agent.default_agent_loop``,
    except that a run with tools or interactions configured and the default left at
    ``single_turn_agent`` runs ``tool_agent`` (verl would run its rows single-turn, never
    calling the tools or users it was given: our choice, written in docs/agents.md)."""
    chosen = cfg.rollout.agent.default_agent_loop
    multi = cfg.rollout.multi_turn
    if chosen == "single_turn_agent" and (multi.tool_config_path or multi.interaction_config_path):
        return "tool_agent"
    return chosen


def check(cfg) -> None:
    """The agent settings a run cannot use, before anything is placed."""
    from rlhf_core.agent.tool_config import build_tools, load_tool_config

    multi = cfg.rollout.multi_turn
    if not multi.enable:
        for key in ("tool_config_path", "interaction_config_path"):
            if getattr(multi, key):
                raise AgentConfigError(f"rollout.multi_turn.{key}: has no effect with rollout.multi_turn.enable="
                                       f"false; found {getattr(multi, key)!r} (enable multi-turn or drop it)")
        if cfg.rollout.agent.default_agent_loop != "single_turn_agent":
            raise AgentConfigError(f"rollout.agent.default_agent_loop: expected single_turn_agent with "
                                   f"rollout.multi_turn.enable=false; found {cfg.rollout.agent.default_agent_loop!r}")
        return
    if cfg.algorithm.adv_estimator == "remax":
        raise AgentConfigError("algorithm.adv_estimator=remax: expected an estimator without a greedy baseline "
                               "with rollout.multi_turn.enable=true (a greedy trajectory would call the tools "
                               "again); found remax")
    build_loops(cfg.rollout.agent)
    if multi.tool_config_path:
        build_tools(load_tool_config(multi.tool_config_path))
    if multi.interaction_config_path:
        from rlhf_core.agent.interaction_config import build_interactions, load_interaction_config

        build_interactions(load_interaction_config(multi.interaction_config_path))
