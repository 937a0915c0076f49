"""LoRA adapters on the actor (``model.lora_rank`` > 0 or ``model.lora_adapter_path``) and
the critic (``critic.lora_rank`` > 0), and the adapter's copy in the vLLM engine.

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


def lora_config(settings, task_type: str | None = "CAUSAL_LM"):
    """The peft ``LoraConfig`` of a section's ``lora_rank`` / ``lora_alpha`` /
    ``target_modules`` / ``exclude_modules`` (``model.*``, or ``critic.*`` with no task:
    the critic's backbone has no output head)."""
    from peft import LoraConfig

    targets = settings.target_modules.strip()
    exclude = _names(settings.exclude_modules)
    return LoraConfig(task_type=task_type, r=settings.lora_rank, lora_alpha=settings.lora_alpha, bias="none",
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
    from peft import PeftModel

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
    return _adapted(model, model_cfg, "model", model_cfg.path, "CAUSAL_LM")


def _adapted(model: torch.nn.Module, settings, section: str, where: str, task_type: str | None):
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(settings, task_type))
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "did not match" not in str(exc):
            raise
        raise LoraError(f"{section}.target_modules: expected names of modules in {where} (its Linear modules: "
                        f"{', '.join(linear_names(model))}); found {settings.target_modules!r}, which matches "
                        f"none") from None


def apply_critic_lora(value_model: torch.nn.Module, critic_cfg, model_path: str, seed: int = 0):
    """``value_model`` (``modeling.ValueModel``) with LoRA adapters on its backbone
    (``critic.lora_rank`` ...), the backbone's own weights frozen; the value head, new
    to this model, trains whole."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        value_model.backbone = _adapted(value_model.backbone, critic_cfg, "critic", model_path, None)
    return value_model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter of a full fine-tune, the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def reference_forward(model: torch.nn.Module):
    """The base model, its adapter off for the block: the reference policy of a LoRA run."""
    with model.disable_adapter():
        yield model


# ---------------------------------------------------------------- the engine's copy

def engine_max_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank`` (``model.lora_rank`` is checked
    with the config; a saved adapter's own rank is checked here)."""
    from rlhf_core.rollout import EngineConfigError
    from rlhf_core.rollout.engines.vllm import max_lora_rank

    try:
        return max_lora_rank(rank)
    except EngineConfigError as exc:
        raise LoraError(str(exc)) from None


#: Modules a LoRA adapter may adapt that vLLM's LoRA requests do not serve (0.32 refuses
#: the adapter): such a policy is served merged.
ENGINE_UNSERVED = ("lm_head", "embed_tokens")


def check_engine_serves(model: torch.nn.Module) -> None:
    """Refuse, in one line, an adapter the engine cannot take as a LoRA request."""
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    unserved = sorted(adapted & set(ENGINE_UNSERVED))
    if unserved:
        raise LoraError(f"model.target_modules: expected modules vLLM serves as a LoRA request (not "
                        f"{', '.join(ENGINE_UNSERVED)}) with rollout.lora_merge=false; found {', '.join(unserved)} "
                        f"adapted: set rollout.lora_merge=true to serve the merged weights")


def settings(model: torch.nn.Module):
    """The adapter's peft ``LoraConfig`` (from ``model.lora_*`` or the saved adapter's own)."""
    return model.peft_config["default"]


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor (``...q_proj.lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def is_base(name: str) -> bool:
    return not is_adapter(name)


def base_name(name: str) -> str:
    """The base model's own name of a peft-wrapped base tensor
    (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``): what the engine's checkpoint calls it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def saved_name(name: str) -> str:
    """An adapter tensor's name as a PEFT adapter file holds it (the adapter's own name,
    ``default``, left out): ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def merged_stream(model: torch.nn.Module, named):
    """The base model's own (name, tensor) with every adapter folded in (W + scaling x B A),
    from ``named``, the peft model's state-dict stream (``sharding.stream_full_parameters``):
    each base weight is held until its module's A and B have come, so one module's three
    tensors are alive at once, not a model copy."""
    scaling = {name: module.scaling["default"] for name, module in model.named_modules()
               if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling}
    parts: dict[str, dict] = {}
    for name, tensor in named:
        prefix, kind = _lora_part(name)
        if prefix not in scaling:
            yield base_name(name), tensor
            continue
        parts.setdefault(prefix, {})[kind] = tensor
        got = parts[prefix]
        if len(got) == 3:
            del parts[prefix]
            weight = got["W"]
            delta = (got["B"].float() @ got["A"].float()) * scaling[prefix]
            yield base_name(f"{prefix}.base_layer.weight"), (weight.float() + delta).to(weight.dtype)


def _lora_part(name: str) -> tuple[str, str]:
    """(module, W | A | B) of a LoRA module's weight tensors; (name, "") for any other."""
    for suffix, kind in ((".base_layer.weight", "W"), (".lora_A.default.weight", "A"),
                         (".lora_B.default.weight", "B")):
        if name.endswith(suffix):
            return name[:-len(suffix)], kind
    return name, ""


def write_adapter_folder(folder: str, tensors: dict[str, torch.Tensor], config) -> None:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) of
    ``tensors`` (saved names) and ``config`` (a peft ``LoraConfig``): what peft and vLLM load."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file({name: t.detach().contiguous() for name, t in tensors.items()},
              os.path.join(folder, "adapter_model.safetensors"))
