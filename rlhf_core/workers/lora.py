"""LoRA adapters on the actor (``model.lora_rank`` > 0 or ``model.lora_adapter_path``).

peft's ``LoraConfig`` over the causal LM, applied before FSDP2 shards it (FSDP2 shards
per parameter, so frozen base weights and trainable adapters share a layer's unit, as in
verl). Only the adapters train: the optimizer holds them and their AdamW state. The
reference policy is the same model with the adapter switched off (``reference_forward``),
so a LoRA run keeps no second copy of the base.

verl's keys keep their meaning: ``target_modules`` is ``all-linear`` (peft's: every
Linear but the output head) or module names; ``exclude_modules`` removes names from
that; ``lora_adapter_path`` starts from a saved adapter, whose own rank, alpha and
modules then apply.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch


class LoraError(ValueError):
    """LoRA settings that do not fit the model; one line naming the field."""


def _names(text: str) -> list[str]:
    """``q_proj,v_proj`` or verl's list syntax ``[q_proj,v_proj]`` / ``['q_proj', 'v_proj']``."""
    return [n for n in (name.strip().strip("'\"") for name in text.strip().strip("[]").split(",")) if n]


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every Linear in ``model`` (what ``target_modules`` names)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear)})


def lora_config(model_cfg):
    """The peft ``LoraConfig`` of ``model.lora_rank`` / ``lora_alpha`` / ``target_modules``
    / ``exclude_modules``."""
    from peft import LoraConfig

    targets = model_cfg.target_modules.strip()
    exclude = _names(model_cfg.exclude_modules)
    return LoraConfig(task_type="CAUSAL_LM", r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, bias="none",
                      target_modules="all-linear" if targets == "all-linear" else _names(targets),
                      exclude_modules=exclude or None)


def _same_base(recorded: str | None, model_path: str, resolved: str) -> bool:
    """Whether an adapter's recorded base (peft's ``base_model_name_or_path``: a folder or a
    hub id) is the model the run loads: the same string or folder, or a hub id whose name is
    the folder's (``Qwen/Qwen2.5-3B`` for ``/models/Qwen2.5-3B``). Nothing recorded: taken."""
    if not recorded:
        return True
    if recorded in (model_path, resolved) or (os.path.isdir(recorded) and os.path.isdir(resolved)
                                             and os.path.realpath(recorded) == os.path.realpath(resolved)):
        return True
    last = recorded.rstrip("/").rsplit("/", 1)[-1]
    return last in (model_path.rstrip("/").rsplit("/", 1)[-1], resolved.rstrip("/").rsplit("/", 1)[-1])


def apply_lora(model: torch.nn.Module, model_cfg, resolved_path: str, seed: int = 0):
    """``model`` with LoRA adapters (a peft ``PeftModel``), its base frozen: new adapters
    (``lora_A`` drawn from ``seed`` alone, whatever ran before in the process; ``lora_B``
    zero, so the model starts as the base), or the saved ones of ``model.lora_adapter_path``,
    trainable."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _with_adapters(model, model_cfg, resolved_path)


def _with_adapters(model: torch.nn.Module, model_cfg, resolved_path: str):
    from peft import PeftModel, get_peft_model

    if model_cfg.lora_adapter_path:
        path = model_cfg.lora_adapter_path
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
                saved = json.load(fh)
        except (OSError, ValueError) as exc:
            raise LoraError(f"model.lora_adapter_path: expected a PEFT adapter folder (adapter_config.json, "
                            f"adapter_model.safetensors); found {path!r} ({exc})") from None
        base = saved.get("base_model_name_or_path") if isinstance(saved, dict) else None
        if not _same_base(base, model_cfg.path, resolved_path):
            raise LoraError(f"model.lora_adapter_path: expected an adapter of model.path={model_cfg.path}; found "
                            f"one of {base} in {path}")
        if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
            raise LoraError(f"model.lora_adapter_path: expected a LoRA adapter; found peft_type="
                            f"{saved.get('peft_type') if isinstance(saved, dict) else saved!r} in {path}")
        return PeftModel.from_pretrained(model, path, is_trainable=True)
    try:
        return get_peft_model(model, lora_config(model_cfg))
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "did not match" not in str(exc):
            raise
        raise LoraError(f"model.target_modules: expected names of modules in {model_cfg.path} (its Linear modules: "
                        f"{', '.join(linear_names(model))}); found {model_cfg.target_modules!r}, which matches "
                        f"none") from None


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter of a full fine-tune, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def reference_forward(model: torch.nn.Module):
    """The base model, its adapter off for the block: the reference policy of a LoRA run."""
    with model.disable_adapter():
        yield model
