"""The actor + rollout + reference worker (HybridFlow's colocated policy roles).

State it owns: the policy (sharded with FSDP2, or replicated with DDP, across the group's
ranks), its AdamW and LR schedule, a frozen reference copy (sharded the same way, on the
CPU by default; a LoRA run's reference is the policy with its adapter off), and the
generation engine, whose weights are replaced with the policy's
after every update, one gathered tensor at a time.
"""

from __future__ import annotations

import contextlib
import time

import torch

from rlhf_core.algorithms import agg_loss, get_policy_loss_fn, kl_penalty, loss_settings, masked_mean, rollout_correction
from rlhf_core.config import LOSS_SETTINGS
from rlhf_core.controller import Dispatch, register
from rlhf_core.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from rlhf_core.protocol import DataProto
from rlhf_core.distributed import sharding
from rlhf_core.workers import devices, lora, modeling, packing
from rlhf_core.rollout import engine_class
from rlhf_core.rollout import checkpoint_engine
from rlhf_core.rollout.engine import engine_dtype
from rlhf_core.rollout.manager import serve
from rlhf_core.workers.trainable import TrainableWorker


def _metrics_proto(metrics: dict) -> DataProto:
    return DataProto(meta_info={"metrics": metrics})


class ActorRolloutRefWorker(TrainableWorker):
    checkpoint_prefix = "actor"

    # ---------------------------------------------------------------- setup

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        self._seed_init()
        self.model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed)
        self.tokenizer = modeling.load_tokenizer(self.model_path)
        spec = sharding.ShardingSpec.from_config(cfg)
        # under FSDP over several ranks rank 0 alone reads the weights (sharding.loads_from_rank0)
        reads = sharding.reads_checkpoint(spec.strategy, self.rank, self.world_size)
        policy = modeling.load_causal_lm(self.model_path, cfg.model.dtype, empty=not reads,
                                         overrides=modeling.config_overrides(cfg.model))
        modeling.check_micro_batch_memory(cfg, policy.config)
        policy = self._packed(policy)
        if cfg.model.lora:  # adapters over the frozen base; every rank's are filled from rank 0's
            policy = lora.apply_lora(policy, cfg.model, self.model_path, seed=cfg.trainer.seed)
            self._note_frozen_base(cfg.model.path, self.model_path)
        weights = sharding.FullWeights.of(policy) if reads else None  # the reference's too
        self.policy = modeling.init_distributed_model(
            self, policy, spec, resources=cfg.resources,
            source=weights if sharding.loads_from_rank0(spec.strategy, self.world_size) else None)
        self.reference = None
        # a LoRA run's reference is its own base, the adapter off (lora.reference_forward)
        if cfg.use_reference and not cfg.model.lora:
            ref_spec = sharding.ShardingSpec.from_config(cfg, param_offload=cfg.actor.fsdp_config.ref_param_offload)
            # the policy's weights in the dtype its forward computes in: bf16 under mixed
            # precision gives the same log-probs from half the bytes (on the GPU, or moved
            # to it per layer when offloaded)
            dtype = "bfloat16" if sharding.computes_in_bf16(ref_spec) else cfg.model.dtype
            reference = modeling.load_causal_lm(self.model_path, dtype, empty=True,
                                                overrides=modeling.config_overrides(cfg.model)).eval().requires_grad_(False)
            self.reference = sharding.wrap(self._packed(reference), ref_spec, trainable=False, source=weights)
        del weights
        self.teacher = self._load_teacher(reads) if cfg.distillation.enabled else None
        self.optimizer = torch.optim.AdamW(lora.trainable_parameters(self.policy), lr=cfg.actor.lr,
                                           weight_decay=cfg.actor.weight_decay)
        self.scheduler = self._lr_schedule(cfg.actor)
        # ranks of one tensor-parallel engine get the same prompts; one of them answers
        tp = cfg.rollout.tensor_model_parallel_size
        self._register_dispatch_collect_info("rollout", dp_rank=self.rank // tp, is_collect=self.rank % tp == 0)
        self.policy_version = self.weight_version = 0
        self.rollout, self.sync_dtype, self.serves_adapter = None, getattr(torch, engine_dtype(cfg)), False
        if not cfg.rollout.own_pool:  # else the replicas have engines of their own (workers/rollout_replica.py)
            self._build_engine()
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.policy.parameters())
        return {"rank": self.rank, "model_path": self.model_path, "strategy": cfg.actor.strategy,
                "parameters": sum(p.numel() for p in self.policy.parameters()), "local_parameters": local}

    def _load_teacher(self, reads: bool):
        """The distillation teacher: a frozen model sharded as the reference is (its first
        rank reads the folder under FSDP), refused when its vocabulary is not the policy's
        (its log-probs would score other tokens)."""
        cfg = self.config
        path = modeling.resolve_model_path(cfg.distillation.teacher_model.model_path, cfg.trainer.seed,
                                           field="distillation.teacher_model.model_path")
        tokenizer = modeling.load_tokenizer(path)
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"distillation.teacher_model.model_path: expected the policy's tokenizer (the same "
                             f"{len(self.tokenizer)} tokens); found {len(tokenizer)} tokens, or the same count "
                             f"with other ids, in {cfg.distillation.teacher_model.model_path}")
        spec = sharding.ShardingSpec.from_config(cfg, param_offload=cfg.actor.fsdp_config.ref_param_offload)
        dtype = "bfloat16" if sharding.computes_in_bf16(spec) else cfg.model.dtype
        teacher = modeling.load_causal_lm(path, dtype, empty=not reads).eval().requires_grad_(False)
        if teacher.config.vocab_size < len(self.tokenizer):
            raise ValueError(f"distillation.teacher_model.model_path: expected an output layer over the policy's "
                             f"{len(self.tokenizer)} tokens; found {teacher.config.vocab_size}")
        if cfg.distillation.topk_width > len(self.tokenizer):
            raise ValueError(f"distillation.distillation_loss.topk: expected at most the policy's "
                             f"{len(self.tokenizer)} tokens; found {cfg.distillation.topk_width}")
        self.teacher_path = path
        source = sharding.FullWeights.of(teacher) if reads else None
        return sharding.wrap(self._packed(teacher), spec, trainable=False, source=source)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def teacher_identity(self) -> dict | None:
        """The teacher: ``distillation.teacher_model.model_path`` as configured and the
        content hash of the folder loaded (rank 0's answer; None on the others)."""
        if self.rank != 0:
            return None
        return {"path": self.config.distillation.teacher_model.model_path,
                "sha256": modeling.content_sha256(self.teacher_path)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """``teacher_log_prob``: the teacher's log-prob of each sampled response token; for
        a top-k loss, ``teacher_topk_log_probs`` and ``teacher_topk_ids`` too: its
        ``distillation_loss.topk`` likeliest tokens at each response position."""
        if self.teacher is None:
            raise RuntimeError("no teacher: set distillation.enabled and distillation.teacher_model.model_path")
        data = devices.to_device(data)
        topk = self.config.distillation.topk_width
        with torch.no_grad():
            out = modeling.forward_in_chunks(
                lambda part: self._log_probs(self.teacher, part, with_entropy=False, topk=topk),
                data, self.config.actor.log_prob_micro_batch_size_per_gpu, *self._log_prob_budget())
        columns = {"teacher_log_prob": out[0]}
        if topk:
            columns.update(teacher_topk_log_probs=out[2], teacher_topk_ids=out[3])
        return DataProto.from_dict(devices.to_host(columns))

    def _build_engine(self) -> None:
        """The generation engine on this rank (``rollout.name``), fed the policy's weights."""
        cfg = self.config
        # the policy's LoRA rank, for an engine that serves the adapter as a LoRA request
        lora_rank = lora.settings(sharding.unwrap(self.policy)).r if cfg.model.lora else 0
        self.rollout = engine_class(cfg.rollout.name).build(
            policy=sharding.unwrap(self.policy), tokenizer=self.tokenizer, model_path=self.model_path, cfg=cfg,
            sharded=sharding.is_sharded(self.policy), lora_rank=lora_rank,
            hf_overrides=modeling.config_overrides(cfg.model))
        if self.rollout.serves_adapter:
            lora.check_engine_serves(sharding.unwrap(self.policy))
        self.sync_dtype = self.rollout.sync_dtype  # what the engine keeps (None: it runs on the policy itself)
        self.serves_adapter = self.rollout.serves_adapter

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def starting_model(self) -> dict | None:
        """The model this run started from (rank 0's answer, None on the others):
        ``model.path`` as configured, the content hash of the folder loaded and the sha256
        of its ``model.safetensors`` (what ``rlhf export`` records as ``weights_sha256``;
        None for sharded weights). Hashed once per worker."""
        if self.rank != 0:
            return None
        if getattr(self, "_starting_model", None) is None:
            import hashlib
            from pathlib import Path

            weights = Path(self.model_path) / "model.safetensors"
            digest = None
            if weights.is_file():
                digest = hashlib.sha256()
                with open(weights, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
            self._starting_model = {"path": self.config.model.path,
                                    "sha256": modeling.content_sha256(self.model_path),
                                    "weights_sha256": digest.hexdigest() if digest else None}
        return dict(self._starting_model)

    def _packed(self, model):
        if self.config.model.use_remove_padding:  # padding-free forwards (packing)
            packing.enable_packing(model)
        return model

    # ---------------------------------------------------------------- stages

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("rollout"))
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """``rollout.mode=sync``: this rank's static share of the prompts, as one call."""
        if self.rollout.needs_weights:  # the engine's sleep after its last generate discarded them
            self.sync_weights()
        out = self.rollout.generate_batch(prompts)
        out.batch["weight_version"] = torch.full((len(out),), self.weight_version, dtype=torch.long)
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_requests(self, requests: list, sampling, version: int | None = None) -> dict:
        """``rollout.mode=async``: this rank as a replica (the manager calls it alone, or
        with the rest of its tensor-parallel group). ``requests``: (id, prompt token ids,
        seed, own token limit or None); ``version``: the weight version they must be
        generated with."""
        if self.rollout.needs_weights:  # discarded by a sleep, or a sync that failed: the policy's again
            self.sync_weights()
        return serve(self.rollout, requests, sampling, version, self.weight_version, f"rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_weight_version(self, version: int) -> None:
        """The trainer step whose weights the policy and engine hold (a restored checkpoint's)."""
        self.policy_version = self.weight_version = int(version)

    def _log_probs(self, model, data: DataProto, with_entropy: bool, with_sum_pi_squared: bool = False,
                   topk: int = 0, gather_ids: torch.Tensor | None = None):
        # top-k ids among the tokenizer's: a teacher's padded output layer has rows no student has
        return modeling.response_log_probs(
            model, data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"],
            data.batch["responses"].shape[1], self.config.rollout.temperature, with_entropy,
            packed=self.config.model.use_remove_padding, with_sum_pi_squared=with_sum_pi_squared, topk=topk,
            gather_ids=gather_ids, topk_vocab=len(self.tokenizer) if topk else None)

    def _log_prob_budget(self) -> tuple[int, str]:
        actor = self.config.actor
        return (actor.log_prob_max_token_len_per_gpu if actor.log_prob_use_dynamic_bsz else 0,
                "actor.log_prob_max_token_len_per_gpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        data = devices.to_device(data)
        sum_pi_squared = self.config.actor.calculate_sum_pi_squared
        with torch.no_grad():
            out = modeling.forward_in_chunks(
                lambda part: self._log_probs(sharding.unwrap(self.policy), part, with_entropy=True,
                                             with_sum_pi_squared=sum_pi_squared),
                data, self.config.actor.log_prob_micro_batch_size_per_gpu, *self._log_prob_budget())
        columns = dict(zip(("old_log_probs", "entropys", "sum_pi_squared"), out))
        return DataProto.from_dict(devices.to_host(columns))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if not self.config.use_reference:
            raise RuntimeError("no reference model: enable actor.use_kl_loss or algorithm.use_kl_in_reward")
        data = devices.to_device(data)
        with torch.no_grad(), (lora.reference_forward(sharding.unwrap(self.policy)) if self.reference is None
                               else contextlib.nullcontext(self.reference)) as reference:
            log_probs, _ = modeling.forward_in_chunks(
                lambda part: self._log_probs(reference, part, with_entropy=False),
                data, self.config.actor.log_prob_micro_batch_size_per_gpu, *self._log_prob_budget())
        return DataProto.from_dict(devices.to_host({"ref_log_prob": log_probs}))

    def _first_update_step(self) -> int:
        return max(0, self.config.trainer.critic_warmup - 1)  # verl's critic warmup: the actor waits it out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches; returns metrics (one list entry per step)."""
        policy_loss = get_policy_loss_fn(self.config.actor.policy_loss)
        return _metrics_proto(self._ppo_update(data, self.config.actor, lambda micro: self._policy_loss(micro, policy_loss),
                                               "actor"))

    def _policy_loss(self, batch: DataProto, policy_loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss on one (micro-)batch and its parts, for the metrics."""
        cfg = self.config.actor
        mask = batch.batch["response_mask"].float()
        on_policy = "old_log_probs" not in batch.batch.keys()  # config.on_policy_update: no old_log_prob stage
        # without the old_log_prob stage (on-policy, or its log-probs from the rollout) the
        # entropy metric comes from this forward
        no_stage = self.config.old_log_prob_column != "old_log_probs"
        topk = self.config.distillation.topk_width  # the student's log-probs at the teacher's top-k too
        at_teacher_topk = {"gather_ids": batch.batch["teacher_topk_ids"]} if topk else {}
        log_prob, entropy, *student_topk = self._log_probs(
            self.policy, batch, with_entropy=cfg.entropy_coeff != 0 or no_stage, **at_teacher_topk)
        old_log_prob = log_prob.detach() if on_policy else batch.batch["old_log_probs"]
        advantages, pg_mask, corrected, weights = batch.batch["advantages"], mask, {}, None
        if "rollout_is_weights" in batch.batch.keys():  # without bypass mode: per-token weights on the loss
            advantages = advantages * batch.batch["rollout_is_weights"]  # (config: only losses linear in it)
        correction = self.config.algorithm.rollout_correction
        bypass = correction.bypass_mode and not on_policy
        if bypass and correction.active:
            # verl's bypass mode: against the policy being trained, per micro-batch (old = the rollout's)
            pg_mask, weights, corrected = rollout_correction.correct(log_prob.detach() - old_log_prob, mask,
                                                                     correction)
        if bypass and correction.loss_type == "reinforce":  # with or without weights and rejection, as verl
            out = {"pg_loss": rollout_correction.reinforce_loss(log_prob, advantages, pg_mask, weights,
                                                                cfg.loss_agg_mode),
                   "ppo_kl": masked_mean(old_log_prob - log_prob.detach(), pg_mask),  # over the tokens kept
                   "pg_clipfrac": torch.zeros(()), "pg_clipfrac_lower": torch.zeros(())}
        else:
            out = policy_loss(old_log_prob, log_prob, advantages, pg_mask,
                              clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                              clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
                              **loss_settings(policy_loss, **{k: getattr(cfg, k) for k in LOSS_SETTINGS}))
        loss = out["pg_loss"]
        parts = {key: out[key].detach() for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")}
        parts.update({key: torch.tensor(value) for key, value in corrected.items()})
        if entropy is not None:
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
            parts["entropy"] = entropy_loss.detach()
        if cfg.use_kl_loss:
            kl_loss = agg_loss(kl_penalty(log_prob, batch.batch["ref_log_prob"], cfg.kl_loss_type), mask,
                               cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            parts["kl_loss"] = kl_loss.detach()
        if topk:  # the supervised top-k forward KL: beside the task's loss, or alone (verl's rule)
            loss, distilled = self._topk_distillation(loss, student_topk[0], batch, mask)
            parts.update(distilled)
        return loss, parts

    def _topk_distillation(self, task_loss: torch.Tensor, student_topk: torch.Tensor, batch: DataProto,
                           mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The top-k forward KL aggregated as the actor's loss is
        (``rlhf_core.algorithms.distillation``): ``loss + coef x KL`` with the task's
        rewards, else the KL alone (verl drops the task's whole loss then: its policy
        gradient, entropy bonus and KL loss)."""
        from rlhf_core.algorithms.distillation import forward_kl_topk, topk_masses

        settings = self.config.distillation.distillation_loss
        teacher = batch.batch["teacher_topk_log_probs"]
        kl = forward_kl_topk(student_topk, teacher, mask, settings.log_prob_min_clamp, settings.loss_max_clamp)
        distill = agg_loss(kl, mask, self.config.actor.loss_agg_mode)
        loss = task_loss + settings.distillation_loss_coef * distill if settings.use_task_rewards else distill
        return loss, {"distillation/loss": distill.detach(),
                      **{k: v.detach() for k, v in topk_masses(student_topk.detach(), teacher, mask).items()}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int | None = None) -> dict:
        """Stream the policy's weights into the generation engine, one whole tensor at a
        time; returns seconds taken and the peak bytes of gathered tensors alive at once.
        A LoRA policy sends its adapter (verl's LoRA request path), and its frozen base
        only when the engine holds none; or (``rollout.lora_merge``) its weights with the
        adapter merged in. ``version``: the trainer step these weights are (None: the
        policy's, as after a sleep that discarded them). A sync that fails leaves the
        engine's version where it was and the engine asking for weights: nothing is
        generated from a part of them."""
        if version is not None:
            self.policy_version = int(version)
        t0 = time.perf_counter()
        meter = sharding.GatherMeter()
        if self.rollout is None:  # the replicas are on a pool of their own: send_weights feeds them
            pass
        elif not self.config.model.lora:
            self.rollout.update_weights(sharding.stream_full_parameters(self.policy, meter, self.sync_dtype))
        elif not self.serves_adapter:
            self.rollout.update_weights(lora.merged_stream(sharding.unwrap(self.policy), sharding.stream_full_parameters(
                self.policy, meter, self.sync_dtype)))
        else:
            if self.rollout.needs_base_weights:
                self.rollout.update_weights((lora.base_name(name), t) for name, t in sharding.stream_full_parameters(
                    self.policy, meter, self.sync_dtype, keep=lora.is_base))
            self.rollout.update_adapter(((lora.saved_name(name), t) for name, t in sharding.stream_full_parameters(
                self.policy, meter, self.sync_dtype, keep=lora.is_adapter)), lora.settings(sharding.unwrap(self.policy)))
        self.weight_version = self.policy_version
        return {"seconds": time.perf_counter() - t0, "peak_gathered_bytes": meter.peak, "gathered": meter.count,
                "bytes": meter.total, "version": self.weight_version}

    # ------------------------------------------------ the checkpoint engine (a rollout pool of its own)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_group(self, size: int) -> tuple[str, int] | None:
        """On the first rank: host the store of the process group the weights go out on
        (``size``: this rank and every replica rank); returns its address."""
        if self.rank != 0:
            return None
        if getattr(self, "_weight_address", None) is not None and self._weight_group_size == size:
            return self._weight_address  # a controller of a later iteration: the same group
        import ray

        host = ray.util.get_node_ip_address()
        self._weight_store, port = checkpoint_engine.WeightGroup.host_store(host, size)
        self._weight_group_size, self._weight_group, self._weight_address = size, None, (host, port)
        return self._weight_address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int) -> dict:
        """The policy's weights to the rollout pool, as ``version``: every rank takes part
        in gathering them (FSDP), the first broadcasts them in buckets."""
        self.policy_version = int(version)
        t0 = time.perf_counter()
        meter = sharding.GatherMeter()
        stream = sharding.stream_full_parameters(self.policy, meter, self.sync_dtype)
        sent = 0
        if self.rank == 0:
            if self._weight_group is None:
                self._weight_group = checkpoint_engine.WeightGroup(
                    "", 0, 0, self._weight_group_size, self.config.rollout.checkpoint_engine.backend,
                    store=self._weight_store)
            sent = checkpoint_engine.send(
                self._weight_group, stream,
                self.config.rollout.checkpoint_engine.update_weights_bucket_megabytes * 2**20, self.policy_version)
        else:
            for _ in stream:  # the gathers are collective: every rank walks the same stream
                pass
        return {"seconds": time.perf_counter() - t0, "peak_gathered_bytes": meter.peak, "bytes": sent,
                "version": self.policy_version}

    # ---------------------------------------------------------------- checkpoints

    def _trained_model(self):
        return self.policy

    def _after_load(self) -> None:
        self.sync_weights()  # the engine must generate with the restored weights
