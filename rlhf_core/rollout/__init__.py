"""Generation as a service: the engine protocol and registry (one file per engine under
``engines/``), and the manager that balances requests over rollout replicas."""

from rlhf_core.rollout.engine import (
    Completion, EngineConfigError, GenerationRequest, RolloutEngine, Sampling, requests_of, responses_from_tensors,
    responses_of, sampling_of, top_k_setting,
)
from rlhf_core.rollout.registry import engine_class, engine_names, register_engine

__all__ = ["Completion", "EngineConfigError", "GenerationRequest", "RolloutEngine", "Sampling", "engine_class",
           "engine_names", "register_engine", "requests_of", "responses_from_tensors", "responses_of",
           "sampling_of", "top_k_setting"]
