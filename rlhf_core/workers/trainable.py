"""Workers that train a model: config in, checkpoints out (shared by actor and critic)."""

from __future__ import annotations

import io
import math
import re
from typing import Callable

import torch

from rlhf_core.config import RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.protocol import DataProto
from rlhf_core.workers import devices, modeling, sharding


class TrainableWorker(Worker):
    """Holds ``self.optimizer`` / ``self.scheduler`` for the model ``_trained_model()``
    returns and trains it with one PPO update loop (``_ppo_update``); checkpoints go under
    ``{uri}/{checkpoint_prefix}/``.

    One seed rule for every role: ``trainer.seed + seed_offset`` plus the rank seeds the
    model's initialization, plus the step the mini-batch shuffling of that step's update."""

    checkpoint_prefix = "model"
    seed_offset = 0  # keeps two roles in one process from drawing the same numbers

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config

    def _trained_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def _seed_update(self, global_step: int) -> None:
        """Seed the process's RNGs (torch, numpy, python) from the run seed, the step and the
        rank before an update: what an update draws (dropout, say) and the RNG states a
        checkpoint records depend on the step alone, not on what ran in this process before
        (a session computing ahead, a resumed or redone iteration)."""
        self._seed_all((self.config.trainer.seed * 1_000_003 + global_step * 1009 + self.rank) % 2**32)

    @staticmethod
    def _seed_all(seed: int) -> None:
        """torch, numpy and python: the states a checkpoint records must not depend on the
        process (an unseeded generator starts from os.urandom)."""
        import random

        import numpy as np

        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    def _seed_init(self) -> None:
        self._seed_all(self.config.trainer.seed + self.seed_offset + self.rank)

    def _ppo_update(self, data: DataProto, role_cfg, loss_fn: Callable, prefix: str) -> dict[str, list]:
        """PPO epochs over shuffled mini-batches of ``data``, each accumulated over
        micro-batches (token-weighted): ``loss_fn(micro) -> (loss, {metric: float})``.
        A step whose gradient norm is not finite is skipped (the optimizer does not step,
        the schedule does) and counted in ``{prefix}/nonfinite_grad_steps``. Returns the
        metrics, one list entry per optimizer step."""
        model = self._trained_model()
        data = devices.to_device(data)  # the whole batch once; mini-batches index it there
        step_no = int(data.meta_info.get("global_step", 0))
        mini = modeling.mini_batch_rows(role_cfg.ppo_mini_batch_size, self.config.rollout.n, self.world_size, len(data))
        metrics: dict[str, list] = {}
        skipped = 0
        self._seed_update(step_no)
        offload = self.config.actor.fsdp_config.optimizer_offload
        if offload:
            sharding.move_optimizer_state(self.optimizer, sharding.device())
        model.train()
        shuffle_seed = self.config.trainer.seed + self.seed_offset + step_no
        for batch in data.make_iterator(mini, role_cfg.ppo_epochs, seed=shuffle_seed,
                                        dataloader_kwargs={"shuffle": True}):
            self.optimizer.zero_grad(set_to_none=True)
            step: dict[str, float] = {}
            for micro, weight in modeling.micro_batches(batch, role_cfg.ppo_micro_batch_size_per_gpu,
                                                        role_cfg.loss_agg_mode):
                loss, parts = loss_fn(micro)
                (loss * weight if weight != 1.0 else loss).backward()
                for key, value in parts.items():
                    step[key] = step.get(key, 0.0) + value * weight
            grad_norm = sharding.grad_norm_and_clip(model, role_cfg.grad_clip)
            if math.isfinite(grad_norm):
                self.optimizer.step()
            else:  # one bad batch must not write NaN into every weight
                skipped += 1
            self.scheduler.step()
            for key, value in step.items():
                metrics.setdefault(f"{prefix}/{key}", []).append(value)
            metrics.setdefault(f"{prefix}/grad_norm", []).append(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)  # gradient memory goes back for rollout
        metrics[f"{prefix}/lr"] = [self.scheduler.get_last_lr()[0]]
        metrics[f"{prefix}/nonfinite_grad_steps"] = [skipped]
        if offload:
            sharding.move_optimizer_state(self.optimizer, torch.device("cpu"))
        return metrics

    def _after_load(self) -> None:
        """Hook run after a checkpoint was loaded (e.g. push weights to an engine)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_checkpoint(self, uri: str, storage_options: dict | None = None) -> None:
        """Every rank starts writing its own shards of the model and optimizer
        (``torch.distributed.checkpoint`` under ``{uri}/{role}/``) and its LR schedule and
        RNG states: returns once the state is copied aside, so the caller may go on (weight
        sync, bookkeeping) while the shards are written; ``finish_checkpoint`` waits for
        them and returns {file: sha256} of what the rank wrote."""
        self._pending_checkpoint = self._start(uri, storage_options)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> dict:
        pending, self._pending_checkpoint = getattr(self, "_pending_checkpoint", None), None
        if pending is None:
            raise RuntimeError(f"{self.checkpoint_prefix}: finish_checkpoint without start_checkpoint")
        return finish_sharded(pending)

    def _start(self, uri: str, storage_options: dict | None):
        # The RNG states a checkpoint records must not depend on this process's history:
        # Ray's own code draws from python's global RNG at moments that depend on timing
        # (a GCS subscriber's id), so the states are reset from the optimizer steps taken
        # first. Nothing draws from them before the next update, which seeds its own.
        self._seed_update(self.scheduler.last_epoch)
        if getattr(self, "_checkpoint_group", None) is None and sharding.world_size() > 1:
            import torch.distributed as dist

            # the background writer's collectives run on a group of their own, so they never
            # interleave with the training collectives on the default one
            self._checkpoint_group = dist.new_group(backend="gloo")
        return start_sharded(uri, self.checkpoint_prefix, self._trained_model(), self.optimizer, self.scheduler,
                             storage_options, getattr(self, "_checkpoint_group", None))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Load the role's shards at this world size (a checkpoint saved at another one is
        resharded); with ``expected`` ({file: sha256}, from the iteration manifest) a file
        whose bytes differ is refused, on every rank, before anything is loaded."""
        load_sharded(uri, self.checkpoint_prefix, self._trained_model(), self.optimizer, self.scheduler,
                     storage_options, expected)
        self._after_load()


RANK_FILE = "rank-{:05d}.pt"


def _rng_states() -> dict:
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    states = {"torch": torch.get_rng_state(),
              "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)},
              "python": {"version": version, "state": list(py_state), "gauss": py_gauss}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = states["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if torch.cuda.is_available() and "cuda" in states and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


class _HashingFile:
    """A file being written whose sha256 is computed from the bytes as they go out. On an
    object store (``upload``) the bytes are kept and sent as one PUT when it closes: DCP
    writes tensor by tensor, and a stream to S3 would be many requests."""

    def __init__(self, raw, name: str, digests: dict, upload=None) -> None:
        import hashlib

        self._raw, self._name, self._digests, self._hash = raw, name, digests, hashlib.sha256()
        self._upload, self._closed = upload, False

    def write(self, data) -> int:
        self._hash.update(data)
        return self._raw.write(data)

    def close(self) -> None:
        if self._closed:  # DCP closes, then leaves the with-block
            return
        self._closed = True
        if self._upload is not None:
            self._upload(self._raw.getvalue())
        self._raw.close()
        self._digests[self._name] = self._hash.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _name(path) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


class _FsProxy:
    """The fsspec filesystem under a DCP writer, with ``open`` replaced (and
    ``on_rename`` told of renames); everything else passes through."""

    def __init__(self, inner, open, on_rename=None) -> None:
        self._inner, self._open, self._on_rename = inner, open, on_rename

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def open(self, path, mode="rb", **kwargs):
        return self._open(path, mode, **kwargs)

    def rename(self, path, new_path, **kwargs):
        self._inner.rename(path, new_path, **kwargs)
        if self._on_rename is not None:
            self._on_rename(_name(path), _name(new_path))


def _writer(folder, digests: dict):
    """DCP's fsspec writer for ``folder``, recording the sha256 of every file it writes
    (by name, renames followed) while writing: no second read of the checkpoint."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # local disk: fsync each file; an object store has no fsync (DCP would sync the whole
    # machine's disks instead): an object exists, durably, once its PUT returned
    writer = FsspecWriter(folder.uri, sync_files=folder.is_local, **folder.storage_options)
    inner = writer.fs.fs

    def open(path, mode, **kwargs):
        if "w" not in mode:
            return inner.open(path, mode, **kwargs)
        if folder.is_local:
            return _HashingFile(inner.open(path, mode, **kwargs), _name(path), digests)
        return _HashingFile(io.BytesIO(), _name(path), digests, upload=lambda data: inner.pipe_file(str(path), data))

    def renamed(old: str, new: str) -> None:
        if old in digests:
            digests[new] = digests.pop(old)

    writer.fs.fs = _FsProxy(inner, open, renamed)
    return writer


def _folder(uri: str, role: str, storage_options: dict | None):
    from rlhf_core.snapshot import fs as sfs

    return sfs.resolve(f"{uri.rstrip('/')}/{role}", storage_options)


class PendingCheckpoint:
    """A rank's checkpoint being written in the background (``start_sharded``)."""

    def __init__(self, future, folder, role: str, rank: int, extra: bytes, storage_options, digests: dict) -> None:
        self.future, self.folder, self.role, self.rank = future, folder, role, rank
        self.extra, self.storage_options, self.digests = extra, storage_options, digests


def start_sharded(uri: str, role: str, model, optimizer, scheduler, storage_options: dict | None = None,
                  process_group=None) -> PendingCheckpoint:
    """Copy this rank's shards aside and start writing them (``torch.distributed.checkpoint
    .async_save``); the schedule and RNG states are taken now too."""
    import torch.distributed.checkpoint as dcp

    if process_group is None and sharding.world_size() > 1:
        # the writer thread's collectives would interleave with the caller's on the default group
        raise ValueError("a background checkpoint at world size > 1 needs a process group of its own")
    folder, digests = _folder(uri, role, storage_options), {}
    future = dcp.async_save(sharding.sharded_state(model, optimizer), storage_writer=_writer(folder, digests),
                            process_group=process_group, no_dist=sharding.world_size() == 1)
    return PendingCheckpoint(future, folder, role, sharding.rank(), _rank_file(scheduler), storage_options, digests)


def _rank_file(scheduler) -> bytes:
    extra = io.BytesIO()
    torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_states(), "world_size": sharding.world_size()},
               extra)
    return extra.getvalue()


def finish_sharded(pending: PendingCheckpoint) -> dict:
    """Wait for the shards, write the rank file; returns {"{role}/{file}": sha256} of what
    this rank wrote (its shard file, its rank file, and rank 0 the DCP metadata)."""
    from rlhf_core.snapshot import fs as sfs

    pending.future.result()
    folder, role, rank = pending.folder, pending.role, pending.rank
    digests = {f"{role}/{k}": v for k, v in sfs.write_durably(
        folder.uri, {RANK_FILE.format(rank): pending.extra}, pending.storage_options).items()}
    digests.update({f"{role}/{name}": digest for name, digest in pending.digests.items()
                    if name.startswith(f"__{rank}_") or name == ".metadata"})
    return digests


def _checked_by(names: list[str], rank: int, world: int, always: tuple[str, ...] = ()) -> list[str]:
    """The committed files rank ``rank`` reads and checks before anything is loaded: what
    it will use itself (``always``: the DCP metadata every rank unpickles, its rank file;
    its own shard file, the one it loads at an unchanged world size) and a round-robin
    share of the rest, so that together the ranks check every file."""
    own, rest = [n for n in always if n in names], []
    for name in sorted(names):
        if name in always:
            continue
        match = re.match(r"__(\d+)_", name.rsplit("/", 1)[-1])
        if match and int(match.group(1)) < world:
            if int(match.group(1)) == rank:
                own.append(name)
        else:
            rest.append(name)
    return own + rest[rank::world]


def load_sharded(uri: str, role: str, model, optimizer, scheduler, storage_options: dict | None = None,
                 expected: dict | None = None) -> None:
    """Load the role's checkpoint into this rank's shards, at any world size, from bytes
    checked against ``expected`` ({"{role}/{file}": sha256}, as the checkpoint's commit
    recorded it): every committed file is checked by some rank before anything is loaded,
    and each rank loads only bytes it fetched and checked itself (``checked_load``)."""
    import torch.distributed.checkpoint as dcp

    from rlhf_core.snapshot import fs as sfs
    from rlhf_core.workers import checked_load

    rank, world = sharding.rank(), sharding.world_size()
    if not expected:
        raise checked_load.CheckpointRefusedError(
            f"{uri}: no committed checksums; a checkpoint is loaded only from files whose sha256 its commit records")
    files = checked_load.CheckedFiles(sfs.resolve(uri, storage_options), expected)
    names = [n for n in expected if n.startswith(f"{role}/")]
    # the same rank's RNG and schedule; at another world size, rank r takes saved rank r mod N
    saved_ranks = sorted(n for n in names if re.fullmatch(rf"{role}/rank-\d+\.pt", n))
    if not saved_ranks:
        raise checked_load.CorruptCheckpointError(f"{uri}/{role}: its commit lists no rank file (rank-NNNNN.pt); "
                                                  f"expected one per saved rank")
    rank_file = saved_ranks[rank % len(saved_ranks)]
    used = (f"{role}/{checked_load.METADATA}", rank_file)
    bad = [p for p in map(files.problem, _checked_by(names, rank, world, always=used)) if p is not None]
    metadata = None
    if not bad:
        try:
            metadata = files.metadata(role)
        except checked_load.CheckpointRefusedError as exc:
            bad.append(str(exc))
    bad = [b for found in sharding.all_gather_objects(bad) for b in found]
    if bad:
        raise checked_load.CorruptCheckpointError(
            bad[0] + (f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""))
    state = sharding.sharded_state(model, optimizer)
    dcp.load(state, storage_reader=checked_load.CheckedReader(files, role, metadata),
             planner=checked_load.WeightsOnlyPlanner(), no_dist=world == 1)
    sharding.set_sharded_state(model, optimizer, state)
    extra = torch.load(io.BytesIO(files.get(rank_file)), weights_only=True)  # tensors and plain containers
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_states(extra["rng"])
