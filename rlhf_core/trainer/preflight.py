"""A run's inputs checked before any worker group is placed: placing them can take minutes
(a busy cluster, a loaded machine: 252 s was seen), loading a large model more, and a
refusal that comes after all that wastes it. Only what the controller can read cheaply
is checked here: the prompts (tokenized, as the loaders will) and the rollout model's
config.json (no weights)."""

from __future__ import annotations

from rlhf_core.config import RunConfig

class PreflightError(ValueError):
    """An input the run cannot use; one line naming the field, what was expected, what was found."""


def check_inputs(cfg: RunConfig) -> None:
    """Raise ``DatasetError`` / ``PreflightError`` for what would fail after placement: a
    training or validation prompt longer than ``data.max_prompt_length`` with
    ``data.truncation=error`` (verl's rule), an empty or too small dataset, and a model
    vLLM's CPU engine cannot serve."""
    from rlhf_core.trainer.loaders import make_loader, make_val_loader

    check_loggers(cfg)
    loaders = [make_loader(cfg)]  # tokenizes every prompt as the run's loader will
    if cfg.data.val_files:
        loaders.append(make_val_loader(cfg))
    check_reward_sources(cfg, {row["data_source"] for loader in loaders for row in loader.rows})
    check_rollout_model(cfg)
    check_critic_model(cfg)
    check_agent(cfg)


def check_agent(cfg: RunConfig) -> None:
    """Agent loops and tools (rlhf_core/agent/): the loop names, the tool and loop config
    files and every tool class, built once here as the rollout will build them."""
    from rlhf_core.agent import registry
    from rlhf_core.agent.tool_config import ToolConfigError

    try:
        registry.check(cfg)
    except (registry.AgentConfigError, ToolConfigError) as exc:
        raise PreflightError(str(exc)) from None


def check_reward_sources(cfg: RunConfig, sources: set) -> None:
    """verl's default reward (``reward.function=verl``) scores each row by its data_source:
    one it does not take is refused here, not scored by something else after placement."""
    from rlhf_core.data.reward_scores import UnscoredSource, scorer_for

    if cfg.reward.function != "verl" or cfg.custom_reward_function.path or cfg.reward_model.enable:
        return
    for source in sorted(map(str, sources)):
        try:
            scorer_for(source, sandbox=bool(cfg.reward_model.sandbox_fusion.url))
        except UnscoredSource as exc:
            raise PreflightError(f"reward.function=verl: {exc}") from None


def check_loggers(cfg: RunConfig) -> None:
    """Every tracker trainer.logger lists can be imported."""
    from rlhf_core.record.tracking import PACKAGES, missing_packages

    missing = missing_packages(cfg.trainer.logger)
    if missing:
        raise PreflightError(f"trainer.logger lists {missing[0]}: expected the {PACKAGES[missing[0]]} package "
                             f"(pip install 'rlhf-core[trackers]'); found none installed")


def check_critic_model(cfg: RunConfig) -> None:
    """``critic.model_path``, when the run trains a critic: a model of the policy's vocabulary."""
    if not cfg.critic.model_path or not cfg.use_critic:
        return
    from rlhf_core.workers import modeling
    from rlhf_core.workers.critic import check_same_vocabulary

    resolve = lambda path, field: modeling.resolve_model_path(path, cfg.trainer.seed, progress=False, weights=False,
                                                              field=field)
    try:
        check_same_vocabulary(resolve(cfg.critic.model_path, "critic.model_path"), resolve(cfg.model.path, "model.path"),
                              cfg.critic.model_path)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_rollout_model(cfg: RunConfig) -> None:
    """What the rollout engine needs of the policy's model config (its ``check_model``:
    vLLM's CPU attention, heads of at least 32 dimensions)."""
    from rlhf_core.rollout import EngineConfigError, engine_class

    check = getattr(engine_class(cfg.rollout.name), "check_model", None)
    if check is None:
        return
    from transformers import AutoConfig

    from rlhf_core.workers import modeling

    path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=False, weights=False)
    try:
        check(cfg, AutoConfig.from_pretrained(path))
    except EngineConfigError as exc:
        raise PreflightError(str(exc)) from None
