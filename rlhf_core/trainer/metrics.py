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
    mask = batch.batch["response_mask"].float()  # the tokens trained on
    # a response's length is every token after the prompt (verl's: a multi-turn row's tool answers included)
    response_length = batch.batch["attention_mask"][:, -mask.shape[1]:].float().sum(dim=-1)
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


#: verl's bootstrap for best@k / worst@k / maj@k: resamples per prompt, and the seed each
#: draw restarts from (``bootstrap_metric``'s defaults).
BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED = 1000, 42


def bootstrap_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for prompts with n responses: 2, 4, 8, ... below
    n, then n itself (none for n = 1), as verl's."""
    sizes, k = [], 2
    while n > 1 and k < n:
        sizes.append(k)
        k *= 2
    return sizes + ([n] if n > 1 else [])


def _bootstrap(values: list, k: int, reduce) -> tuple[float, float]:
    """Mean and std over ``BOOTSTRAP_SAMPLES`` draws of k of ``values`` (with replacement)
    of ``reduce(draw)``; every call draws the same indices for the same sizes (verl's
    reseeded global generator)."""
    import numpy as np

    draws = np.random.RandomState(BOOTSTRAP_SEED).choice(len(values), size=(BOOTSTRAP_SAMPLES, k), replace=True)
    results = np.array([reduce([values[i] for i in row]) for row in draws], dtype=np.float64)
    return float(results.mean()), float(results.std())


def _majority(pairs: list[tuple[float, object]]) -> float:
    """The value of the first response giving the most common answer (verl's ``calc_maj_val``)."""
    counts: dict = {}
    for value, answer in pairs:
        counts.setdefault(answer, []).append(value)
    return counts[max(counts, key=lambda a: len(counts[a]))][0]


def validation_metrics(data_sources, uids, variables: dict[str, list]) -> dict[str, float]:
    """verl's validation metrics (``process_validation_metrics`` and ``_val_metrics_update``)
    from one value per response, per data source and variable, each the mean over prompts
    of a per-prompt figure over its n responses: ``mean@n``; for n > 1 ``std@n`` and, for
    k in 2, 4, ..., n, ``best@k`` / ``worst@k`` (the max / min of k responses drawn with
    replacement, ``/mean`` and ``/std`` over verl's 1000 seeded draws) and, when the reward
    reports a ``pred`` answer, ``maj@k`` (the value of the majority answer among k). The
    core variable (``acc`` when the reward reports it, else ``reward``) has its mean, best
    and maj at the largest n under ``val-core/<data_source>/<var>/``; all else is under
    ``val-aux/``."""
    import numpy as np

    grouped: dict = {}
    for row, (source, uid) in enumerate(zip(data_sources, uids)):
        for name, values in variables.items():
            grouped.setdefault(source, {}).setdefault(name, {}).setdefault(uid, []).append(values[row])
    out = {}
    for source, by_var in grouped.items():
        core = "acc" if "acc" in by_var else "reward"
        answers = by_var.get("pred")
        for name, by_uid in by_var.items():
            if name == "pred":  # answers are voted on, not averaged
                continue
            per_prompt: dict[str, list[float]] = {}
            for uid, raw in by_uid.items():
                values = [float(v) for v in raw]
                n = len(values)
                figures = {f"mean@{n}": float(np.mean(values))}
                if n > 1:
                    figures[f"std@{n}"] = float(np.std(values))
                    for k in bootstrap_sizes(n):
                        for kind, reduce in (("best", max), ("worst", min)):
                            figures[f"{kind}@{k}/mean"], figures[f"{kind}@{k}/std"] = _bootstrap(values, k, reduce)
                        if answers is not None:
                            figures[f"maj@{k}/mean"], figures[f"maj@{k}/std"] = _bootstrap(
                                list(zip(values, answers[uid])), k, _majority)
                for key, value in figures.items():
                    per_prompt.setdefault(key, []).append(value)
            largest = max(int(key.split("@")[1].split("/")[0]) for key in per_prompt)
            for key, values in per_prompt.items():
                core_figure = name == core and key.startswith(("mean", "maj", "best")) and f"@{largest}" in key
                out[f"{'val-core' if core_figure else 'val-aux'}/{source}/{name}/{key}"] = float(np.mean(values))
    return out

