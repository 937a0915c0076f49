"""The reward worker: the rewards of decoded responses, from a rule-based reward function
or, with a reward model (``rlhf_core.workers.reward_model``), from its scores.

The function is named as ``module:function`` with verl's signature
``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`` (a dict must
hold ``"score"``; its other numeric keys become ``reward_extra_info`` columns).

``reward.function`` is code the run's owner chose: every reward worker imports and calls
it. A config read back from the store (``rlhf replay``) names it too; ``installed`` says
whether this machine vouches for it without being told (docs/security.md, "Trust").
"""

from __future__ import annotations

import numpy as np
import torch

from rlhf_core.algorithms import last_token_index
from rlhf_core.config import NAMED_REWARDS, RunConfig
from rlhf_core.controller import Dispatch, Worker, register
from rlhf_core.protocol import DataProto, object_column
from rlhf_core.workers import modeling
from rlhf_core.workers.reward_functions import load_reward_file, load_reward_fn, routed_to_sandbox
from rlhf_core.workers.reward_loop import CALLS_COLUMN
from rlhf_core.workers.reward_managers import MANAGERS, ScoringRows, dapo_after, naive, score_each


#: Entry-point group under which an installed package registers its reward functions
#: (``name = "module:function"``): ones ``rlhf replay`` imports from a stored config.
REWARD_ENTRY_POINTS = "rlhf.rewards"


def installed(spec: str) -> bool:
    """Whether ``spec`` (a ``reward.function`` value) is a built-in reward function or one
    an installed package registers under ``REWARD_ENTRY_POINTS``. Nothing is imported."""
    from importlib.metadata import entry_points

    if spec in NAMED_REWARDS or spec in NAMED_REWARDS.values():
        return True
    return any(ep.value.replace(" ", "") == spec for ep in entry_points(group=REWARD_ENTRY_POINTS))


def configured_reward_fn(config: RunConfig):
    """The run's reward function: ``custom_reward_function`` when its path is set, else
    ``reward.function``."""
    custom = config.custom_reward_function
    if custom.path:
        return load_reward_file(custom.path, custom.name)
    fn, name = load_reward_fn(config.reward.function)
    sandbox = config.reward_model.sandbox_fusion
    if sandbox.url:  # verl's rule: the sandbox scores code unless a custom function scores everything
        return routed_to_sandbox(fn, sandbox), f"{name} (code: sandbox_fusion at {sandbox.url})"
    return fn, name


class RewardWorker(Worker):
    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        path = modeling.resolve_model_path(self.config.model.path, self.config.trainer.seed, weights=False)
        self.tokenizer = modeling.load_tokenizer(path)
        self.fn, self.fn_name = configured_reward_fn(self.config)
        self.judges, self.judge_tokenizer = [], None
        if self.config.judge_served:
            from rlhf_core.workers.reward_loop import takes_router

            if not takes_router(self.fn):
                raise ValueError(f"custom_reward_function.name: expected {self.fn_name} to take verl's "
                                 f"reward_router_address and reward_model_tokenizer (a served judge: use_reward_loop "
                                 f"with reward_model.enable); found neither among its parameters")
            judge_path = modeling.resolve_model_path(self.config.reward_model.model.path, self.config.trainer.seed,
                                                     weights=False)
            self.judge_tokenizer = modeling.load_tokenizer(judge_path)
        return {"rank": self.rank, "reward_function": self.fn_name}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_judges(self, addresses: list[str]) -> None:
        """The served judge's replicas (``host:port`` each) this worker's router balances over."""
        self.judges = list(addresses)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_reward(self, data: DataProto) -> DataProto:
        """``token_level_scores``: the reward manager's score of each response at its last
        token (``reward_model.reward_manager``). With a reward model's ``rm_scores`` in the
        batch, they are the rewards, unless a custom reward function is set: it scores, and
        sees the model's score as ``extra_info["rm_score"]``."""
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        # the text scored is every response token (verl's: a multi-turn row's tool answers
        # included); the score goes on the last token the policy generated
        valid = data.batch["attention_mask"][:, -responses.shape[1]:] if "attention_mask" in data.batch.keys() \
            else mask
        texts = [self.tokenizer.decode([t for t, keep in zip(row, row_mask) if keep], skip_special_tokens=True)
                 for row, row_mask in zip(responses.tolist(), valid.tolist())]
        nt = data.non_tensor_batch
        lengths = valid.sum(dim=1).tolist()

        def rows(extra_infos) -> ScoringRows:
            return ScoringRows(nt["data_source"], texts, nt["ground_truth"], extra_infos, nt["uid"], lengths)

        extra_infos = nt.get("extra_info", [None] * len(data))
        columns = {"response_text": np.array(texts, dtype=object)}
        if "rm_scores" in data.batch.keys():
            rm_scores = data.batch["rm_scores"].float()
            if not self.config.custom_reward_function.path:
                if self.config.reward_model.log_function_score:  # a metric beside the reward, never the reward
                    scores, extras = naive(self.fn, self.fn_name, rows(extra_infos), self.config)
                    columns["reward_extra/function_score"] = object_column(scores)
                    columns.update((f"reward_extra/{key}", object_column(values)) for key, values in extras.items())
                return DataProto.from_dict({"token_level_scores": rm_scores.clone()}, columns)
            extra_infos = [{**(extra or {}), "rm_score": score}
                           for extra, score in zip(extra_infos, rm_scores.sum(dim=-1).tolist())]
        if self.config.judge_served:
            scores, extras, columns[CALLS_COLUMN] = self._judged(rows(extra_infos), nt.get(CALLS_COLUMN))
        else:
            manager = MANAGERS[self.config.reward_model.reward_manager]
            scores, extras = manager(self.fn, self.fn_name, rows(extra_infos), self.config)
        token_level_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = last_token_index(mask)  # an outcome reward: on the last token the policy generated
        token_level_scores[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
        for key, values in extras.items():
            columns[f"reward_extra/{key}"] = object_column(values)
        return DataProto.from_dict({"token_level_scores": token_level_scores}, columns)

    def _judged(self, rows: ScoringRows, recorded) -> tuple[list[float], dict[str, list], np.ndarray]:
        """The rows scored through the judge (``workers/reward_loop.py``); with a recorded
        ``judge/calls`` column (a replay) its answers are given again and no judge is asked."""
        from rlhf_core.workers import reward_loop

        if recorded is None and not self.judges:
            raise RuntimeError("RewardWorker: a served judge's replicas were never set (set_judges)")
        rm = self.config.reward_model
        router = reward_loop.JudgeRouter(self.judges, rm.timeout,
                                         None if recorded is None else reward_loop.recorded_calls(recorded))
        try:
            scores, extras = score_each(self.fn, self.fn_name, rows, self.config, router, self.judge_tokenizer)
        finally:
            router.close()
            reward_loop.check_replayed(router)
        if rm.reward_manager == "dapo":
            scores, extras = dapo_after(scores, extras, rows, self.config)
        return scores, extras, object_column(reward_loop.calls_column(router, len(rows.uids), extras))
