"""The reward-model worker: a learned reward (an HF sequence-classification model with one
label) scores each response, as verl's reward-model worker does.

The score of a sequence is the model's score head applied at its last valid token (the
highest position id under the attention mask), never at a fixed column and never found
by looking for a pad token (a response that ends in EOS may end in the pad token too).
It is placed at the response's last valid token of ``rm_scores`` [rows, response_length],
which the reward stage turns into ``token_level_scores``.

What the reward model reads:

- when its tokenizer and chat template are the policy's, the policy's own tokens: exactly
  the sequence that was sampled;
- otherwise (verl's ``_switch_chat_template``) each response is decoded with the policy's
  tokenizer, EOS text removed, appended to the prompt's chat messages as the assistant's
  turn, templated with the reward model's chat template (no generation prompt) and
  tokenized without added special tokens; longer than ``reward_model.max_length``, it is
  cut by ``reward_model.truncation`` (verl's rules: right, left, middle, error).
"""

from __future__ import annotations

import torch

from rlhf_core.algorithms import last_token_index
from rlhf_core.config import RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.protocol import DataProto
from rlhf_core.workers import devices, modeling
from rlhf_core.workers.modeling import content_sha256

FIELD = "reward_model.model.path"
#: The record ``rlhf reward-model train`` leaves in the folder it writes: the preference
#: data (URI, sha256), the base model, the settings and the held-out curve.
PROVENANCE = "rlhf_reward_model.json"


class RewardModelError(ValueError):
    """The reward model or its inputs are not what scoring needs."""


def load_reward_model(path: str, dtype: str = "float32", empty: bool = False):
    """An HF sequence-classification model with one label and a ``score`` head (the
    layout of Llama, Qwen2, Mistral and Gemma reward models); anything else is refused
    in one line naming what was found. ``empty``: built from its config on the meta
    device (no weights read), for a rank whose shards ``sharding.wrap`` fills from rank 0."""
    from transformers import AutoModelForSequenceClassification

    config = check_reward_model_config(path)
    if empty:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise RewardModelError(f"{FIELD}: expected a score head (a Linear named 'score'); found "
                               f"{type(getattr(model, 'score', None)).__name__} in {path}")
    model.config.use_cache = False
    return model.eval().requires_grad_(False)


def check_reward_model_config(path: str):
    """The folder's config, refused in one line unless it is a one-label sequence
    classifier (no weights are read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(f"{FIELD}: expected a sequence-classification model (architectures "
                               f"*ForSequenceClassification); found {architectures or 'none'} in {path}")
    if config.num_labels != 1:
        raise RewardModelError(f"{FIELD}: expected a reward model with one label (num_labels=1); found "
                               f"num_labels={config.num_labels} in {path}")
    return config


def check_judge_config(path: str):
    """The folder's config, refused in one line unless it is a causal language model (a
    judge generates its verdict; no weights are read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForCausalLM") for a in architectures):
        raise RewardModelError(f"{FIELD}: expected a causal language model (architectures *ForCausalLM) to serve as "
                               f"a judge behind reward_router_address (use_reward_loop with "
                               f"custom_reward_function.path); found {architectures or 'none'} in {path} (for a "
                               f"classifier's score in extra_info['rm_score'], set reward_model.use_reward_loop=false)")
    return config


def trained_from(folder: str) -> dict | None:
    """Where a reward model trained here came from (its ``PROVENANCE`` record): the
    preference data's URI and sha256, the base model and the training run; None for a folder without one,
    or whose record is not what ``rlhf reward-model train`` writes (it is data: read as
    JSON, its fields checked, nothing else)."""
    import json
    import os

    path = os.path.join(folder, PROVENANCE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        data = record["data"]
        out = {"data": data["uri"], "data_sha256": data["sha256"], "base": record["base"]}
        if "run" in record:  # the training run in the store: its epochs, scored pairs, checkpoints
            out["run"] = record["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return out if all(isinstance(v, str) for v in out.values()) else None


def same_tokenization(a, b) -> bool:
    """Whether two tokenizers turn the same chat into the same tokens: same vocabulary,
    special tokens and chat template."""
    return (a.get_vocab() == b.get_vocab() and a.chat_template == b.chat_template
            and a.all_special_tokens == b.all_special_tokens)


def last_valid_index(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """verl's rule: the column of each row's last valid token (the largest position id
    under the mask)."""
    return torch.argmax(position_ids * attention_mask, dim=-1)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    packed: bool = False) -> torch.Tensor:
    """[rows] scores: the score head at each row's last valid token. ``packed``: the rows'
    real tokens as one packed sequence (``packing.enable_packing`` set up the model).

    The model's own forward runs (under FSDP its root gathers the embeddings and the head
    there); the head's per-token output is taken from inside it, and HF's pooling, which
    finds the last token by looking for the pad token, is ignored."""
    from rlhf_core.distributed import sharding

    inner = sharding.unwrap(model)
    head, seen = inner.score, []
    original = head.forward

    def per_token(hidden):
        out = original(hidden)
        seen.append(out)
        return out

    if packed:
        from rlhf_core.workers import packing

        rows = packing.pack_sequences(input_ids, attention_mask, position_ids)
        inputs = {"input_ids": rows.input_ids, "position_ids": rows.position_ids,
                  **rows.attention_kwargs(inner.config._attn_implementation)}
    else:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    head.forward = per_token
    try:
        model(**inputs)
    finally:
        head.forward = original
    logits = seen[0].squeeze(-1).float()  # [rows, width] or, packed, [1, tokens]
    if packed:
        return logits[0, rows.last_tokens]
    return logits[torch.arange(len(input_ids), device=logits.device), last_valid_index(attention_mask, position_ids)]


def truncate(ids: list[int], max_length: int, rule: str, row: int) -> list[int]:
    """verl's truncation of a re-templated input (``reward_model.truncation``)."""
    if len(ids) <= max_length:
        return ids
    if rule == "right":
        return ids[:max_length]
    if rule == "left":
        return ids[-max_length:]
    if rule == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    raise RewardModelError(f"reward_model.max_length: row {row}'s re-templated input has {len(ids)} tokens, "
                           f"more than {max_length}; raise it or set reward_model.truncation=right|left|middle")


def retemplate(data: DataProto, policy_tokenizer, tokenizer, max_length: int, truncation: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's prompts and responses as the reward model's chat: input ids, attention
    mask and position ids, right-padded (verl's ``_switch_chat_template``). The prompt's
    chat messages come from the ``raw_chat`` column (a prompt given as text is one user
    message)."""
    responses, mask = data.batch["responses"], data.batch["attention_mask"]
    valid = mask[:, -responses.shape[1]:].sum(dim=1).tolist()
    chats, texts = data.non_tensor_batch.get("raw_chat"), data.non_tensor_batch.get("raw_prompt")
    if chats is None and texts is None:
        raise RewardModelError("reward_model: expected the prompts' chat messages (column raw_chat) or text "
                               "(raw_prompt) in the batch; found neither")
    eos = policy_tokenizer.eos_token or ""
    rows = []
    for i, (ids, length) in enumerate(zip(responses.tolist(), valid)):
        response = policy_tokenizer.decode(ids[:length])
        if eos:
            response = response.replace(eos, "")
        chat = list(chats[i]) if chats is not None and chats[i] is not None else \
            [{"role": "user", "content": str(texts[i])}]
        text = tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": response}],
                                             add_generation_prompt=False, tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not encoded:
            raise RewardModelError(f"reward_model: row {i} re-templated to no tokens")
        rows.append(truncate(encoded, max_length, truncation, i))
    input_ids, attention_mask = right_padded(rows, tokenizer.pad_token_id)
    return input_ids, attention_mask, (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def right_padded(rows: list[list[int]], pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as right-padded ids and attention mask (pad id 0 when there is none)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad if pad is not None else 0, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        attention_mask[i, :len(r)] = 1
    return input_ids, attention_mask


def check_vocabulary(tokenizer, folder: str) -> None:
    """The ids the reward model will read (from ``tokenizer``) fit its embedding: refused at
    load in one line, not an IndexError in the first forward (a tokenizer class that adds
    its own special token when transformers loads the folder makes one id too many)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    rows = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise RewardModelError(f"{FIELD}: expected token ids that fit the model's embedding; found a tokenizer of "
                               f"{len(tokenizer)} tokens for {rows} embedding rows in {folder}")


def scores_to_tokens(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[rows, response_length] with each score at its response's last generated token
    (``response_mask``'s last 1; 0 for a row without a response token)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    has = response_mask.bool().any(dim=1)
    out[has.nonzero().flatten(), last_token_index(response_mask)[has]] = scores[has].float().cpu()
    return out


class VLLMRewardScorer:
    """The reward model served by vLLM's pooling runner in this process (verl's reward
    loop): each sequence's tokens in, the score head's raw output at its last token out
    (``use_activation=False``: no sigmoid). The inputs are the ones the FSDP path scores, so
    the scores are that path's up to the engine's arithmetic. On GPUs the engine sleeps
    between scorings (its weights to host memory, level 1): the training pool's memory is
    the actor's while it trains."""

    def __init__(self, model_path: str, rollout, max_model_len: int, dtype: str, seed: int) -> None:
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.sleeps = torch.cuda.is_available()
        engine = {"gpu_memory_utilization": rollout.gpu_memory_utilization, "enable_sleep_mode": True} \
            if self.sleeps else {"gpu_memory_utilization": 0.9, "enable_chunked_prefill": False}
        self.llm = LLM(model=model_path, runner="pooling", dtype=dtype, max_model_len=max_model_len,
                       enforce_eager=not self.sleeps, seed=seed, enable_prefix_caching=False, **engine)
        self._sleep()

    def _sleep(self) -> None:
        if self.sleeps:
            self.llm.sleep(level=1)

    def scores(self, sequences: list[list[int]]) -> torch.Tensor:
        """[rows] scores of token-id lists (each its real tokens, in order)."""
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

        if self.sleeps:
            self.llm.wake_up()
        try:
            outputs = self.llm.classify([TokensPrompt(prompt_token_ids=ids) for ids in sequences],
                                        pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        finally:
            self._sleep()
        return torch.tensor([float(out.outputs.probs[-1]) for out in outputs], dtype=torch.float32)


class RewardModelWorker(Worker):
    """Holds the reward model (FSDP2 over the pool's ranks, parameters offloaded between
    forwards) and scores batches."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        from rlhf_core.distributed import sharding
        from rlhf_core.workers import packing

        cfg, rm = self.config, self.config.reward_model
        self.model_path = modeling.resolve_model_path(rm.model.path, cfg.trainer.seed, field=FIELD)
        if cfg.judge_served:
            return self._serve_judge()
        self.tokenizer = modeling.load_tokenizer(self.model_path)
        policy_path = modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed, weights=False)
        self.policy_tokenizer = modeling.load_tokenizer(policy_path)
        self.retemplates = not same_tokenization(self.policy_tokenizer, self.tokenizer)
        # re-templated inputs are cut to this (verl's default: the policy's longest sequence)
        self.max_length = rm.max_length or cfg.data.max_prompt_length + cfg.rollout.response_length
        if self.retemplates and not self.tokenizer.chat_template:
            raise RewardModelError(f"{FIELD}: expected a chat template in the reward model's tokenizer (its "
                                   f"tokenizer differs from the policy's, so responses are re-templated for it); "
                                   f"found none in {self.model_path}")
        check_vocabulary(self.tokenizer if self.retemplates else self.policy_tokenizer, self.model_path)
        # what scored the run is rank 0's folder: the other ranks hold rank 0's weights (FSDP)
        # or the same folder, and hashing 15 GB on every rank of a node costs minutes
        self.content_sha256 = content_sha256(self.model_path) if self.rank == 0 else None
        if rm.use_reward_loop:  # served: one engine per rank, each scoring its share of the batch
            check_reward_model_config(self.model_path)  # a one-label classifier, as the FSDP path requires
            longest = max(self.max_length, cfg.data.max_prompt_length + cfg.rollout.response_length)
            self.engine = VLLMRewardScorer(self.model_path, rm.rollout, longest, cfg.model.dtype, cfg.trainer.seed)
            return {"rank": self.rank, "reward_model": self.model_path, "retemplates": self.retemplates}
        spec = sharding.ShardingSpec.from_config(cfg, param_offload=rm.model.fsdp_config.param_offload)
        # under FSDP over several ranks rank 0 alone reads the weights (as the actor's): one
        # read of the folder and one copy in host memory, not one per rank
        reads = sharding.reads_checkpoint(spec.strategy, self.rank, self.world_size)
        model = load_reward_model(self.model_path, cfg.model.dtype, empty=not reads)
        modeling.check_micro_batch_memory(cfg, None, reward_model_config=model.config)
        if model.config.pad_token_id is None:  # HF's pooling (unused here) refuses batches without one
            model.config.pad_token_id = self.tokenizer.pad_token_id or 0
        if rm.model.use_remove_padding:
            packing.enable_packing(model)
        source = sharding.FullWeights.of(model) if reads and sharding.loads_from_rank0(spec.strategy,
                                                                                      self.world_size) else None
        self.model = modeling.init_distributed_model(self, model, spec, trainable=False, resources=cfg.resources,
                                                     source=source)
        del source
        return {"rank": self.rank, "reward_model": self.model_path, "retemplates": self.retemplates}

    def _serve_judge(self) -> dict:
        """A generative reward model served on this rank (verl's GenRM): transformers'
        generate behind an OpenAI-compatible chat-completions endpoint on this node's
        address, which the custom reward function reaches as ``reward_router_address``."""
        import ray

        from rlhf_core.controller.worker import node_ip
        from rlhf_core.rollout.openai_server import ChatCompletionServer
        from rlhf_core.workers.judge import build_judge

        cfg, rm = self.config, self.config.reward_model
        self.retemplates = False  # the judge is asked in its own chat template by the reward function
        check_judge_config(self.model_path)
        self.tokenizer = modeling.load_tokenizer(self.model_path)
        if not self.tokenizer.chat_template:
            raise RewardModelError(f"{FIELD}: expected a chat template in the judge's tokenizer (requests are chat "
                                   f"messages); found none in {self.model_path}")
        self.content_sha256 = content_sha256(self.model_path) if self.rank == 0 else None
        self.judge_engine = build_judge(rm, self.model_path, self.tokenizer, cfg.model.dtype, cfg.trainer.seed)
        # the node's address: the reward workers that call it may be on other nodes
        host = node_ip() if ray.is_initialized() else "127.0.0.1"
        self.judge = ChatCompletionServer(self.judge_engine, self.tokenizer, rm.model.path, rm.rollout.prompt_length,
                                          rm.rollout.response_length, host=host)
        self.judge.sleep()  # until the first reward stage
        address = self.judge.start()
        return {"rank": self.rank, "reward_model": self.model_path, "judge_address": address}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def judge_address(self) -> str:
        """This rank's judge endpoint (``host:port``)."""
        return self.judge.address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def judge_wake(self) -> None:
        """Take the judge's memory back for a scoring (no-op on CPU)."""
        self.judge.wake()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def judge_sleep(self) -> None:
        """Free the judge's device memory while the actor trains (no-op on CPU); a call left
        over from the stage waits for none and is answered 503."""
        self.judge.sleep()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def identity(self) -> dict:
        """What scored this run's responses: ``reward_model.model.path`` as configured, the
        content hash of rank 0's folder (``content_sha256``; None on the other ranks) and, for
        a model trained here, the preferences it was trained on (``trained_from``)."""
        identity = {"path": self.config.reward_model.model.path, "sha256": self.content_sha256}
        if self.config.judge_served:
            identity["served"] = "judge"
        origin = trained_from(self.model_path)
        return identity if origin is None else {**identity, "trained_from": origin}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` [rows, response_length]: each response's score at its last generated token."""
        rm = self.config.reward_model
        response_mask = (data.batch["response_mask"] if "response_mask" in data.batch.keys()
                         else data.batch["attention_mask"][:, -data.batch["responses"].shape[1]:])
        if len(data) == 0:  # every rank gets none together (a batch is padded to the world size), so none waits
            return DataProto.from_dict({"rm_scores": torch.zeros(response_mask.shape, dtype=torch.float32)})
        if self.retemplates:
            ids, mask, positions = retemplate(data, self.policy_tokenizer, self.tokenizer, self.max_length,
                                              rm.truncation)
            inputs = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        else:
            inputs = data.select(["input_ids", "attention_mask", "position_ids"], [])
        if rm.use_reward_loop:
            ids, mask = inputs.batch["input_ids"], inputs.batch["attention_mask"].bool()
            scores = self.engine.scores([row[keep].tolist() for row, keep in zip(ids, mask)])
            return DataProto.from_dict({"rm_scores": scores_to_tokens(scores, response_mask)})
        inputs = devices.to_device(inputs)
        with torch.no_grad():
            [scores] = modeling.forward_in_chunks(
                lambda part: (sequence_scores(self.model, part.batch["input_ids"], part.batch["attention_mask"],
                                              part.batch["position_ids"], packed=rm.model.use_remove_padding),),
                inputs, rm.micro_batch_size_per_gpu,
                rm.forward_max_token_len_per_gpu if rm.bounded_by_tokens else 0,
                "reward_model.forward_max_token_len_per_gpu")
        return DataProto.from_dict({"rm_scores": scores_to_tokens(scores, response_mask)})
