"""A run's inputs checked before any worker group is placed: placing them can take minutes
(a busy cluster, a loaded machine: 252 s was seen), loading a large model more, and a
refusal that comes after all that wastes it. Only what the controller can read cheaply
is checked here: the prompts (tokenized, as the loaders will) and the rollout model's
config.json (no weights)."""

from __future__ import annotations

from rlhf_core.config import RunConfig

#: vLLM's CPU attention backend refuses smaller heads, at the first generation.
VLLM_CPU_MIN_HEAD_DIM = 32


class PreflightError(ValueError):
    """An input the run cannot use; one line naming the field, what was expected, what was found."""


def check_inputs(cfg: RunConfig) -> None:
    """Raise ``DatasetError`` / ``PreflightError`` for what would fail after placement: a
    training or validation prompt longer than ``data.max_prompt_length`` with
    ``data.truncation=error`` (verl's rule), an empty or too small dataset, and a model
    vLLM's CPU engine cannot serve."""
    from rlhf_core.trainer.loaders import make_loader, make_val_loader

    check_loggers(cfg)
    make_loader(cfg)  # tokenizes every prompt as the run's loader will
    if cfg.data.val_files:
        make_val_loader(cfg)
    check_rollout_model(cfg)
    check_critic_model(cfg)


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
    """``rollout.name=vllm`` on CPU workers needs heads of at least 32 dimensions."""
    if cfg.rollout.name != "vllm" or cfg.resources.gpus_per_node > 0:
        return
    from transformers import AutoConfig

    from rlhf_core.workers import modeling

    path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=False, weights=False)
    config = AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < VLLM_CPU_MIN_HEAD_DIM:
        raise PreflightError(f"rollout.name=vllm: vLLM's CPU attention needs a head_dim of at least "
                             f"{VLLM_CPU_MIN_HEAD_DIM}; found {head_dim} in model.path {cfg.model.path} (use "
                             f"rollout.name=hf on CPU workers, or GPUs: resources.gpus_per_node)")
