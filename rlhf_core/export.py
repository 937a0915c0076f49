"""``rlhf export CHECKPOINT_URI --out DIR``: a trained policy as a Hugging Face model folder.

The folder is the base model's (config, generation config, tokenizer, chat template) with
the checkpoint's weights in ``model.safetensors``, so ``transformers`` and vLLM load it as
they load the base model. ``EXPORT.json`` says where it came from: the checkpoint URI, the
weights' sha256, the config hash and the step (``rlhf lineage`` goes on from there).

Only a checkpoint a committed record names is exported (an iteration manifest's
checkpoint, or the run's INITIAL.json for step 0), from bytes checked against the
checksums of that record (``rlhf_core.checkpoint.reader``): a file changed after the
commit is refused before anything of it is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from rlhf_core.record import run_layout
from rlhf_core.record.checkpoints import checked_checkpoint_uri
from rlhf_core.snapshot import fs as sfs
from rlhf_core.checkpoint.layout import TRAINER_STATE_FILE

POLICY = "actor"  # the policy's folder in a checkpoint (sharded, torch.distributed.checkpoint)
#: Files of the base folder that are weights (replaced) rather than config or tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message says what is missing."""


def committed_record(uri: str, storage_options: dict | None = None) -> tuple[dict[str, str], dict | None]:
    """({file: sha256} of the checkpoint at ``uri`` as the record that commits it lists
    them, that record). For a PPO run's step S > 0 the record is the manifest of iteration
    S - 1, which names the checkpoint it wrote (``step-S-<attempt>``; ``step-S`` in runs
    from before attempt ids), for step 0 the run's ``checkpoints/INITIAL.json`` (None is
    returned for it); for a reward model's training, epoch S's manifest. A folder no
    committed record names (a lost or unfinished write, a copy, anything outside a run) is
    refused, and so is one whose record has no checksums."""
    from rlhf_core.record.checkpoints import writer_iteration
    from rlhf_core.record.iteration_store import IterationStore

    loc = run_layout.parse(uri.rstrip("/"))
    if loc is None or loc.step is None:
        raise ExportError(f"{uri}: expected a run's checkpoint, {{store}}/{{run_id}}/checkpoints/step-NNNNNN-<attempt> "
                          f"(the one an iteration manifest's weights.checkpoint or the run's "
                          f"checkpoints/{run_layout.INITIAL_CHECKPOINT} names)")
    istore = IterationStore(loc.run, storage_options)
    run_format = istore.run_format()
    manifest = None
    if loc.step == 0 and writer_iteration(0, run_format) < 0:
        record = f"{istore.run_uri}/{run_layout.CHECKPOINTS}/{run_layout.INITIAL_CHECKPOINT}"
        named, checksums = istore.initial_checkpoint() or (None, None)
    else:
        writer = writer_iteration(loc.step, run_format)
        if writer not in istore.committed_iterations():
            raise ExportError(f"{uri}: iteration {writer}, which writes step {loc.step}'s checkpoint, is not "
                              f"committed; only a checkpoint a committed record names is exported")
        record = f"{istore.iteration_uri(writer)}/{run_layout.MANIFEST}"
        manifest = istore.read_manifest(writer, format=run_format)
        named, checksums = manifest.get("checkpoint"), manifest.get("checkpoint_sha256")
        named = checked_checkpoint_uri(istore, named, loc.step, record) if named else None
    if named is None or sfs.resolve(named, storage_options).uri != sfs.resolve(uri, storage_options).uri:
        raise ExportError(f"{uri}: no committed record names this checkpoint ({record} names {named or 'none'}); "
                          f"only the checkpoint a record commits is exported")
    if not checksums:
        raise ExportError(f"{uri}: no committed checksums in {record}; a "
                          f"checkpoint is read only from files whose sha256 its record lists")
    return checksums, manifest


def export_checkpoint(uri: str, out: str, storage_options: dict | None = None,
                      expected: dict[str, str] | None = None, merged: bool = False) -> dict:
    """Write the policy of the checkpoint at ``uri`` as a Hugging Face folder ``out``
    (which must not exist yet, or be empty). ``expected``: {file: sha256} of the
    checkpoint (``save_checkpoint``'s result); by default its commit's. A LoRA run's
    checkpoint becomes a PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, for ``PeftModel.from_pretrained`` over the base), or with
    ``merged`` the base with the adapter merged in, as a full run's. Returns what
    EXPORT.json records."""
    from safetensors.torch import save as save_safetensors

    from rlhf_core.record.run_layout import REWARD_MODEL_TRAINING_FORMAT
    from rlhf_core.workers import modeling
    from rlhf_core.checkpoint.reader import METADATA, CheckedFiles

    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"--out: expected a new or empty folder; found {out} with files in it")
    manifest = None
    if expected is None:
        expected, manifest = committed_record(uri, storage_options)
    files = CheckedFiles(sfs.resolve(uri.rstrip("/"), storage_options), expected)
    if manifest is not None and manifest["format"] == REWARD_MODEL_TRAINING_FORMAT:
        return export_reward_model(files, manifest, uri, out)
    state = json.loads(files.get(TRAINER_STATE_FILE))
    metadata = files.get(f"{POLICY}/{METADATA}")
    config = state.get("config") or {}
    model_path = (config.get("model") or {}).get("path")
    if not model_path:
        raise ExportError(f"{uri}/{TRAINER_STATE_FILE}: no config.model.path; cannot find the base model's "
                          f"config and tokenizer")
    base = Path(modeling.resolve_model_path(model_path, int((config.get("trainer") or {}).get("seed", 0))))
    lora_cfg = _lora_settings(config)
    if lora_cfg is not None:
        _check_base(files, uri, base)
        adapted = read_adapted_policy(files, base, lora_cfg)
        if not merged:
            return _write_adapter(adapted, target, uri, metadata, state, model_path)
        weights = {name: tensor.contiguous() for name, tensor in adapted.merge_and_unload().state_dict().items()}
    else:
        weights = read_policy_weights(files, base)
    target.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "WARM_START.json":
            shutil.copy2(item, target / item.name)
    model_config = json.loads((base / "config.json").read_text())
    if model_config.get("tie_word_embeddings") and "lm_head.weight" in weights:
        del weights["lm_head.weight"]  # tied to the input embeddings: stored once, as HF saves it
    raw = save_safetensors(weights, metadata={"format": "pt"})
    (target / "model.safetensors").write_bytes(raw)
    return _write_record(target, uri, metadata, state, model_path, raw,
                         **({"lora": "merged"} if lora_cfg is not None else {}))


def export_reward_model(files, manifest: dict, uri: str, out: str) -> dict:
    """A reward model's training checkpoint (epoch E of ``rlhf reward-model train``) as the
    folder that training writes after its last epoch: the base's classifier with the
    checkpoint's weights, its tokenizer, and the provenance record (the preferences, the
    base, the run) that PPO's manifests and ``rlhf lineage`` read; EXPORT.json beside it.
    A training killed after its last commit, or any earlier epoch, is exported this way."""
    import torch.distributed.checkpoint as dcp

    from rlhf_core.checkpoint.reader import METADATA, CheckedReader, WeightsOnlyPlanner
    from rlhf_core.trainer.preference import ROLE, base_and_tokenizer, write_folder
    from rlhf_core.workers import modeling
    from rlhf_core.workers.reward_model import PROVENANCE

    target = Path(out)  # new or empty: export_checkpoint checked
    settings, where = manifest.get("settings"), f"{uri}: its epoch's manifest"
    if not isinstance(settings, dict) or not isinstance(manifest.get("base"), str) \
            or not isinstance(settings.get("seed"), int):
        raise ExportError(f"{where}: expected the training's base and settings.seed; found base "
                          f"{str(manifest.get('base'))[:60]!r}, settings {str(settings)[:60]!r}")
    base = modeling.resolve_model_path(manifest["base"], settings["seed"], field="base")
    model, tokenizer = base_and_tokenizer(base, settings["seed"])
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    wrapped = {"model": state}
    dcp.load(wrapped, storage_reader=CheckedReader(files, ROLE, files.metadata(ROLE)),
             planner=WeightsOnlyPlanner(), no_dist=True)
    model.load_state_dict(wrapped["model"])
    write_folder(model, tokenizer, target)
    # what training writes beside its folder (the pair counts aside), as this epoch recorded it
    provenance = {"format": 1, **{key: manifest.get(key) for key in ("data", "base", "settings", "curve",
                                                                      "cut_sides", "code_version")},
                  "run": uri.rstrip("/").split(f"/{run_layout.CHECKPOINTS}/")[0], "epoch": manifest["iteration"]}
    (target / PROVENANCE).write_text(json.dumps(provenance, indent=1, sort_keys=True))
    metadata = files.get(f"{ROLE}/{METADATA}")
    return _write_record(target, uri, metadata, {"global_step": manifest["iteration"]}, manifest["base"],
                         (target / "model.safetensors").read_bytes(), reward_model=True)


def _write_record(target: Path, uri: str, metadata: bytes, state: dict, model_path: str, weights: bytes,
                  **extra) -> dict:
    """EXPORT.json: where the folder's weights came from."""
    record = {"checkpoint_uri": uri, "checkpoint_metadata_sha256": hashlib.sha256(metadata).hexdigest(),
              "weights_sha256": hashlib.sha256(weights).hexdigest(), "global_step": state.get("global_step"),
              "config_hash": state.get("config_hash"), "base_model": model_path, **extra}
    (target / "EXPORT.json").write_text(json.dumps(record, indent=1))
    return record


def _lora_settings(config: dict):
    """The run's ``model`` section as a ``ModelConfig`` when it trained LoRA adapters, else None."""
    from rlhf_core.config import ModelConfig

    section = config.get("model") or {}
    known = {k: v for k, v in section.items() if k in ModelConfig.__dataclass_fields__}
    settings = ModelConfig(**known)
    return settings if settings.lora else None


def _check_base(files, uri: str, base: Path) -> None:
    """A LoRA checkpoint's adapter goes only onto the base it was trained on: the content
    hash its rank-0 file records against the folder ``model.path`` names now."""
    import io

    import torch

    from rlhf_core.checkpoint.layout import RANK_FILE
    from rlhf_core.checkpoint.reader import other_base_problem
    from rlhf_core.workers import modeling

    extra = torch.load(io.BytesIO(files.get(f"{POLICY}/{RANK_FILE.format(0)}")), weights_only=True)
    problem = other_base_problem(extra, {"path": str(base), "sha256": modeling.content_sha256(str(base))}, uri)
    if problem:
        raise ExportError(problem)


def read_adapted_policy(files, base: Path, lora_cfg):
    """The base model (its own weights) with the checkpoint's adapters, as peft holds it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rlhf_core.checkpoint.reader import CheckedReader, WeightsOnlyPlanner
    from rlhf_core.workers import lora, modeling

    model = lora.apply_lora(modeling.load_causal_lm(str(base)), lora_cfg, str(base))
    state = {name: torch.empty_like(p) for name, p in model.named_parameters() if p.requires_grad}
    wrapped = {"model": state}
    dcp.load(wrapped, storage_reader=CheckedReader(files, POLICY, files.metadata(POLICY)),
             planner=WeightsOnlyPlanner(), no_dist=True)
    model.load_state_dict(wrapped["model"], strict=False)  # the adapters; the base stays the base's
    return model.eval()


def _write_adapter(model, target: Path, uri: str, metadata: bytes, state: dict, model_path: str) -> dict:
    model.peft_config["default"].base_model_name_or_path = model_path  # what lora_adapter_path checks
    model.save_pretrained(target, safe_serialization=True)
    return _write_record(target, uri, metadata, state, model_path,
                         (target / "adapter_model.safetensors").read_bytes(), lora="adapter")


def read_policy_weights(files, base: Path) -> dict:
    """The policy's whole tensors from the checkpoint's shards (``files``: its
    ``CheckedFiles``), in this process (no process group: the shards of every rank are
    read and joined)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_core.checkpoint.reader import CheckedReader, WeightsOnlyPlanner

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in skeleton.state_dict().items()}
    wrapped = {"model": state}
    dcp.load(wrapped, storage_reader=CheckedReader(files, POLICY, files.metadata(POLICY)),
             planner=WeightsOnlyPlanner(), no_dist=True)
    return wrapped["model"]
