"""verl's reward managers (``reward_model.reward_manager``: naive, dapo, batch) through
the reward worker, on the rollout layout of ``tests/test_reward_model.py``: each response's
reward sits at its last valid token."""

import pytest
import torch

from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.protocol import DataProto, object_column
from rlhf_core.workers.reward_managers import RewardFunctionError, overlong_penalty
from tests.test_reward_model import PROMPT, RESPONSE, folders, rollout_batch  # noqa: F401 (a fixture)

#: The responses of rollout_batch: valid tokens (EOS included) and what each should contain.
LENGTHS, TRUTHS = (8, 5, 3), ["14", "5", "15"]

FUNCTIONS = '''
CALLS = []


def score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if ground_truth in solution_str else 0.0


def scores(data_sources, solution_strs, ground_truths, extra_infos):
    CALLS.append(len(solution_strs))
    return [{"score": 2.0 if g in s else -1.0, "hit": float(g in s)} for s, g in zip(solution_strs, ground_truths)]


def too_few(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0]
'''


@pytest.fixture
def functions(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(FUNCTIONS)
    return path


def reward_worker(folders, overrides):  # noqa: F811 (the fixture's value)
    from rlhf_core.workers.reward import RewardWorker

    cfg = apply_overrides(RunConfig(), [f"model.path={folders['policy']}", f"rollout.response_length={RESPONSE}",
                                        *overrides]).validate()
    worker = RewardWorker(cfg)
    worker.init_model()
    return worker


def responses(folders, rm_scores=None) -> DataProto:  # noqa: F811
    data = rollout_batch(folders["policy"])
    response_mask = data.batch["attention_mask"][:, PROMPT:]
    assert response_mask.sum(1).tolist() == list(LENGTHS)
    tensors = {"responses": data.batch["responses"], "response_mask": response_mask}
    if rm_scores is not None:
        tensors["rm_scores"] = rm_scores
    return DataProto.from_dict(tensors, {"uid": object_column(["a", "b", "c"]), "data_source": object_column(["t"] * 3),
                                         "ground_truth": object_column(TRUTHS),
                                         "extra_info": object_column([{}, {}, {}])})


def at_last_tokens(values) -> torch.Tensor:
    out = torch.zeros(len(LENGTHS), RESPONSE)
    for i, (length, value) in enumerate(zip(LENGTHS, values)):
        out[i, length - 1] = value
    return out


def test_dapo_adds_the_overlong_punishment_and_logs_acc(folders, functions):  # noqa: F811
    """DAPO's eq. 13 with verl's numbers: max_resp_len 8, a buffer of 4, factor 2: a
    response of 8 tokens loses 2, of 5 loses 0.5, of 3 nothing; ``acc`` is the function's
    own score; with ``log`` each response's punishment is logged."""
    worker = reward_worker(folders, [f"custom_reward_function.path={functions}", "custom_reward_function.name=score",
                                     "reward_model.reward_manager=dapo",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=2.0",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.log=true"])
    out = worker.compute_reward(responses(folders))
    texts = out.non_tensor_batch["response_text"].tolist()
    hits = [1.0 if truth in text else 0.0 for truth, text in zip(TRUTHS, texts)]
    assert hits[0] == 1.0, texts  # "He has 14 apples. #### 14" cut at 7 tokens still holds 14
    penalties = [-2.0, -0.5, 0.0]
    assert [overlong_penalty(n, 8, 4, 2.0) for n in LENGTHS] == penalties
    assert torch.allclose(out.batch["token_level_scores"], at_last_tokens([h + p for h, p in zip(hits, penalties)]))
    assert out.non_tensor_batch["reward_extra/acc"].tolist() == hits
    assert out.non_tensor_batch["reward_extra/overlong_reward"].tolist() == penalties
    assert out.non_tensor_batch["reward_extra/overlong"].tolist() == [1.0, 1.0, 0.0]
    # the naive manager, same function: the function's scores alone
    naive = reward_worker(folders, [f"custom_reward_function.path={functions}", "custom_reward_function.name=score"])
    assert torch.equal(naive.compute_reward(responses(folders)).batch["token_level_scores"], at_last_tokens(hits))


def test_under_dapo_a_reward_models_scores_are_the_rewards(folders):  # noqa: F811
    rm_scores = at_last_tokens([0.25, -1.5, 3.0])
    worker = reward_worker(folders, ["reward_model.reward_manager=dapo",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                                     "reward_model.reward_kwargs.overlong_buffer_cfg.len=4"])
    assert torch.equal(worker.compute_reward(responses(folders, rm_scores)).batch["token_level_scores"], rm_scores)


def test_batch_calls_the_function_once_with_lists(folders, functions):  # noqa: F811
    worker = reward_worker(folders, [f"custom_reward_function.path={functions}", "custom_reward_function.name=scores",
                                     "reward_model.reward_manager=batch"])
    out = worker.compute_reward(responses(folders))
    texts = out.non_tensor_batch["response_text"].tolist()
    hits = [float(truth in text) for truth, text in zip(TRUTHS, texts)]
    assert worker.fn.__globals__["CALLS"] == [3]
    assert torch.equal(out.batch["token_level_scores"], at_last_tokens([2.0 if h else -1.0 for h in hits]))
    assert out.non_tensor_batch["reward_extra/hit"].tolist() == hits
    short = reward_worker(folders, [f"custom_reward_function.path={functions}", "custom_reward_function.name=too_few",
                                    "reward_model.reward_manager=batch"])
    with pytest.raises(RewardFunctionError, match=r"^reward function .*rewards.py:too_few \(reward_model.reward_manager"
                                                  r"=batch\): expected 3 results, one per response; found 1$"):
        short.compute_reward(responses(folders))


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.reward_kwargs.overlong_buffer_cfg.enable=true", "reward_model.reward_kwargs.overlong_buffer_cfg.len=4"],
     "reward_model.reward_kwargs.overlong_buffer_cfg.enable: expected reward_model.reward_manager=dapo (the manager "
     "that applies it); found naive"),
    (["reward_model.reward_manager=dapo", "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
      "reward_model.reward_kwargs.overlong_buffer_cfg.len=9"],
     "reward_model.reward_kwargs.overlong_buffer_cfg.len: expected 1 to 8 tokens (reward_model.reward_kwargs."
     "max_resp_len, 0: rollout.response_length); found 9"),
    (["reward_model.reward_manager=dapo", "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"],
     "reward_model.reward_kwargs.overlong_buffer_cfg.len: expected 1 to 8 tokens"),
    (["reward_model.reward_manager=remote"], "reward_model.reward_manager"),
])
def test_settings_no_manager_would_apply_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        apply_overrides(RunConfig(), ["rollout.response_length=8", *overrides]).validate()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), refused.value


def test_verls_dapo_reward_keys_with_hydras_plus_are_taken():
    """As verl's DAPO scripts give them (``+reward_model.reward_kwargs...``)."""
    cfg = apply_overrides(RunConfig(), ["data.max_response_length=20", "reward_model.reward_manager=dapo",
                                        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                                        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                                        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                                        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                                        "+reward_model.reward_kwargs.max_resp_len=20"], notes=[]).validate()
    kwargs = cfg.reward_model.reward_kwargs
    assert (kwargs.overlong_buffer_cfg.enable, kwargs.overlong_buffer_cfg.len, kwargs.max_resp_len) == (True, 4, 20)
    with pytest.raises(ConfigError, match=r"^verl key 'reward_model.reward_kwargs.nope': no counterpart here"):
        apply_overrides(RunConfig(), ["+reward_model.reward_kwargs.nope=1"], notes=[])


def test_a_multi_turn_row_is_scored_on_its_whole_text_at_the_policys_last_token(folders, functions):  # noqa: F811
    """``response_mask`` leaves out tokens others inserted (a tool's answer): the reward
    function reads every response token (verl's), and the score sits on the last token the
    policy generated, not on the last token of the row."""
    worker = reward_worker(folders, [f"custom_reward_function.path={functions}", "custom_reward_function.name=score"])
    data = responses(folders)
    attention = data.batch["response_mask"].clone()
    data.batch["attention_mask"] = torch.cat([torch.ones(3, PROMPT, dtype=torch.long), attention], dim=1)
    inserted = data.batch["response_mask"].clone()
    inserted[0, 4:] = 0  # row 0: the policy's 4 tokens, then 4 tokens of a tool
    inserted[1, 1:3] = 0  # row 1: a tool's 2 tokens between the policy's
    data.batch["response_mask"] = inserted
    out = worker.compute_reward(data)
    scores = out.batch["token_level_scores"]
    plain = worker.compute_reward(responses(folders)).batch["token_level_scores"]
    assert plain.sum(dim=1).ne(0).all()  # every row scores (the texts hold their truths)
    assert scores.nonzero().tolist() == [[0, 3], [1, 4], [2, 2]]
    assert out.non_tensor_batch["response_text"].tolist() == responses(folders).non_tensor_batch.get(
        "response_text", worker.compute_reward(responses(folders)).non_tensor_batch["response_text"]).tolist()
    assert scores.sum(dim=1).tolist() == worker.compute_reward(responses(folders)).batch["token_level_scores"].sum(
        dim=1).tolist()
