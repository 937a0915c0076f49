"""transformers' ``generate`` on the training model itself (no separate engine, nothing to
sync): the requests a call holds are generated as one left-padded batch, seeded by the
first request's seed (HF sampling has no per-row seed)."""

from __future__ import annotations

from rlhf_core.rollout.engine import Completion, GenerationRequest, RolloutEngine, Sampling, top_k_setting
from rlhf_core.rollout.registry import register_engine


@register_engine("hf")
class HFEngine(RolloutEngine):
    """On the actor's ranks it generates with the training model itself (always current:
    nothing is sent to it); a replica on a pool of its own (``owns_weights``) generates with
    a copy it loads, replaced tensor by tensor at each weight sync."""

    needs_base_weights = False
    sync_dtype = None  # nothing is sent to it on the actor's ranks
    serves_adapter = False
    runs_on_policy = True  # generates with a model object it is given (a replica loads one)

    def __init__(self, model, tokenizer, config, seed: int, synced: bool = False, owns_weights: bool = False) -> None:
        self.model, self.config, self.seed = model, config, seed
        self.owns_weights, self.loading = owns_weights, False
        # a sharded model gathers layers collectively: every rank must run as many decoding
        # steps as the longest, so ranks that finish early keep stepping (synced_gpus)
        self.synced = synced
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_id = tokenizer.eos_token_id

    @classmethod
    def build(cls, *, policy, tokenizer, cfg, sharded: bool, owns_weights: bool = False, **_) -> "HFEngine":
        return cls(policy, tokenizer, cfg.rollout, cfg.trainer.seed, synced=sharded, owns_weights=owns_weights)

    @property
    def needs_weights(self) -> bool:
        return self.loading  # a load that began and did not finish

    @classmethod
    def replica_shape(cls, cfg) -> tuple[int, bool]:
        # generate on an FSDP-sharded model all-gathers every layer: all ranks decode
        # together, so they are one replica, each rank generating its part of a call
        if cfg.actor.world_size > 1 and cfg.actor.strategy == "fsdp":
            return cfg.actor.world_size, True
        return 1, False

    def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[Completion]:
        import torch

        if not requests:
            return []
        torch.manual_seed(int(requests[0].seed))
        from rlhf_core.distributed import sharding

        model = self.model
        device = sharding.device()  # the rank's device (CPU-offloaded parameters compute there too)
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):  # left-padded
            if request.prompt_ids:
                ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids, dtype=torch.long)
                mask[row, width - len(request.prompt_ids):] = 1
        was_training = model.training
        model.eval()
        model.config.use_cache = True
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                # top_k always given: transformers' own default is 50
                **(dict(do_sample=False) if sampling.greedy else
                   dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                        **top_k_setting(sampling.top_k, off=0))),
                max_new_tokens=max(r.limit(sampling) for r in requests), pad_token_id=self.pad_id, eos_token_id=self.eos_id,
                output_scores=True, return_dict_in_generate=True, synced_gpus=self.synced)
        model.config.use_cache = False
        model.train(was_training)
        new = out.sequences[:, width:]
        scores = (torch.stack(out.scores, dim=1).float() if out.scores
                  else torch.zeros(len(new), 0, 1, device=new.device))
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        new, logp = new.cpu(), logp.cpu()
        completions = []
        for request, tokens, lps in zip(requests, new.tolist(), logp.tolist()):
            # a response ends after its first EOS (kept); generate pads the rest
            end = tokens.index(self.eos_id) + 1 if self.eos_id is not None and self.eos_id in tokens else len(tokens)
            end = min(end, request.limit(sampling))
            completions.append(Completion(request.request_id, tokens[:end], lps[:end]))
        return completions

    def update_weights(self, named_tensors) -> None:
        if not self.owns_weights:  # generates with the training model: always current
            return
        import torch

        held = self.model.state_dict(keep_vars=True)
        self.loading = True  # until the last tensor is in (a failed load must not be generated from)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in held:
                    raise KeyError(f"HFEngine.update_weights: {name!r} is not a tensor of the replica's model")
                held[name].data.copy_(tensor)
        self.loading = False

    def update_adapter(self, named_tensors, config) -> None:
        pass  # the training model's own adapter is active while it generates
