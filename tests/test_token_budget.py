"""Micro-batches by tokens (verl's use_dynamic_bsz): rows grouped under a token budget,
balanced by tokens; the mini-batch's gradient is the same however the rows are grouped,
for every loss aggregation; forwards come back in the rows' order; a budget no sequence
can fit is refused in one line."""

import pytest
import torch

from rlhf_core.algorithms import agg_loss
from rlhf_core.config import LOSS_AGG_MODES, ConfigError, RunConfig, apply_overrides
from rlhf_core.models.qwen2 import qwen2_from_config
from rlhf_core.protocol import DataProto
from rlhf_core.workers import modeling

VOCAB = 61
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
             num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
PROMPT, RESPONSE = 4, 10
LENGTHS = [10, 1, 7, 3, 10, 2, 8, 5, 6, 4]  # response lengths: spread 10x


def rollout_batch() -> DataProto:
    g = torch.Generator().manual_seed(0)
    rows = len(LENGTHS)
    ids = torch.randint(3, VOCAB, (rows, PROMPT + RESPONSE), generator=g)
    response_mask = (torch.arange(RESPONSE)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    attention_mask = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), response_mask], dim=1)
    ids[attention_mask == 0] = 0
    return DataProto.from_dict({"input_ids": ids, "attention_mask": attention_mask, "response_mask": response_mask,
                                "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
                                "advantages": torch.randn(rows, RESPONSE, generator=g)})


def test_groups_hold_every_row_once_within_the_budget_and_balanced():
    lengths = [PROMPT + n for n in LENGTHS]  # 14 ... 5 tokens, 96 in all
    for budget in (14, 20, 33, 96, 200):
        groups = modeling.token_budget_parts(lengths, budget, "actor.ppo_max_token_len_per_gpu")
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert max(loads) <= budget and all(g == sorted(g) for g in groups)
        assert len(groups) >= -(-sum(lengths) // budget)
        if len(groups) > 1:
            assert max(loads) - min(loads) <= max(lengths), (budget, loads)  # balanced by tokens
    assert modeling.token_budget_parts(lengths, 200, "x") == [list(range(len(lengths)))]
    with pytest.raises(modeling.TokenBudgetError,
                       match=r"^actor.ppo_max_token_len_per_gpu: expected every sequence to fit in 13 tokens; "
                             r"found one of 14 \(prompt and response\)$"):
        modeling.token_budget_parts(lengths, 13, "actor.ppo_max_token_len_per_gpu")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_the_mini_batch_gradient_is_the_same_however_the_rows_are_grouped(mode):
    """The policy-gradient-shaped loss over response log-probs, accumulated over token-budget
    micro-batches with their weights, has the gradient of the whole mini-batch's loss."""
    batch = rollout_batch()

    def grads(**split):
        model = qwen2_from_config(seed=0, **SHAPE)
        seen = []
        for part, weight in modeling.micro_batches(batch, loss_agg_mode=mode, **split):
            seen.append(len(part))
            log_probs, _ = modeling.response_log_probs(model, part.batch["input_ids"], part.batch["attention_mask"],
                                                       part.batch["position_ids"], RESPONSE)
            loss = agg_loss(-part.batch["advantages"] * log_probs, part.batch["response_mask"].float(), mode)
            (loss * weight).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, seen

    whole, one = grads(micro_rows=0)
    assert one == [len(LENGTHS)]
    for budget in (14, 25, 40):
        split, sizes = grads(micro_rows=0, token_budget=budget)
        assert len(sizes) > 1 and sum(sizes) == len(LENGTHS)
        for name in whole:
            assert torch.allclose(split[name], whole[name], atol=1e-6, rtol=1e-5), (mode, budget, name)


def test_forwards_by_tokens_come_back_in_the_rows_order():
    batch = rollout_batch()
    model = qwen2_from_config(seed=0, **SHAPE)

    def forward(part):
        return modeling.response_log_probs(model, part.batch["input_ids"], part.batch["attention_mask"],
                                           part.batch["position_ids"], RESPONSE, with_entropy=True)

    with torch.no_grad():
        whole = modeling.forward_in_chunks(forward, batch, 0)
        split = modeling.forward_in_chunks(forward, batch, 0, token_budget=20)
    mask = batch.batch["response_mask"].bool()
    for a, b in zip(whole, split):
        assert torch.allclose(a[mask], b[mask], atol=1e-6, rtol=0)


def test_budgets_are_verls_keys_and_one_no_sequence_fits_is_refused():
    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                                        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
                                        "critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=9000"],
                          notes=[]).validate()
    assert (cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu) == (True, 4096)
    assert (cfg.actor.log_prob_use_dynamic_bsz, cfg.actor.log_prob_max_token_len_per_gpu) == (True, 8192)
    assert (cfg.critic.use_dynamic_bsz, cfg.critic.forward_max_token_len_per_gpu) == (True, 9000)
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    with pytest.raises(ConfigError, match=rf"^actor.ppo_max_token_len_per_gpu: expected at least "
                                          rf"data.max_prompt_length \+ rollout.response_length \({longest} tokens"):
        apply_overrides(RunConfig(), ["actor.use_dynamic_bsz=true",
                                      f"actor.ppo_max_token_len_per_gpu={longest - 1}"]).validate()
    # a budget that is not used is not checked
    apply_overrides(RunConfig(), [f"actor.ppo_max_token_len_per_gpu={longest - 1}"]).validate()


def test_a_rollout_is_reordered_so_every_data_parallel_rank_gets_about_the_same_tokens():
    lengths = [PROMPT + n for n in LENGTHS]
    for parts in (2, 5):
        order = modeling.balanced_order(lengths, parts)
        assert sorted(order) == list(range(len(lengths)))
        size = len(lengths) // parts
        loads = [sum(lengths[i] for i in order[p * size:(p + 1) * size]) for p in range(parts)]
        contiguous = [sum(lengths[p * size:(p + 1) * size]) for p in range(parts)]
        assert max(loads) - min(loads) <= max(lengths) and max(loads) - min(loads) < max(contiguous) - min(contiguous)
    assert modeling.balanced_order(lengths, 1) == list(range(len(lengths)))
    assert modeling.balanced_order(lengths, 3) == list(range(len(lengths)))  # 10 rows do not split in 3: as is
    cfg = apply_overrides(RunConfig(), ["trainer.balance_batch=false"], notes=[])
    assert cfg.trainer.balance_batch is False and RunConfig().trainer.balance_batch is True
