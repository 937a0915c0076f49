"""Metrics with verl's names, computed from the finished batch (pure functions)."""

from __future__ import annotations

import numpy as np
import torch

from rlhf_core.algorithms import masked_mean
from rlhf_core.protocol import DataProto


def reduce_metrics(metrics: dict) -> dict:
    """Mean of every list-valued metric (per-step, per-rank values from the workers)."""
    out = {}
    for key, value in metrics.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        values = [float(v) for v in values if v is not None]
        if values:
            out[key] = float(np.mean(values))
    return out


def _stats(prefix: str, values: torch.Tensor) -> dict:
    values = values.float()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: DataProto, entropys: torch.Tensor | None, use_critic: bool) -> dict:
    mask = batch.batch["response_mask"].float()
    response_length = mask.sum(dim=-1)
    prompt_length = batch.batch["prompts"].ne(0).sum(dim=-1) if "prompts" in batch.batch.keys() else None
    seq_mask = response_length > 0
    metrics = {}
    metrics.update(_stats("critic/score", batch.batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)))
    adv = batch.batch["advantages"][mask.bool()]
    ret = batch.batch["returns"][mask.bool()]
    metrics.update(_stats("critic/advantages", adv if adv.numel() else torch.zeros(1)))
    metrics.update(_stats("critic/returns", ret if ret.numel() else torch.zeros(1)))
    if use_critic and "values" in batch.batch.keys():
        vals = batch.batch["values"][mask.bool()]
        metrics.update(_stats("critic/values", vals if vals.numel() else torch.zeros(1)))
        var_ret = ret.var() if ret.numel() > 1 else torch.tensor(0.0)
        metrics["critic/vf_explained_var"] = (1 - (ret - vals).var() / (var_ret + 1e-5)).item() \
            if ret.numel() > 1 else 0.0
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == mask.shape[1]).float().mean().item()
    if prompt_length is not None:
        metrics.update(_stats("prompt_length", prompt_length))
    if entropys is not None:
        metrics["actor/entropy"] = masked_mean(entropys, mask).item()
    for key, column in batch.non_tensor_batch.items():
        if key.startswith("reward_extra/"):
            values = [float(v) for v in column.tolist() if isinstance(v, (int, float))]
            if values:
                metrics[f"critic/{key}/mean"] = float(np.mean(values))
    metrics["critic/num_valid_responses"] = int(seq_mask.sum())
    return metrics


def validation_metrics(data_sources, uids, variables: dict[str, list[float]]) -> dict[str, float]:
    """verl's validation metrics (``process_validation_metrics`` and ``_val_metrics_update``)
    from one value per response: per data source and variable, ``mean@n`` (the mean over
    prompts of each prompt's mean over its n responses) and, for n > 1, ``std@n`` (the mean
    over prompts of their std). The core variable (``acc`` when the reward reports it, else
    ``reward``) is logged as ``val-core/<data_source>/<var>/mean@n``, everything else under
    ``val-aux/``. verl's bootstrapped best@k / worst@k / maj@k are not computed."""
    import numpy as np

    grouped: dict = {}
    for row, (source, uid) in enumerate(zip(data_sources, uids)):
        for name, values in variables.items():
            grouped.setdefault(source, {}).setdefault(name, {}).setdefault(uid, []).append(float(values[row]))
    out = {}
    for source, by_var in grouped.items():
        core = "acc" if "acc" in by_var else "reward"
        for name, by_uid in by_var.items():
            n = max(len(v) for v in by_uid.values())
            section = "val-core" if name == core else "val-aux"
            out[f"{section}/{source}/{name}/mean@{n}"] = float(np.mean([np.mean(v) for v in by_uid.values()]))
            if n > 1:
                out[f"val-aux/{source}/{name}/std@{n}"] = float(np.mean([np.std(v) for v in by_uid.values()]))
    return out

