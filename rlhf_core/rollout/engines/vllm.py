"""vLLM's engine in the worker's process (no engine subprocess: fastest on CPU, and the
weights can be pushed in place after every actor update).

A LoRA policy is served as verl serves one: the engine holds the base weights and the
adapter as a LoRA request, replaced after every update (``update_adapter``); the base is
pushed only when the engine has none (a dummy load, or a sleep that discarded it).

Every rule vLLM sets on the run's config is in ``check`` (and, for what only the model
folder tells, ``check_model``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import rlhf_core.rollout.engine as engine_module
from rlhf_core.rollout.engine import (
    Completion, EngineConfigError, GenerationRequest, RolloutEngine, Sampling, top_k_setting,
)
from rlhf_core.rollout.registry import register_engine

#: the LoRA ranks vLLM serves (its ``max_lora_rank`` choices)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's all-reduce paths that need IPC between the GPUs of one tensor-parallel engine
TP_IPC_ALL_REDUCES = ("VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER")
#: vLLM's CPU attention kernels need heads of at least this many dimensions
CPU_MIN_HEAD_DIM = 32


def max_lora_rank(rank: int, field: str = "model.lora_adapter_path") -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``."""
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise EngineConfigError(f"{field}: expected an adapter of rank at most {LORA_RANKS[-1]} with rollout.name=vllm "
                            f"(the largest rank vLLM serves); found rank {rank}")


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    #: the one adapter the engine serves: the policy's
    ADAPTER_NAME, ADAPTER_ID = "policy", 1

    @classmethod
    def check(cls, cfg) -> None:
        rollout = cfg.rollout
        cls._check_token_budget(cfg)
        if cfg.algorithm.rollout_correction.active and rollout.temperature != 1:
            raise EngineConfigError(
                f"algorithm.rollout_correction: expected rollout.temperature=1 with rollout.name=vllm (the engine's "
                f"log-probs here are the raw model's, before temperature: the weights would measure the "
                f"temperature); found {rollout.temperature}")
        if cfg.old_log_prob_column == "rollout_log_probs" and rollout.temperature != 1:
            raise EngineConfigError(
                f"algorithm.rollout_correction.bypass_mode: expected false when sampling is not the plain softmax "
                f"at temperature 1 with rollout.name=vllm (the engine's log-probs would not be the policy's); "
                f"found true with rollout.temperature={rollout.temperature}")
        if cfg.model.lora_rank:
            max_lora_rank(cfg.model.lora_rank, "model.lora_rank")

    @staticmethod
    def _check_token_budget(cfg) -> None:
        """vLLM's own rules for rollout.max_num_batched_tokens (its SchedulerConfig): at
        least max_num_seqs, and without chunked prefill (always off on CPU nodes; vLLM's
        default on GPUs is on) at least the engine's max_model_len."""
        rollout, budget = cfg.rollout, cfg.rollout.max_num_batched_tokens
        if not budget:
            return
        if budget < rollout.max_num_seqs:
            raise EngineConfigError(f"rollout.max_num_batched_tokens: expected at least rollout.max_num_seqs="
                                    f"{rollout.max_num_seqs} (vLLM's rule); found {budget}")
        chunked = bool(cfg.resources.gpus_per_node) and rollout.enable_chunked_prefill is not False
        model_len = rollout.max_model_len or engine_max_model_len(cfg)
        if not chunked and budget < model_len:
            raise EngineConfigError(f"rollout.max_num_batched_tokens: expected at least the engine's max_model_len="
                                    f"{model_len} without chunked prefill (vLLM's rule; it is off on CPU nodes or "
                                    f"with enable_chunked_prefill=false); found {budget}")

    @classmethod
    def replica_shape(cls, cfg) -> tuple[int, bool]:
        # the ranks of one tensor-parallel engine each take every request; one answers
        return cfg.rollout.tensor_model_parallel_size, False

    @classmethod
    def check_model(cls, cfg, model_config) -> None:
        """What the policy's model config must be for vLLM (CPU workers: head_dim >= 32)."""
        if cfg.resources.gpus_per_node > 0:
            return
        head_dim = getattr(model_config, "head_dim", None) or \
            model_config.hidden_size // model_config.num_attention_heads
        if head_dim < CPU_MIN_HEAD_DIM:
            raise EngineConfigError(f"rollout.name=vllm: vLLM's CPU attention needs a head_dim of at least "
                                    f"{CPU_MIN_HEAD_DIM}; found {head_dim} in model.path {cfg.model.path} (use "
                                    f"rollout.name=hf on CPU workers, or GPUs: resources.gpus_per_node)")

    @classmethod
    def build(cls, *, model_path: str, cfg, lora_rank: int, hf_overrides: dict | None, **_) -> "VLLMEngine":
        import torch

        dtype = engine_module.engine_dtype(cfg)
        merge = cfg.rollout.lora_merge if cfg.rollout.lora_merge is not None else not torch.cuda.is_available()
        engine = cls(model_path, cfg.rollout, seed=cfg.trainer.seed, max_model_len=engine_max_model_len(cfg),
                     dtype=dtype, lora_rank=lora_rank if lora_rank and not merge else 0, hf_overrides=hf_overrides)
        return engine

    def __init__(self, model_path: str, config, seed: int, max_model_len: int, dtype: str = "float32",
                 lora_rank: int = 0, hf_overrides: dict | None = None) -> None:
        import torch

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.config = config
        self.sync_dtype = getattr(torch, dtype)  # what the engine keeps: gather no more bytes
        on_gpu = torch.cuda.is_available()
        self.seeds_per_call = config.seed_scope == "call" or (config.seed_scope == "auto" and on_gpu)
        tp = config.tensor_model_parallel_size
        # Sleep mode frees the engine's weights and KV cache while the actor trains; CPU
        # engines have no sleep mode (and nothing to gain: training uses the same RAM).
        self.sleeps = on_gpu and config.free_cache_engine
        engine = {"gpu_memory_utilization": config.gpu_memory_utilization, "enable_sleep_mode": self.sleeps,
                  # the engine's first weights are the policy's, pushed before its first
                  # generate: reading the checkpoint here would only be thrown away
                  "load_format": "dummy",
                  # the n samples of a prompt are n requests sharing its tokens: one prefill
                  "enable_prefix_caching": config.enable_prefix_caching is not False}
        if config.enable_chunked_prefill is not None:
            engine["enable_chunked_prefill"] = config.enable_chunked_prefill
        if tp > 1:
            # the training ranks are the engine's ranks: vLLM joins the torch.distributed
            # world they already formed (consecutive ranks share one engine). Ray narrows each
            # rank's CUDA_VISIBLE_DEVICES to its own GPU, so vLLM's custom all-reduce (a
            # peer-to-peer check over the engine's logical devices) cannot work: NCCL's does.
            engine.update(tensor_parallel_size=tp, distributed_executor_backend="external_launcher",
                          disable_custom_all_reduce=True)
            # vLLM's symmetric-memory and FlashInfer all-reduces also rely on IPC between
            # GPUs that the narrowing hides (on by default): NCCL's all-reduce instead
            for flag in TP_IPC_ALL_REDUCES:
                os.environ[flag] = "0"
        if not on_gpu:
            # On CPU, no chunked prefill: a prompt split across engine steps makes vLLM rewind
            # that request's seeded generator, which CPU generators cannot do ("CPU Generator
            # does not use offset"), so batches of more prompt tokens than one step takes
            # (e.g. 2048 responses) failed. Whole prompts per step keep per-request seeds.
            # The checkpoint is loaded (no sleep mode: the weights stay until replaced).
            engine = {"gpu_memory_utilization": 0.9, "enable_chunked_prefill": False, "enable_prefix_caching": False}
            asked = [k for k in ("enable_chunked_prefill", "enable_prefix_caching") if getattr(config, k)]
            if asked:
                print(f"rlhf: note: rollout.{' and rollout.'.join(asked)} has no effect on CPU workers (vLLM's CPU "
                      f"generators cannot rewind a request's seed for a split prompt)", flush=True)
        self.lora_rank = lora_rank
        self.serves_adapter = lora_rank > 0
        if lora_rank:
            engine.update(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank(lora_rank))
        self.has_adapter, self._adapter_dir = False, None
        self.loading = False  # a load began and did not finish: the engine holds part of the weights
        enforce_eager = (not on_gpu) if config.enforce_eager is None else config.enforce_eager
        if config.max_num_batched_tokens:
            engine["max_num_batched_tokens"] = config.max_num_batched_tokens
        if hf_overrides:  # the model config's settings the run overrides, as the trained model's
            engine["hf_overrides"] = dict(hf_overrides)
        self.llm = LLM(model=model_path, dtype=dtype, max_model_len=config.max_model_len or max_model_len,
                       enforce_eager=enforce_eager, seed=seed, max_num_seqs=config.max_num_seqs, **engine)
        # what the engine holds on the device (a dummy load holds no policy weights yet)
        self.has_weights, self.kv_cache_awake = engine.get("load_format") != "dummy", True
        tokenizer = self.llm.get_tokenizer()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_id = tokenizer.eos_token_id
        self.sleep()

    @property
    def needs_weights(self) -> bool:
        """True while the engine holds no weights (its sleep discarded them), or a LoRA
        engine no adapter: the caller pushes the policy's with ``update_weights`` (and
        ``update_adapter``) before the next ``generate``."""
        return not self.has_weights or self.loading or (self.lora_rank > 0 and not self.has_adapter)

    @property
    def needs_base_weights(self) -> bool:
        """Whether the engine holds no base weights (a LoRA policy's frozen base is pushed
        only then)."""
        return not self.has_weights

    # Memory follows verl's hybrid engine: sleep(level=2) after generating, then at the
    # weight sync wake_up(tags=["weights"]), load, empty torch's cache, and wake the KV
    # cache only when generation starts (the one change: here the sync is its own stage,
    # so the KV cache stays asleep until the rollout stage needs it).

    def sleep(self) -> None:
        if self.sleeps and (self.has_weights or self.kv_cache_awake):
            # level 2 frees weights and KV cache without copying the weights to pinned host
            # memory (level 1 copies ~7 GiB per rank at 7B, every iteration): the trainer
            # pushes them again at the next weight sync anyway
            self.llm.sleep(level=2)
            self.has_weights = self.kv_cache_awake = False
            engine_module.free_cached_memory()  # generation's freed blocks go back to the device for training

    def _wake_weights(self) -> None:
        if self.sleeps and not self.has_weights:
            engine_module.free_cached_memory()  # training's cached blocks: vLLM allocates outside torch's cache
            self.llm.wake_up(tags=["weights"])  # not the KV cache: the weights are still being gathered
            self.has_weights = True

    def wake_up(self) -> None:
        if self.sleeps and not self.kv_cache_awake:
            engine_module.free_cached_memory()
            self.llm.wake_up(tags=["kv_cache"])  # the engine is fully awake and schedules again
            self.kv_cache_awake = True

    def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[Completion]:
        import torch
        from vllm import SamplingParams

        common = dict(n=1, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
                      max_tokens=sampling.max_tokens, logprobs=0, detokenize=False,
                      **top_k_setting(sampling.top_k, off=-1))
        own_limits = any(r.max_tokens is not None for r in requests)
        if self.seeds_per_call:
            # the engine runs in this process: unseeded requests draw from torch's generators
            torch.manual_seed(int(requests[0].seed) if requests else 0)
            params = ([SamplingParams(**{**common, "max_tokens": r.limit(sampling)}) for r in requests] if own_limits
                      else SamplingParams(**common))  # one for every request: sampled as one batch
        else:
            params = [SamplingParams(**{**common, "max_tokens": r.limit(sampling)}, seed=int(r.seed)) for r in requests]
        if self.needs_weights:
            raise RuntimeError("VLLMEngine.generate: the engine holds no complete weights (its sleep discarded "
                               "them, or a load did not finish); "
                               "call update_weights with the policy's weights first")
        self.wake_up()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], params,
                                        use_tqdm=False, lora_request=self._lora_request())
        finally:
            self.sleep()  # the memory goes to log-prob, value and update stages
        completions = []
        for request, out in zip(requests, outputs):
            done = out.outputs[0]
            completions.append(Completion(request.request_id, list(done.token_ids),
                                          [step[tok].logprob for step, tok in zip(done.logprobs, done.token_ids)]))
        return completions

    def update_weights(self, named_tensors) -> None:
        """Load weights as they stream in (the engine copies each into its own tensor, so the
        caller's gathered tensor can be freed before the next one is gathered). A sleeping
        engine gets its weights' memory back first; its KV cache stays asleep until the next
        ``generate`` (training stages may run in between: a resume's redone updates)."""
        self._wake_weights()
        self.loading = True  # until the last tensor is in (a failed load must not be generated from)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.has_weights, self.loading = True, False
        self.has_adapter = False  # vLLM drops its adapters when the base weights change
        engine_module.free_cached_memory()  # the gathered tensors' blocks
        if not self.sleeps:  # a sleep already cleared it
            self.llm.reset_prefix_cache()

    def update_adapter(self, named_tensors, config) -> None:
        """Replace the policy's adapter in the engine: ``named_tensors`` in a PEFT adapter
        file's names, ``config`` its peft ``LoraConfig``. vLLM loads adapters from folders:
        this engine's own folder (in shared memory where there is one) is rewritten and
        reloaded in place under the same adapter id."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise RuntimeError("VLLMEngine.update_adapter: the engine was started without LoRA (lora_rank=0)")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="rlhf-adapter-",
                                                 dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        self.has_adapter = False  # until the new one is loaded
        config.save_pretrained(self._adapter_dir)  # a PEFT adapter folder: what vLLM loads
        save_file({name: t.detach().contiguous() for name, t in dict(named_tensors).items()},
                  os.path.join(self._adapter_dir, "adapter_model.safetensors"))
        self.llm.llm_engine.add_lora(LoRARequest(self.ADAPTER_NAME, self.ADAPTER_ID, self._adapter_dir,
                                                 load_inplace=True))
        self.has_adapter = True
        if not self.sleeps:
            self.llm.reset_prefix_cache()  # cached blocks were computed with the previous adapter

    def _lora_request(self):
        if not self.lora_rank:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.ADAPTER_NAME, self.ADAPTER_ID, self._adapter_dir)


def engine_max_model_len(cfg) -> int:
    """The engine's max_model_len when rollout.max_model_len is 0: prompt + response, at least 64."""
    return max(64, cfg.data.max_prompt_length + cfg.rollout.response_length)
