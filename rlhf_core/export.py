"""``rlhf export CHECKPOINT_URI --out DIR``: a trained policy as a Hugging Face model folder.

The folder is the base model's (config, generation config, tokenizer, chat template) with
the checkpoint's weights in ``model.safetensors``, so ``transformers`` and vLLM load it as
they load the base model. ``EXPORT.json`` says where it came from: the checkpoint URI, the
weights' sha256, the config hash and the step (``rlhf lineage`` goes on from there).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from rlhf_core.snapshot import fs as sfs
from rlhf_core.workers.worker_set import TRAINER_STATE_FILE

POLICY = "actor"  # the policy's folder in a checkpoint (sharded, torch.distributed.checkpoint)
#: Files of the base folder that are weights (replaced) rather than config or tokenizer.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class ExportError(ValueError):
    """The checkpoint cannot be exported; the message says what is missing."""


def _read(uri: str, name: str, storage_options: dict | None) -> bytes:
    data = sfs.read_bytes(sfs.resolve(f"{uri.rstrip('/')}/{name}", storage_options))
    if data is None:
        raise ExportError(f"{uri}: no {name}; expected a checkpoint folder written by a run "
                          f"(an iteration manifest's checkpoint_uri)")
    return data


def export_checkpoint(uri: str, out: str, storage_options: dict | None = None) -> dict:
    """Write the policy of the checkpoint at ``uri`` as a Hugging Face folder ``out``
    (which must not exist yet, or be empty). Returns what EXPORT.json records."""
    from safetensors.torch import save as save_safetensors

    from rlhf_core.workers import modeling

    state = json.loads(_read(uri, TRAINER_STATE_FILE, storage_options))
    metadata = _read(f"{uri.rstrip('/')}/{POLICY}", ".metadata", storage_options)
    config = state.get("config") or {}
    model_path = (config.get("model") or {}).get("path")
    if not model_path:
        raise ExportError(f"{uri}/{TRAINER_STATE_FILE}: no config.model.path; cannot find the base model's "
                          f"config and tokenizer")
    base = Path(modeling.resolve_model_path(model_path, int((config.get("trainer") or {}).get("seed", 0))))
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"--out: expected a new or empty folder; found {out} with files in it")
    weights = read_policy_weights(uri, base, storage_options)
    target.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "WARM_START.json":
            shutil.copy2(item, target / item.name)
    model_config = json.loads((base / "config.json").read_text())
    if model_config.get("tie_word_embeddings") and "lm_head.weight" in weights:
        del weights["lm_head.weight"]  # tied to the input embeddings: stored once, as HF saves it
    raw = save_safetensors(weights, metadata={"format": "pt"})
    (target / "model.safetensors").write_bytes(raw)
    record = {"checkpoint_uri": uri, "checkpoint_metadata_sha256": hashlib.sha256(metadata).hexdigest(),
              "weights_sha256": hashlib.sha256(raw).hexdigest(), "global_step": state.get("global_step"),
              "config_hash": state.get("config_hash"), "base_model": model_path}
    (target / "EXPORT.json").write_text(json.dumps(record, indent=1))
    return record


def read_policy_weights(uri: str, base: Path, storage_options: dict | None = None) -> dict:
    """The policy's whole tensors from the checkpoint's shards, in this process (no
    process group: the shards of every rank are read and joined)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in skeleton.state_dict().items()}
    folder = sfs.resolve(f"{uri.rstrip('/')}/{POLICY}", storage_options)
    wrapped = {"model": state}
    dcp.load(wrapped, storage_reader=FsspecReader(folder.uri, **folder.storage_options), no_dist=True)
    return wrapped["model"]
