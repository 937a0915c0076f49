"""The one PPO update loop actor and critic share (``TrainableWorker._ppo_update``): a step
whose gradient norm is not finite is skipped for either role and counted in the metrics;
the loop shuffles mini-batches by the role's seed rule."""

from __future__ import annotations

import inspect

import pytest
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.protocol import DataProto
from rlhf_core.workers.trainable import TrainableWorker

ROWS = 8


class ToyWorker(TrainableWorker):
    """A linear model trained by the shared loop; rows whose ``poison`` is 1 give a NaN loss."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.seen: list[list[int]] = []

    def _trained_model(self):
        return self.model

    def loss(self, micro: DataProto):
        self.seen.append(micro.batch["row"].tolist())
        out = self.model(micro.batch["x"]).squeeze(-1)
        loss = ((out - 1.0) ** 2).mean() * torch.where(micro.batch["poison"].any(), torch.tensor(float("nan")),
                                                        torch.tensor(1.0))
        return loss, {"loss": loss.item()}


def config() -> RunConfig:
    return apply_overrides(RunConfig(), ["rollout.n=1", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                                         "actor.ppo_epochs=1", "critic.ppo_epochs=1",
                                         "actor.ppo_micro_batch_size_per_gpu=0",
                                         "critic.ppo_micro_batch_size_per_gpu=0"])


def batch(poisoned_row: int | None) -> DataProto:
    poison = torch.zeros(ROWS, dtype=torch.long)
    if poisoned_row is not None:
        poison[poisoned_row] = 1
    data = DataProto.from_dict({"x": torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(1)),
                                "poison": poison, "row": torch.arange(ROWS)})
    data.meta_info["global_step"] = 3
    return data


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_nonfinite_gradient_skips_the_step_and_is_counted_for_either_role(role):
    cfg = config()
    clean, poisoned = ToyWorker(cfg), ToyWorker(cfg)
    clean_metrics = clean._ppo_update(batch(None), getattr(cfg, role), clean.loss, role)
    metrics = poisoned._ppo_update(batch(5), getattr(cfg, role), poisoned.loss, role)
    assert len(metrics[f"{role}/grad_norm"]) == ROWS // 2  # one entry per optimizer step
    assert clean_metrics[f"{role}/nonfinite_grad_steps"] == [0]
    assert metrics[f"{role}/nonfinite_grad_steps"] == [1]
    weights = torch.cat([p.detach().flatten() for p in poisoned.model.parameters()])
    start = torch.cat([p.detach().flatten() for p in ToyWorker(cfg).model.parameters()])
    assert torch.isfinite(weights).all()  # the NaN step wrote nothing
    assert not torch.equal(weights, start)  # the other steps did
    # the same shuffled mini-batches in both runs (the step's seed), and all rows seen
    assert clean.seen == poisoned.seen and sorted(r for rows in clean.seen for r in rows) == list(range(ROWS))


def test_the_shuffle_follows_the_role_seed_rule():
    """Each role shuffles by trainer.seed + its offset + the step: the actor and the
    critic (different offsets) see different orders; the same role and step the same."""
    cfg = config()

    class Critic(ToyWorker):
        seed_offset = 1000

    orders = []
    for cls in (ToyWorker, ToyWorker, Critic):
        worker = cls(cfg)
        worker._ppo_update(batch(None), cfg.actor, worker.loss, "actor")
        orders.append(worker.seen)
    assert orders[0] == orders[1] and orders[0] != orders[2]
    assert orders[0] != [[0, 1], [2, 3], [4, 5], [6, 7]]  # shuffled, not in order


def test_actor_and_critic_update_through_the_shared_loop():
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.critic import CriticWorker

    for method in (ActorRolloutRefWorker.update_actor, CriticWorker.update_critic):
        source = inspect.getsource(method.__registered__)
        assert "self._ppo_update(" in source and "optimizer.step" not in source, method
    assert CriticWorker.seed_offset != ActorRolloutRefWorker.seed_offset


def test_replicas_all_reduce_gradients_on_the_last_micro_batch_of_each_step_only(monkeypatch):
    """HSDP's cross-replica all-reduce runs once per optimizer step (the sum is the same):
    the loop turns it off for every micro-batch but a step's last."""
    from rlhf_core.distributed import sharding

    cfg = apply_overrides(config(), ["actor.ppo_micro_batch_size_per_gpu=1"])  # 2 micro-batches a step
    worker = ToyWorker(cfg)
    switched = []
    monkeypatch.setattr(sharding, "is_sharded", lambda model: True)
    worker.model.set_requires_all_reduce = switched.append
    seen = []
    real_loss = worker.loss
    worker.loss = lambda micro: (seen.append(switched[-1]), real_loss(micro))[1]
    data = batch(None)
    data.batch["response_mask"] = torch.ones(ROWS, 2)  # micro-batches of a token-mean loss weigh by tokens
    worker._ppo_update(data, cfg.actor, worker.loss, "actor")
    steps = ROWS // cfg.actor.ppo_mini_batch_size
    assert seen == [False, True] * steps  # each micro-batch's backward ran with the switch as set


@pytest.mark.parametrize("keep", [True, False])
def test_layers_stay_gathered_between_the_micro_batches_of_a_step_when_asked(monkeypatch, keep):
    from rlhf_core.distributed import sharding

    cfg = apply_overrides(config(), ["actor.ppo_micro_batch_size_per_gpu=1",
                                     f"actor.fsdp_config.keep_gathered_between_micro_batches={keep}"])
    worker = ToyWorker(cfg)
    reshard = []
    monkeypatch.setattr(sharding, "is_sharded", lambda model: True)
    worker.model.set_requires_all_reduce = lambda now: None
    worker.model.set_reshard_after_backward = reshard.append
    data = batch(None)
    data.batch["response_mask"] = torch.ones(ROWS, 2)
    worker._ppo_update(data, cfg.actor, worker.loss, "actor")
    steps = ROWS // cfg.actor.ppo_mini_batch_size
    # kept after the first micro-batch's backward, resharded after the step's last
    assert reshard == ([False, True] * steps if keep else [])
