"""The critic worker: a value model trained with the clipped value loss."""

from __future__ import annotations

import torch

from rlhf_core.algorithms import compute_value_loss, masked_mean
from rlhf_core.controller import Dispatch, register
from rlhf_core.protocol import DataProto
from rlhf_core.workers import modeling, sharding
from rlhf_core.workers.trainable import TrainableWorker


class CriticWorker(TrainableWorker):
    checkpoint_prefix = "critic"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        self._seed_all(cfg.trainer.seed + 1000 + self.rank)
        path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed)
        self.critic = modeling.init_distributed_model(self, modeling.ValueModel(path, cfg.model.dtype),
                                                      sharding.ShardingSpec.from_config(cfg))
        self.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        return {"rank": self.rank, "parameters": sum(p.numel() for p in self.critic.parameters())}

    def _values(self, model, data: DataProto) -> torch.Tensor:
        return modeling.response_values(model, data.batch["input_ids"], data.batch["attention_mask"],
                                        data.batch["position_ids"], data.batch["responses"].shape[1])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        with torch.no_grad():
            (values,) = modeling.forward_in_chunks(lambda part: (self._values(sharding.unwrap(self.critic), part),),
                                                   data, self.config.critic.forward_micro_batch_size_per_gpu)
            values = values * data.batch["response_mask"]
        return DataProto.from_dict({"values": values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        cfg = self.config
        mini = modeling.mini_batch_rows(cfg.critic.ppo_mini_batch_size, cfg.rollout.n, self.world_size, len(data))
        metrics: dict[str, list] = {}
        seed = cfg.trainer.seed + 17 + int(data.meta_info.get("global_step", 0))
        self._seed_update(int(data.meta_info.get("global_step", 0)))
        if cfg.actor.fsdp_config.optimizer_offload:
            sharding.move_optimizer_state(self.optimizer, sharding.device())
        self.critic.train()
        for batch in data.make_iterator(mini, cfg.critic.ppo_epochs, seed=seed, dataloader_kwargs={"shuffle": True}):
            self.optimizer.zero_grad(set_to_none=True)
            step: dict[str, float] = {}
            for micro, weight in modeling.micro_batches(batch, cfg.critic.ppo_micro_batch_size_per_gpu,
                                                        cfg.critic.loss_agg_mode):
                mask = micro.batch["response_mask"].float()
                vpreds = self._values(self.critic, micro)
                vf_loss, vf_clipfrac = compute_value_loss(vpreds, micro.batch["returns"], micro.batch["values"],
                                                          mask, cfg.critic.cliprange_value, cfg.critic.loss_agg_mode)
                (vf_loss * weight if weight != 1.0 else vf_loss).backward()
                for key, value in (("vf_loss", vf_loss.item()), ("vf_clipfrac", vf_clipfrac.item()),
                                   ("vpred_mean", masked_mean(vpreds, mask).item())):
                    step[key] = step.get(key, 0.0) + value * weight
            grad_norm = sharding.grad_norm_and_clip(self.critic, cfg.critic.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            for key, value in step.items():
                metrics.setdefault(f"critic/{key}", []).append(value)
            metrics.setdefault("critic/grad_norm", []).append(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)  # gradient memory goes back for rollout
        if cfg.actor.fsdp_config.optimizer_offload:
            sharding.move_optimizer_state(self.optimizer, torch.device("cpu"))
        return DataProto(meta_info={"metrics": metrics})

    def _trained_model(self):
        return self.critic
