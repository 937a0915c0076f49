"""Qwen2 models built from a config, with random weights: the built-in task's model (before
its warm start), the test model folders, the FSDP tests and the scale benchmark."""

from __future__ import annotations

import torch


def qwen2_from_config(seed: int | None = None, use_cache: bool = False, **config):
    """A randomly initialized Qwen2 causal LM of the given ``Qwen2Config`` fields (the
    built-in task's model, test and benchmark models); ``seed`` seeds torch first;
    ``use_cache``: the KV cache, for a model folder that will serve generation."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.config.use_cache = use_cache
    return model
