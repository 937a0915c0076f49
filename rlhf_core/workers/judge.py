"""The engines a served judge (a generative reward model, verl's GenRM) generates with,
behind the chat-completions endpoint of ``rlhf_core/rollout/openai_server.py``
(``reward_model.rollout.name``):

- ``hf``: transformers' generate on the judge's own copy of the weights; on a GPU the
  model goes to host memory while it sleeps;
- ``vllm``: a vLLM engine of the judge's own (its checkpoint read, per-request seeds),
  sleeping at level 1 (weights to host memory, KV cache freed) between scorings on GPUs.

A judge sleeps while the actor trains and wakes for the reward stage (the controller
asks: ``RewardModelWorker.judge_wake`` / ``judge_sleep``). Only one vLLM engine ever lives
in a process: a vLLM judge colocated with a vLLM rollout is refused by the config.
"""

from __future__ import annotations

import os

from rlhf_core.rollout.engine import Completion, GenerationRequest, RolloutEngine, Sampling, top_k_setting


class HFJudge(RolloutEngine):
    """transformers' generate on the judge's weights (``rollout.engines.hf``'s batching)."""

    def __init__(self, model_path: str, tokenizer, dtype: str, seed: int) -> None:
        from rlhf_core.distributed import sharding
        from rlhf_core.rollout.engines.hf import HFEngine
        from rlhf_core.workers import modeling

        self.device = sharding.device()
        self.model = modeling.load_causal_lm(model_path, dtype).to(self.device).eval()
        self._engine = HFEngine(self.model, tokenizer, None, seed)
        self.pad_id, self.eos_id = self._engine.pad_id, self._engine.eos_id
        self.awake = True

    def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[Completion]:
        return self._engine.generate(requests, sampling)

    def sleep(self) -> None:
        import torch

        if self.awake and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.awake = False

    def wake_up(self) -> None:
        if not self.awake and self.device.type == "cuda":
            self.model.to(self.device)
        self.awake = True


class VLLMJudge(RolloutEngine):
    """A vLLM engine over the judge's checkpoint; each request sampled with its own seed
    (its answer does not depend on what it was batched with)."""

    def __init__(self, model_path: str, rollout, dtype: str, seed: int) -> None:
        import torch

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.sleeps = torch.cuda.is_available()
        engine = ({"gpu_memory_utilization": rollout.gpu_memory_utilization, "enable_sleep_mode": True}
                  if self.sleeps else {"gpu_memory_utilization": 0.9, "enable_chunked_prefill": False,
                                       "enable_prefix_caching": False})
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=rollout.prompt_length + rollout.response_length,
                       enforce_eager=not self.sleeps, seed=seed, **engine)
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_id = tokenizer.eos_token_id
        self.awake = True

    def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        common = dict(n=1, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
                      logprobs=0, detokenize=False, **top_k_setting(sampling.top_k, off=-1))
        params = [SamplingParams(**common, max_tokens=r.limit(sampling), seed=int(r.seed)) for r in requests]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests], params,
                                    use_tqdm=False)
        return [Completion(request.request_id, list(out.outputs[0].token_ids),
                           [step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
                for request, out in zip(requests, outputs)]

    def sleep(self) -> None:
        if self.sleeps and self.awake:
            self.llm.sleep(level=1)  # the weights to host memory: the judge's are not pushed again
        self.awake = False

    def wake_up(self) -> None:
        if self.sleeps and not self.awake:
            self.llm.wake_up()
        self.awake = True


def build_judge(rm_cfg, model_path: str, tokenizer, dtype: str, seed: int) -> RolloutEngine:
    """The engine ``reward_model.rollout.name`` names, over the judge at ``model_path``."""
    if rm_cfg.rollout.name == "vllm":
        return VLLMJudge(model_path, rm_cfg.rollout, dtype, seed)
    return HFJudge(model_path, tokenizer, dtype, seed)
