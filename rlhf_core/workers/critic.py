"""The critic worker: a value model trained with the clipped value loss."""

from __future__ import annotations

import torch

from rlhf_core.algorithms import compute_value_loss, masked_mean
from rlhf_core.controller import Dispatch, register
from rlhf_core.protocol import DataProto
from rlhf_core.distributed import sharding
from rlhf_core.workers import devices, lora, modeling
from rlhf_core.workers.trainable import TrainableWorker


def check_same_vocabulary(critic_path: str, policy_path: str, given: str) -> None:
    """The critic reads the policy's token ids: a value model of another vocabulary would
    read them as other tokens. Refused in one line (config.json only, no weights)."""
    from transformers import AutoConfig

    critic, policy = (AutoConfig.from_pretrained(p).vocab_size for p in (critic_path, policy_path))
    if critic != policy:
        raise ValueError(f"critic.model_path: expected a model of the policy's vocabulary (vocab_size {policy}, the "
                         f"critic reads the policy's token ids); found vocab_size {critic} in {given}")


class CriticWorker(TrainableWorker):
    checkpoint_prefix = "critic"
    seed_offset = 1000

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        self._seed_init()
        path = modeling.resolve_model_path(cfg.critic.model_path or cfg.model.path, cfg.trainer.seed,
                                           field="critic.model_path" if cfg.critic.model_path else "model.path")
        if cfg.critic.model_path:
            check_same_vocabulary(path, modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, weights=False),
                                  cfg.critic.model_path)
        spec = sharding.ShardingSpec.from_config(cfg)
        reads = sharding.reads_checkpoint(spec.strategy, self.rank, self.world_size)  # rank 0 alone under FSDP
        value_model = modeling.ValueModel(path, cfg.model.dtype, packed=cfg.critic_remove_padding, empty=not reads)
        modeling.check_micro_batch_memory(cfg, value_model.backbone.config)
        if cfg.critic.lora_rank:  # adapters over the frozen backbone; every rank's are filled from rank 0's
            value_model = lora.apply_critic_lora(value_model, cfg.critic, cfg.critic.model_path or cfg.model.path,
                                                 seed=cfg.trainer.seed + self.seed_offset)
            self._note_frozen_base(cfg.critic.model_path or cfg.model.path, path)
        source = sharding.FullWeights.of(value_model) if reads and sharding.loads_from_rank0(
            spec.strategy, self.world_size) else None
        self.critic = modeling.init_distributed_model(self, value_model, spec, resources=cfg.resources, source=source)
        self.optimizer = torch.optim.AdamW(lora.trainable_parameters(self.critic), lr=cfg.critic.lr,
                                           weight_decay=cfg.critic.weight_decay)
        self.scheduler = self._lr_schedule(cfg.critic)
        return {"rank": self.rank, "parameters": sum(p.numel() for p in self.critic.parameters())}

    def _values(self, model, data: DataProto) -> torch.Tensor:
        return modeling.response_values(model, data.batch["input_ids"], data.batch["attention_mask"],
                                        data.batch["position_ids"], data.batch["responses"].shape[1],
                                        packed=self.config.critic_remove_padding)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        data = devices.to_device(data)
        with torch.no_grad():
            critic = self.config.critic
            (values,) = modeling.forward_in_chunks(lambda part: (self._values(sharding.unwrap(self.critic), part),),
                                                   data, critic.forward_micro_batch_size_per_gpu,
                                                   critic.forward_max_token_len_per_gpu if critic.use_dynamic_bsz else 0,
                                                   "critic.forward_max_token_len_per_gpu")
            values = values * data.batch["response_mask"]
        return DataProto.from_dict(devices.to_host({"values": values}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": self._ppo_update(data, self.config.critic, self._value_loss, "critic")})

    def _value_loss(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped value loss on one (micro-)batch and its parts, for the metrics."""
        cfg = self.config.critic
        mask = batch.batch["response_mask"].float()
        vpreds = self._values(self.critic, batch)
        vf_loss, vf_clipfrac = compute_value_loss(vpreds, batch.batch["returns"], batch.batch["values"], mask,
                                                  cfg.cliprange_value, cfg.loss_agg_mode)
        return vf_loss, {"vf_loss": vf_loss.detach(), "vf_clipfrac": vf_clipfrac.detach(),
                         "vpred_mean": masked_mean(vpreds, mask).detach()}

    def _trained_model(self):
        return self.critic
