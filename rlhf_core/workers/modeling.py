"""Model-side helpers shared by the role workers: loading, log-probs, values."""

from __future__ import annotations

import torch

from rlhf_core.config import LOGIT_BUDGET_BYTES  # (validate()'s memory estimate counts it too)


class ModelPathError(ValueError):
    """``model.path`` is not a model folder this machine has."""


def resolve_model_path(path: str, seed: int, progress: bool = False, weights: bool = True,
                       field: str = "model.path") -> str:
    """The local folder of ``model.path``: a Hugging Face model folder (``config.json``,
    weights, tokenizer), an object-store folder of one (``s3://``, ``gs://``: fetched once
    into this node's cache and checked, ``rlhf_core.data.fetch``; ``weights=False`` leaves
    the weight files out, for a tokenizer), or the built-in model (built and cached here).
    Hub ids are not downloaded: training nodes often have no network, and a run must name
    exact bytes."""
    if path.startswith("builtin:"):
        if path == "builtin:calculator":  # the built-in tool task's (rlhf agent-demo)
            from rlhf_core.models.calculator import calculator_model_path

            return calculator_model_path(seed=seed, progress=progress)
        from rlhf_core.models.builtin import builtin_model_path

        return builtin_model_path(seed=seed, progress=progress, teacher=path == "builtin:teacher")
    import os

    from rlhf_core.data import fetch

    local = path[len("file://"):] if path.startswith("file://") else path
    if fetch.is_remote(path):
        try:
            local = fetch.fetch(path, field, weights=weights)
        except fetch.FetchError as exc:
            raise ModelPathError(str(exc)) from None
    if not os.path.isfile(os.path.join(local, "config.json")):
        hint = (" (it looks like a Hugging Face hub id: download it first, e.g. `huggingface-cli download "
                f"{path} --local-dir DIR`, and set {field}=DIR)" if not os.path.exists(local)
                and path.count("/") == 1 and not path.startswith((".", "/")) else "")
        raise ModelPathError(f"{field}: expected a local Hugging Face model folder with config.json; found "
                             f"{path!r}{hint}")
    return local


def content_sha256(folder: str) -> str:
    """One sha256 over a model folder's files (their relative paths and bytes, in path
    order; hidden files such as the fetch cache's record and the object store's
    ``SHA256SUMS`` list left out: a folder hashes the same before upload and after fetch):
    the identity that a manifest records and a replay checks."""
    import hashlib
    from pathlib import Path

    from rlhf_core.data.fetch import SUMS

    root, digest = Path(folder), hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and str(p.relative_to(root)) != SUMS
                       and not any(part.startswith(".") for part in p.relative_to(root).parts)):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def config_overrides(model_cfg) -> dict:
    """The model config's settings a run overrides (``model.max_position_embeddings``)."""
    limit = getattr(model_cfg, "max_position_embeddings", None)
    return {"max_position_embeddings": limit} if limit else {}


def load_causal_lm(path: str, dtype: str = "float32", empty: bool = False, overrides: dict | None = None):
    """The causal LM in ``path``; ``empty``: built from its config on the meta device (no
    weights read, no memory), for a rank whose shards are filled by ``sharding.wrap``.
    ``overrides``: settings of its config replaced (``config_overrides``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = overrides or {}

    if empty:
        from transformers import GenerationConfig

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, **overrides),
                                                     dtype=getattr(torch, dtype))
        try:  # what from_pretrained reads too: every rank samples with the checkpoint's settings
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # the folder has none: from_config's defaults, as from_pretrained's
            pass
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **overrides)
    model.config.use_cache = False
    return model


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The columns a forward needs: those that are padding in every row (left of the
    prompts, which are padded to ``data.max_prompt_length``; right of the responses, which
    are padded to ``rollout.response_length``) are dropped. Exact: attention is causal and
    the position ids are explicit, so no kept token attends to a dropped one or moves.
    Returns the trimmed tensors and how many response columns they keep (at least one)."""
    prompt_width = input_ids.shape[1] - response_length
    used = attention_mask.bool().any(dim=0).nonzero().flatten().tolist()
    first = min(used[0], prompt_width - 1) if used else prompt_width - 1
    end = max(used[-1] + 1, prompt_width + 1) if used else prompt_width + 1
    return (input_ids[:, first:end], attention_mask[:, first:end], position_ids[:, first:end],
            end - prompt_width)


def _pad_responses(t: torch.Tensor, response_length: int) -> torch.Tensor:
    """[rows, kept, ...] -> [rows, response_length, ...], zeros after ``kept``."""
    short = response_length - t.shape[1]
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, short)) if short > 0 else t


def check_micro_batch_memory(cfg, model_config, device_bytes: int | None = None, reward_model_config=None) -> None:
    """validate()'s micro-batch memory check with the loaded model's shape (validate()
    checks only where ``model.path`` is a folder it can read): against
    ``resources.gpu_memory_gib`` when declared, else ``device_bytes`` (the GPU's own total
    memory by default). The reward-model worker passes its model's config as
    ``reward_model_config`` (and no policy's). Nothing to check on CPU ranks."""
    from rlhf_core.config import ModelShape, check_micro_batch_memory as check

    if not cfg.resources.gpus_per_node:
        return
    if cfg.resources.gpu_memory_gib:
        device_bytes = cfg.resources.gpu_memory_gib * 2**30
    elif device_bytes is None:
        if not torch.cuda.is_available():
            return  # a GPU pool's rank without one: placing the model refuses it, in its own words
        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    def shape_of(config):
        return None if config is None else ModelShape.from_hf_config(getattr(config, "text_config", config))

    shape, reward_shape = shape_of(model_config), shape_of(reward_model_config)
    if shape is not None or reward_shape is not None:
        check(cfg, shape, device_bytes, reward_shape)


def response_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor, response_length: int, temperature: float = 1.0,
                       with_entropy: bool = False, chunk_tokens: int | None = None, packed: bool = False,
                       with_sum_pi_squared: bool = False, topk: int = 0, gather_ids: torch.Tensor | None = None,
                       topk_vocab: int | None = None):
    """Log-probs (and entropies) of the last ``response_length`` tokens under ``model``
    (0 where a row's response has ended, or, padded, where every row's has: see
    ``trim_padding``).

    Logits are divided by the sampling temperature so the log-probs are those of the
    distribution the responses were sampled from. ``packed``: the rows' real tokens in one
    packed sequence (``packing``; the model's attention set up by ``packing.enable_packing``),
    projected on the response positions only. Logits beyond ``LOGIT_BUDGET_BYTES`` (or
    ``chunk_tokens`` given) are computed in slices of tokens: the vocabulary projection
    runs inside the model's forward (where FSDP has gathered its parameters) on the
    response positions only, and the batch's full logits never exist at once.
    Returns (log-probs, entropies or None), and ``with_sum_pi_squared`` a third output from
    the same pass: sum over the vocabulary of pi^2 per token (verl's
    ``calculate_sum_pi_squared``, the optimal token baseline's input). Then, from the same
    pass, ``topk``: the ``topk`` largest log-probs of each position and their token ids
    ([rows, response_length, topk] each: a teacher's for the top-k forward KL), picked among
    the first ``topk_vocab`` ids when given (a tokenizer's: the extra rows of a padded
    output layer are no token another model has);
    ``gather_ids`` ([rows, response_length, k] token ids): the log-probs of those tokens
    at each position (the student's at the teacher's top-k).
    """
    from rlhf_core.distributed import sharding

    stats = ("entropy",) * with_entropy + ("sum_pi_squared",) * with_sum_pi_squared
    width = topk * 2 + (gather_ids.shape[-1] if gather_ids is not None else 0)  # extra columns a token

    def outputs(log_probs, values, columns, finish):
        named = dict(zip(stats, (finish(v) for v in values)))
        out = (finish(log_probs), named.get("entropy"))
        out = out + (named["sum_pi_squared"],) if with_sum_pi_squared else out
        if width:
            columns = finish(torch.cat(columns, dim=-1)) if len(columns) > 1 else finish(columns[0])
            if topk:
                out += (columns[..., :topk], columns[..., topk:2 * topk].round().long())
            if gather_ids is not None:
                out += (columns[..., 2 * topk:],)
        return out

    inner = sharding.unwrap(model)  # (DDP hides the model's own methods)
    head = inner.get_output_embeddings()
    token_bytes = head.out_features * 4
    if packed:
        from rlhf_core.workers import packing

        rows = packing.pack(input_ids, attention_mask, position_ids, response_length)
        inputs = {"input_ids": rows.input_ids, "position_ids": rows.position_ids, "logits_to_keep": rows.predictors,
                  **rows.attention_kwargs(inner.config._attn_implementation)}
        targets, select, finish = rows.targets, (lambda hidden: hidden[0]), rows.unpack
        ids = gather_ids[rows.response_index] if gather_ids is not None else None
    else:
        input_ids, attention_mask, position_ids, kept = trim_padding(input_ids, attention_mask, position_ids,
                                                                     response_length)
        responses = input_ids[:, -kept:]
        ids = gather_ids[:, :kept].reshape(-1, gather_ids.shape[-1]) if gather_ids is not None else None
        if chunk_tokens is None and input_ids.numel() * token_bytes <= LOGIT_BUDGET_BYTES:
            # one full-vocabulary pass, as it always was (bit for bit)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            logits = logits[:, -kept - 1:-1].float() / temperature
            every = torch.log_softmax(logits, dim=-1)
            log_probs = every.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
            pad = lambda values: _pad_responses(values, response_length)  # noqa: E731
            columns = [c.reshape(len(responses), kept, -1)
                       for c in _extra_columns(every.reshape(-1, every.shape[-1]), topk, ids, topk_vocab)]
            return outputs(log_probs, [_statistic(every, name) for name in stats], columns, pad)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "logits_to_keep": kept + 1}
        targets = responses.reshape(-1)

        def select(hidden):  # the kept + 1 last positions -> the kept that predict responses
            return hidden[:, :-1].reshape(-1, hidden.shape[-1])

        def finish(flat):
            return _pad_responses(flat.reshape(len(responses), kept, *flat.shape[1:]), response_length)

    if chunk_tokens is None and targets.numel() * token_bytes <= LOGIT_BUDGET_BYTES:
        logits = select(model(**inputs).logits).float() / temperature
        every = torch.log_softmax(logits, dim=-1)
        log_probs = every.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return outputs(log_probs, [_statistic(every, name) for name in stats],
                       _extra_columns(every, topk, ids, topk_vocab), finish)
    chunk_tokens = chunk_tokens or max(1, LOGIT_BUDGET_BYTES // token_bytes)
    original = head.forward

    def project(hidden: torch.Tensor) -> torch.Tensor:
        flat = select(hidden)
        parts = []
        for start in range(0, flat.shape[0], chunk_tokens):
            piece = (flat[start:start + chunk_tokens], targets[start:start + chunk_tokens])
            more = (topk, ids[start:start + chunk_tokens] if ids is not None else None, topk_vocab)
            if torch.is_grad_enabled() and flat.requires_grad:
                from torch.utils.checkpoint import checkpoint

                parts.append(checkpoint(_token_log_probs, original, *piece, temperature, stats, *more,
                                        use_reentrant=False))
            else:
                parts.append(_token_log_probs(original, *piece, temperature, stats, *more))
        # a copy (a few numbers a token), not a view: FSDP2 hooks its module's output for the backward
        return torch.cat(parts).clone()

    head.forward = project  # what the model's forward returns as its logits: [tokens, (log-prob, stats...)]
    try:
        out = model(**inputs).logits
    finally:
        head.forward = original
    return outputs(out[:, 0], [out[:, 1 + i] for i in range(len(stats))], [out[:, 1 + len(stats):]], finish)


def _statistic(log_probs: torch.Tensor, name: str) -> torch.Tensor:
    """Per position, from the full log-softmax: the entropy, or sum over the vocabulary of
    pi^2 (exp(logsumexp(2 log pi)))."""
    if name == "sum_pi_squared":
        return torch.exp(torch.logsumexp(2 * log_probs, dim=-1))
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def _token_log_probs(projection, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     stats: tuple[str, ...] = (), topk: int = 0, ids: torch.Tensor | None = None,
                     topk_vocab: int | None = None) -> torch.Tensor:
    """(log-prob of each target, then each of ``stats``, then the top-k log-probs and their
    ids, then the log-probs at ``ids``) of one slice of tokens: [tokens, columns]."""
    every = torch.log_softmax(projection(hidden).float() / temperature, dim=-1)
    chosen = every.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    columns = [torch.stack([chosen, *(_statistic(every, name) for name in stats)], dim=-1),
               *_extra_columns(every, topk, ids, topk_vocab)]
    return torch.cat(columns, dim=-1) if len(columns) > 1 else columns[0]


def _extra_columns(every: torch.Tensor, topk: int, ids: torch.Tensor | None,
                   topk_vocab: int | None = None) -> list[torch.Tensor]:
    """From [tokens, vocabulary] log-probs: the ``topk`` largest among the first
    ``topk_vocab`` ids and their token ids (as floats: exact below 2^24, any vocabulary),
    then the log-probs at ``ids`` [tokens, k]."""
    columns = []
    if topk:
        values, index = every[..., :topk_vocab].topk(topk, dim=-1)
        columns += [values, index.to(values.dtype)]
    if ids is not None:
        columns.append(every.gather(-1, ids))
    return columns


def is_sequence_classifier(path: str) -> bool:
    """Whether the folder's config.json names a one-label ``*ForSequenceClassification`` (a
    reward model), read without its weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return any(a.endswith("ForSequenceClassification") for a in (config.architectures or [])) and \
        config.num_labels == 1


class ValueModel(torch.nn.Module):
    """A backbone with a scalar value head: a causal LM's (the policy's, by default) with a
    zero head, or a one-label sequence classifier's (a reward model: OpenRLHF's and
    InstructGPT's critic init) with its score head as the value head, bias 0."""

    def __init__(self, path: str, dtype: str = "float32", packed: bool = False, empty: bool = False) -> None:
        super().__init__()
        classifier = is_sequence_classifier(path)
        if classifier:
            from transformers import AutoConfig, AutoModelForSequenceClassification

            if empty:
                with torch.device("meta"):
                    lm = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path),
                                                                        dtype=getattr(torch, dtype))
            else:
                lm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
            lm.config.use_cache = False
        else:
            lm = load_causal_lm(path, dtype, empty=empty)
        if packed:
            from rlhf_core.workers import packing

            packing.enable_packing(lm)
        self.backbone = lm.model
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, device="meta" if empty else None,
                                          dtype=getattr(torch, dtype))
        if not empty:
            with torch.no_grad():
                if classifier:
                    self.value_head.weight.copy_(lm.score.weight)
                else:
                    torch.nn.init.zeros_(self.value_head.weight)
                torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids, keep: torch.Tensor | None = None, **attention):
        """Values at every position, or at the positions ``keep`` (packed forwards)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, **attention).last_hidden_state
        return self.value_head(hidden if keep is None else hidden[:, keep]).squeeze(-1)


def response_values(model, input_ids, attention_mask, position_ids, response_length: int,
                    packed: bool = False) -> torch.Tensor:
    """V(s_t) for each response token t: the value at the position that predicts it
    (``packed``: as ``response_log_probs``; 0 where a row's response has ended)."""
    if packed:
        from rlhf_core.distributed import sharding
        from rlhf_core.workers import packing

        rows = packing.pack(input_ids, attention_mask, position_ids, response_length)
        implementation = sharding.unwrap(model).backbone.config._attn_implementation
        return rows.unpack(model(rows.input_ids, None, rows.position_ids, keep=rows.predictors,
                                 **rows.attention_kwargs(implementation))[0])
    input_ids, attention_mask, position_ids, kept = trim_padding(input_ids, attention_mask, position_ids,
                                                                 response_length)
    values = model(input_ids, attention_mask, position_ids)
    return _pad_responses(values[:, -kept - 1:-1], response_length)


def init_distributed_model(worker, model: torch.nn.Module, spec, trainable: bool = True,
                           resources=None, source=None) -> torch.nn.Module:
    """Join the worker group's process group (gloo on CPU, NCCL and gloo on GPU) and prepare ``model`` for it under ``spec``
    (``sharding.ShardingSpec``: FSDP2 or DDP). With ``resources`` (the run's config
    section), a pool that reserved GPUs refuses a worker that finds no CUDA. ``source``:
    rank 0's weights when the other ranks built ``model`` empty (``sharding.wrap``)."""
    import socket

    from rlhf_core.distributed import sharding

    from rlhf_core.workers import devices

    on_gpu = torch.cuda.is_available()
    if resources is not None:
        devices.require_cuda(resources.gpus_per_node, resources.accelerator_resource, on_gpu, socket.gethostname())
    worker.init_process_group(devices.process_group_backend(on_gpu))
    return sharding.wrap(model, spec, trainable=trainable, source=source)


def mini_batch_rows(ppo_mini_batch_size: int, n: int, world_size: int, rows: int) -> int:
    """Rows per optimizer step on one rank: ``ppo_mini_batch_size`` prompts x ``n``
    responses, split across ranks, shrunk to divide this rank's rows."""
    mini = max(1, min(ppo_mini_batch_size * n // world_size, rows))
    while rows % mini:
        mini -= 1
    return mini


class TokenBudgetError(ValueError):
    """A sequence longer than the token budget of one micro-batch."""


def token_budget_parts(lengths: list[int], budget: int, field: str) -> list[list[int]]:
    """Row indices in groups of at most ``budget`` tokens (``lengths``: each row's), as few
    groups as fit and balanced by tokens as verl balances them: the fewest groups the
    total needs, longest rows first into the lightest group, one group more while any is
    over. Rows keep their order inside a group. A row longer than the budget is refused."""
    longest = max(lengths, default=0)
    if longest > budget:
        raise TokenBudgetError(f"{field}: expected every sequence to fit in {budget} tokens; found one of {longest} "
                               f"(prompt and response)")
    count = max(1, -(-sum(lengths) // budget))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    while True:
        groups: list[list[int]] = [[] for _ in range(count)]
        load = [0] * count
        for i in order:
            lightest = min(range(count), key=lambda g: (load[g], g))
            groups[lightest].append(i)
            load[lightest] += lengths[i]
        if max(load) <= budget:
            return [sorted(g) for g in groups if g]
        count += 1


def balanced_order(lengths: list[int], parts: int) -> list[int]:
    """A row order whose ``parts`` consecutive equal chunks (one per data-parallel rank)
    carry about the same number of tokens: longest rows first, each to the lightest chunk
    with room. Identity when the rows do not split evenly (dispatch pads those) or at one
    part."""
    rows = len(lengths)
    if parts <= 1 or rows % parts:
        return list(range(rows))
    size = rows // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(rows), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(parts) if len(groups[g]) < size), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += lengths[i]
    return [i for group in groups for i in sorted(group)]


def _row_tokens(batch) -> list[int]:
    return batch.batch["attention_mask"].sum(dim=1).tolist()  # one host read per batch


def micro_batches(batch, micro_rows: int, loss_agg_mode: str = "token-mean", token_budget: int = 0,
                  field: str = "ppo_max_token_len_per_gpu"):
    """(micro-batch, weight) pairs for gradient accumulation (a weight is a number or a
    0-dim tensor): the weighted sum of the
    micro-batches' losses is the whole batch's loss (token-mean: by response tokens; the
    sequence means: by rows), however the rows are grouped. Groups of ``micro_rows`` rows,
    or with ``token_budget`` > 0 of at most that many tokens (``token_budget_parts``).
    ``micro_rows`` 0 or >= the batch (and no budget): the batch itself, weight 1."""
    rows = len(batch)
    if token_budget > 0:
        parts = [batch.select_idxs(group) for group in token_budget_parts(_row_tokens(batch), token_budget, field)]
    elif micro_rows <= 0 or micro_rows >= rows:
        yield batch, 1.0
        return
    else:
        parts = batch.split(micro_rows)
    if len(parts) == 1:
        yield parts[0], 1.0
        return
    tokens = batch.batch["response_mask"].sum().clamp(min=1)
    for part in parts:  # (a token share stays a tensor: no host read per micro-batch)
        yield part, part.batch["response_mask"].sum() / tokens if loss_agg_mode == "token-mean" else len(part) / rows


def forward_in_chunks(fn, data, micro_rows: int, token_budget: int = 0,
                      field: str = "log_prob_max_token_len_per_gpu") -> list:
    """``fn(part)`` over row chunks of ``micro_rows`` (0: all rows at once), or with
    ``token_budget`` > 0 over groups of at most that many tokens; outputs in the rows'
    order: forward passes over more rows than fit in memory."""
    if token_budget > 0:
        groups = token_budget_parts(_row_tokens(data), token_budget, field)
        outs = [fn(data.select_idxs(group)) for group in groups]
        order = torch.tensor([i for group in groups for i in group])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return [None if items[0] is None else torch.cat(items)[inverse.to(items[0].device)] for items in zip(*outs)]
    parts = [data] if micro_rows <= 0 or micro_rows >= len(data) else data.split(micro_rows)
    outs = [fn(part) for part in parts]
    if len(outs) == 1:
        return list(outs[0])
    return [None if items[0] is None else torch.cat(items) for items in zip(*outs)]
