"""The generation engine protocol: requests in, tokens and their log-probs out.

A request is one response to sample: the prompt's token ids, the sampling settings, a
seed and an id. An engine answers a list of requests (the ones its server holds at once;
vLLM schedules them continuously, HF generates them as one padded batch) with one
``Completion`` each, in order. Everything above an engine (the actor's in-process call,
rollout replicas and the manager balancing requests over them) speaks only this protocol,
so a new engine is one file under ``rollout/engines/`` (see ``rollout.registry``).

This module imports no torch: the config asks the engines' ``check`` at validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterable

if TYPE_CHECKING:
    import torch

    from rlhf_core.protocol import DataProto


class EngineConfigError(ValueError):
    """A setting an engine cannot serve (one line: the key, what was expected, what was found)."""


@dataclass(frozen=True)
class Sampling:
    """How every request of one call samples (``greedy``: temperature 0, ReMax's baseline)."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    greedy: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One response to sample. ``seed`` alone decides its draws on engines that seed per
    request (its sample does not depend on its batch, its replica or a restart)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    seed: int
    #: this request's own limit on new tokens (None: the call's ``Sampling.max_tokens``),
    #: e.g. what a multi-turn trajectory has left of its response budget
    max_tokens: int | None = None

    def limit(self, sampling: "Sampling") -> int:
        return sampling.max_tokens if self.max_tokens is None else min(self.max_tokens, sampling.max_tokens)


@dataclass
class Completion:
    """An engine's answer to one request: the sampled tokens (up to and including the
    end-of-sequence token) and each one's log-probability."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]


class RolloutEngine:
    """What every engine implements. ``needs_weights``: the engine holds no (or stale)
    weights and must be sent the policy's before it generates."""

    #: the ``rollout.name`` it is registered under (set by ``registry.register_engine``)
    name: ClassVar[str] = ""
    needs_weights: bool = False
    needs_base_weights: bool = False
    pad_id: int = 0
    eos_id: int | None = None
    config = None  # the run's ``rollout`` section

    @classmethod
    def check(cls, cfg) -> None:
        """Refuse settings this engine cannot serve, before anything is placed
        (``EngineConfigError``, one line). ``cfg`` is the whole ``RunConfig``."""

    @classmethod
    def replica_shape(cls, cfg) -> tuple[int, bool]:
        """How the actor's ranks form replicas: (ranks per replica, whether those ranks
        split a call's requests between them and generate together, as HF does on an
        FSDP-sharded policy, rather than each taking all of them, as the ranks of one
        tensor-parallel engine do). Default: each rank a replica of its own."""
        return 1, False

    def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[Completion]:
        raise NotImplementedError

    def generate_batch(self, prompts: "DataProto") -> "DataProto":
        """A batch of left-padded prompt rows (with ``sample_seed``) as one call: the
        rollout's columns (``rollout.mode=sync``'s path, and a convenience for tests)."""
        completions = self.generate(requests_of(prompts), sampling_of(prompts, self.config))
        return responses_of(prompts, completions, self.config.response_length, self.pad_id)

    def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Replace the full weights (streamed one tensor at a time)."""
        raise NotImplementedError

    def update_adapter(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], config) -> None:
        """Replace the policy's LoRA adapter (PEFT file names, ``config`` its LoraConfig)."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free what generation holds while the trainer computes (no-op where nothing can be)."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` freed."""


# ---------------------------------------------------------------- DataProto <-> requests

def top_k_setting(top_k: int, off: int) -> dict:
    """``top_k`` as an engine takes it: k when above 0, else the engine's "off" (vLLM's -1;
    transformers' 0, whose generate would otherwise keep its default of 50)."""
    return {"top_k": int(top_k) if top_k > 0 else off}


def sampling_of(prompts: "DataProto", rollout_cfg) -> Sampling:
    """The sampling a batch of prompts asks for: ``rollout.*``, overridden by the batch's
    ``meta_info["sampling"]`` (validation's val_kwargs), greedy when ``do_sample`` is false."""
    asked = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p, "top_k": rollout_cfg.top_k,
             **prompts.meta_info.get("sampling", {})}
    return Sampling(temperature=float(asked["temperature"]), top_p=float(asked["top_p"]), top_k=int(asked["top_k"]),
                    max_tokens=int(rollout_cfg.response_length), greedy=not prompts.meta_info.get("do_sample", True))


def requests_of(prompts: "DataProto", id_prefix: str = "") -> list[GenerationRequest]:
    """One request per row of left-padded prompts with a ``sample_seed`` column (and, for
    the turns of a multi-turn trajectory, each row's own ``max_new_tokens``)."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    seeds = prompts.batch["sample_seed"].tolist()
    limits = (prompts.batch["max_new_tokens"].tolist() if "max_new_tokens" in prompts.batch.keys()
              else [None] * len(seeds))
    return [GenerationRequest(f"{id_prefix}{row}", tuple(r[m].tolist()), int(seed),
                              None if limit is None or limit < 0 else int(limit))
            for row, (r, m, seed, limit) in enumerate(zip(ids, mask, seeds, limits))]


def prompts_of(requests: list[GenerationRequest], pad_id: int) -> "DataProto":
    """Requests as left-padded prompt rows (``requests_of``'s inverse): how a list of
    requests goes through the batch path (``rollout.mode=sync``)."""
    import torch

    from rlhf_core.protocol import DataProto

    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids, dtype=torch.long)
        mask[row, width - len(request.prompt_ids):] = 1
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
        "sample_seed": torch.tensor([r.seed for r in requests], dtype=torch.long),
        "max_new_tokens": torch.tensor([-1 if r.max_tokens is None else r.max_tokens for r in requests],
                                       dtype=torch.long)})


def completions_of(requests: list[GenerationRequest], out: "DataProto") -> list[Completion]:
    """The completions in a batch path's rollout columns (row ``i`` answers ``requests[i]``)."""
    lengths = out.batch["response_mask"].sum(dim=1).tolist()
    return [Completion(r.request_id, out.batch["responses"][i, :n].tolist(),
                       out.batch["rollout_log_probs"][i, :n].tolist())
            for i, (r, n) in enumerate(zip(requests, lengths))]


def responses_of(prompts: "DataProto", completions: list[Completion], response_length: int, pad_id: int) -> "DataProto":
    """The rollout's columns from one completion per prompt row (in row order)."""
    import torch

    n = len(completions)
    resp = torch.full((n, response_length), pad_id, dtype=torch.long)
    rollout_lp = torch.zeros((n, response_length), dtype=torch.float32)
    lengths = torch.zeros(n, dtype=torch.long)
    for i, done in enumerate(completions):
        tokens = done.token_ids[:response_length]
        resp[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        rollout_lp[i, :len(tokens)] = torch.tensor(done.log_probs[:len(tokens)], dtype=torch.float32)
        lengths[i] = len(tokens)
    return responses_from_tensors(prompts, resp, rollout_lp, lengths)


def responses_from_tensors(prompts: "DataProto", resp: "torch.Tensor", rollout_lp: "torch.Tensor",
                           lengths: "torch.Tensor") -> "DataProto":
    """The rollout's output: responses (padded after ``lengths``), the per-token
    ``response_mask`` (1 for every token the policy generated: single-turn rows train on
    their whole response), the engine's log-probs, and the full sequences with attention
    mask and positions (the attention mask is its own column: tokens others insert in a
    multi-turn row are attended to but not trained on)."""
    import torch

    from rlhf_core.protocol import DataProto

    resp_mask = (torch.arange(resp.shape[1]) < lengths.unsqueeze(1)).long()
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return DataProto.from_dict({
        "prompts": prompt_ids,
        "responses": resp,
        "response_mask": resp_mask,
        # after a response's end HF's scores may give the padding -inf: never multiplied through
        "rollout_log_probs": torch.where(resp_mask.bool(), rollout_lp, torch.zeros_like(rollout_lp)),
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    })


def engine_dtype(cfg) -> str:
    """The dtype an engine serves (``rollout.dtype``; auto: bf16 copies of the fp32 master
    weights on GPU, ``model.dtype`` on CPU): what weight syncs send."""
    import torch

    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    return "bfloat16" if torch.cuda.is_available() else cfg.model.dtype


def free_cached_memory() -> None:
    """Return the blocks torch's caching allocator holds to the device (vLLM's sleep-mode
    memory is allocated outside that cache and cannot reuse them). No-op on CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
