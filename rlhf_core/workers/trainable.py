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
    def save_checkpoint(self, uri: str, storage_options: dict | None = None) -> str | None:
        """Rank 0 writes weights (safetensors), optimizer + LR schedule (torch, tensors
        only) and RNG states under ``uri`` through fsspec."""
        if self.rank != 0:
            return None
        return save_training_state(uri, modeling.unwrap(self._trained_model()), self.optimizer, self.scheduler,
                                   storage_options, prefix=self.checkpoint_prefix)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, uri: str, storage_options: dict | None = None) -> None:
        load_training_state(uri, modeling.unwrap(self._trained_model()), self.optimizer, self.scheduler,
                            storage_options, prefix=self.checkpoint_prefix)
        self._after_load()


def save_training_state(uri: str, model, optimizer, scheduler, storage_options, prefix: str) -> str:
    import fsspec
    from safetensors.torch import save as save_safetensors

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    fs.pipe_file(f"{root}/{prefix}_model.safetensors", save_safetensors(state))
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, buffer)
    fs.pipe_file(f"{root}/{prefix}_optim.pt", buffer.getvalue())
    fs.pipe_file(f"{root}/{prefix}_meta.json", json.dumps({"parameters": len(state)}).encode())
    return f"{uri.rstrip('/')}/{prefix}_model.safetensors"


def load_training_state(uri: str, model, optimizer, scheduler, storage_options, prefix: str) -> None:
    import fsspec
    from safetensors.torch import load as load_safetensors

    fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    model.load_state_dict(load_safetensors(fs.cat_file(f"{root}/{prefix}_model.safetensors")))
    # weights_only: the optimizer file holds tensors and plain containers, nothing callable
    state = torch.load(io.BytesIO(fs.cat_file(f"{root}/{prefix}_optim.pt")), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
