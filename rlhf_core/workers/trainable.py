"""Workers that train a model: config in, checkpoints out (shared by actor and critic)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from rlhf_core.config import RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.protocol import DataProto
from rlhf_core.checkpoint.reader import load_sharded
from rlhf_core.checkpoint.writer import finish_sharded, start_sharded
from rlhf_core.distributed import sharding
from rlhf_core.workers import devices, modeling


def _marking_the_last(items):
    """(item, is_last) for each of ``items``, reading one ahead."""
    items = iter(items)
    try:
        current = next(items)
    except StopIteration:
        return
    for following in items:
        yield current, False
        current = following
    yield current, True


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

    def _first_update_step(self) -> int:
        """The iteration (0-based) of the role's first update, where its schedule starts."""
        return 0

    def _lr_schedule(self, role_cfg) -> torch.optim.lr_scheduler.LambdaLR:
        """The role's learning-rate schedule (``rlhf_core/algorithms/schedules.py``): a
        LambdaLR whose factor ``_ppo_update`` sets from the iteration before it steps, so
        the rate is a function of the iteration alone (the scheduler's own count, one per
        optimizer step, is what the checkpoint records)."""
        self._lr_role_cfg = role_cfg
        self._lr_now = self._lr_at(0)
        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: self._lr_now)

    def _lr_at(self, update: int) -> float:
        from rlhf_core.algorithms.schedules import lr_factor, warmup_steps

        role_cfg, total = self._lr_role_cfg, self.config.trainer.total_iterations
        return lr_factor(update, warmup_steps(role_cfg, total), total, role_cfg.lr_scheduler_type,
                         role_cfg.min_lr_ratio, role_cfg.num_cycles)

    def _ppo_update(self, data: DataProto, role_cfg, loss_fn: Callable, prefix: str) -> dict[str, list]:
        """PPO epochs over shuffled mini-batches of ``data``, each accumulated over
        micro-batches (token-weighted): ``loss_fn(micro) -> (loss, {metric: 0-dim tensor})``.
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
        if getattr(self, "_lr_role_cfg", None) is not None:  # a role with its own scheduler keeps it
            self._lr_now = self._lr_at(max(0, step_no - self._first_update_step()))  # verl: one step per update
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                group["lr"] = base * self._lr_now
        offload = self.config.actor.fsdp_config.optimizer_offload
        keep_gathered = self.config.actor.fsdp_config.keep_gathered_between_micro_batches
        if offload:
            sharding.move_optimizer_state(self.optimizer, sharding.device())
        model.train()
        shuffle_seed = self.config.trainer.seed + self.seed_offset + step_no
        for batch in data.make_iterator(mini, role_cfg.ppo_epochs, seed=shuffle_seed,
                                        dataloader_kwargs={"shuffle": role_cfg.shuffle}):
            self.optimizer.zero_grad(set_to_none=True)
            step: dict[str, torch.Tensor] = {}  # summed on the device: read once per optimizer step
            micros = modeling.micro_batches(
                batch, role_cfg.ppo_micro_batch_size_per_gpu, role_cfg.loss_agg_mode,
                role_cfg.ppo_max_token_len_per_gpu if role_cfg.use_dynamic_bsz else 0,
                f"{prefix}.ppo_max_token_len_per_gpu")
            for (micro, weight), last in _marking_the_last(micros):
                sharding.all_reduce_across_replicas(model, now=last)
                if keep_gathered:
                    sharding.keep_gathered_after_backward(model, keep=not last)
                loss, parts = loss_fn(micro)
                (loss * weight).backward()
                for key, value in parts.items():  # in float64, as Python floats were summed
                    value = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, dtype=torch.float64,
                                            device=loss.device)  # (a loss_fn may give plain numbers)
                    weighted = value * (weight.double() if torch.is_tensor(weight) else weight)
                    step[key] = step[key] + weighted if key in step else weighted
            grad_norm = sharding.grad_norm_and_clip(model, role_cfg.grad_clip)
            if math.isfinite(grad_norm):
                self.optimizer.step()
            else:  # one bad batch must not write NaN into every weight
                skipped += 1
            self.scheduler.step()
            for key, value in zip(step, torch.stack(list(step.values())).tolist() if step else []):
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

    def _frozen_base(self) -> dict | None:
        """The identity ({"path", "sha256"}) of the frozen model under trained adapters,
        which a checkpoint records and its load checks (rank 0's; None: nothing frozen,
        or another rank)."""
        return getattr(self, "base_identity", None)

    def _note_frozen_base(self, configured: str, folder: str) -> None:
        """Record the frozen base's identity (``model.path`` as configured, the content
        hash of the folder loaded) on rank 0, whose rank file carries it."""
        if self.rank == 0:
            from rlhf_core.workers.modeling import content_sha256

            self.base_identity = {"path": configured, "sha256": content_sha256(folder)}

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
                             storage_options, getattr(self, "_checkpoint_group", None), base=self._frozen_base())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, uri: str, storage_options: dict | None = None, expected: dict | None = None) -> None:
        """Load the role's shards at this world size (a checkpoint saved at another one is
        resharded); with ``expected`` ({file: sha256}, from the iteration manifest) a file
        whose bytes differ is refused, on every rank, before anything is loaded."""
        load_sharded(uri, self.checkpoint_prefix, self._trained_model(), self.optimizer, self.scheduler,
                     storage_options, expected, base=self._frozen_base())
        self._after_load()
