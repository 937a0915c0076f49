"""Workers that train a model: config in, checkpoints out (shared by actor and critic)."""

from __future__ import annotations

import io
import json

import torch

from rlhf_core.config import RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.workers import sharding


class TrainableWorker(Worker):
    """Holds ``self.optimizer`` / ``self.scheduler`` for the model ``_trained_model()``
    returns; checkpoints go under ``{uri}/{checkpoint_prefix}_*``."""

    checkpoint_prefix = "model"

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config

    def _trained_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def _after_load(self) -> None:
        """Hook run after a checkpoint was loaded (e.g. push weights to an engine)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, uri: str, storage_options: dict | None = None) -> dict | None:
        """Every rank helps gather the whole model and optimizer state (FSDP shards them);
        rank 0 writes weights (safetensors), optimizer + LR schedule (torch, tensors only)
        and RNG states under ``uri`` through fsspec and returns {file: sha256}."""
        model_state, optim_state = sharding.full_state(self._trained_model(), self.optimizer)
        if self.rank != 0:
            return None
        return save_training_state(uri, model_state, optim_state, self.scheduler, storage_options,
                                   prefix=self.checkpoint_prefix)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Rank 0 reads the role's files and every rank takes its shard of them; with
        ``expected`` ({file: sha256}, from the iteration manifest) a file whose bytes differ
        is refused before anything is loaded. Any world size and strategy can load them."""
        model_state, optim_state, small = {}, {}, None
        if self.rank == 0:
            try:
                model_state, optim_state, small = read_training_state(uri, storage_options, self.checkpoint_prefix,
                                                                      expected)
            except Exception as error:  # the other ranks wait in the broadcast below
                small = error
        small = sharding.broadcast_from_rank0(small)  # a refused file fails every rank, not just rank 0
        if isinstance(small, Exception):
            raise small
        sharding.load_full_state(self._trained_model(), self.optimizer, model_state, optim_state)
        self.scheduler.load_state_dict(small["scheduler"])
        torch.set_rng_state(small["torch_rng"])
        self._after_load()


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file whose bytes are not the ones its iteration committed."""


def save_training_state(uri: str, model_state: dict, optim_state: dict, scheduler, storage_options,
                        prefix: str) -> dict:
    """Write the role's files (each durable on local disk before this returns); returns
    {file name: sha256} of what was written, for the iteration manifest."""
    from safetensors.torch import save as save_safetensors

    from rlhf_core.snapshot import fs as sfs

    weights, seen = {}, set()
    for key, value in model_state.items():
        value = value.detach().contiguous().cpu()
        if value.untyped_storage().data_ptr() in seen:  # tied weights (e.g. embeddings and LM head)
            value = value.clone()  # safetensors stores each name's own bytes
        seen.add(value.untyped_storage().data_ptr())
        weights[key] = value
    buffer = io.BytesIO()
    torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, buffer)
    files = {f"{prefix}_model.safetensors": save_safetensors(weights), f"{prefix}_optim.pt": buffer.getvalue(),
             f"{prefix}_meta.json": json.dumps({"parameters": len(weights)}).encode()}
    return sfs.write_durably(uri, files, storage_options)


def read_training_state(uri: str, storage_options, prefix: str, expected: dict | None = None
                        ) -> tuple[dict, dict, dict]:
    """(model state, optimizer state, {scheduler, torch_rng}) from the role's files; a
    file whose sha256 differs from ``expected`` is refused before anything is used."""
    import hashlib

    import fsspec
    from safetensors.torch import load as load_safetensors

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    raw = {name: fs.cat_file(f"{root}/{name}") for name in (f"{prefix}_model.safetensors", f"{prefix}_optim.pt")}
    for name, data in raw.items():
        want = (expected or {}).get(name)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise CorruptCheckpointError(f"{uri}/{name}: sha256 {hashlib.sha256(data).hexdigest()[:16]}... is not "
                                         f"the {want[:16]}... its iteration committed; the checkpoint was changed "
                                         f"or damaged after the commit")
    # weights_only: the optimizer file holds tensors and plain containers, nothing callable
    state = torch.load(io.BytesIO(raw[f"{prefix}_optim.pt"]), weights_only=True)
    return (load_safetensors(raw[f"{prefix}_model.safetensors"]), state["optimizer"],
            {"scheduler": state["scheduler"], "torch_rng": state["torch_rng"]})
