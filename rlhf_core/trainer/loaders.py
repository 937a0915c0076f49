"""The prompt loaders of a run: its training batches (resuming at a cursor), its
validation set, and the run's total iterations from ``trainer.total_epochs``. The
controller only tokenizes, so the model folder it resolves holds no weights."""

from __future__ import annotations

from rlhf_core.config import RunConfig


def make_val_loader(cfg: RunConfig):
    """Every validation prompt (data.val_files) as one batch, in file order."""
    from rlhf_core.data.dataset import PromptLoader, load_rows
    from rlhf_core.data.tokenizer import PromptTokenizer
    from rlhf_core.workers import modeling

    model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=cfg.trainer.progress,
                                            weights=False)
    rows = load_rows(cfg.data.val_files, cfg.trainer.seed, field="data.val_files", prompt_key=cfg.data.prompt_key,
                     source_key=cfg.data.reward_fn_key)
    return PromptLoader(rows, PromptTokenizer(model_path), len(rows), cfg.data.max_prompt_length, cfg.trainer.seed,
                        shuffle=False, truncation=cfg.data.truncation, keep_chat=cfg.reward_model.enable or cfg.rollout.multi_turn.enable)


def total_iterations(cfg: RunConfig) -> int:
    """The run's total: ``trainer.total_epochs`` x the loader's whole batches per epoch
    (verl's ``len(dataloader) * total_epochs``, after ``data.filter_overlong_prompts``;
    at most ``rollout.total_rollout_steps``' steps under verl's fully-async rule), else
    ``trainer.total_iterations``."""
    if not cfg.trainer.total_epochs:
        return cfg.trainer.total_iterations
    by_epochs = cfg.trainer.total_epochs * make_loader(cfg).iterations_per_epoch
    if cfg.async_training.enable and cfg.rollout.total_rollout_steps:  # verl's fully-async: the smaller
        return min(by_epochs, cfg.trainer.total_iterations)
    return by_epochs


def make_loader(cfg: RunConfig, state=None):
    from rlhf_core.data.dataset import Cursor, PromptLoader, load_rows
    from rlhf_core.data.tokenizer import PromptTokenizer
    from rlhf_core.workers import modeling

    model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, progress=cfg.trainer.progress,
                                            weights=False)  # the controller only tokenizes
    rows = load_rows(cfg.data.train_files, cfg.trainer.seed, prompt_key=cfg.data.prompt_key,
                     source_key=cfg.data.reward_fn_key)
    return PromptLoader(rows, PromptTokenizer(model_path),
                        cfg.prompts_per_generation, cfg.data.max_prompt_length, cfg.trainer.seed,
                        cfg.data.shuffle, cursor=Cursor(**state.cursor) if state is not None else None,
                        truncation=cfg.data.truncation, filter_overlong=cfg.data.filter_overlong_prompts,
                        keep_chat=cfg.reward_model.enable or cfg.rollout.multi_turn.enable)
