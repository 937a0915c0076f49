"""Log-probs and entropies of responses, computed slice by slice over the vocabulary
projection (``modeling.response_log_probs``): the same numbers as one full-vocabulary pass,
in the forward and in the gradient, at a fraction of its peak memory."""

import json
import subprocess
import sys

import pytest
import torch

from rlhf_core.models.qwen2 import qwen2_from_config
from rlhf_core.workers import modeling

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
             max_position_embeddings=128, tie_word_embeddings=False)


def full_vocabulary_pass(model, input_ids, attention_mask, position_ids, response_length, temperature):
    """What the log-prob pass was before: the whole batch's logits, a float copy of the
    response slice divided by the temperature, and a full log_softmax."""
    ids, mask, pos, kept = modeling.trim_padding(input_ids, attention_mask, position_ids, response_length)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, -kept - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, ids[:, -kept:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    pad = lambda t: torch.nn.functional.pad(t, (0, response_length - t.shape[1]))
    return pad(chosen), pad(entropy)


def batch(rows, prompt, response, lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        mask[i, prompt + n:] = 0
        mask[i, :i % 3] = 0  # left padding of the prompt, a different amount per row
    ids[mask == 0] = 0
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, position_ids


@pytest.mark.parametrize("lengths, chunk", [([7], 3), ([1, 7, 4], 5), ([6, 6], 512), ([2, 5, 7, 3], 1)])
def test_slices_give_the_full_vocabulary_pass_and_its_gradient(lengths, chunk):
    torch.manual_seed(0)
    model = qwen2_from_config(seed=0, vocab_size=97, **SHAPE)
    ids, mask, pos = batch(len(lengths), 5, 7, lengths, 97)
    expected_lp, expected_ent = full_vocabulary_pass(model, ids, mask, pos, 7, 0.7)
    log_probs, entropy = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, with_entropy=True,
                                                     chunk_tokens=chunk)
    resp = mask[:, -7:].bool()
    assert torch.allclose(log_probs[resp], expected_lp[resp], atol=1e-5, rtol=0)
    assert torch.allclose(entropy[resp], expected_ent[resp], atol=1e-5, rtol=0)
    # the gradient of a loss over both, through the recomputed slices
    weights = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(1)) * resp

    def grads(fn):
        model.zero_grad()
        lp, ent = fn()
        ((lp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = grads(lambda: modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, with_entropy=True,
                                                     chunk_tokens=chunk))
    theirs = grads(lambda: full_vocabulary_pass(model, ids, mask, pos, 7, 0.7))
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-5, rtol=1e-4), name


def test_no_entropy_asked_none_computed():
    model = qwen2_from_config(seed=0, vocab_size=50, **SHAPE)
    ids, mask, pos = batch(2, 4, 5, [5, 2], 50)
    log_probs, entropy = modeling.response_log_probs(model, ids, mask, pos, 5, 1.0)
    assert entropy is None and log_probs.shape == (2, 5)


PEAK = """
import json, resource, torch
from test_log_probs import SHAPE, batch, full_vocabulary_pass
from rlhf_core.models.qwen2 import qwen2_from_config
from rlhf_core.workers import modeling
torch.set_num_threads(1)
model = qwen2_from_config(seed=0, vocab_size=151936, **SHAPE)
ids, mask, pos = batch(2, 16, 1500, [1500, 1200], 151936)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    if {ours!r}:
        modeling.response_log_probs(model, ids, mask, pos, 1500, 0.7, with_entropy=True)
    else:
        full_vocabulary_pass(model, ids, mask, pos, 1500, 0.7)
print(json.dumps({{"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}}))
"""


def test_a_log_prob_pass_at_qwen2s_vocabulary_needs_a_quarter_of_the_full_passes_memory():
    """Peak memory (RSS above what the process held before, each pass in a fresh process)
    of one log-prob and entropy pass over 2,700 response tokens at vocabulary 151,936."""
    import os

    tests = os.path.dirname(os.path.abspath(__file__))

    def peak(ours: bool) -> float:
        out = subprocess.run([sys.executable, "-c", PEAK.format(ours=ours)], capture_output=True, text=True,
                             timeout=600, cwd=tests)  # (python -c puts its cwd first on the path)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]

    full, sliced = peak(False), peak(True)
    assert full > 2000, full  # the full pass holds several copies of 2,700 x 151,936 fp32 logits
    assert sliced <= full / 4, (sliced, full)


def test_a_batch_whose_logits_fit_the_budget_is_one_full_pass_bit_for_bit_and_one_that_does_not_is_sliced(
        monkeypatch):
    model = qwen2_from_config(seed=0, vocab_size=97, **SHAPE)
    ids, mask, pos = batch(3, 5, 7, [7, 2, 5], 97)
    expected = full_vocabulary_pass(model, ids, mask, pos, 7, 0.7)
    fitting = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, with_entropy=True)
    assert torch.equal(fitting[0], expected[0]) and torch.equal(fitting[1], expected[1])
    seen, real = [], modeling._token_log_probs
    monkeypatch.setattr(modeling, "_token_log_probs", lambda *a: seen.append(a[1].shape[0]) or real(*a))
    monkeypatch.setattr(modeling, "LOGIT_BUDGET_BYTES", 97 * 4 * 8)  # 8 tokens' logits
    sliced = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, with_entropy=True)
    assert seen == [8, 8, 5]  # 3 rows x 7 response positions, 8 at a time
    resp = mask[:, -7:].bool()
    assert torch.allclose(sliced[0][resp], expected[0][resp], atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["one pass", "slices", "packed"])
def test_top_k_and_gathered_log_probs_are_the_full_passes_on_every_path(path):
    """What the top-k forward KL reads: a teacher's k largest log-probs and their ids at
    each response position, and the student's log-probs at those ids (with their
    gradient), from the padded pass, the sliced projection and the packed forward alike."""
    from rlhf_core.workers import packing

    torch.manual_seed(0)
    model = qwen2_from_config(seed=0, vocab_size=97, **SHAPE)
    lengths = [1, 7, 4]
    ids, mask, pos = batch(len(lengths), 5, 7, lengths, 97)
    kw = {"chunk_tokens": 2} if path == "slices" else {}
    if path == "packed":
        packing.enable_packing(model)
        kw = {"packed": True}
    ref_ids, ref_mask, ref_pos, kept = modeling.trim_padding(ids, mask, pos, 7)
    logits = model(input_ids=ref_ids, attention_mask=ref_mask, position_ids=ref_pos).logits if path != "packed" else \
        qwen2_from_config(seed=0, vocab_size=97, **SHAPE)(input_ids=ref_ids, attention_mask=ref_mask,
                                                           position_ids=ref_pos).logits
    every = torch.nn.functional.pad(torch.log_softmax(logits[:, -kept - 1:-1].float() / 0.7, dim=-1),
                                    (0, 0, 0, 7 - kept))
    resp = mask[:, -7:].bool()
    _, _, values, top = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, topk=4, **kw)
    expected_values, expected_ids = every.topk(4, dim=-1)
    assert top.dtype == torch.long and values.shape == top.shape == (3, 7, 4)
    assert torch.equal(top[resp], expected_ids[resp])
    assert torch.allclose(values[resp], expected_values[resp], atol=1e-5, rtol=0)
    # among the first 50 ids only (a teacher's padded output layer has rows no tokenizer names)
    _, _, values, top = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, topk=4, topk_vocab=50, **kw)
    expected_values, expected_ids = every[..., :50].topk(4, dim=-1)
    assert torch.equal(top[resp], expected_ids[resp]) and int(top.max()) < 50
    assert torch.allclose(values[resp], expected_values[resp], atol=1e-5, rtol=0)
    chosen = torch.randint(0, 97, (3, 7, 5), generator=torch.Generator().manual_seed(2))
    log_probs, _, gathered = modeling.response_log_probs(model, ids, mask, pos, 7, 0.7, gather_ids=chosen, **kw)
    assert gathered.shape == (3, 7, 5)
    assert torch.allclose(gathered[resp], every.gather(-1, chosen)[resp], atol=1e-5, rtol=0)
    assert log_probs.shape == (3, 7)
    gathered[resp].sum().backward()  # the student's loss reaches the weights through them
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
