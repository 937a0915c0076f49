"""The engine registry: ``rollout.name`` -> an engine class, one file per engine.

An engine is the module ``rlhf_core/rollout/engines/<name>.py`` with one class decorated
``@register_engine("<name>")``. Names are the modules found there (nothing is imported to
list them: the config validates ``rollout.name`` without torch or vLLM); a class is
imported when a run or a check asks for it.
"""

from __future__ import annotations

import importlib
import pkgutil

import rlhf_core.rollout.engines as _engines_package
from rlhf_core.rollout.engine import EngineConfigError, RolloutEngine

_REGISTERED: dict[str, type[RolloutEngine]] = {}


def register_engine(name: str):
    """Class decorator: the engine ``rollout.name=<name>`` selects."""

    def decorate(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        if _REGISTERED.get(name, cls) is not cls:
            raise ValueError(f"rollout engine {name!r} registered twice: {_REGISTERED[name].__qualname__} and "
                             f"{cls.__qualname__}")
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return decorate


def engine_names() -> tuple[str, ...]:
    """Every engine's name (its module under ``rollout/engines``), sorted."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(_engines_package.__path__) if not m.name.startswith("_")))


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine registered as ``name`` (``rollout.name``)."""
    if name not in engine_names():
        raise EngineConfigError(f"rollout.name: expected one of {', '.join(engine_names())}; found {name!r}")
    if name not in _REGISTERED:
        importlib.import_module(f"{_engines_package.__name__}.{name}")
    if name not in _REGISTERED:
        raise EngineConfigError(f"rollout.name={name}: rlhf_core/rollout/engines/{name}.py registers no engine "
                                f"(expected a class decorated @register_engine({name!r}))")
    return _REGISTERED[name]
