"""verl's interaction-config YAML (``rollout.multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

verl's own interaction classes map to ours (``VERL_INTERACTIONS``); another class name is
imported as a user's tool is (``tool_config._import_tool_module``: its import of verl's
``BaseInteraction`` answered by ours) and must subclass our ``BaseInteraction``. A row
picks its interaction by ``extra_info.interaction_kwargs.name``. Everything is checked
before any worker is placed; an error names the file and the entry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.agent.interactions.base import BaseInteraction
from rlhf_core.agent.tool_config import ToolConfigError, _import_tool_module, read_yaml_file

#: verl's interaction classes -> ours (module:class)
VERL_INTERACTIONS = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rlhf_core.agent.interactions.gsm8k:Gsm8kInteraction",
}
FIELD = "rollout.multi_turn.interaction_config_path"


@dataclass(frozen=True)
class InteractionSpec:
    name: str
    class_name: str      # as the file names it
    target: str          # module:class built
    config: dict
    source: str          # the file and entry, for errors


def load_interaction_config(path: str) -> list[InteractionSpec]:
    where = f"{FIELD}={path}"
    data = read_yaml_file(Path(path), where)
    if not isinstance(data, dict) or not isinstance(data.get("interaction"), list) or not data["interaction"]:
        raise ToolConfigError(f"{where}: expected a mapping with an 'interaction' list; found {str(data)[:120]!r}")
    specs, names = [], set()
    for i, entry in enumerate(data["interaction"]):
        at = f"{where}: interaction[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{at}: expected a mapping with class_name; found {entry!r}"[:300])
        class_name = entry["class_name"]
        name = entry.get("name")
        if name is None:  # verl's default: the class name less "Interaction", lower case
            simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
            name = (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if not isinstance(name, str) or not name:
            raise ToolConfigError(f"{at}.name: expected a text; found {name!r}")
        if name in names:
            raise ToolConfigError(f"{at}.name: {name!r} is named twice")
        names.add(name)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{at}.config: expected a mapping; found {type(config).__name__}")
        if class_name in VERL_INTERACTIONS:
            target = VERL_INTERACTIONS[class_name]
        elif ":" in class_name:
            target = class_name
        else:
            module, _, cls = class_name.rpartition(".")
            if not module:
                raise ToolConfigError(f"{at}.class_name: expected a dotted class path (module.Class); found "
                                      f"{class_name!r}")
            target = f"{module}:{cls}"
        specs.append(InteractionSpec(name, class_name, target, {**config, "name": name}, at))
    return specs


def build_interactions(specs: list[InteractionSpec]) -> dict[str, BaseInteraction]:
    """Each interaction once per process (its instances are per trajectory)."""
    built = {}
    for spec in specs:
        module_name, _, class_name = spec.target.partition(":")
        try:
            module = _import_tool_module(module_name)
        except ImportError as exc:
            raise ToolConfigError(f"{spec.source}.class_name: {spec.class_name}: cannot import {module_name}: "
                                  f"{exc}") from None
        except Exception as exc:  # noqa: BLE001 - the owner's module failed as it ran
            raise ToolConfigError(f"{spec.source}.class_name: {spec.class_name}: importing {module_name} raised "
                                  f"{type(exc).__name__}: {exc}") from None
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type) or not issubclass(cls, BaseInteraction):
            raise ToolConfigError(f"{spec.source}.class_name: {spec.class_name}: expected a subclass of "
                                  f"rlhf_core.agent.interactions.base.BaseInteraction; found {cls!r}")
        try:
            built[spec.name] = cls(config=dict(spec.config))
        except (ValueError, TypeError, KeyError) as exc:
            raise ToolConfigError(f"{spec.source}.config: interaction {spec.name!r}: {exc}") from None
    return built


def interactions_identity(path: str) -> dict:
    """What the manifest says of the interactions: the file by content hash, each class."""
    return {"config": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "classes": {spec.name: {"class_name": spec.class_name, "built": spec.target}
                        for spec in load_interaction_config(path)}}
