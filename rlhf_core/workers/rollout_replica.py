"""A rollout replica on a pool of its own (``rollout.nnodes`` > 0): an engine from the
registry that serves the manager's requests and receives the trainer's weights through
the checkpoint engine (``rlhf_core.rollout.checkpoint_engine``).

State it owns: the engine (HF on a copy of the policy it loads, or vLLM), the weight
version it holds, and its end of the weight group.
"""

from __future__ import annotations

import time

from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.rollout import checkpoint_engine, engine_class
from rlhf_core.rollout.manager import serve
from rlhf_core.workers import modeling


class RolloutReplicaWorker(Worker):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        cfg = self.config
        self.model_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed)
        tokenizer = modeling.load_tokenizer(self.model_path)
        cls = engine_class(cfg.rollout.name)
        # the initial weights are the policy's starting point, version 0 (a restored run's
        # replicas are sent the trainer's before they generate)
        policy = (modeling.load_causal_lm(self.model_path, cfg.model.dtype,
                                          overrides=modeling.config_overrides(cfg.model)).eval()
                  if getattr(cls, "runs_on_policy", False) else None)
        self.engine = cls.build(policy=policy, tokenizer=tokenizer, model_path=self.model_path, cfg=cfg, sharded=False,
                                lora_rank=0, hf_overrides=modeling.config_overrides(cfg.model), owns_weights=True)
        self.weight_version = 0 if policy is not None else -1  # -1: a dummy-loaded engine holds no weights yet
        self.group, self.group_address = None, None
        return {"rank": self.rank, "engine": cls.name, "model_path": self.model_path}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held_version(self) -> int:
        """The weight version this replica holds (-1: none; a failed load counts as none)."""
        return -1 if self.engine.needs_weights else self.weight_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_requests(self, requests: list, sampling, version: int | None = None) -> dict:
        if self.engine.needs_weights:
            raise RuntimeError(f"rollout replica (rank {self.rank}): its engine holds no complete weights (a sync "
                               f"that did not finish): the trainer sends them before it generates")
        return serve(self.engine, requests, sampling, version, self.weight_version, f"pool rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self, host: str, port: int, group_rank_offset: int, size: int) -> dict:
        """Take the weights the actor's first rank broadcasts (this rank is
        ``group_rank_offset + rank`` of the weight group); the version they carry is held
        once the last bucket is in."""
        t0 = time.perf_counter()
        if self.group is None or self.group_address != (host, port):
            self.group_address = (host, port)
            self.group = checkpoint_engine.WeightGroup(host, port, group_rank_offset + self.rank, size,
                                                       self.config.rollout.checkpoint_engine.backend)
        received = {}
        self.engine.update_weights(checkpoint_engine.receive(self.group, on_version=lambda v: received.update(v=v)))
        if "v" not in received:
            raise RuntimeError(f"rollout replica (rank {self.rank}): the weights ended before their last bucket")
        self.weight_version = received["v"]
        return {"seconds": time.perf_counter() - t0, "version": self.weight_version}
