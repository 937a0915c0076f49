"""Generation engines behind one interface: vLLM (default) and HF ``generate`` (fallback).

``generate(prompts)`` takes a DataProto of left-padded prompts (one row per response to
sample, with a ``sample_seed`` per row) and returns the responses, their mask, the
sampled tokens' log-probs, and the full sequences. Per-row seeds make a row's sample
independent of batch composition, chunking and restarts (exact resume and replay); vLLM
on a GPU seeds each call instead (``rollout.seed_scope``): a seed per request puts its
sampler in a loop over rows at every decoding step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Iterable

import torch

from rlhf_core.protocol import DataProto
from rlhf_core.workers import devices


def free_cached_memory() -> None:
    """Return the blocks torch's caching allocator holds to the device (vLLM's sleep-mode
    memory is allocated outside that cache and cannot reuse them). No-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _finish(prompts: DataProto, responses: list[list[int]], log_probs: list[list[float]],
            response_length: int, pad_id: int, eos_id: int | None) -> DataProto:
    """The rollout's output from per-response token and log-prob lists (vLLM's)."""
    n = len(responses)
    resp = torch.full((n, response_length), pad_id, dtype=torch.long)
    rollout_lp = torch.zeros((n, response_length), dtype=torch.float32)
    lengths = torch.zeros(n, dtype=torch.long)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs)):
        tokens = tokens[:response_length]
        resp[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        rollout_lp[i, :len(tokens)] = torch.tensor(lps[:len(tokens)], dtype=torch.float32)
        lengths[i] = len(tokens)
    return _finish_tensors(prompts, resp, rollout_lp, lengths)


def _finish_tensors(prompts: DataProto, resp: torch.Tensor, rollout_lp: torch.Tensor,
                    lengths: torch.Tensor) -> DataProto:
    """The rollout's output: responses (padded after ``lengths``), their mask and
    log-probs, and the full sequences with attention mask and positions."""
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


def _prompt_token_lists(prompts: DataProto) -> list[list[int]]:
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def top_k_setting(top_k: int, off: int) -> dict:
    """``top_k`` as an engine takes it: k when above 0, else the engine's "off" (vLLM's -1;
    transformers' 0, whose generate would otherwise keep its default of 50)."""
    return {"top_k": int(top_k) if top_k > 0 else off}


class VLLMRollout:
    """vLLM's engine in this process (no engine subprocess: fastest on CPU, and the
    weights can be pushed in place after every actor update).

    A LoRA policy (``lora_rank`` > 0) is served as verl serves one: the engine holds the
    base weights and the adapter as a LoRA request, replaced after every update
    (``update_adapter``); the base is pushed only when the engine has none (a dummy load,
    or a sleep that discarded it)."""

    #: the one adapter the engine serves: the policy's
    ADAPTER_NAME, ADAPTER_ID = "policy", 1

    def __init__(self, model_path: str, config, seed: int, max_model_len: int, dtype: str = "float32",
                 lora_rank: int = 0, hf_overrides: dict | None = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.config = config
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
        if lora_rank:
            from rlhf_core.workers.lora import engine_max_rank

            engine.update(enable_lora=True, max_loras=1, max_lora_rank=engine_max_rank(lora_rank))
        self.has_adapter, self._adapter_dir = False, None
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
        self._sleep()

    @property
    def needs_weights(self) -> bool:
        """True while the engine holds no weights (its sleep discarded them), or a LoRA
        engine no adapter: the caller pushes the policy's with ``update_weights`` (and
        ``update_adapter``) before the next ``generate``."""
        return not self.has_weights or (self.lora_rank > 0 and not self.has_adapter)

    @property
    def needs_base_weights(self) -> bool:
        """Whether the engine holds no base weights (a LoRA policy's frozen base is pushed
        only then)."""
        return not self.has_weights

    # Memory follows verl's hybrid engine: sleep(level=2) after generating, then at the
    # weight sync wake_up(tags=["weights"]), load, empty torch's cache, and wake the KV
    # cache only when generation starts (the one change: here the sync is its own stage,
    # so the KV cache stays asleep until the rollout stage needs it).

    def _sleep(self) -> None:
        if self.sleeps and (self.has_weights or self.kv_cache_awake):
            # level 2 frees weights and KV cache without copying the weights to pinned host
            # memory (level 1 copies ~7 GiB per rank at 7B, every iteration): the trainer
            # pushes them again at the next weight sync anyway
            self.llm.sleep(level=2)
            self.has_weights = self.kv_cache_awake = False
            free_cached_memory()  # generation's freed blocks go back to the device for training

    def _wake_weights(self) -> None:
        if self.sleeps and not self.has_weights:
            free_cached_memory()  # training's cached blocks: vLLM allocates outside torch's cache
            self.llm.wake_up(tags=["weights"])  # not the KV cache: the weights are still being gathered
            self.has_weights = True

    def _wake_kv_cache(self) -> None:
        if self.sleeps and not self.kv_cache_awake:
            free_cached_memory()
            self.llm.wake_up(tags=["kv_cache"])  # the engine is fully awake and schedules again
            self.kv_cache_awake = True

    def generate(self, prompts: DataProto) -> DataProto:
        from vllm import SamplingParams

        seeds = prompts.batch["sample_seed"].tolist()
        # do_sample=False (ReMax's baseline): greedy decoding, temperature 0
        sampling = {"temperature": self.config.temperature, "top_p": self.config.top_p, "top_k": self.config.top_k,
                    **prompts.meta_info.get("sampling", {})}  # validation's val_kwargs
        temperature = sampling["temperature"] if prompts.meta_info.get("do_sample", True) else 0.0
        common = dict(n=1, temperature=temperature, top_p=sampling["top_p"], max_tokens=self.config.response_length,
                      logprobs=0, detokenize=False, **top_k_setting(sampling["top_k"], off=-1))
        if self.seeds_per_call:
            # the engine runs in this process: unseeded requests draw from torch's generators
            torch.manual_seed(int(seeds[0]) if seeds else 0)
            params = SamplingParams(**common)  # one for every request: sampled as one batch
        else:
            params = [SamplingParams(**common, seed=int(s)) for s in seeds]
        requests = [{"prompt_token_ids": ids} for ids in _prompt_token_lists(prompts)]
        if self.needs_weights:
            raise RuntimeError("VLLMRollout.generate: the engine holds no weights (its sleep discarded them); "
                               "call update_weights with the policy's weights first")
        self._wake_kv_cache()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request())
        finally:
            self._sleep()  # the memory goes to log-prob, value and update stages
        tokens, lps = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            lps.append([step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)])
        return _finish(prompts, tokens, lps, self.config.response_length, self.pad_id, self.eos_id)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load weights as they stream in (the engine copies each into its own tensor, so the
        caller's gathered tensor can be freed before the next one is gathered). A sleeping
        engine gets its weights' memory back first; its KV cache stays asleep until the next
        ``generate`` (training stages may run in between: a resume's redone updates)."""
        self._wake_weights()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.has_weights = True
        self.has_adapter = False  # vLLM drops its adapters when the base weights change
        free_cached_memory()  # the gathered tensors' blocks
        if not self.sleeps:  # a sleep already cleared it
            self.llm.reset_prefix_cache()

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config) -> None:
        """Replace the policy's adapter in the engine: ``named_tensors`` in a PEFT adapter
        file's names, ``config`` its peft ``LoraConfig``. vLLM loads adapters from folders:
        this engine's own folder (in shared memory where there is one) is rewritten and
        reloaded in place under the same adapter id."""
        from vllm.lora.request import LoRARequest

        from rlhf_core.workers.lora import write_adapter_folder

        if not self.lora_rank:
            raise RuntimeError("VLLMRollout.update_adapter: the engine was started without LoRA (lora_rank=0)")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="rlhf-adapter-",
                                                 dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)
        write_adapter_folder(self._adapter_dir, dict(named_tensors), config)
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


class HFRollout:
    """``transformers`` generate on the training model itself (no separate engine)."""

    needs_weights = needs_base_weights = False  # it generates with the training model itself

    def __init__(self, model, tokenizer, config, seed: int, synced: bool = False) -> None:
        self.model, self.config, self.seed = model, config, seed
        # a sharded model gathers layers collectively: every rank must run as many decoding
        # steps as the longest, so ranks that finish early keep stepping (synced_gpus)
        self.synced = synced
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_id = tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompts: DataProto) -> DataProto:
        # HF sampling has no per-row seed: seed the batch from its first row's seed.
        torch.manual_seed(int(prompts.batch["sample_seed"][0]))
        model = self.model
        was_training = model.training
        model.eval()
        model.config.use_cache = True
        on_device = devices.to_device(prompts)  # the model's device; the outputs come back to the host
        ids, mask = on_device.batch["input_ids"], on_device.batch["attention_mask"]
        pad = int(mask.bool().any(dim=0).float().argmax())  # columns of padding in every prompt
        sampling = {"temperature": self.config.temperature, "top_p": self.config.top_p, "top_k": self.config.top_k,
                    **prompts.meta_info.get("sampling", {})}  # validation's val_kwargs
        out = model.generate(input_ids=ids[:, pad:], attention_mask=mask[:, pad:],
                             # top_k always given: transformers' own default is 50
                             **(dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"],
                                     **top_k_setting(sampling["top_k"], off=0))
                                if prompts.meta_info.get("do_sample", True) else dict(do_sample=False)),
                             max_new_tokens=self.config.response_length, pad_token_id=self.pad_id,
                             eos_token_id=self.eos_id, output_scores=True, return_dict_in_generate=True,
                             synced_gpus=self.synced)
        model.config.use_cache = False
        model.train(was_training)
        new = out.sequences[:, ids.shape[1] - pad:]
        scores = (torch.stack(out.scores, dim=1).float() if out.scores
                  else torch.zeros(len(new), 0, 1, device=new.device))
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        new, logp = new.cpu(), logp.cpu()
        # a response ends after its first EOS (kept); generate pads the rest
        width = self.config.response_length
        is_eos = new == self.eos_id if self.eos_id is not None else torch.zeros_like(new, dtype=torch.bool)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1) + 1, new.shape[1])
        resp = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        rollout_lp = torch.zeros((len(new), width), dtype=torch.float32)
        resp[:, :new.shape[1]], rollout_lp[:, :new.shape[1]] = new[:, :width], logp[:, :width]
        lengths = first_eos.clamp(max=width)
        resp[torch.arange(width) >= lengths.unsqueeze(1)] = self.pad_id
        return _finish_tensors(prompts, resp, rollout_lp, lengths)

    def update_weights(self, named_tensors) -> None:
        pass  # generates with the training model: always current

    def update_adapter(self, named_tensors, config) -> None:
        pass  # the training model's own adapter is active while it generates
