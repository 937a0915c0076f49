"""Workers that train a model: config in, checkpoints out (shared by actor and critic)."""

from __future__ import annotations

import io
import json

import torch

from rlhf_core.config import RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.workers import modeling


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
        """Rank 0 writes weights (safetensors), optimizer + LR schedule (torch, tensors
        only) and RNG states under ``uri`` through fsspec; returns {file: sha256}."""
        if self.rank != 0:
            return None
        return save_training_state(uri, modeling.unwrap(self._trained_model()), self.optimizer, self.scheduler,
                                   storage_options, prefix=self.checkpoint_prefix)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Load the role's files; with ``expected`` ({file: sha256}, from the iteration
        manifest) a file whose bytes differ is refused before anything is loaded."""
        load_training_state(uri, modeling.unwrap(self._trained_model()), self.optimizer, self.scheduler,
                            storage_options, prefix=self.checkpoint_prefix, expected=expected)
        self._after_load()


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file whose bytes are not the ones its iteration committed."""


def save_training_state(uri: str, model, optimizer, scheduler, storage_options, prefix: str) -> dict:
    """Write the role's files (each durable on local disk before this returns); returns
    {file name: sha256} of what was written, for the iteration manifest."""
    from safetensors.torch import save as save_safetensors

    from rlhf_core.snapshot import fs as sfs

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, buffer)
    files = {f"{prefix}_model.safetensors": save_safetensors(state), f"{prefix}_optim.pt": buffer.getvalue(),
             f"{prefix}_meta.json": json.dumps({"parameters": len(state)}).encode()}
    return sfs.write_durably(uri, files, storage_options)


def load_training_state(uri: str, model, optimizer, scheduler, storage_options, prefix: str,
                        expected: dict | None = None) -> None:
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
    model.load_state_dict(load_safetensors(raw[f"{prefix}_model.safetensors"]))
    # weights_only: the optimizer file holds tensors and plain containers, nothing callable
    state = torch.load(io.BytesIO(raw[f"{prefix}_optim.pt"]), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
