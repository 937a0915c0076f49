"""The files of one checkpoint folder: per trainable role a ``torch.distributed.checkpoint``
folder (shard files, ``.metadata``) and one rank file per rank, then the controller's
state file, written last: a checkpoint is complete once that file exists."""

from __future__ import annotations

RANK_FILE = "rank-{:05d}.pt"
#: The controller's state (global step, data cursor, KL coefficient, config), written last.
TRAINER_STATE_FILE = "trainer_state.json"


def checkpoint_exists(uri: str, storage_options: dict | None = None) -> bool:
    """A checkpoint is complete once the controller's state file, written last, exists."""
    from rlhf_core.snapshot import fs as sfs

    return sfs.read_bytes(sfs.resolve(f"{uri.rstrip('/')}/{TRAINER_STATE_FILE}", storage_options)) is not None
