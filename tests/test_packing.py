"""Padding-free forwards (``model.use_remove_padding``, ``rlhf_core.workers.packing``): a
micro-batch's sequences packed into one, attention bounded per sequence, give the padded
forward's log-probs, entropies, values and gradients (fp32, to 1e-5), through the model
helpers and through the workers' stages."""

from types import SimpleNamespace

import pytest
import torch

from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.controller import Worker
from rlhf_core.models.qwen2 import qwen2_from_config
from rlhf_core.protocol import DataProto
from rlhf_core.workers import modeling, packing

#: GQA (4 query heads over 2 key/value heads), head_dim 32, untied head.
SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
PROMPT, RESPONSE, VOCAB = 9, 8, 101

#: (prompt tokens, response tokens) per row: lengths spread, a batch of one, a full row,
#: one-token prompts and responses, a row with no response token.
MIXES = [[(9, 8)], [(3, 1)], [(9, 8), (2, 3), (5, 8), (1, 1)], [(4, 2), (9, 0), (6, 7)],
         [(7, 5)] * 3, [(1, 8), (9, 1), (3, 4), (8, 6), (2, 2), (5, 7)]]


def batch(mix, seed=0):
    """Left-padded prompts, right-padded responses: the rollout's layout."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(mix), PROMPT + RESPONSE), generator=g)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(mix):
        mask[i, PROMPT - prompt:PROMPT + response] = 1
    ids = ids * mask
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = qwen2_from_config(seed=0, vocab_size=VOCAB, **SHAPE)
    m.config.use_cache = False
    return m


@pytest.fixture(scope="module")
def packed_model(model):
    import copy

    m = copy.deepcopy(model)
    assert packing.enable_packing(m) == packing.PACKED_SDPA  # no FlashAttention on CPU
    return m


def same_gradient(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to fp32 rounding: a relative 1e-5 of the gradient's norm."""
    return bool((got - expected).norm() <= 1e-5 * expected.norm() + 1e-8)


def _grads(model, fn, weights):
    model.zero_grad()
    lp, ent = fn()
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mix", MIXES, ids=lambda mix: "-".join(f"{p}+{r}" for p, r in mix))
@pytest.mark.parametrize("chunk", [None, 3], ids=["one-pass", "sliced"])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_forward(model, packed_model, mix, chunk):
    ids, mask, pos = batch(mix)
    resp = mask[:, -RESPONSE:].bool()
    padded = lambda: modeling.response_log_probs(model, ids, mask, pos, RESPONSE, 0.7, with_entropy=True)
    packed = lambda: modeling.response_log_probs(packed_model, ids, mask, pos, RESPONSE, 0.7, with_entropy=True,
                                                 chunk_tokens=chunk, packed=True)
    with torch.no_grad():
        (lp, ent), (plp, pent) = padded(), packed()
    assert plp.shape == ent.shape == (len(mix), RESPONSE)
    assert (plp[resp] - lp[resp]).abs().max() <= 1e-5 if resp.any() else True
    assert (pent[resp] - ent[resp]).abs().max() <= 1e-5 if resp.any() else True
    assert not plp[~resp].any() and not pent[~resp].any()  # nothing where a row has no token
    weights = torch.randn((2,) + resp.shape, generator=torch.Generator().manual_seed(1)) * resp
    expected, got = _grads(model, padded, weights), _grads(packed_model, packed, weights)
    assert expected.keys() == got.keys()
    for name in expected:
        assert same_gradient(got[name], expected[name]), name


def test_packing_leaves_the_padded_forward_and_generation_unchanged(model, packed_model):
    """The packed attention takes a forward without sequence boundaries as plain SDPA: the
    padded forward and HF generation (the hf rollout's) give the same bits."""
    ids, mask, pos = batch(MIXES[2])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits,
                           packed_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits)
    prompts, prompt_mask = ids[:, :PROMPT], mask[:, :PROMPT]
    kwargs = dict(attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    assert torch.equal(model.generate(prompts, **kwargs), packed_model.generate(prompts, **kwargs))


def test_a_packed_sequence_never_attends_to_another(packed_model):
    """Changing one row's tokens leaves every other row's packed log-probs bit for bit."""
    ids, mask, pos = batch(MIXES[5])
    changed = ids.clone()
    changed[2] = torch.where(mask[2].bool(), (ids[2] + 1) % VOCAB, 0)
    with torch.no_grad():
        a, _ = modeling.response_log_probs(packed_model, ids, mask, pos, RESPONSE, packed=True)
        b, _ = modeling.response_log_probs(packed_model, changed, mask, pos, RESPONSE, packed=True)
    others = [i for i in range(len(ids)) if i != 2]
    assert torch.equal(a[others], b[others]) and not torch.equal(a[2], b[2])


def test_packed_values_and_their_gradient_equal_the_padded_value_model(tmp_path, model):
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    padded, packed = modeling.ValueModel(str(tmp_path)), modeling.ValueModel(str(tmp_path), packed=True)
    for m in (padded, packed):  # a value head that is not zero, so its gradient reaches the backbone
        torch.nn.init.normal_(m.value_head.weight, std=0.02, generator=torch.Generator().manual_seed(3))
    for mix in MIXES:
        ids, mask, pos = batch(mix, seed=len(mix))
        resp = mask[:, -RESPONSE:].bool()
        for m in (padded, packed):
            m.zero_grad()
        v = modeling.response_values(padded, ids, mask, pos, RESPONSE)
        pv = modeling.response_values(packed, ids, mask, pos, RESPONSE, packed=True)
        assert torch.allclose(pv[resp], v[resp], atol=1e-5, rtol=0) and not pv[~resp].any()
        (v * resp).sum().backward()
        (pv * resp).sum().backward()
        for (name, p), q in zip(padded.named_parameters(), packed.parameters()):
            assert same_gradient(q.grad, p.grad), name


def test_a_response_after_padding_is_refused_in_one_line():
    ids, mask, pos = batch([(3, 4)])
    mask[0, PROMPT - 3:PROMPT] = 0  # a response with no prompt before it
    with pytest.raises(ValueError, match=r"^attention_mask: expected every response token to follow a real "
                                         r"token .*found a response token after padding$"):
        packing.pack(ids, mask, pos, RESPONSE)


def test_a_sequence_longer_than_a_sliding_window_is_refused(packed_model):
    rows = packing.pack(*batch([(9, 8)]), RESPONSE)
    attention = packed_model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 17, 32)
    kv = torch.zeros(1, 2, 17, 32)
    with pytest.raises(ValueError, match=r"^model.use_remove_padding: a sequence is longer than the model's "
                                         r"sliding window \(8\)"):
        packing.packed_sdpa_attention(attention, q, kv, kv, None, sliding_window=8,
                                      **rows.attention_kwargs(packing.PACKED_SDPA))


# ------------------------------------------------- torch's varlen FlashAttention (GPUs)
def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """What ``torch.nn.attention.varlen.varlen_attn`` computes, by its documentation, in
    fp32 on the CPU: per sequence of the offsets, attention of [T, H, D] tensors, causal
    with ``window_size=(left, 0)`` (left -1: unbounded), key heads shared by query-head
    groups with ``enable_gqa``. It checks what the kernel would refuse."""
    assert q.dim() == k.dim() == 3 and cu_q.dtype == cu_k.dtype == torch.int32
    assert cu_q.device == q.device and torch.equal(cu_q, cu_k)
    assert q.dtype in (torch.float16, torch.bfloat16)
    assert window_size[1] == 0, "causal attention only here"
    if k.shape[1] != q.shape[1]:
        assert enable_gqa and q.shape[1] % k.shape[1] == 0
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    bounds, out = cu_q.tolist(), torch.empty(q.shape, dtype=torch.float32)
    for a, b in zip(bounds, bounds[1:]):
        assert b - a <= max_q and b - a <= max_k
        scores = torch.einsum("ihd,jhd->hij", q[a:b].float(), k[a:b].float()) * (scale or q.shape[-1] ** -0.5)
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        allowed = (j <= i) & ((window_size[0] < 0) | (i - j <= window_size[0]))
        out[a:b] = torch.einsum("hij,jhd->ihd", scores.masked_fill(~allowed, float("-inf")).softmax(-1),
                                v[a:b].float())
    return out.to(q.dtype)


def test_the_packed_implementation_is_picked_by_device_and_installed_kernels(monkeypatch):
    import importlib.util

    found = {"flash_attn": False, "torch.nn.attention.varlen": True}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if found[name] else None) if name in found else real(name, *a))
    assert packing.packed_attention_implementation(on_gpu=False) == packing.PACKED_SDPA
    assert packing.packed_attention_implementation(on_gpu=True) == packing.PACKED_VARLEN
    found["flash_attn"] = True
    assert packing.packed_attention_implementation(on_gpu=True) == "flash_attention_2"
    assert packing.packed_attention_implementation(on_gpu=False) == packing.PACKED_SDPA
    found.update(flash_attn=False, **{"torch.nn.attention.varlen": False})  # an older torch
    assert packing.packed_attention_implementation(on_gpu=True) == packing.PACKED_SDPA


def test_varlen_arguments_match_the_per_sequence_path(monkeypatch):
    """The offsets, max length, causal window and GQA that the varlen call is given,
    against per-sequence SDPA on the same 16-bit inputs; fp32 and wide heads fall back."""
    calls = []
    monkeypatch.setattr(packing, "_varlen_kernel", lambda: lambda *a, **kw: calls.append(kw) or
                        reference_varlen_attn(*a, **kw))
    rows = packing.pack(*batch(MIXES[5]), RESPONSE)
    tokens = rows.input_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, tokens, 32, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, tokens, 32, generator=g).bfloat16() for _ in range(2))
    attention = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    kwargs = rows.attention_kwargs(packing.PACKED_VARLEN)
    got, _ = packing.packed_varlen_attention(attention, q, k, v, None, scaling=0.2, **kwargs)
    expected, _ = packing.packed_sdpa_attention(attention, q.float(), k.float(), v.float(), None, scaling=0.2,
                                                **rows.attention_kwargs(packing.PACKED_SDPA))
    assert got.shape == expected.shape == (1, tokens, 4, 32)
    assert torch.allclose(got.float(), expected, atol=2e-2, rtol=0)
    assert calls == [{"scale": 0.2, "window_size": (-1, 0), "enable_gqa": True}]
    (q_, k_, v_, cu_q, cu_k, max_q, max_k), _ = packing.varlen_call(q, k, v, kwargs["cu_seq_lens_q"],
                                                                    rows.max_length, 0.2, 6)
    assert cu_q.tolist() == rows.cu_seqlens and max_q == max_k == 14 and q_.shape == (tokens, 4, 32)
    windowed, _ = packing.packed_varlen_attention(attention, q, k, v, None, scaling=0.2, sliding_window=6, **kwargs)
    # HF's window of 6 is 6 tokens, the query's own included (its FlashAttention path: 5 left)
    assert calls[-1]["window_size"] == (5, 0) and not torch.allclose(windowed, got)
    first = slice(0, 6)  # a sequence's first 6 tokens have nothing beyond the window to lose
    assert torch.allclose(windowed[0, first].float(), got[0, first].float())
    assert packing.varlen_call(q.float(), k.float(), v.float(), kwargs["cu_seq_lens_q"], 14, None, None) is None
    wide = torch.zeros(1, 4, tokens, 320, dtype=torch.bfloat16)
    assert packing.varlen_call(wide, wide, wide, kwargs["cu_seq_lens_q"], 14, None, None) is None


def test_a_bf16_model_on_the_varlen_path_gives_the_per_sequence_log_probs(model, monkeypatch):
    """The whole model through ``PACKED_VARLEN`` (the kernel: the documented reference):
    one call per layer per forward, log-probs as the per-sequence path's in bf16."""
    import copy

    calls = []
    monkeypatch.setattr(packing, "_varlen_kernel", lambda: lambda *a, **kw: calls.append(1) or
                        reference_varlen_attn(*a, **kw))
    per_sequence = copy.deepcopy(model).to(torch.bfloat16)
    packing.enable_packing(per_sequence)
    varlen = copy.deepcopy(per_sequence)
    varlen.set_attn_implementation(packing.PACKED_VARLEN)
    ids, mask, pos = batch(MIXES[2])
    with torch.no_grad():
        a, _ = modeling.response_log_probs(per_sequence, ids, mask, pos, RESPONSE, packed=True)
        b, _ = modeling.response_log_probs(varlen, ids, mask, pos, RESPONSE, packed=True)
    assert len(calls) == SHAPE["num_hidden_layers"]
    resp = mask[:, -RESPONSE:].bool()
    assert torch.allclose(a[resp].float(), b[resp].float(), atol=0.1, rtol=0) and not b[~resp].any()
    assert (a[resp].float() - b[resp].float()).abs().mean() < 0.02


# ------------------------------------------------------------------ through the workers


def _config(folder, extra=()) -> RunConfig:
    return apply_overrides(RunConfig(), [f"model.path={folder}", f"data.max_prompt_length={PROMPT}",
                                         f"rollout.response_length={RESPONSE}", "rollout.n=1",
                                         "actor.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size=3",
                                         "actor.ppo_micro_batch_size_per_gpu=2", "actor.use_kl_loss=true",
                                         "actor.entropy_coeff=0.01", "algorithm.adv_estimator=gae", *extra])


def _stage_batch() -> DataProto:
    ids, mask, pos = batch(MIXES[5], seed=4)
    g = torch.Generator().manual_seed(5)
    response_mask = mask[:, -RESPONSE:]
    lp = -torch.rand(ids.shape[0], RESPONSE, generator=g)
    data = DataProto.from_dict({
        "prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "response_mask": response_mask,
        "input_ids": ids, "attention_mask": mask, "position_ids": pos, "old_log_probs": lp,
        "ref_log_prob": lp - 0.1, "advantages": torch.randn(lp.shape, generator=g) * response_mask,
        "values": torch.randn(lp.shape, generator=g), "returns": torch.randn(lp.shape, generator=g)})
    data.meta_info["global_step"] = 1
    return data


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Actor and critic workers, padded and packed, from the same weights."""
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers.actor import ActorRolloutRefWorker
    from rlhf_core.workers.critic import CriticWorker

    folder = build_model_folder(tmp_path_factory.mktemp("model"))
    mp = pytest.MonkeyPatch()
    mp.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    made = {}
    for packed in (False, True):
        cfg = _config(folder, [f"model.use_remove_padding={str(packed).lower()}", "rollout.name=hf"])
        made["actor", packed] = ActorRolloutRefWorker(cfg)
        made["critic", packed] = CriticWorker(cfg)
        made["actor", packed].init_model()
        made["critic", packed].init_model()
    mp.undo()
    return made


def _close(a, b, mask=None):
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    return torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_the_workers_stages_give_the_padded_numbers_packed(workers, monkeypatch):
    data = _stage_batch()
    mask = data.batch["response_mask"]
    padded, packed = workers["actor", False], workers["actor", True]
    assert packed.policy.config._attn_implementation == packing.PACKED_SDPA
    packs, pack = [], packing.pack
    monkeypatch.setattr(packing, "pack", lambda *a, **kw: packs.append(a[0].shape[0]) or pack(*a, **kw))
    padded.compute_log_prob(data)
    assert packs == []  # the padded worker never packs ...
    packed.compute_log_prob(data)
    assert packs and sum(packs) == len(data)  # ... the packed one packs every row
    for stage, column in (("compute_log_prob", "old_log_probs"), ("compute_log_prob", "entropys"),
                          ("compute_ref_log_prob", "ref_log_prob")):
        assert _close(getattr(padded, stage)(data).batch[column], getattr(packed, stage)(data).batch[column], mask)
    assert _close(workers["critic", False].compute_values(data).batch["values"],
                  workers["critic", True].compute_values(data).batch["values"])
    # the first optimizer step's metrics (loss parts, grad norm) come from the same weights;
    # later ones not quite: Adam's first step moves a weight by about lr whatever its
    # gradient's size, so rounding-level gradients become lr-level weight differences
    for role, stage in (("actor", "update_actor"), ("critic", "update_critic")):
        metrics = [getattr(workers[role, p], stage)(data).meta_info["metrics"] for p in (False, True)]
        assert metrics[0].keys() == metrics[1].keys() and any("grad_norm" in k for k in metrics[0])
        for key in [k for k in metrics[0] if "timing" not in k]:
            first = [m[key][0] if isinstance(m[key], list) else m[key] for m in metrics]
            assert abs(first[0] - first[1]) <= 1e-5 + 1e-4 * abs(first[0]), (key, first)


def test_the_actors_update_by_token_budget_has_the_row_micro_batches_gradient(tmp_path, monkeypatch):
    """The worker's update with use_dynamic_bsz: each mini-batch of 3 rows (26 and 30 tokens)
    in micro-batches of at most 20 tokens, and the first step's gradient norm that of
    2-row micro-batches (the same weights, the same mini-batch loss)."""
    from rlhf_core.testing.model_folders import build_model_folder
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    folder = build_model_folder(tmp_path / "model")
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    by_rows = ActorRolloutRefWorker(_config(folder, ["rollout.name=hf"]))
    by_tokens = ActorRolloutRefWorker(_config(folder, ["rollout.name=hf", "actor.use_dynamic_bsz=true",
                                                       "actor.ppo_max_token_len_per_gpu=20"]))
    by_rows.init_model()
    by_tokens.init_model()
    groups, parts = [], modeling.token_budget_parts

    def recorded(lengths, budget, field):
        out = parts(lengths, budget, field)
        groups.append([sum(lengths[i] for i in g) for g in out])
        return out

    monkeypatch.setattr(modeling, "token_budget_parts", recorded)
    data = _stage_batch()
    rows_metrics = by_rows.update_actor(data).meta_info["metrics"]
    assert groups == []
    tokens_metrics = by_tokens.update_actor(data).meta_info["metrics"]
    assert len(groups) == 2 and all(len(g) > 1 and max(g) <= 20 for g in groups)
    first = [m["actor/grad_norm"][0] for m in (rows_metrics, tokens_metrics)]
    assert first[1] == pytest.approx(first[0], rel=1e-4) and first[0] > 0


def test_packing_is_on_where_configured():
    cfg = RunConfig()
    assert not cfg.model.use_remove_padding and not cfg.critic_remove_padding
    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.model.use_remove_padding=True"], notes=[])
    assert cfg.model.use_remove_padding and cfg.critic_remove_padding  # the critic follows the model
    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.model.use_remove_padding=True",
                                        "critic.model.use_remove_padding=False"], notes=[])
    assert cfg.model.use_remove_padding and not cfg.critic_remove_padding
